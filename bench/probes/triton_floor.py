"""One launch of an empty Triton kernel with as many arguments as moefx's grouped GEMM 1 takes (bench/dispatch.py):
the host time Triton's launcher itself costs per kernel, which no moefx-side memo removes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _empty_kernel(
    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, i0, i1, i2, i3, i4, i5, i6, i7, i8,
    C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr, C5: tl.constexpr,
    C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr, C9: tl.constexpr,
):
    if tl.program_id(0) < 0:
        tl.store(p0, tl.load(p1))


def empty_launch(x: torch.Tensor) -> None:
    ints = (1, 2, 3, 4, 5, 6, 7, 8, 9)
    _empty_kernel[(1,)](x, x, x, x, x, x, x, x, x, x, *ints, C0=1, C1=2, C2=3, C3=4, C4=5, C5=6, C6=7, C7=8, C8=9,
                        C9=10, num_warps=4)
