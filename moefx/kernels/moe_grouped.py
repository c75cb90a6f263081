"""Triton grouped MoE GEMMs over the padded expert blocks from `moe_align.moe_align`.

GEMM 1 (gate_up, activation-mul fused): program = (block of BLOCK_M pairs of one expert, BLOCK_N columns of
I); it loads the gate tile and the up tile of w13 and keeps two accumulators, so the [pairs, 2I]
projection never reaches memory: it writes act(gate) * up (SiLU, GELU or GELU-tanh: the ACT constexpr,
moe_epilogue.py). GEMM 2 (down): same blocks over H, scales
each row by its routing weight and writes [M*k, H]; the top-k sum is one reduction after (`topk_sum`: fp32
accumulation, one write in hidden's dtype; H200: 6.5 µs at M=1024 and 37.5 at 4096, torch's sum 12.4 and 52.4). The
[pairs, I] intermediate is stored in the padded sorted order (row = position in `sorted_ids`, padding rows
written as zeros except those a half tile leaves out), so GEMM 2 reads contiguous row blocks. GEMM 1's BLOCK_M is
the align block; GEMM 2's may divide it (its tiles of only padding return at once), so GEMM 1 can take one block
per expert while GEMM 2 keeps smaller tiles.
GemmConfig switches (all off by default unless DEFAULT_TILES says otherwise; Hopper and later):
`tma` loads weight tiles (and GEMM 2's intermediate tiles) through tensor descriptors; GEMM 1's activation rows
are gathered by token, so they stay pointer loads. `pdl` launches each kernel as a programmatic dependent
of the previous one (see pdl.py). `running` (FP8): the block-scaled K loop `acc += dot(a, w) * s_k` keeps the
dot's result tile live beside the accumulator (sm_90a: GEMM 1 at BLOCK_M 128 spills); a running-scale
accumulator, `acc = dot(a, w, acc * s_{k-1} / s_k)` and one multiply by the last step's scales after the loop,
needs no second tile, so BLOCK_M 128 fits (H200, M=4096: 708 -> 530 µs). The same tile is ~5% slower with it
(the rescale must finish before the dot is issued), so the defaults use it only where the larger tile pays.
`half`: a block with at most BLOCK_M/2 valid rows (an expert's last, mostly padding) runs a BLOCK_M/2-row tile,
a second copy of the K loop behind a runtime branch (both pipelined; shared memory is shared between them), so
padding rows cost fewer MMAs (H200, bf16 M=4096: ~3-5% per call). The rows it leaves out are never written;
a row of the product depends only on its own row of A, so what they hold reaches only padding rows' results,
which are never stored.
Program order: GROUP_M consecutive blocks (mostly one expert) sweep all N tiles together, so a
weight tile is fetched from HBM once and reused from L2 by the expert's other blocks, and an
activation tile is reused across N tiles.
FP8 w8a8: activations are quantized per token and per group of SBK (= BLOCK_K) columns; GEMM 1
quantizes its own output in the epilogue (BLOCK_N == SBK, so one tile row is one group) and
writes fp8 + scales, so GEMM 2 reads half the bytes and needs no separate quant launch.
All shapes are fixed by (M, k, E, BLOCK_M): no host sync, CUDA-graph capturable.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from moefx.kernels.activation import get_activation
from moefx.kernels.memo import device_capability
from moefx.kernels.moe_align import moe_align
from moefx.kernels.moe_align_ref import max_padded_len
from moefx.kernels.moe_call import MoeCall
from moefx.kernels.moe_epilogue import gate_up
from moefx.kernels.pdl import pdl_launch, pdl_supported

FP8_MAX = tl.constexpr(448.0)
# RUNNING accumulators divide by scales: a weight scale is clamped here (an all-zero block has zero weights, so
# its dot is 0 either way); activation scales are >= 1e-10 / 448 by construction.
MIN_SCALE = tl.constexpr(1e-12)
SMEM_RESERVE = 2048  # shared memory a tile needs besides its operand stages (TMA barriers, epilogue scratch)
# Triton's interpreter multiplies bf16/fp16 dot operands wrongly (numpy has no bf16) and rounds fp32 -> e4m3
# wrongly when rounding carries into the exponent (31.3 -> 16): under it (the kernels' INTERPRET flag), dots
# get fp32 operands and values are put on the e4m3 grid before the cast.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False  # weight (and GEMM 2 activation) tiles through TMA descriptors; CUDA capability >= 9
    pdl: bool = True  # launched as a programmatic dependent of the kernel before it (capability >= 9)
    running: bool = False  # FP8: a running-scale accumulator (one dot into it per K step, no dot result tile)
    # a block with at most block_m / 2 rows (an expert's last, partly padded block) runs a block_m / 2-row tile
    half: bool = False


_C = GemmConfig
# The default tiles, in one place: per weight kind ("bf16" serves every unquantized dtype), rows of
# (largest average rows per expert = M * top_k / E, GEMM 1 tile, GEMM 2 tile), first match wins. Small
# BLOCK_M while bandwidth-bound, larger tiles as the FLOPs grow. GEMM 2's BLOCK_M divides GEMM 1's (the align).
# FP8: GEMM 1's BLOCK_N is the quant block's k (its epilogue writes one activation group per tile row) and
# BLOCK_K must divide it (fused_moe enforces both). Picked from H200 sweeps and A/B probes (docs/FINDINGS.md):
# adopting a `bench/moe.py --sweep` result is an edit of these rows.
DEFAULT_TILES: dict[str, tuple[tuple[float, GemmConfig, GemmConfig], ...]] = {
    "bf16": (
        (8, _C(16, 64, 128, 1, 4, 4), _C(16, 64, 128, 1, 4, 4)),
        (32, _C(32, 128, 128, 4, 4, 3, tma=True), _C(32, 128, 128, 4, 4, 3, tma=True)),
        # M=1024: GEMM 1 aligns at 128 (one block for most experts, half tiles for those with at most 64 rows),
        # GEMM 2 keeps 64-row tiles inside those blocks (docs/FINDINGS.md: 0.98x in A/B, 0.97x after a sweep)
        (128, _C(128, 128, 64, 8, 8, 4, tma=True, half=True), _C(64, 128, 64, 8, 4, 3, tma=True)),
        # M=4096: GEMM 2 at 128x256x64, TMA weight tiles on both GEMMs, half tiles for an expert's last block
        # (docs/FINDINGS.md: 0.86x, 0.94x and 0.97x)
        (math.inf, _C(128, 128, 64, 8, 8, 3, tma=True, half=True), _C(128, 256, 64, 8, 8, 3, tma=True, half=True)),
    ),
    "fp8": (
        (8, _C(16, 128, 128, 1, 4, 4), _C(16, 64, 128, 1, 4, 4)),
        (32, _C(32, 128, 128, 4, 4, 3, tma=True), _C(32, 128, 128, 4, 4, 3, tma=True)),
        # M=1024: GEMM 1 at the large-M tile with half tiles, GEMM 2 at 64 rows (docs/FINDINGS.md: 0.97x in A/B,
        # 0.97x after a sweep)
        (128, _C(128, 128, 128, 1, 8, 4, running=True, half=True), _C(64, 128, 128, 16, 4, 3, tma=True)),
        # M=4096: running-scale accumulators let BLOCK_M 128 fit without spills (docs/FINDINGS.md: 708 -> 530 us);
        # half tiles in GEMM 2 (GEMM 2 0.99x, the whole call within run-to-run spread)
        (math.inf, _C(128, 128, 128, 8, 8, 4, running=True),
         _C(128, 128, 128, 16, 8, 3, tma=True, running=True, half=True)),
    ),
}


@triton.jit
def _swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _scaled(x, a_s, w_s, PER_COL: tl.constexpr):
    """x * a_s (per row) * w_s (per column when PER_COL, else one scalar)."""
    if PER_COL:
        y = x * a_s[:, None] * w_s[None, :]
    else:
        y = x * (a_s * w_s)[:, None]
    return y


@triton.jit
def _scale_rows(pid_n, offs_n, row0, SBN: tl.constexpr, BLOCK_N: tl.constexpr, PER_COL: tl.constexpr):
    """The weight scale row of each tile column (PER_COL), else of the whole tile (it lies in one row block)."""
    if PER_COL:
        r = (row0 + offs_n) // SBN
    else:
        r = (row0 + pid_n * BLOCK_N) // SBN
    return r


@triton.jit
def _load_w_scale(ptrs, n_mask, PER_COL: tl.constexpr):
    """The weight scales at `ptrs`: one per tile column when PER_COL, else the tile's one scale."""
    if PER_COL:
        s = tl.load(ptrs, mask=n_mask, other=1.0)
    else:
        s = tl.load(ptrs)
    return s


