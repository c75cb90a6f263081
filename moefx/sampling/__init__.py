"""Sync-free sampling for moefx: the static-shape sampler, the decode loop, the deferred stop check."""

from moefx.sampling.decode import DecodeLoop
from moefx.sampling.sampler import SamplingParams, sample
from moefx.sampling.stop import enable_deferred_stop

__all__ = ["DecodeLoop", "SamplingParams", "enable_deferred_stop", "sample"]
