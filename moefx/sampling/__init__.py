"""Sync-free sampling for moefx: the static-shape sampler (`sampler.py`: `SamplingParams`, `sample`).

The decode engine that runs it is `moefx.engine` (`moefx.engine.engine.DecodeLoop`).
"""

from moefx.sampling.sampler import SamplingParams, sample

__all__ = ["SamplingParams", "sample"]
