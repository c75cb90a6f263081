"""`moefx` command line. Each subcommand is one module with `add_parser(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import sys

from moefx import __version__

# Subcommand modules, in the order `moefx --help` lists them.
COMMANDS = ("demo", "plan", "bench", "calibrate", "audit_syncs", "explain_fusions")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moefx",
        description="Fast Mixture-of-Experts inference with torch.compile.",
        epilog="Config overrides: -cc.KEY=VALUE, e.g. -cc.pass_config.fuse_act_quant=true",
    )
    parser.add_argument("--version", action="version", version=f"moefx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"moefx.cli.{name}").add_parser(sub)
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
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, overrides = split_config_overrides(argv)
    parser = build_parser()
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
