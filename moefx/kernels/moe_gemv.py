"""Triton GEMV kernels for small-M MoE (decode): two launches, no sort, no host sync.

Stage 1, grid (M*k pairs, I/BLOCK_N): each program reads BLOCK_N gate rows and the matching BLOCK_N
up rows of its pair's expert (indexed straight from topk_ids) over all of H, 16-byte loads, and
writes act(gate) * up in fp32 (act: the ACT constexpr, moe_epilogue.py). Stage 2, grid (M, H/BLOCK_N): each program
loads BLOCK_N rows of w2 for all k of the token's experts at once (one [k, BLOCK_N, BLOCK_K] tile per K step, so
the loads of the k experts overlap), weights each expert's dot by its routing weight and sums the top-k in
registers; it writes the output row slice once, in hidden's dtype.
Weights are streamed with evict_first (each byte is used once); work is split over output rows
rather than K because (2I and H) / BLOCK_N already gives hundreds of programs at M = 1.
Each K step's products are summed over K right away (one accumulator per row, not a [rows, BLOCK_K] one):
at M = 1 the bytes in flight per SM are about (grid rows x BLOCK_K) / SMs whatever BLOCK_N is, so a wide
BLOCK_K is what keeps HBM busy, and a per-row accumulator leaves the registers for it (FP8 stage 1 at
BLOCK_K 256: 65 registers instead of 145).
FP8 (block-quant e4m3 weights, scales per (SBN x SBK) block): each weight tile lies inside one
SBN row-block, so the scale multiplies the activation vector (K-wise), not every weight element.
Activations stay in fp32 (w8a16 arithmetic): same bytes as w8a8 at these M, and closer to the oracle.
Hopper and later: stage 2 is a programmatic dependent launch (H200, M=1: 23.0 vs 24.1 µs bf16). Stage 1
lets it start once every stage-1 program has finished its loop; stage 2 loads its ids and routing weights
(which stage 1 does not write) and then waits for stage 1's activations. Tried and dropped on the H200
(docs/FINDINGS.md, "Tried and not kept"): stage 2 loading its first w2 tile before the wait (FP8 M=1 stage 2
~7 -> 16.5 µs: twice the live tile), L2 prefetches of its w2 rows before the wait (bf16 M=1 23.2 -> 28.9 µs), an FP8
stage 1 on tensor cores (e4m3 -> fp16 into 16-row MMAs: M=1 stage 1 10.1 -> 19.1 µs), software-pipelined K loops
(`tl.range(num_stages=...)`, cp.async through shared memory: twice as slow), and, with per-row accumulators,
stage 2 as one K step whose whole w2 tile is loaded before the wait while stage 1 signals at its start (FP8 M=1
15.9 -> 15.3 µs, within what run-to-run spread allows; not kept).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefx.kernels.activation import get_activation
from moefx.kernels.moe_call import MoeCall
from moefx.kernels.moe_epilogue import gate_up
from moefx.kernels.pdl import pdl_launch, pdl_supported, step_pdl


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, ws_ptr, act_ptr,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
    FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, ACT: tl.constexpr, LIMIT: tl.constexpr,
    CHAIN: tl.constexpr,
):
    if CHAIN:  # the decode step's chain (kernels/pdl.py): the ids and the hidden rows are the router's writes
        gdc_wait()
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pair // TOP_K
    e = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = offs_k < H - k0
        x = tl.load(x_ptr + m * stride_xm + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w_mask = n_mask[:, None] & k_mask[None, :]
        g = tl.load(g_ptrs + k0, mask=w_mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        u = tl.load(u_ptrs + k0, mask=w_mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if FP8:
            s_base = ws_ptr + e * stride_se + ((k0 + offs_k) // SBK) * stride_sk
            sg = tl.load(s_base + ((pid_n * BLOCK_N) // SBN) * stride_sn, mask=k_mask, other=0.0)
            su = tl.load(s_base + ((I + pid_n * BLOCK_N) // SBN) * stride_sn, mask=k_mask, other=0.0)
            acc_g += tl.sum(g * (x * sg)[None, :], axis=1)
            acc_u += tl.sum(u * (x * su)[None, :], axis=1)
        else:
            acc_g += tl.sum(g * x[None, :], axis=1)
            acc_u += tl.sum(u * x[None, :], axis=1)
    if PDL:
        gdc_launch_dependents()  # stage 2 may launch now: it waits for this grid before reading act
    act = gate_up(acc_g, acc_u, ACT, LIMIT)
    tl.store(act_ptr + pair * I + offs_n, act, mask=n_mask)


@triton.jit
def _gemv_down_kernel(
    act_ptr, ids_ptr, tw_ptr, w_ptr, ws_ptr, res_ptr, out_ptr,
    stride_om, stride_rm, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
    FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, RESIDUAL: tl.constexpr, CHAIN: tl.constexpr,
):
    # One [KP experts, BLOCK_N rows, BLOCK_K] tile per K step: the k experts' loads are in flight together
    # (a loop over experts would chain k * I/BLOCK_K dependent HBM round trips per program).
    m = tl.program_id(0)
    pid_n = tl.program_id(1)
    j = tl.arange(0, KP)
    j_mask = j < TOP_K
    pair = m * TOP_K + j
    e = tl.load(ids_ptr + pair, mask=j_mask, other=0).to(tl.int64)
    tw = tl.load(tw_ptr + pair, mask=j_mask, other=0.0).to(tl.float32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    rows = e[:, None] * stride_we + offs_n[None, :] * stride_wn
    row_mask = j_mask[:, None] & n_mask[None, :]
    w_ptrs = w_ptr + rows[:, :, None] + offs_k[None, None, :]
    if PDL:
        gdc_wait()  # stage 1's activations are visible from here on
        if CHAIN:
            gdc_launch_dependents()  # the next layer's first kernel may launch
    acc = tl.zeros([KP, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_mask = offs_k < I - k0
        a_mask = j_mask[:, None] & k_mask[None, :]
        a = tl.load(act_ptr + pair[:, None] * I + k0 + offs_k[None, :], mask=a_mask, other=0.0)
        if FP8:
            s_ptrs = ws_ptr + e[:, None] * stride_se + ((pid_n * BLOCK_N) // SBN) * stride_sn
            a = a * tl.load(s_ptrs + ((k0 + offs_k) // SBK)[None, :] * stride_sk, mask=a_mask, other=0.0)
        w = tl.load(w_ptrs + k0, mask=row_mask[:, :, None] & k_mask[None, None, :], other=0.0,
                    eviction_policy="evict_first")
        acc += tl.sum(w.to(tl.float32) * a[:, None, :], axis=2)
    out = tl.sum(acc * tw[:, None], axis=0).to(out_ptr.dtype.element_ty)
    if RESIDUAL:  # the sum rounded to the output dtype first, then the add: what the unfused graph computes
        res = tl.load(res_ptr + m * stride_rm + offs_n, mask=n_mask, other=0.0)
        out = (out.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + m * stride_om + offs_n, out, mask=n_mask)


@dataclass(frozen=True)
class GemvConfig:
    block_n1: int = 16  # stage 1: rows of I per program (gate rows and as many up rows)
    rows2: int = 32  # stage 2: KP * BLOCK_N rows of w2 per program (BLOCK_N = rows2 // KP, at least 1)
    block_k1: int = 0  # 0: the largest of 1024/512/256/128 that divides K
    block_k2: int = 0
    num_warps1: int = 4
    num_warps2: int = 4
    pdl: bool = True  # stage 2 as a programmatic dependent launch where the GPU has it (capability >= 9)


# The default tiles, in one place: per weight kind ("bf16" serves every unquantized dtype), rows of
# (largest M, config), first match wins. Adopting a `bench/moe.py --sweep` result is an edit of these rows.
DEFAULT_TILES: dict[str, tuple[tuple[float, GemvConfig], ...]] = {
    # picked by a per-stage grid sweep against the first per-row-accumulator defaults, each ratio re-timed back
    # to back (docs/FINDINGS.md: bf16 M=1 0.95x, M=4 0.93x; fp8 M=1 0.92x, M=4 0.90x)
    "bf16": (
        (1, GemvConfig(block_n1=4, rows2=16, block_k1=1024, block_k2=128, num_warps1=2)),
        (math.inf, GemvConfig(block_n1=4, rows2=64, block_k1=1024, block_k2=128, num_warps1=2, num_warps2=8)),
    ),
    "fp8": (
        (1, GemvConfig(block_n1=4, rows2=32, block_k1=2048, block_k2=256, num_warps2=8)),
        (math.inf, GemvConfig(block_n1=4, rows2=128, block_k1=2048, block_k2=128)),
    ),
}


def default_gemv_config(m: int, fp8: bool) -> GemvConfig:
    for max_m, cfg in DEFAULT_TILES["fp8" if fp8 else "bf16"]:
        if m <= max_m:
            return cfg
    raise ValueError(f"gemv DEFAULT_TILES has no row for M={m} (last bound must be inf)")


def block_k_for(k: int, wanted: int = 0) -> int:
    """BLOCK_K for a K of `k`: `wanted` when given, else the automatic choice (see GemvConfig)."""
    if wanted:
        if wanted < 16 or wanted & (wanted - 1):
            raise ValueError(f"gemv block_k={wanted} must be a power of two >= 16 (0 = automatic)")
        return wanted
    for bk in (1024, 512, 256, 128):
        if k % bk == 0:
            return bk
    return min(triton.next_power_of_2(k), 128)


def stage_tiles(
    cfg: GemvConfig, h: int, inter: int, top_k: int, block_shape: tuple[int, int] | None
) -> tuple[int, int, int, int, int]:
    """(stage 1 BLOCK_N, BLOCK_K, stage 2 BLOCK_N, BLOCK_K, KP) as gemv_moe launches `cfg`."""
    if any(v < 1 or v & (v - 1) for v in (cfg.block_n1, cfg.rows2)):
        raise ValueError(f"gemv config {cfg}: block_n1 and rows2 must be powers of two")
    kp = triton.next_power_of_2(top_k)
    bn1, bn2 = cfg.block_n1, max(1, cfg.rows2 // kp)
    if block_shape is not None:  # a program's rows must lie inside one SBN row block: one weight scale row each
        bn1, bn2 = math.gcd(bn1, block_shape[0]), math.gcd(bn2, block_shape[0])
    return bn1, block_k_for(h, cfg.block_k1), bn2, block_k_for(inter, cfg.block_k2), kp


def gemv_moe(call: MoeCall, config: GemvConfig | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Launch both stages; `config` overrides DEFAULT_TILES; the call's `activation` and `gate_limit` pick stage 1's
    epilogue; a `residual` [M, H] is added to the result in stage 2's epilogue."""
    hidden, topk_ids, topk_weights, w13, w2 = call.hidden.contiguous(), call.topk_ids, call.topk_weights, call.w13, \
        call.w2
    w13_scale, w2_scale, block_shape = call.w13_scale, call.w2_scale, call.block_shape
    m, h = hidden.shape
    top_k = topk_ids.shape[1]
    inter = w2.shape[2]
    fp8 = w13_scale is not None
    grid1, kw1, grid2, kw2 = _launch_plan(m, h, inter, top_k, tuple(block_shape) if fp8 else None, config,
                                          call.activation, call.gate_limit, pdl_supported(hidden.device),
                                          step_pdl(hidden.device))
    ids = topk_ids.contiguous()
    tw = topk_weights.contiguous()
    act = torch.empty(m * top_k, inter, dtype=torch.float32, device=hidden.device)
    out = torch.empty(m, h, dtype=hidden.dtype, device=hidden.device)
    s13 = w13_scale if fp8 else act
    s2 = w2_scale if fp8 else act
    s13_strides = w13_scale.stride() if fp8 else (0, 0, 0)
    s2_strides = w2_scale.stride() if fp8 else (0, 0, 0)
    _gemv_gate_up_kernel[grid1](
        hidden, ids, w13, s13, act, hidden.stride(0), w13.stride(0), w13.stride(1), *s13_strides, **kw1)
    if residual is not None:
        if tuple(residual.shape) != (m, h) or residual.dtype != hidden.dtype:
            raise ValueError(f"gemv residual must be [{m}, {h}] {hidden.dtype}, got {tuple(residual.shape)} "
                             f"{residual.dtype}")
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    res = residual if residual is not None else out
    _gemv_down_kernel[grid2](act, ids, tw, w2, s2, res, out, out.stride(0), res.stride(0), w2.stride(0), w2.stride(1),
                             *s2_strides, RESIDUAL=residual is not None, **kw2)
    return out


