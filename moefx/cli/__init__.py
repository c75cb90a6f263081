"""`moefx` command line.

Each subcommand is one module with `add_arguments(parser)` and `run(args) -> int`, listed in COMMANDS. Only the
module of the command being run is imported (torch, transformers and inductor load there), so `moefx --help`
and `moefx --version` print at once; adding a subcommand is one COMMANDS entry and its module.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moefx import __version__

# CLI name -> (module, one-line help), in the order `moefx --help` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("moefx.cli.demo", "run the embedded tiny Qwen3-MoE, eager vs optimized"),
    "plan": ("moefx.cli.plan", "explain the plan for a model, here or for another machine"),
    "precompile": ("moefx.cli.precompile", "build a model's persistent compile artifacts ahead of time"),
    "bench": ("moefx.cli.bench", "A/B two configs: separate caches, interleaved runs, medians, noise"),
    "calibrate": ("moefx.cli.calibrate", "measure MoE and dense-linear backend crossovers on this device"),
    "audit-syncs": ("moefx.cli.audit_syncs", "list host syncs and graph breaks in a decode step"),
    "explain-fusions": ("moefx.cli.explain_fusions", "show which quant fusions apply to a function, and why not"),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and each option's default after its help, unless the help already says
    its default (or there is none to show: None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS) and action.option_strings
        if shown and "default" not in text:
            text += " (default: %(default)s)"
        return text


def _chosen_command(argv: list[str]) -> str | None:
    """The subcommand named on the command line (the first non-option word), if it is one of COMMANDS."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the subcommand named in `argv` gets its full arguments (all of them when argv is None)."""
    parser = argparse.ArgumentParser(
        prog="moefx",
        description="Fast Mixture-of-Experts inference with torch.compile.",
        epilog="Config overrides: -cc.KEY=VALUE, e.g. -cc.pass_config.fuse_act_quant=true",
    )
    parser.add_argument("--version", action="version", version=f"moefx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _chosen_command(argv) if argv is not None else None
    for name, (module_name, help_text) in COMMANDS.items():
        if argv is not None and name != chosen:
            sub.add_parser(name, help=help_text)  # listed in --help; its module is not imported
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=module.__doc__, formatter_class=HelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def split_config_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate vLLM-style `-cc.key=value` / `--compilation-config.key=value` overrides from argv."""
    rest, overrides = [], []
    for arg in argv:
        for prefix in ("-cc.", "--compilation-config."):
            if arg.startswith(prefix):
                overrides.append(arg[len(prefix) :])
                break
        else:
            rest.append(arg)
    return rest, overrides


def main(argv: list[str] | None = None) -> int:
    from moefx.log import log_level

    try:
        log_level()  # a bad MOEFX_LOG is one line here, not a traceback from deep inside an import
    except ValueError as exc:
        print(f"moefx: error: {exc}", file=sys.stderr)
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, overrides = split_config_overrides(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    args.config_overrides = overrides
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"moefx {args.command}: error: {exc}", file=sys.stderr)
        return 2
