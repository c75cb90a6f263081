"""Programmatic dependent launch (PDL, Hopper and later): a kernel may start before the previous one ends.

A kernel launched this way runs its independent prologue (indices, weight tiles) while the previous kernel
finishes, then calls `gdc_wait()` before it reads that kernel's output; the previous kernel may call
`gdc_launch_dependents()` to let it start early. CUDA-graph capture keeps the edge as a programmatic one.
`gdc_wait()` waits for the whole previous grid and its memory, so a kernel that calls it before its first read of
anything that kernel may have written is correct whatever the kernel before it is (a kernel not launched this way
is simply ordered as usual, and a kernel that never triggers lets its dependent start when its programs exit).
Off under the Triton interpreter (the wait is inline PTX) and below capability 9.0.

Two uses:
- inside one op (the MoE experts' stage 2 after stage 1, grouped GEMM 2 after GEMM 1): always on where supported;
- between ops, the decode step's chain (`step_pdl`): the dense GEMV, q/k norm + RoPE + cache write, decode
  attention, and the experts' first stage each launch as a programmatic dependent of the kernel
  before them, wait before their first read, and let their own dependents launch once all their programs run.
  On the H100 (8 and 48 layers at Qwen3-30B-A3B widths, B=1, bf16 and FP8) the chain took the decode step 2-4%
  faster than the same graphs without it, tokens equal (docs/PERFORMANCE.md); loading the dense GEMV's weights
  before its wait gained nothing more there (docs/FINDINGS.md), so no kernel reads before its wait.
  `set_step_pdl(False)` turns the chain off: the before/after switch of bench/e2e.py's `--step-pdl` arms.
"""

from __future__ import annotations

import functools
import os

import torch

from moefx.kernels.memo import device_capability

# Read once, as Triton does: whether a kernel runs in the interpreter is fixed when its module defines it.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_STEP = {"chain": True}


@functools.cache  # launchers ask per call
def pdl_supported(device: torch.device) -> bool:
    if _INTERPRET or device.type != "cuda":
        return False
    return device_capability(device) >= (9, 0)


def set_step_pdl(chain: bool = True) -> None:
    """Whether the decode step's kernels chain by PDL. Read at each launch: graphs captured before a change keep the
    launches they recorded."""
    _STEP["chain"] = bool(chain)


def step_pdl(device: torch.device) -> bool:
    """Whether a launch on `device` joins the decode step's chain: False where PDL is not supported."""
    return pdl_supported(device) and _STEP["chain"]


def pdl_launch(enabled: bool) -> dict[str, bool]:
    """Launch keyword for a dependent kernel (nothing when off, so older launchers see no new option)."""
    return {"launch_pdl": True} if enabled else {}
