"""`moefx calibrate`: measure every calibration row the plan reads for a model on this device, and write them.

With `--model`, one command covers the MoE experts and the dense linears (q/k/v, o, the router, shared experts'
and dense MLPs' projections), in the model's dtype and, where the GPU has FP8, in FP8 block-128, eager and capture:
each contender checked against a reference first, then timed over a grid of M (moefx.calibrate.sweep), the
crossovers written as rows with their provenance. With explicit --experts/--hidden/--intermediate/--topk it
calibrates that MoE shape alone. Rows go to the user table folder (or --output), replacing rows of the same key; a
latency-vs-M PNG per MoE shape is drawn next to it.
"""

from __future__ import annotations

import argparse

from moefx.calibrate import QUANTS

DTYPE_NAMES = ("bfloat16", "float16", "float32")


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("shape (either --model or all of --experts/--hidden/--intermediate/--topk)")
    src.add_argument("--model", help="catalog name (e.g. qwen3-30b-a3b) or a config.json / model folder")
    src.add_argument("--tp", type=int, default=1, help="tensor-parallel size: per-GPU experts get intermediate/tp")
    src.add_argument("--experts", type=int, help="number of experts E")
    src.add_argument("--hidden", type=int, help="hidden size H")
    src.add_argument("--intermediate", type=int, help="per-expert intermediate size I (w13 has 2I rows)")
    src.add_argument("--topk", type=int, help="experts per token")
    p.add_argument("--dtype", default=None, choices=DTYPE_NAMES, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--quant", default=None, choices=QUANTS,
                   help="weight format (default: none, and fp8-block128 too with --model on a GPU with FP8)")
    p.add_argument("--parts", default=None,
                   help="comma list of moe,dense (default: both with --model, moe with explicit sizes)")
    p.add_argument("--modes", default=None, help="comma list of eager,capture (default: both on CUDA, eager on CPU)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when present")
    p.add_argument("--backends", default=None,
                   help="comma list of MoE contenders (default: every available + upstream)")
    p.add_argument("--max-m", type=int, default=4096, help="largest token count M timed")
    p.add_argument("--reps", type=int, default=None, help="timed calls per point (default 20 on CUDA, 5 on CPU)")
    p.add_argument("--quick", action="store_true", help="small grids (M up to 16) and few reps: a smoke run")
    p.add_argument("--output", default=None, help="table YAML to write (default: user table folder)")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the table); 'none' skips it")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")


def run(args: argparse.Namespace) -> int:
    overrides = getattr(args, "config_overrides", [])
    if overrides:  # refused, not ignored: a user who passes one expects it to change something
        raise ValueError(f"calibrate reads no compilation config, so -cc overrides {overrides} would change "
                         f"nothing; valid: no -cc (it times every backend; the plan that reads the rows takes the "
                         f"config)")
    from moefx.cli.calibrate_run import run as calibrate

    return calibrate(args)