@triton.jit
def _w_scale_at(ptrs, kg, stride_sk, n_mask, PER_COL: tl.constexpr):
    """A weight scale (per column when PER_COL) of K group `kg`, clamped for the running-scale division."""
    return tl.maximum(_load_w_scale(ptrs + kg * stride_sk, n_mask, PER_COL), MIN_SCALE)


@triton.jit
def _w_scale_ratio(ptrs, kc, kn, stride_sk, n_mask, PER_COL: tl.constexpr):
    """Running scales: the weight scale of K group `kc` over that of group `kn` (clamped, per column when PER_COL)."""
    return _w_scale_at(ptrs, kc, stride_sk, n_mask, PER_COL) / _w_scale_at(ptrs, kn, stride_sk, n_mask, PER_COL)


@triton.jit
def _fits_half_tile(sorted_ptr, row0, num_pairs, BLOCK_M: tl.constexpr):
    """Whether the block at sorted row row0 holds at most BLOCK_M / 2 pairs (padding comes last in a block)."""
    return tl.sum((tl.load(sorted_ptr + row0 + tl.arange(0, BLOCK_M)) < num_pairs).to(tl.int32)) <= BLOCK_M // 2


@triton.jit
def _to_e4m3(x, EXACT: tl.constexpr):
    if EXACT:
        # round to nearest on the e4m3 grid (3 mantissa bits, min normal exponent -6) in fp32 first
        e = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(x), 1e-30))), -6.0)
        step = tl.exp2(e - 3.0)
        x = tl.floor(x / step + 0.5) * step
    return x.to(tl.float8e4nv)


