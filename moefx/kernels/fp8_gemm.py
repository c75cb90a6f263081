"""Triton FP8 block-scaled GEMM: fp8 tensor-core dot per K block, scaled by the activation group scale and
the weight block scale, accumulated in fp32 (the DeepSeek-V3 w8a8 recipe). The launcher accepts CPU tensors
so CI tests it under TRITON_INTERPRET=1."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_block_gemm_kernel(
    A, AS, W, WS, BIAS, C,
    M, N, K,
    stride_am, stride_asm, stride_ask, stride_wn, stride_wsn, stride_wsk, stride_cm,
    QN: tl.constexpr, QK: tl.constexpr, HAS_BIAS: tl.constexpr, K_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    a_ptrs = A + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = W + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    as_ptrs = AS + offs_m.to(tl.int64) * stride_asm
    ws_ptrs = WS + (offs_n // QN) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, K_TILES):  # constexpr: one compile per weight K, and a plain int for the interpreter
        kmask = offs_k < K - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        kq = (kk * BLOCK_K) // QK
        a_s = tl.load(as_ptrs + kq * stride_ask, mask=mmask, other=0.0)
        w_s = tl.load(ws_ptrs + kq * stride_wsk, mask=nmask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def supported(block_n: int, block_k: int) -> bool:
    """K tiles must sit inside one scale block: block_k a power of two >= 16."""
    return block_n > 0 and block_k >= 16 and (block_k & (block_k - 1)) == 0


def _config(m: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): small M streams weights across many CTAs; large M uses
    Hopper-sized tiles."""
    if m <= 16:  # weight streaming: one CTA per narrow N slice, deep pipeline to keep ~32 KB in flight per SM
        return (16, 64, 4, 6) if n >= 8192 else (16, 32, 4, 8)
    if m <= 64:
        return 64, 64, 4, 4
    if m <= 256:
        return 64, 128, 4, 4
    return 128, 128, 8, 3


def fp8_block_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    n, k = w.shape
    a2 = a.reshape(-1, k)
    if a2.stride(-1) != 1:
        a2 = a2.contiguous()
    s2 = a_scale.reshape(-1, a_scale.shape[-1]) if a_scale.dim() != 2 else a_scale
    w = w if w.stride(-1) == 1 else w.contiguous()
    m = a2.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c.reshape(*a.shape[:-1], n)
    block_m, bn, warps, stages = _config(m, n)
    bk = min(block_k, 128)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, bn),)
    _fp8_block_gemm_kernel[grid](
        a2, s2, w, w_scale, bias if bias is not None else c, c,
        m, n, k,
        a2.stride(0), s2.stride(0), s2.stride(1), w.stride(0), w_scale.stride(0), w_scale.stride(1), c.stride(0),
        QN=block_n, QK=block_k, HAS_BIAS=bias is not None, K_TILES=triton.cdiv(k, bk),
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
    )
    return c.reshape(*a.shape[:-1], n)
