"""`moefx explain-fusions FILE.py:FUNC`: list every SiLU-mul / RMSNorm -> quant candidate in FUNC, fused or
not, with the file:line of the code and the exact reason for each one left alone.

FUNC's example inputs come from `--inputs` (shapes such as `64x512`, `256:float32`; random normal tensors of
`--dtype`), else from FUNC's `example_inputs` attribute or a module-level `example_inputs()` function (called
with FUNC's name when it takes an argument). Nothing is code-generated: the post-grad graph is captured and
the passes run on it. `--config` and `-cc.pass_config.fuse_act_quant=false` (or fuse_norm_quant) turn a pass off,
as in a compile; the other config keys do not change what this command shows.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from moefx.cli.common import add_config_arg, load_config

DTYPES = ("bfloat16", "float16", "float32")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="FILE.py:FUNC")
    p.add_argument("--inputs", nargs="+", default=None, metavar="SHAPE[:DTYPE]",
                   help="example input shapes, e.g. 64x512 256:float32")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of --inputs tensors")
    p.add_argument("--dynamic-rows", action="store_true", help="make the first dim of 2+-d inputs symbolic")
    add_config_arg(p)


def load_function(target: str) -> tuple[Any, Any]:
    """(module, function) for FILE.py:FUNC; ValueError naming what is wrong."""
    path, sep, name = target.rpartition(":")
    if not sep or not path.endswith(".py") or not name:
        raise ValueError(f"target {target!r} must look like FILE.py:FUNC")
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"moefx_explain_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.resolve().parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    fn = getattr(module, name, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__)
        raise ValueError(f"{path} has no function {name!r}; functions there: {names}")
    return module, fn


def parse_inputs(specs: list[str], dtype: str) -> list[Any]:
    import torch

    out = []
    for spec in specs:
        shape, _, dt = spec.partition(":")
        dt = dt or dtype
        if dt not in DTYPES:
            raise ValueError(f"input {spec!r}: dtype {dt!r} is invalid; valid choices: {list(DTYPES)}")
        try:
            dims = [int(d) for d in shape.lower().split("x")]
        except ValueError:
            raise ValueError(f"input {spec!r}: shape must look like 64x512") from None
        out.append(torch.randn(*dims, dtype=getattr(torch, dt)))
    return out


def example_inputs(module: Any, fn: Any) -> list[Any]:
    source = getattr(fn, "example_inputs", None) or getattr(module, "example_inputs", None)
    if source is None:
        raise ValueError(f"give --inputs, or define {fn.__name__}.example_inputs or example_inputs() in the file")
    if callable(source):
        source = source(fn.__name__) if inspect.signature(source).parameters else source()
    return list(source)


def run(args: argparse.Namespace) -> int:
    from moefx.explain import explain_fusions

    cfg = load_config(args)  # a bad key or value is refused before the file is run
    module, fn = load_function(args.target)
    inputs = parse_inputs(args.inputs, args.dtype) if args.inputs else example_inputs(module, fn)
    print(explain_fusions(fn, *inputs, dynamic_rows=args.dynamic_rows, config=cfg))
    return 0
