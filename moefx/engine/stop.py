"""Deferred stop check for transformers' `generate()`: read "all sequences finished?" one step late.

Stock `_sample` evaluates `unfinished_sequences.max() == 0` on the host after every token, which waits
for the GPU each step. transformers 5.x ships the fix (`DeferredStopCheck`: copy the flag to pinned
memory asynchronously, read it on the next step, undo the one extra step at the end) but turns it on
only for MPS. moefx turns it on, per model and only inside that model's `generate()`, for the devices
it is asked for (CUDA from `optimize`). Outputs are identical to the stock loop: the extra step's
token is trimmed and a returned cache is cropped back, by transformers' own code.

Without a fork: the module-level `DeferredStopCheck` that `_sample` looks up is replaced once by a
subclass that behaves exactly like the original unless a moefx-enabled `generate()` is running.
"""

from __future__ import annotations

import collections
import contextvars
import functools
from typing import Any

import torch

from moefx.log import get_logger

log = get_logger("moefx.sampling")

# Device types for which the running generate() defers its stop check (empty: stock behaviour).
_DEFER_ON: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("moefx_defer_stop", default=())
_INSTALLED: dict[str, Any] = {}


class _HostEvent:
    """Stands in for `torch.Event` on devices without events (CPU): copies there are already synchronous."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _patched_class() -> type | None:
    """transformers' DeferredStopCheck, subclassed to honour `_DEFER_ON`; None when this transformers lacks it."""
    if "cls" in _INSTALLED:
        return _INSTALLED["cls"]
    try:
        from transformers.generation import utils as gen_utils
    except ImportError:
        return None
    base = getattr(gen_utils, "DeferredStopCheck", None)
    if base is None or not hasattr(base, "is_supported"):
        return None

    class MoefxDeferredStopCheck(base):  # type: ignore[misc, valid-type]
        """transformers' DeferredStopCheck, enabled on more devices while a moefx generate() runs."""

        instances = 0

        def __init__(
            self, input_ids: torch.Tensor, max_length: int, cache: Any, cache_is_returned: bool, streamer: Any = None
        ) -> None:
            MoefxDeferredStopCheck.instances += 1
            if input_ids.device.type != "cpu":
                super().__init__(input_ids, max_length, cache, cache_is_returned, streamer)
                return
            # torch has no CPU events; the same state as the base class, with synchronous stand-ins.
            gen_utils.StopCheck.__init__(self, streamer)
            self.max_length = max_length
            self.cache = cache if cache_is_returned else None
            if self.cache is not None:
                self.cache.activate_past_recording()
            batch = input_ids.shape[0]
            self.slots = collections.deque(
                (torch.zeros((), dtype=torch.bool), torch.zeros(batch, dtype=torch.long), _HostEvent())
                for _ in range(2)
            )
            self.is_first_step = True
            self.stop_reported = False

        @staticmethod
        def is_supported(device: torch.device, cache: Any, cache_is_returned: bool, is_assistant: bool) -> bool:
            if device.type not in _DEFER_ON.get():
                return base.is_supported(device, cache, cache_is_returned, is_assistant)
            if is_assistant:
                return False
            return cache is None or bool(getattr(cache, "is_croppable", False)) or not cache_is_returned

    gen_utils.DeferredStopCheck = MoefxDeferredStopCheck
    _INSTALLED["cls"] = MoefxDeferredStopCheck
    return MoefxDeferredStopCheck


def no_transformers_generate(model: Any) -> str | None:
    """Why `model` has no transformers `generate()` loop to hook, or None when it has one."""
    if not callable(getattr(model, "generate", None)) or not hasattr(model, "_sample"):
        return "the model has no transformers generate()"
    return None


def enable_deferred_stop(model: Any, devices: tuple[str, ...] = ("cuda",)) -> str | None:
    """Make `model.generate()` defer its stop check on `devices`. Returns None when applied, else why not."""
    if why := no_transformers_generate(model):
        return why
    if getattr(model, "_moefx_deferred_stop", None) is not None:
        return None
    if _patched_class() is None:
        return "this transformers version has no DeferredStopCheck"
    original = model.generate

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        token = _DEFER_ON.set(tuple(devices))
        try:
            return original(*args, **kwargs)
        finally:
            _DEFER_ON.reset(token)

    model.generate = generate
    model._moefx_deferred_stop = tuple(devices)
    log.debug("deferred stop check enabled for %s on %s", type(model).__name__, devices)
    return None


def deferred_stop_instances() -> int:
    """How many deferred stop checks moefx-enabled generate() calls have created (tests, benchmarks)."""
    cls = _patched_class()
    return cls.instances if cls is not None else 0
