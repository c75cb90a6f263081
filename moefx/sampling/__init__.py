"""Sync-free sampling for moefx: the static-shape sampler (`sampler.py`: `SamplingParams`, `sample`).

The decode engine that runs it lives in `moefx.engine`. `DecodeLoop` and `enable_deferred_stop` stay importable
from here, loaded on first use, because published pages name `moefx.sampling.DecodeLoop`.
"""

from typing import Any

from moefx.sampling.sampler import SamplingParams, sample

__all__ = ["DecodeLoop", "SamplingParams", "enable_deferred_stop", "sample"]


def __getattr__(name: str) -> Any:
    # Loaded lazily: importing the sampler (or the FX helpers beside it) must not load the engine.
    if name == "DecodeLoop":
        from moefx.engine.engine import DecodeLoop

        return DecodeLoop
    if name == "enable_deferred_stop":
        from moefx.engine.hf_generate import enable_deferred_stop

        return enable_deferred_stop
    raise AttributeError(f"module 'moefx.sampling' has no attribute {name!r}")