@functools.lru_cache(maxsize=512)  # pure in its arguments (shapes, config, device facts); asked per call
def _launch_plan(
    m: int, h: int, inter: int, top_k: int, block_shape: tuple[int, int] | None, config: GemvConfig | None,
    activation: str, gate_limit: float | None, pdl_ok: bool, chain: bool = False,
) -> tuple[tuple[int, int], dict, tuple[int, int], dict]:
    """(stage 1 grid, its constexpr/launch arguments, stage 2 grid, its arguments) for one gemv_moe shape."""
    fp8 = block_shape is not None
    sbn, sbk = block_shape if fp8 else (1, 1)
    cfg = config or default_gemv_config(m, fp8)
    bn1, bk1, bn2, bk2, kp = stage_tiles(cfg, h, inter, top_k, block_shape)
    pdl = cfg.pdl and pdl_ok
    chain = chain and pdl  # stage 1 a dependent of the kernel before the op, stage 2 letting the next one launch
    kw1 = dict(H=h, I=inter, TOP_K=top_k, FP8=fp8, SBN=sbn, SBK=sbk, BLOCK_N=bn1, BLOCK_K=bk1, PDL=pdl,
               ACT=get_activation(activation).kernel_id, LIMIT=float(gate_limit or 0.0), CHAIN=chain,
               num_warps=cfg.num_warps1, **pdl_launch(chain))
    kw2 = dict(H=h, I=inter, TOP_K=top_k, KP=kp, FP8=fp8, SBN=sbn, SBK=sbk, BLOCK_N=bn2, BLOCK_K=bk2, PDL=pdl,
               CHAIN=chain, num_warps=cfg.num_warps2, **pdl_launch(pdl))
    return (m * top_k, triton.cdiv(inter, bn1)), kw1, (m, triton.cdiv(h, bn2)), kw2