@triton.jit
def _quant_rows_kernel(
    x_ptr, q_ptr, s_ptr, stride_xm, K: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, EXACT: tl.constexpr
):
    """One program per row: the row as [groups, GROUP]; fp8 e4m3 values and one fp32 scale per group."""
    m = tl.program_id(0)
    offs = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = offs < K
    x = tl.load(x_ptr + m * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / FP8_MAX
    q = tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + m * K + offs, _to_e4m3(q, EXACT), mask=mask)
    g = tl.arange(0, NG)
    tl.store(s_ptr + m * tl.cdiv(K, GROUP) + g, scale, mask=g * GROUP < K)


@triton.jit
def _gemm1_kernel(
    a_ptr, as_ptr, w_ptr, w_desc, ws_ptr, out_ptr, os_ptr,
    sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, num_pid_m,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
    FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, ALIGN_M: tl.constexpr, HALF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRET: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr, RUNNING: tl.constexpr, ACT: tl.constexpr,
    LIMIT: tl.constexpr,
):
    num_pid_n: tl.constexpr = (I + BLOCK_N - 1) // BLOCK_N
    if PDL:
        gdc_wait()  # the align (and activation quant) results are visible from here on
    pid_m, pid_n = _swizzle(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    row0 = pid_m * BLOCK_M
    if row0 >= tl.load(num_post_ptr):
        return
    if tl.load(sorted_ptr + row0) >= num_pairs:  # BLOCK_M < ALIGN_M: a tile of its align block's padding only
        return
    e = tl.load(expert_ids_ptr + row0 // ALIGN_M).to(tl.int64)
    # HALF: a runtime branch between the two tiles. Without HALF the `and` stops at the constexpr and the half tile is
    # not compiled at all (a `half_tile = False` variable would be a runtime value: both calls compiled, GEMM 2's
    # with a descriptor of the wrong block, which the GPU compiler rejects and the interpreter never sees).
    if HALF and _fits_half_tile(sorted_ptr, row0, num_pairs, BLOCK_M):
        _gemm1_tile(a_ptr, as_ptr, w_ptr, w_desc, ws_ptr, out_ptr, os_ptr, sorted_ptr, num_pairs, row0, e, pid_n,
                    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_sk, H, I, TOP_K, FP8, SBN, SBK,
                    BLOCK_M // 2, BLOCK_N, BLOCK_K, INTERPRET, TMA, PDL, RUNNING, ACT, LIMIT)
    else:
        _gemm1_tile(a_ptr, as_ptr, w_ptr, w_desc, ws_ptr, out_ptr, os_ptr, sorted_ptr, num_pairs, row0, e, pid_n,
                    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_sk, H, I, TOP_K, FP8, SBN, SBK,
                    BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET, TMA, PDL, RUNNING, ACT, LIMIT)


@triton.jit
def _gemm1_tile(
    a_ptr, as_ptr, w_ptr, w_desc, ws_ptr, out_ptr, os_ptr, sorted_ptr, num_pairs, row0, e, pid_n,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr, RUNNING: tl.constexpr, ACT: tl.constexpr,
    LIMIT: tl.constexpr,
):
    """Rows row0 .. row0 + BLOCK_M of the sorted pairs (one expert, e) times gate/up column tile pid_n."""
    pairs = tl.load(sorted_ptr + row0 + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    tok = (pairs // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + tok[:, None] * stride_am + offs_k[None, :]
    g_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + I * stride_wn
    g_row = (e * (2 * I) + pid_n * BLOCK_N).to(tl.int32)  # TMA: w13 viewed as [E * 2I, H]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    PER_COL: tl.constexpr = SBN % BLOCK_N != 0  # FP8: the tile spans weight scale row blocks
    if FP8:
        a_s_ptrs = as_ptr + tok * (H // SBK)
        g_s_ptrs = ws_ptr + e * stride_se + _scale_rows(pid_n, offs_n, 0, SBN, BLOCK_N, PER_COL) * stride_sn
        u_s_ptrs = ws_ptr + e * stride_se + _scale_rows(pid_n, offs_n, I, SBN, BLOCK_N, PER_COL) * stride_sn
        # RUNNING: step k's scale over step k+1's, per row and per weight tile (any value while acc = 0). Each step
        # loads both scales of the ratio it needs next, so every scale is read twice: carrying a loaded scale into
        # the step after next made Triton 3.6 give up pipelining the tiles (sm_90a: 40 KB of shared memory, not 164).
        if RUNNING:
            r_a = tl.full([BLOCK_M], 1.0, tl.float32)
            r_g = tl.full([BLOCK_N] if PER_COL else [], 1.0, tl.float32)
            r_u = r_g
    for k0 in range(0, H, BLOCK_K):
        k_mask = offs_k < H - k0
        a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if TMA:  # columns past I read the next rows (up, next expert) or TMA's zero fill: never stored
            g = w_desc.load([g_row, k0]).T
            u = w_desc.load([g_row + I, k0]).T
        else:
            w_mask = k_mask[:, None] & n_mask[None, :]
            g = tl.load(g_ptrs + k0, mask=w_mask, other=0.0)
            u = tl.load(u_ptrs + k0, mask=w_mask, other=0.0)
        if FP8:
            kc = k0 // SBK
            if RUNNING:
                kn = tl.minimum(k0 + BLOCK_K, H - 1) // SBK  # the next step's group (the last step: its own)
                acc_g = tl.dot(a, g, _scaled(acc_g, r_a, r_g, PER_COL))
                acc_u = tl.dot(a, u, _scaled(acc_u, r_a, r_u, PER_COL))
                r_a = (tl.load(a_s_ptrs + kc, mask=row_mask, other=1.0)
                       / tl.load(a_s_ptrs + kn, mask=row_mask, other=1.0))
                r_g = _w_scale_ratio(g_s_ptrs, kc, kn, stride_sk, n_mask, PER_COL)
                r_u = _w_scale_ratio(u_s_ptrs, kc, kn, stride_sk, n_mask, PER_COL)
            else:
                a_s = tl.load(a_s_ptrs + kc, mask=row_mask, other=1.0)
                acc_g += _scaled(tl.dot(a, g), a_s, _load_w_scale(g_s_ptrs + kc * stride_sk, n_mask, PER_COL), PER_COL)
                acc_u += _scaled(tl.dot(a, u), a_s, _load_w_scale(u_s_ptrs + kc * stride_sk, n_mask, PER_COL), PER_COL)
        else:
            if INTERPRET:
                a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
    if PDL:
        gdc_launch_dependents()  # GEMM 2 may start launching; it waits for this grid before reading
    if FP8 and RUNNING:  # from units of the last step's scales to values
        last_a = tl.load(a_s_ptrs + (H - 1) // SBK, mask=row_mask, other=1.0)
        acc_g = _scaled(acc_g, last_a, _w_scale_at(g_s_ptrs, (H - 1) // SBK, stride_sk, n_mask, PER_COL), PER_COL)
        acc_u = _scaled(acc_u, last_a, _w_scale_at(u_s_ptrs, (H - 1) // SBK, stride_sk, n_mask, PER_COL), PER_COL)
    act = gate_up(acc_g, acc_u, ACT, LIMIT)  # padding rows: a = 0, so act = 0
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)  # sorted position: GEMM 2 reads row blocks
    out_ptrs = out_ptr + rows[:, None] * I + offs_n[None, :]
    out_mask = n_mask[None, :]
    if FP8:
        # BLOCK_N == SBK: this tile row is exactly one activation quant group of GEMM 2
        scale = tl.maximum(tl.max(tl.abs(act), axis=1), 1e-10) / FP8_MAX
        q = tl.clamp(act / scale[:, None], -FP8_MAX, FP8_MAX)
        tl.store(out_ptrs, _to_e4m3(q, INTERPRET), mask=out_mask)
        tl.store(os_ptr + rows * (I // SBK) + pid_n, scale)
    else:
        tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _gemm2_kernel(
    a_ptr, a_desc, a_desc_half, as_ptr, w_ptr, w_desc, ws_ptr, out_ptr, tw_ptr,
    sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, num_pid_m,
    stride_we, stride_wn, stride_se, stride_sn, stride_sk,
    H: tl.constexpr, I: tl.constexpr,
    FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, ALIGN_M: tl.constexpr, HALF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRET: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr, RUNNING: tl.constexpr,
):
    num_pid_n: tl.constexpr = (H + BLOCK_N - 1) // BLOCK_N
    if PDL:
        gdc_wait()  # GEMM 1's intermediate is visible from here on
    pid_m, pid_n = _swizzle(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    row0 = pid_m * BLOCK_M
    if row0 >= tl.load(num_post_ptr):
        return
    if tl.load(sorted_ptr + row0) >= num_pairs:  # as in GEMM 1
        return
    e = tl.load(expert_ids_ptr + row0 // ALIGN_M).to(tl.int64)
    if HALF and _fits_half_tile(sorted_ptr, row0, num_pairs, BLOCK_M):  # as in GEMM 1
        _gemm2_tile(a_ptr, a_desc_half, as_ptr, w_ptr, w_desc, ws_ptr, out_ptr, tw_ptr, sorted_ptr, num_pairs,
                    row0, e, pid_n, stride_we, stride_wn, stride_se, stride_sn, stride_sk, H, I, FP8, SBN, SBK,
                    BLOCK_M // 2, BLOCK_N, BLOCK_K, INTERPRET, TMA, RUNNING)
    else:
        _gemm2_tile(a_ptr, a_desc, as_ptr, w_ptr, w_desc, ws_ptr, out_ptr, tw_ptr, sorted_ptr, num_pairs,
                    row0, e, pid_n, stride_we, stride_wn, stride_se, stride_sn, stride_sk, H, I, FP8, SBN, SBK,
                    BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET, TMA, RUNNING)


@triton.jit
def _gemm2_tile(
    a_ptr, a_desc, as_ptr, w_ptr, w_desc, ws_ptr, out_ptr, tw_ptr, sorted_ptr, num_pairs, row0, e, pid_n,
    stride_we, stride_wn, stride_se, stride_sn, stride_sk,
    H: tl.constexpr, I: tl.constexpr, FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr, TMA: tl.constexpr, RUNNING: tl.constexpr,
):
    """Rows row0 .. row0 + BLOCK_M of the sorted intermediate (one expert, e) times w2 column tile pid_n."""
    pairs = tl.load(sorted_ptr + row0 + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    rows = pairs.to(tl.int64)
    sorted_rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)  # GEMM 1 wrote the intermediate here
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + sorted_rows[:, None] * I + offs_k[None, :]
    w_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    w_row = (e * H + pid_n * BLOCK_N).to(tl.int32)  # TMA: w2 viewed as [E * H, I]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    PER_COL: tl.constexpr = SBN % BLOCK_N != 0  # FP8: the tile spans weight scale row blocks
    # FP8: as in GEMM 1. GEMM 1 wrote every row's activation scale (> 0), padding rows included, except in the rows
    # its half tiles left out: those hold whatever was there, which (a row of the product depending only on its
    # own row of A) reaches only padding rows' results, never stored.
    if FP8:
        a_s_ptrs = as_ptr + sorted_rows * (I // SBK)
        w_s_ptrs = ws_ptr + e * stride_se + _scale_rows(pid_n, offs_n, 0, SBN, BLOCK_N, PER_COL) * stride_sn
        if RUNNING:
            r_a = tl.full([BLOCK_M], 1.0, tl.float32)
            r_w = tl.full([BLOCK_N] if PER_COL else [], 1.0, tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_mask = offs_k < I - k0
        if TMA:
            a = a_desc.load([row0, k0])
            w = w_desc.load([w_row, k0]).T
        else:
            a = tl.load(a_ptrs + k0, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP8:
            kc = k0 // SBK
            if RUNNING:
                kn = tl.minimum(k0 + BLOCK_K, I - 1) // SBK
                acc = tl.dot(a, w, _scaled(acc, r_a, r_w, PER_COL))
                r_a = tl.load(a_s_ptrs + kc) / tl.load(a_s_ptrs + kn)
                r_w = _w_scale_ratio(w_s_ptrs, kc, kn, stride_sk, n_mask, PER_COL)
            else:
                acc += _scaled(tl.dot(a, w), tl.load(a_s_ptrs + kc),
                               _load_w_scale(w_s_ptrs + kc * stride_sk, n_mask, PER_COL), PER_COL)
        else:
            if INTERPRET:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc)
    if FP8 and RUNNING:
        last = (I - 1) // SBK
        acc = _scaled(acc, tl.load(a_s_ptrs + last), _w_scale_at(w_s_ptrs, last, stride_sk, n_mask, PER_COL), PER_COL)
    acc = acc * tl.load(tw_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[:, None] * H + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _topk_sum_kernel(x_ptr, out_ptr, H: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    """out[m] = sum of x's TOP_K rows m*TOP_K .. (one [KP, BLOCK_H] tile; each thread holds whole columns, so the
    sum stays in registers), accumulated in fp32 and rounded once."""
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, KP)
    mask = (j < TOP_K)[:, None] & (offs < H)[None, :]
    x = tl.load(x_ptr + (m * TOP_K + j)[:, None] * H + offs[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + m * H + offs, tl.sum(x.to(tl.float32), axis=0).to(out_ptr.dtype.element_ty), mask=offs < H)


def topk_sum(x: torch.Tensor, top_k: int) -> torch.Tensor:
    """[M * top_k, H] -> [M, H]: the sum over each token's top_k rows, in x's dtype (fp32 accumulation)."""
    rows, h = x.shape
    out = torch.empty(rows // top_k, h, dtype=x.dtype, device=x.device)
    if rows:
        grid, kw = _topk_sum_launch(rows, h, top_k)
        _topk_sum_kernel[grid](x, out, **kw)
    return out


@functools.lru_cache(maxsize=512)
def _topk_sum_launch(rows: int, h: int, top_k: int) -> tuple[tuple[int, int], dict]:
    block_h = min(triton.next_power_of_2(h), 1024)
    kw = dict(H=h, TOP_K=top_k, KP=triton.next_power_of_2(top_k), BLOCK_H=block_h, num_warps=4)
    return (rows // top_k, triton.cdiv(h, block_h)), kw


def quant_rows_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-`group`-columns e4m3 quantization: (q [M, K] fp8, scales [M, ceil(K/group)] fp32)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, triton.cdiv(k, group), dtype=torch.float32, device=x.device)
    if m:
        _quant_rows_kernel[(m,)](x, q, s, x.stride(0), K=k, GROUP=group, NG=_groups_pow2(k, group), EXACT=_INTERPRET)
    return q, s


@functools.lru_cache(maxsize=64)
def _groups_pow2(k: int, group: int) -> int:
    return triton.next_power_of_2(triton.cdiv(k, group))


def default_tiles(m: int, top_k: int, num_experts: int, fp8: bool) -> tuple[GemmConfig, GemmConfig]:
    """(GEMM 1, GEMM 2) tiles from DEFAULT_TILES for this call's average rows per expert."""
    rows_per_expert = m * top_k / num_experts
    for max_rows, cfg1, cfg2 in DEFAULT_TILES["fp8" if fp8 else "bf16"]:
        if rows_per_expert <= max_rows:
            return cfg1, cfg2
    raise ValueError(f"DEFAULT_TILES has no row for {rows_per_expert} rows per expert (last bound must be inf)")


def normalize_tiles(
    cfg1: GemmConfig, cfg2: GemmConfig, block_shape: tuple[int, int] | None
) -> tuple[GemmConfig, GemmConfig]:
    """The tiles that actually run: GEMM 1's BLOCK_M is the align block, GEMM 2's divides it (else it takes GEMM 1's);
    `half` needs a half tile of at least 16 rows; FP8: GEMM 1's BLOCK_N is the quant block's k (one activation group
    per tile row) and BLOCK_K must divide it (one scale per K step) and be at least 32 where the block allows."""
    if cfg2.block_m > cfg1.block_m or cfg1.block_m % cfg2.block_m:
        cfg2 = replace(cfg2, block_m=cfg1.block_m)
    cfg1, cfg2 = (replace(c, half=c.half and c.block_m >= 32) for c in (cfg1, cfg2))
    if block_shape is None:
        return cfg1, cfg2
    sbk = block_shape[1]

    def bk(cfg: GemmConfig) -> int:  # the FP8 tensor-core dot takes K >= 32 (Hopper)
        return cfg.block_k if min(32, sbk) <= cfg.block_k <= sbk and sbk % cfg.block_k == 0 else sbk

    return replace(cfg1, block_n=sbk, block_k=bk(cfg1)), replace(cfg2, block_k=bk(cfg2))  # GEMM 2: scales per column


def fused_moe(call: MoeCall, config: GemmConfig | None = None, config2: GemmConfig | None = None) -> torch.Tensor:
    """Align, GEMM 1 (+act(gate) * up, +fp8 quant), GEMM 2 (+routing weight), top-k sum.

    `config` (GEMM 1, and GEMM 2 unless `config2` is given) overrides DEFAULT_TILES; GEMM 2 takes GEMM 1's BLOCK_M.
    The call's `activation` and `gate_limit` pick GEMM 1's epilogue (moefx/kernels/activation.py).
    """
    hidden, topk_ids, topk_weights, w13, w2 = call.hidden.contiguous(), call.topk_ids, call.topk_weights, call.w13, \
        call.w2
    w13_scale, w2_scale, block_shape, activation, gate_limit = call.w13_scale, call.w2_scale, call.block_shape, \
        call.activation, call.gate_limit
    m, h = hidden.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w2.shape[0], w2.shape[2]
    fp8 = w13_scale is not None
    dev = hidden.device
    p = _launch_plan(m, h, top_k, num_experts, inter, tuple(block_shape) if fp8 else None, config, config2, activation,
                     gate_limit, w13.element_size(), w2.element_size(), tma_problem(w13, w2) is None, dev,
                     pdl_supported(dev))
    cfg1, cfg2 = p.cfg1, p.cfg2
    num_pairs = m * top_k
    sorted_ids, expert_ids, num_post = moe_align(topk_ids, num_experts, cfg1.block_m)
    rows = sorted_ids.numel()  # the intermediate is stored in sorted (padded) order
    tw = topk_weights.reshape(-1).contiguous()
    if fp8:
        sbk = block_shape[1]
        a, a_s = quant_rows_fp8(hidden, sbk)
        inter_buf = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=dev)
        inter_s = torch.empty(rows, inter // sbk, dtype=torch.float32, device=dev)
        s13, s2 = w13_scale, w2_scale
        s13_strides, s2_strides = w13_scale.stride(), w2_scale.stride()
    else:
        a, a_s = hidden, hidden
        inter_buf = torch.empty(rows, inter, dtype=hidden.dtype, device=dev)
        inter_s = inter_buf
        s13 = s2 = hidden
        s13_strides = s2_strides = (0, 0, 0)
    w13_desc = _weight_desc(w13, cfg1.block_n, cfg1.block_k) if cfg1.tma else w13
    _gemm1_kernel[p.grid1](
        a, a_s, w13, w13_desc, s13, inter_buf, inter_s,
        sorted_ids, expert_ids, num_post, num_pairs, p.num_pid_m1,
        a.stride(0), w13.stride(0), w13.stride(1), *s13_strides, **p.kw1,
    )
    pair_out = torch.empty(num_pairs, h, dtype=hidden.dtype, device=dev)
    if cfg2.tma:
        a2_desc = TensorDescriptor.from_tensor(inter_buf, [cfg2.block_m, cfg2.block_k])
        a2_half = TensorDescriptor.from_tensor(inter_buf, [cfg2.block_m // 2, cfg2.block_k]) if cfg2.half else a2_desc
        w2_desc = _weight_desc(w2, cfg2.block_n, cfg2.block_k)
    else:
        a2_desc = a2_half = inter_buf
        w2_desc = w2
    _gemm2_kernel[p.grid2](
        inter_buf, a2_desc, a2_half, inter_s, w2, w2_desc, s2, pair_out, tw,
        sorted_ids, expert_ids, num_post, num_pairs, p.num_pid_m2,
        w2.stride(0), w2.stride(1), *s2_strides, **p.kw2,
    )
    return topk_sum(pair_out, top_k)


@dataclass(frozen=True)
class _Plan:
    """The tiles, grids and constexpr/launch arguments of one fused_moe shape (no tensor values)."""

    cfg1: GemmConfig
    cfg2: GemmConfig
    num_pid_m1: int
    num_pid_m2: int
    grid1: tuple[int]
    grid2: tuple[int]
    kw1: dict
    kw2: dict


@functools.lru_cache(maxsize=512)  # pure in its arguments (shapes, configs, device facts); asked per call
def _launch_plan(
    m: int, h: int, top_k: int, num_experts: int, inter: int, block_shape: tuple[int, int] | None,
    config: GemmConfig | None, config2: GemmConfig | None, activation: str, gate_limit: float | None,
    elem13: int, elem2: int, tma_ok: bool, device: torch.device, pdl_ok: bool,
) -> _Plan:
    fp8 = block_shape is not None
    sbn, sbk = block_shape if fp8 else (1, 1)
    if config is None:
        cfg1, cfg2 = default_tiles(m, top_k, num_experts, fp8)
    else:
        cfg1, cfg2 = config, config2 or config
    cfg1, cfg2 = normalize_tiles(cfg1, cfg2, block_shape)
    if (cfg1.tma or cfg2.tma) and not tma_ok:
        cfg1, cfg2 = replace(cfg1, tma=False), replace(cfg2, tma=False)
    if device.type == "cuda":  # e.g. fp32 weights, or a GPU with less shared memory than the H200 the tiles came from
        limit, min_k = _shared_memory_limit(device), 32 if fp8 else 16
        cfg1 = fit_shared_memory(cfg1, 2, elem13, limit, min_k)
        cfg2 = fit_shared_memory(cfg2, 1, elem2, limit, min_k)
    rows = max_padded_len(m * top_k, num_experts, cfg1.block_m)  # the align's sorted length
    pdl1, pdl2 = (cfg.pdl and pdl_ok for cfg in (cfg1, cfg2))
    common = dict(H=h, I=inter, FP8=fp8, SBN=sbn, SBK=sbk, ALIGN_M=cfg1.block_m, INTERPRET=_INTERPRET)
    kw1 = dict(common, TOP_K=top_k, HALF=cfg1.half, BLOCK_M=cfg1.block_m, BLOCK_N=cfg1.block_n,
               BLOCK_K=cfg1.block_k, GROUP_M=cfg1.group_m, TMA=cfg1.tma, PDL=pdl1, RUNNING=cfg1.running,
               ACT=get_activation(activation).kernel_id, LIMIT=float(gate_limit or 0.0),
               num_warps=cfg1.num_warps, num_stages=cfg1.num_stages, **pdl_launch(pdl1))
    kw2 = dict(common, HALF=cfg2.half, BLOCK_M=cfg2.block_m, BLOCK_N=cfg2.block_n, BLOCK_K=cfg2.block_k,
               GROUP_M=cfg2.group_m, TMA=cfg2.tma, PDL=pdl2, RUNNING=cfg2.running,
               num_warps=cfg2.num_warps, num_stages=cfg2.num_stages, **pdl_launch(pdl2))
    m1, m2 = rows // cfg1.block_m, rows // cfg2.block_m
    return _Plan(cfg1, cfg2, m1, m2, (m1 * triton.cdiv(inter, cfg1.block_n),), (m2 * triton.cdiv(h, cfg2.block_n),),
                 kw1, kw2)


def tile_smem_bytes(cfg: GemmConfig, weight_tiles: int, elem: int) -> int:
    """Shared memory of a tile's pipelined operands: num_stages x (activation tile + weight tiles) (GEMM 1 loads
    two weight tiles, gate and up)."""
    return cfg.num_stages * (cfg.block_m * cfg.block_k + weight_tiles * cfg.block_k * cfg.block_n) * elem


def fit_shared_memory(cfg: GemmConfig, weight_tiles: int, elem: int, limit: int, min_k: int = 16) -> GemmConfig:
    """`cfg` with fewer stages (down to 2), then a thinner BLOCK_K (down to `min_k`), until it fits `limit` bytes."""
    while tile_smem_bytes(cfg, weight_tiles, elem) > limit:
        if cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > min_k:
            cfg = replace(cfg, block_k=cfg.block_k // 2)
        else:
            break
    return cfg


@functools.cache
def _shared_memory_limit(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block) - SMEM_RESERVE


def _weight_desc(w: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """[E, N, K] weights as one [E * N, K] TMA descriptor with [block_n, block_k] tiles."""
    return TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [block_n, block_k])


def tma_problem(w13: torch.Tensor, w2: torch.Tensor) -> str | None:
    """Why the weights cannot be read through TMA descriptors (GemmConfig.tma), or None."""
    if w13.is_cuda and device_capability(w13.device) < (9, 0):
        return "TMA needs compute capability >= 9.0"
    for name, w in (("w13", w13), ("w2", w2)):
        if not w.is_contiguous():
            return f"TMA needs contiguous {name}"
        if (w.shape[-1] * w.element_size()) % 16 or w.data_ptr() % 16:
            return f"TMA needs {name} rows 16-byte aligned (K={w.shape[-1]})"
    return None
