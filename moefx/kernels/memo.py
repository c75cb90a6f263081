"""Per-key memos of what a custom op decides from shapes alone, so a call pays one dict lookup, not the decision.

A moefx op decides per call, from tensor metadata only, which backend runs (the calibrated policy, the backend's
own checks) and how its kernels launch (tiles, grids, buffer sizes, constexpr arguments). Those decisions are the
same for every call with the same key, and the host time they cost is what keeps a prefill's GPU waiting
(issue 28), so each op memoizes them here. A key holds everything its decision reads: shapes, strides, dtypes and
devices of the tensors, the op's non-tensor arguments, and the raw values of the environment knobs and the
calibration-table generation the decision consulted, so changing an override or writing a table gives a new key;
a decision that depends on tensor values (the grouped path's per-expert token counts) stays on the device.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Hashable
from typing import Any

import torch

_NO_SWITCH = contextlib.nullcontext()


class ShapeMemo:
    """key -> decision, at most `maxsize` entries (the oldest goes first): keys are shape buckets, so there are few."""

    __slots__ = ("_entries", "maxsize")

    def __init__(self, maxsize: int = 1024):
        self._entries: dict[Hashable, Any] = {}
        self.maxsize = maxsize

    def get(self, key: Hashable) -> Any:
        return self._entries.get(key)

    def put(self, key: Hashable, value: Any) -> Any:
        if len(self._entries) >= self.maxsize:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = value
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def tensor_meta(t: torch.Tensor) -> tuple:
    """What a decision may read of a tensor besides its values: shape, strides, dtype, device."""
    return t.shape, t.stride(), t.dtype, t.device


@functools.cache
def device_capability(device: torch.device) -> tuple[int, int]:
    """`torch.cuda.get_device_capability`, asked once per device (launchers check it per call)."""
    return torch.cuda.get_device_capability(device)


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """`torch.cuda.device(device)` where it would switch the current device; nothing to enter where it is current
    already (the usual case, and entering the switch costs microseconds per launch)."""
    if device.index is None or device.index == torch.cuda.current_device():
        return _NO_SWITCH
    return torch.cuda.device(device)
