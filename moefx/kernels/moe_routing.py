"""Fused MoE routing in one Triton kernel: scores, (group) top-k, renormalize, scale; one row per program.

Selection is by repeated maxima with ties to the lower id. "softmax" ranks the fp32 logits themselves
(softmax is monotone in them, so this is eager's choice without depending on the exp implementation);
"sigmoid" ranks sigmoid + bias as computed here, `1 / (1 + exp(-x))` in fp32 (Triton's `tl.sigmoid`, which
is also what inductor emits). TOP_K is any k >= 1; the k slots live in a power-of-two block K_BLOCK.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

KIND_CODES = {"softmax": 0, "topk_softmax": 1, "sigmoid": 2}
# The softmax denominator is summed in int64 fixed point: each exp(x - max) in [0, 1] times 2^50, truncated, so a
# row of up to 4096 (routing_limits.MAX_KERNEL_EXPERTS) terms stays below 2^62. Integer sums do not depend on the
# order the reduction adds in, so every tile shape and kernel gets the same denominator to the bit; the terms lose
# less than 2^-50 each against a sum >= 1 (the max's own term), far below fp32's 2^-24.
FIXED_ONE = tl.constexpr(2.0**50)
FIXED_ULP = tl.constexpr(2.0**-50)
INT64_MIN = tl.constexpr(-(2**63))
# Scores one warp routes (16 a thread). A program is one warp with as many rows as that holds (4 of 128 experts, 2 of
# 256; wider routers one row over more warps): every pick's max then stays in the warp, shuffles without a barrier
# (the sm_90a PTX at 128 experts: 1 barrier where one row over 4 warps has 23). For 4096 rows on the H100 the one-row,
# 4-warp program took 98.7 us a layer, these 5.1 (the 48-layer prefill step tables, docs/FINDINGS.md).
WARP_SCORES = 512


@triton.jit
def _sum_and_max(s_a, k_a, s_b, k_b):
    return s_a + s_b, tl.maximum(k_a, k_b)


@triton.jit
def _unkey(packed):
    """The fp32 value of a packed key's upper half (the order-preserving map is its own inverse; NaN's key gives a
    NaN)."""
    key = (packed >> 32).to(tl.int32)
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def route_rows(
    x, cols, bias_ptr,
    E: tl.constexpr, TOP_K: tl.constexpr, KIND: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_E: tl.constexpr, K_BLOCK: tl.constexpr,
):
    """Route a tile of rows together: x the fp32 logits [ROWS, BLOCK_E] (-inf past E), `cols` their ids [BLOCK_E];
    returns (weights before the scaling factor, ids), each [ROWS, K_BLOCK] (0 past TOP_K). Also the dense kernel's
    ROUTE epilogue (kernels/dense_gemm.py).

    Each pick is one block-wide max over a packed int64 key per expert: an order-preserving int32 image of the fp32
    choice in the upper half (NaN highest, as torch.topk; padding and taken experts below -inf, so the k ids are
    distinct even when -inf scores remain), BLOCK_E - 1 - id in the lower half (ties to the lower id). The max
    yields the value and the id at once. softmax/topk_softmax recover the pick's logit from its key; the softmax
    denominator (fixed point, FIXED_ONE) rides in the reduction of the second pick; sigmoid's score at pick j is a
    masked sum (exact: one term) riding in the reduction of pick j + 1. The sums over the k picks (renormalize,
    topk_softmax) add in pick order. Block-wide reductions per tile of rows: TOP_K (softmax, topk_softmax), TOP_K + 1
    (sigmoid; plus the group stage's), against 2 * TOP_K (+ 2 for softmax) per row when each pick took an argmax and
    a masked sum and the rows went one after another. Every sum is either integer or in a fixed order, so any tile
    of rows gives the same weights to the bit."""
    ROWS: tl.constexpr = x.shape[0]
    valid = (cols < E)[None, :]
    if KIND == 2:
        scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), 0.0)
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
        choice = tl.where(valid, choice, float("-inf"))
        if N_GROUP > 1:
            gsize: tl.constexpr = BLOCK_E // N_GROUP
            grouped = tl.reshape(choice, (ROWS, N_GROUP, gsize))
            first = tl.max(grouped, axis=2)
            first_at = tl.argmax(grouped, axis=2, tie_break_left=True)
            in_group = tl.arange(0, gsize)[None, None, :]
            second = tl.max(tl.where(in_group == first_at[:, :, None], float("-inf"), grouped), axis=2)
            group_score = first + second
            keep = tl.zeros((ROWS, N_GROUP), dtype=tl.int1)
            g_cols = tl.arange(0, N_GROUP)[None, :]
            for _ in tl.static_range(TOPK_GROUP):
                g = tl.argmax(tl.where(keep, float("-inf"), group_score), axis=1, tie_break_left=True)
                keep = keep | (g_cols == g[:, None])
            keep_cols = tl.reshape(tl.broadcast_to(keep[:, :, None], (ROWS, N_GROUP, gsize)), (ROWS, BLOCK_E))
            choice = tl.where(keep_cols, choice, float("-inf"))
    else:
        choice = x
    bits = choice.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(choice != choice, 2147483647, key)
    key = tl.where(valid, key, -2147483648)
    packed = (key.to(tl.int64) << 32) | (BLOCK_E - 1 - cols).to(tl.int64)[None, :]
    k_offs = tl.arange(0, K_BLOCK)[None, :]
    top_w = tl.zeros((ROWS, K_BLOCK), dtype=tl.float32)
    top_i = tl.zeros((ROWS, K_BLOCK), dtype=tl.int32)
    total = tl.zeros((ROWS,), dtype=tl.float32)  # the picks' weights (topk_softmax: exps) summed in pick order
    best = tl.max(packed, axis=1)
    for j in tl.static_range(TOP_K):
        taken = packed == best[:, None]
        packed = tl.where(taken, INT64_MIN, packed)
        top_i = tl.where(k_offs == j, (BLOCK_E - 1 - best.to(tl.int32))[:, None], top_i)
        if KIND == 2:
            if j + 1 < TOP_K:
                w, best = tl.reduce((tl.where(taken, scores, 0.0), packed), 1, _sum_and_max)
            else:
                w = tl.sum(tl.where(taken, scores, 0.0), axis=1)
        else:
            v = _unkey(best)
            if j == 0:
                row_max = v  # tl.max(x) but for the sign of a zero max (exp(x - max) is the same) and NaN rows
                if KIND == 0:
                    ex = tl.exp(x - row_max[:, None])
                    fixed = tl.where(ex == ex, ex * FIXED_ONE, 0.0).to(tl.int64)
                    if j + 1 < TOP_K:
                        fixed_sum, best = tl.reduce((fixed, packed), 1, _sum_and_max)
                    else:
                        fixed_sum = tl.sum(fixed, axis=1)
                    # NaN where an exp(x - max) is: a NaN or +inf max (a -inf max makes every weight NaN itself)
                    denom = tl.where(tl.abs(row_max) < float("inf"), fixed_sum.to(tl.float32) * FIXED_ULP,
                                     float("nan"))
                elif j + 1 < TOP_K:
                    best = tl.max(packed, axis=1)
            elif j + 1 < TOP_K:
                best = tl.max(packed, axis=1)
            w = tl.exp(v - row_max)
            if KIND == 0:
                w = w / denom
        total += w
        top_w = tl.where(k_offs == j, w[:, None], top_w)
    if KIND == 1:
        top_w = top_w / total[:, None]
    elif RENORM:
        if KIND == 2:
            total += 1e-20  # routing.SIGMOID_RENORM_EPS
        top_w = top_w / total[:, None]
    return top_w, top_i


@triton.jit(do_not_specialize=["T"])  # T only bounds masks: one compile serves every row count of a tile height
def _fused_topk_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, T, stride_t, stride_e, scaling,
    E: tl.constexpr, TOP_K: tl.constexpr, KIND: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_E: tl.constexpr, K_BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_E)
    in_t = (rows < T)[:, None]
    x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :] * stride_e, mask=in_t & (cols < E)[None, :],
                other=float("-inf")).to(tl.float32)
    x = tl.where(in_t, x, 0.0)  # rows past T: finite, routed and dropped
    top_w, top_i = route_rows(x, cols, bias_ptr, E, TOP_K, KIND, RENORM, HAS_BIAS, N_GROUP, TOPK_GROUP, BLOCK_E,
                              K_BLOCK)
    k_offs = tl.arange(0, K_BLOCK)[None, :]
    out = rows[:, None] * TOP_K + k_offs
    out_mask = in_t & (k_offs < TOP_K)
    tl.store(w_ptr + out, (top_w * scaling).to(w_ptr.dtype.element_ty), mask=out_mask)
    tl.store(ids_ptr + out, top_i.to(tl.int64), mask=out_mask)


def launch_shape(t: int, num_experts: int) -> tuple[int, int]:
    """(rows a program routes, its warps) for t rows of `num_experts` scores: WARP_SCORES a warp, one warp holding as
    many rows as fit (at most t's power of two: rows past t are masked), a row wider than that on more warps."""
    block_e = triton.next_power_of_2(num_experts)
    if block_e <= WARP_SCORES:
        return min(WARP_SCORES // block_e, triton.next_power_of_2(max(t, 1))), 1
    return 1, block_e // WARP_SCORES


def fused_topk_triton(
    router_logits: torch.Tensor,
    top_k: int,
    kind: str,
    renormalize: bool,
    correction_bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    weights_dtype: torch.dtype | None = None,
    shape: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch one program per `rows` rows over `warps` warps (`shape` = (rows, warps), powers of two; None:
    `launch_shape`); outputs are allocated here (fixed sizes, so CUDA-graph capturable). Weights are computed in fp32
    and stored in `weights_dtype` (default fp32): one rounding, as a cast after the op. Every shape gives the same
    weights and ids to the bit."""
    t, e = router_logits.shape
    w = torch.empty(t, top_k, dtype=weights_dtype or torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    bias = correction_bias.contiguous() if correction_bias is not None else w
    rows, warps = shape or launch_shape(t, e)
    if any(v < 1 or v & (v - 1) for v in (rows, warps)):
        raise ValueError(f"fused_topk_triton: shape={(rows, warps)} (rows, warps) must be powers of two >= 1")
    if t:
        _fused_topk_kernel[(triton.cdiv(t, rows),)](
            router_logits, bias, w, ids, t, router_logits.stride(0), router_logits.stride(1),
            float(routed_scaling_factor),
            **constexprs(e, top_k, kind, renormalize, correction_bias is not None, n_group, topk_group), ROWS=rows,
            num_warps=warps,
        )
    return w, ids


@functools.lru_cache(maxsize=256)  # pure in its arguments; asked per call
def constexprs(e: int, top_k: int, kind: str, renormalize: bool, has_bias: bool, n_group: int,
                topk_group: int) -> dict:
    return dict(E=e, TOP_K=top_k, KIND=KIND_CODES[kind], RENORM=renormalize, HAS_BIAS=has_bias, N_GROUP=n_group,
                TOPK_GROUP=topk_group, BLOCK_E=triton.next_power_of_2(e), K_BLOCK=triton.next_power_of_2(top_k))
