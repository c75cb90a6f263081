"""Programmatic dependent launch (PDL, Hopper and later): a kernel may start before the previous one ends.

A kernel launched this way runs its independent prologue (indices, weight tiles) while the previous kernel
finishes, then calls `gdc_wait()` before it reads that kernel's output; the previous kernel may call
`gdc_launch_dependents()` to let it start early. CUDA-graph capture keeps the edge as a programmatic one.
Off under the Triton interpreter (the wait is inline PTX) and below capability 9.0.
"""

from __future__ import annotations

import functools
import os

import torch

from moefx.kernels.memo import device_capability

# Read once, as Triton does: whether a kernel runs in the interpreter is fixed when its module defines it.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache  # launchers ask per call
def pdl_supported(device: torch.device) -> bool:
    if _INTERPRET or device.type != "cuda":
        return False
    return device_capability(device) >= (9, 0)


def pdl_launch(enabled: bool) -> dict[str, bool]:
    """Launch keyword for a dependent kernel (nothing when off, so older launchers see no new option)."""
    return {"launch_pdl": True} if enabled else {}
