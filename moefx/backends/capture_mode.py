"""Which calibration rows a backend decision reads: those measured under CUDA-graph capture, or the eager ones.

A call on a capturing stream decides from the capture rows, any other call from the eager rows, and the two pick
other kernels at some sizes (H200 tables: q/k/v at M=48 run the dense gemv captured and cuBLAS eager), whose bf16
sums round apart. A step run directly in place of a graph (the engine with its CUDA graphs turned off) runs under
`as_captured()`, so it runs the kernels the graph would have replayed and gives the same bits.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_AS_CAPTURED = contextvars.ContextVar("moefx_as_captured", default=False)


def decides_as_captured(t: torch.Tensor) -> bool:
    """Whether a call on `t` decides from the capture rows: its stream is capturing, or it runs `as_captured()`."""
    return t.is_cuda and (_AS_CAPTURED.get() or torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def as_captured(enabled: bool = True) -> Iterator[None]:
    """Backend decisions inside read the capture rows, as in a capture (a no-op when not `enabled`)."""
    token = _AS_CAPTURED.set(enabled or _AS_CAPTURED.get())
    try:
        yield
    finally:
        _AS_CAPTURED.reset(token)
