"""The `optimize` transform for sampling: on CUDA, `generate()` reads its stop flag one step late."""

from __future__ import annotations

from typing import Any

from moefx.sampling.stop import enable_deferred_stop
from moefx.transforms import register_model_transform


@register_model_transform("sampling", order=50)
def sampling_transform(model: Any, plan: Any, config: Any) -> list[str]:
    device = getattr(getattr(plan, "execution", None), "device_type", None)
    if device != "cuda":
        return [f"deferred stop check off: device {device or 'unknown'} (on for cuda only)"]
    why = enable_deferred_stop(model, devices=("cuda",))
    if why is not None:
        return [f"deferred stop check off: {why}"]
    return ["deferred stop check on for generate() (host reads the stop flag one step late)"]
