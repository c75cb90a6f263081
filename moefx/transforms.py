"""Model transforms that `optimize` applies before compiling (MoE backend, offload, sampling, ...).

Each feature registers one function `fn(model, plan, config) -> list[str]`; the returned lines are
the decisions it applied, and they land in the plan's provenance so `explain()` shows them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

TransformFn = Callable[[Any, Any, Any], list[str]]


@dataclass(frozen=True)
class ModelTransform:
    name: str
    order: int
    fn: TransformFn


MODEL_TRANSFORMS: dict[str, ModelTransform] = {}


def register_model_transform(name: str, order: int) -> Callable[[TransformFn], TransformFn]:
    def deco(fn: TransformFn) -> TransformFn:
        if name in MODEL_TRANSFORMS:
            raise ValueError(f"model transform {name!r} is registered twice")
        MODEL_TRANSFORMS[name] = ModelTransform(name, order, fn)
        return fn

    return deco


def ordered_transforms() -> list[ModelTransform]:
    return sorted(MODEL_TRANSFORMS.values(), key=lambda t: (t.order, t.name))
