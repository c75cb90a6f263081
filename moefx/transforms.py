"""Model transforms that `optimize` applies before compiling (MoE backend, offload, sampling, ...).

Each feature registers one function `fn(model, plan, config) -> list[str]`; the returned lines are
the decisions it applied, and they land in the plan's provenance so `explain()` shows them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TransformFn = Callable[[Any, Any, Any], list[str]]


@dataclass(frozen=True)
class ModelTransform:
    name: str
    order: int
    fn: TransformFn


MODEL_TRANSFORMS: dict[str, ModelTransform] = {}

# Modules that register a transform when imported; `optimize` imports them on first use.
TRANSFORM_MODULES: tuple[str, ...] = (
    "moefx.offload.transform",
    "moefx.integrations.transformers",
    "moefx.integrations.attention",
    "moefx.parallel.transform",
    "moefx.engine.install",
    "moefx.engine.layers.regions",
)


def register_model_transform(name: str, order: int) -> Callable[[TransformFn], TransformFn]:
    def deco(fn: TransformFn) -> TransformFn:
        if name in MODEL_TRANSFORMS:
            raise ValueError(f"model transform {name!r} is registered twice")
        MODEL_TRANSFORMS[name] = ModelTransform(name, order, fn)
        return fn

    return deco


def ordered_transforms() -> list[ModelTransform]:
    for module in TRANSFORM_MODULES:
        importlib.import_module(module)
    return sorted(MODEL_TRANSFORMS.values(), key=lambda t: (t.order, t.name))
