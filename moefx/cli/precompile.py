"""`moefx precompile MODEL`: build the persistent compile artifacts of a model ahead of time.

MODEL is a built-in name, a config.json or a model folder; it is built at full depth (or `--layers`) with random
weights, since compiled code depends on shapes, not weight values. One greedy request per batch size and prompt
length compiles what `generate()` needs and the artifacts are saved where a later process on this machine (same
config, device, dtype and buckets) loads them: `$XDG_CACHE_HOME/moefx/compile/`, or `--cache-dir`. Run it, for
example, in a container build on the target GPU. On a CUDA device where no calibration row (shipped or the user's)
matches the model, it runs `moefx calibrate --model MODEL` first, so the artifacts are those of the fast plan
(`--no-calibrate` skips that).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moefx.cli.common import add_config_arg, load_config
from moefx.config import MODES, CompilationConfig


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    from moefx.models.catalog import catalog_names

    p.add_argument("model", help=f"built-in name ({', '.join(catalog_names())}), a config.json or a model folder")
    p.add_argument("--layers", type=int, default=None, help="decoder layers to build (default: all of them)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--mode", default=None, choices=[m for m in MODES if m != "eager"],
                   help="default: the config's (capture)")
    p.add_argument("--max-batch-size", type=int, default=None, help="caps the capture buckets (config key)")
    p.add_argument("--batch-sizes", type=_ints, default=None, help="e.g. 1,4,16 (default: the plan's buckets, or 1)")
    p.add_argument("--prompt-lengths", type=_ints, default=[128], help="e.g. 128,512 (default 128)")
    p.add_argument("--new-tokens", type=int, default=2, help="tokens per request (default 2)")
    p.add_argument("--cache-dir", default=None, help="folder for the artifacts (the config key compile_cache)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="do not calibrate first where this CUDA device has no calibration rows for the model")
    add_config_arg(p)


def run(args: argparse.Namespace) -> int:
    from moefx.precompile import precompile

    cfg = load_config(args)
    cache = str(Path(args.cache_dir).expanduser().resolve()) if args.cache_dir else None
    overrides = {"mode": args.mode, "max_batch_size": args.max_batch_size, "compile_cache": cache}
    chosen = {k: v for k, v in overrides.items() if v is not None}
    if chosen:
        cfg = CompilationConfig.from_any({**cfg.to_dict(), **chosen})
    if not args.no_calibrate:
        _calibrate_if_missing(args, cfg)
    result = precompile(args.model, batch_sizes=args.batch_sizes, prompt_lengths=args.prompt_lengths,
                        new_tokens=args.new_tokens, device=args.device, dtype=args.dtype, layers=args.layers,
                        config=cfg)
    print(result.describe())
    return 0


def _calibrate_if_missing(args: argparse.Namespace, cfg: CompilationConfig) -> None:
    """Run `moefx calibrate --model MODEL` first when this CUDA device has no row for the model's MoE or dense
    calls (the plan would keep them on the upstream path), and say so."""
    import torch

    from moefx.cli import main
    from moefx.facts import ExecutionSignature, ModelSignature
    from moefx.models.spec import model_config
    from moefx.optimize import uncalibrated_calls
    from moefx.planner import resolve

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not str(device).startswith("cuda"):
        return
    ms = ModelSignature.from_config(model_config(args.model))
    es = ExecutionSignature.detect(device=device, mode=cfg.mode, max_batch_size=cfg.max_batch_size,
                                   dtype=getattr(torch, args.dtype) if args.dtype else None)
    missing = uncalibrated_calls(resolve(ms, es, cfg))
    if not missing:
        return
    print(f"no calibration rows for {args.model} on {es.device_name} ({', '.join(missing)}): running "
          f"`moefx calibrate --model {args.model}` first (--no-calibrate skips it)", flush=True)
    argv = ["calibrate", "--model", args.model, "--device", "cuda"] + (["--dtype", args.dtype] if args.dtype else [])
    if main(argv) != 0:
        raise ValueError(f"calibrating {args.model} failed; precompile with --no-calibrate to build the "
                         "upstream plan's artifacts")
