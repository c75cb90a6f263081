"""`moefx plan MODEL`: print the plan moefx would apply to a model, here or on another machine.

MODEL is a built-in name (see `moefx.models.catalog`), a config.json or model folder, or a YAML file
holding either a config / signature mapping or `model:` and `execution:` sections. `--device` takes
cpu, cuda (this machine's GPU) or a GPU preset (h200, h100, ...) to plan for a machine you are not on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moefx.cli.common import add_config_arg, load_config
from moefx.config import MODES, load_data_file
from moefx.machine import DEVICE_PRESETS
from moefx.models.catalog import catalog_names
from moefx.models.spec import model_config

if TYPE_CHECKING:
    from moefx.facts import ExecutionSignature, ModelSignature


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=f"built-in name ({', '.join(catalog_names())}), config.json, folder or YAML")
    p.add_argument("--device", default=None, help=f"cpu, cuda or a preset: {', '.join(DEVICE_PRESETS)}")
    p.add_argument("--mode", default=None, choices=list(MODES), help="default: the config's (capture)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="caps the capture buckets, 1 to 8192 (default: the config's, else a cap from memory)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the model's)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_config_arg(p)


def _load_spec(spec: str) -> tuple[ModelSignature, dict[str, Any]]:
    """(model signature, execution fields from a YAML `execution:` section)."""
    from moefx.facts import ModelSignature
    path = Path(spec)
    if path.is_file() and path.suffix.lower() in (".yaml", ".yml"):
        data = load_data_file(path, "model signature file")
        if not isinstance(data, dict):
            raise ValueError(f"{spec}: a YAML model signature must be a mapping")
        if "model" in data or "execution" in data:
            extra = sorted(set(data) - {"model", "execution"})
            if extra:
                raise ValueError(f"{spec}: unknown sections {extra}; valid sections: ['model', 'execution']")
            return ModelSignature.from_config(data.get("model") or {}), dict(data.get("execution") or {})
        return ModelSignature.from_config(data), {}
    return ModelSignature.from_config(model_config(spec)), {}


def _execution(args: argparse.Namespace, ms: ModelSignature, fields: dict[str, Any], cfg: Any) -> ExecutionSignature:
    flags = {
        "mode": args.mode,
        "tp_size": args.tp,
        "ep_size": args.ep,
        "max_batch_size": args.max_batch_size,
        "dtype": args.dtype,
    }
    from moefx.facts import ExecutionSignature

    defaults = {"mode": cfg.mode, "max_batch_size": cfg.max_batch_size, "dtype": ms.dtype}
    chosen = {**defaults, **fields, **{k: v for k, v in flags.items() if v is not None}}
    if fields and args.device is None:
        return ExecutionSignature.from_dict(chosen)
    device = args.device
    if device is not None and device.lower() in DEVICE_PRESETS:
        return ExecutionSignature.preset(device, **chosen)
    base = ExecutionSignature.detect(device=device)
    return base.replace(**chosen)


def run(args: argparse.Namespace) -> int:
    from moefx.planner import resolve

    cfg = load_config(args)
    ms, fields = _load_spec(args.model)
    es = _execution(args, ms, fields, cfg)
    plan = resolve(ms, es, cfg)
    print(json.dumps(plan.to_dict(), indent=2, default=str) if args.json else plan.explain())
    return 0
