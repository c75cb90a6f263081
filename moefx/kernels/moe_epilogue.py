"""The gate activation of the GEMM-1 epilogues (grouped GEMM 1, gemv stage 1): one `ACT` constexpr per activation.

ACT ids are `moefx.kernels.activation.ACTIVATIONS[name].kernel_id`: 0 SiLU, 1 exact GELU (erf), 2 GELU's tanh
approximation, computed as x * sigmoid(2 k (x + 0.044715 x^3)) (equal to 0.5 x (1 + tanh(k (...))), no tanh).
Every variant is elementwise on the fp32 accumulators, so a variant costs the same loads as SiLU; LIMIT > 0 (a
constexpr) clamps gate and up first, the clamped SwiGLU of DeepSeek-V4, GLM-5-Next and HY-V4.
"""

from __future__ import annotations

import triton
import triton.language as tl

# A module-level constexpr stays a constexpr object in Triton's interpreter (3.9), and constexpr * tensor wraps
# the tensor in a constexpr, which tl.exp then rejects; so each constant multiplies with the tensor on the left.
INV_SQRT2 = tl.constexpr(0.7071067811865476)
TWO_K = tl.constexpr(1.5957691216057308)  # 2 * sqrt(2 / pi)


@triton.jit
def gate_up(g, u, ACT: tl.constexpr, LIMIT: tl.constexpr):
    """act(g) * u, after clamping g to <= LIMIT and u to [-LIMIT, LIMIT] when LIMIT > 0 (clamped SwiGLU)."""
    if LIMIT > 0:
        g = tl.minimum(g, LIMIT)
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
    return gate_act(g, ACT) * u


@triton.jit
def gate_act(g, ACT: tl.constexpr):
    """act(g), fp32 in and out."""
    if ACT == 1:
        y = 0.5 * g * (1.0 + tl.erf(g * INV_SQRT2))
    elif ACT == 2:
        y = g / (1.0 + tl.exp((g + 0.044715 * g * g * g) * -TWO_K))
    else:
        y = g / (1.0 + tl.exp(-g))
    return y
