"""Fused MoE routing in one Triton kernel: scores, (group) top-k, renormalize, scale; one row per program.

Selection is by repeated argmax with ties to the lower id. "softmax" ranks the fp32 logits themselves
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


@triton.jit
def route_row(
    x, valid, cols, bias_ptr,
    E: tl.constexpr, TOP_K: tl.constexpr, KIND: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_E: tl.constexpr, K_BLOCK: tl.constexpr,
):
    """One row's routing: x the fp32 logits [BLOCK_E] (-inf past E, `valid`), `cols` their ids; (weights before
    the scaling factor, ids), each [K_BLOCK]. Also the dense kernel's ROUTE epilogue (kernels/dense_gemm.py)."""
    if KIND == 2:
        scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), 0.0)
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, choice, float("-inf"))
        if N_GROUP > 1:
            gsize: tl.constexpr = BLOCK_E // N_GROUP
            grouped = tl.reshape(choice, (N_GROUP, gsize))
            first = tl.max(grouped, axis=1)
            first_at = tl.argmax(grouped, axis=1, tie_break_left=True)
            in_group = tl.arange(0, gsize)[None, :]
            second = tl.max(tl.where(in_group == first_at[:, None], float("-inf"), grouped), axis=1)
            group_score = first + second
            keep = tl.zeros((N_GROUP,), dtype=tl.int1)
            g_cols = tl.arange(0, N_GROUP)
            for _ in tl.static_range(TOPK_GROUP):
                g = tl.argmax(tl.where(keep, float("-inf"), group_score), axis=0, tie_break_left=True)
                keep = keep | (g_cols == g)
            keep_cols = tl.reshape(tl.broadcast_to(keep[:, None], (N_GROUP, gsize)), (BLOCK_E,))
            choice = tl.where(keep_cols, choice, float("-inf"))
    elif KIND == 0:
        ex = tl.exp(x - tl.max(x, axis=0))
        scores = ex / tl.sum(ex, axis=0)
        choice = x
    else:
        scores = x
        choice = x
    # Rank on an order-preserving int32 image of the fp32 choice: INT32_MIN (below -inf) marks padding and
    # experts already taken, so the k ids are distinct even when -inf scores remain; NaN ranks highest, as in
    # torch.topk.
    bits = choice.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(choice != choice, 2147483647, key)
    key = tl.where(valid, key, -2147483648)
    k_offs = tl.arange(0, K_BLOCK)
    k_valid = k_offs < TOP_K
    top_w = tl.zeros((K_BLOCK,), dtype=tl.float32)
    top_i = tl.zeros((K_BLOCK,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        i = tl.argmax(key, axis=0, tie_break_left=True)
        w = tl.sum(tl.where(cols == i, scores, 0.0), axis=0)
        top_w = tl.where(k_offs == j, w, top_w)
        top_i = tl.where(k_offs == j, i, top_i)
        key = tl.where(cols == i, -2147483648, key)
    if KIND == 1:
        ex = tl.where(k_valid, tl.exp(top_w - tl.max(tl.where(k_valid, top_w, float("-inf")), axis=0)), 0.0)
        top_w = ex / tl.sum(ex, axis=0)
    elif RENORM:
        denom = tl.sum(top_w, axis=0)
        if KIND == 2:
            denom += 1e-20  # routing.SIGMOID_RENORM_EPS
        top_w = top_w / denom
    return top_w, top_i


@triton.jit
def _fused_topk_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, stride_t, stride_e, scaling,
    E: tl.constexpr, TOP_K: tl.constexpr, KIND: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_E: tl.constexpr, K_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    x = tl.load(logits_ptr + row * stride_t + cols * stride_e, mask=valid, other=float("-inf")).to(tl.float32)
    top_w, top_i = route_row(x, valid, cols, bias_ptr, E, TOP_K, KIND, RENORM, HAS_BIAS, N_GROUP, TOPK_GROUP,
                             BLOCK_E, K_BLOCK)
    k_offs = tl.arange(0, K_BLOCK)
    k_valid = k_offs < TOP_K
    tl.store(w_ptr + row * TOP_K + k_offs, (top_w * scaling).to(w_ptr.dtype.element_ty), mask=k_valid)
    tl.store(ids_ptr + row * TOP_K + k_offs, top_i.to(tl.int64), mask=k_valid)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch one program per row; outputs are allocated here (fixed sizes, so CUDA-graph capturable). Weights are
    computed in fp32 and stored in `weights_dtype` (default fp32): one rounding, as a cast after the op."""
    t, e = router_logits.shape
    w = torch.empty(t, top_k, dtype=weights_dtype or torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    bias = correction_bias.contiguous() if correction_bias is not None else w
    if t:
        _fused_topk_kernel[(t,)](
            router_logits, bias, w, ids, router_logits.stride(0), router_logits.stride(1),
            float(routed_scaling_factor),
            **constexprs(e, top_k, kind, renormalize, correction_bias is not None, n_group, topk_group),
        )
    return w, ids


@functools.lru_cache(maxsize=256)  # pure in its arguments; asked per call
def constexprs(e: int, top_k: int, kind: str, renormalize: bool, has_bias: bool, n_group: int,
                topk_group: int) -> dict:
    return dict(E=e, TOP_K=top_k, KIND=KIND_CODES[kind], RENORM=renormalize, HAS_BIAS=has_bias, N_GROUP=n_group,
                TOPK_GROUP=topk_group, BLOCK_E=triton.next_power_of_2(e), K_BLOCK=triton.next_power_of_2(top_k))
