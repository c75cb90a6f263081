"""`moefx plan MODEL`: print the plan moefx would apply to a model on this machine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moefx.cli.common import add_config_arg, load_config
from moefx.models import tiny_qwen3_moe_config
from moefx.signatures import ExecutionSignature, ModelSignature, resolve

BUILTIN = {"tiny-qwen3-moe": tiny_qwen3_moe_config}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="explain the plan for a model", description=__doc__)
    p.add_argument("model", help=f"built-in name ({', '.join(BUILTIN)}) or a config.json / model folder")
    p.add_argument("--device", default=None, help="cpu or cuda (default: this machine's)")
    p.add_argument("--mode", default=None, choices=["eager", "compile", "capture"])
    add_config_arg(p)
    p.set_defaults(func=run)


def _model_signature(spec: str) -> ModelSignature:
    if spec in BUILTIN:
        return ModelSignature.from_config(BUILTIN[spec]())
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model {spec!r} is neither a built-in name {sorted(BUILTIN)} nor a config file")
    return ModelSignature.from_config(json.loads(path.read_text()))


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    es = ExecutionSignature.detect(device=args.device, mode=args.mode or cfg.mode, max_batch_size=cfg.max_batch_size)
    print(resolve(_model_signature(args.model), es, cfg).explain())
    return 0
