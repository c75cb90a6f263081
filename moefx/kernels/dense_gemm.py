"""Triton small-M dense GEMM/GEMV: Y_i = X W_i^T (+ b_i) for up to four weights that read the same X, one launch.

At decode M (1..16 rows) a linear reads every weight byte once and does almost no arithmetic per byte, so its time
is the weight bytes over HBM bandwidth, reached only when every SM streams weights with wide loads. The grid is
the N tiles of all the call's weights laid end to end (q, k and v of one attention: 4096 + 512 + 512 rows at
Qwen3-30B-A3B widths) times SPLIT_K slices of K: a program reads BLOCK_N weight rows over its K slice (16-byte
loads, evict_first: each byte is used once) and the matching X columns (small, L2-resident), and accumulates in
fp32. Two inner products, chosen by M:
- DOT=False (M <= 4): the [BLOCK_M, BLOCK_N, BLOCK_K] product summed over K on the CUDA cores; BLOCK_N can be as
  small as one row, so even N=128 (a router) spreads over many programs without a tensor-core tile's 16-row floor.
- DOT=True: tl.dot on the tensor cores with BLOCK_M >= 16 (rows past M are masked, never read), for M where the
  CUDA-core product would cost more than the weight bytes.
SPLIT_K > 1 (few N tiles for the SM count): each slice writes its fp32 partial tile to a workspace, then adds one
to the tile's counter (acq_rel, GPU scope); the slice that arrives last sums the partials in a fixed order, adds
the bias, writes Y once and resets the counter to zero. One launch, deterministic, and capturable: the counters
live in a per-device buffer that every tile leaves at zero, allocated outside CUDA-graph capture (a call being
captured before the buffer exists runs SPLIT_K = 1).
FP8 (block-quant e4m3 weights with `weight_scale_inv` per (SBN x SBK) block), in two forms: W8A8 (XQ: e4m3
activations with per-token-group scales, the `moefx::fp8_block_gemm` contract) and weight-only (float X, no x_scale).
A program's rows lie inside one SBN row block. DOT=False multiplies each X element by its block's weight scale
(and its activation scale, W8A8) before the plain product: the scale loads hit L1, and on the H100 this form is 2x
faster at M=1 than summing each quant block's products first and scaling the partial sums (docs/FINDINGS.md).
DOT=True (BLOCK_K <= SBK) scales each per-K-block dot; the weight-only form converts the weights to X's dtype first
(exact). Accumulation stays fp32 and Y is rounded once, as `ref_fp8_block_gemm` / `ref_fp8_weight_only` do.
NORM (float X: the float or the FP8 weight-only form, `moefx::rms_norm_dense_linear`): X is the RMSNorm's input, so
the norm costs no kernel of its own. A program needs the variance of its whole rows though it may own one K slice,
so it first reads its rows over all of K (L2-resident, BLOCK_M x K elements; in NORM_BLOCK-wide loads, unrolled so
they are in flight together) for rstd = rsqrt(mean(x^2) + eps) in fp32; each X chunk is then replaced by (x * rstd)
rounded to X's dtype, times the norm weight and rounded again when there is one (transformers' Qwen3/Llama RMSNorm:
the weight applied after the downcast), before the product. RESID (with NORM, `moefx::add_rms_norm_dense_linear`):
the norm's input is a residual add, X + R rounded to X's dtype, computed where X is read; the programs of the first
N tile write the sum (the layer's next residual) and the normed rows (the experts' input) over their K slices, so a
decoder layer's post-attention add and norm cost no kernel of their own either.
Launch contract (the dense op relies on it): fixed-shape work only, no host sync; buffers are sized from shapes.
PDL (the decode step's chain, kernels/pdl.py): the kernel waits for the previous one before anything it reads,
then lets its own dependent launch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefx.kernels.moe_routing import constexprs as route_constexprs
from moefx.kernels.moe_routing import route_rows
from moefx.kernels.pdl import pdl_launch, step_pdl
from moefx.kernels.rounding import round_as
from moefx.kernels.routing_limits import kernel_supports

MAX_WEIGHTS = 4  # weights per launch (q/k/v: 3, gate/up: 2); more are launched in groups of this many
# Largest automatic block_m (CUDA-core product, tensor-core tile): more rows are more M tiles, so a prefill of
# 2048 rows does not ask for a 2048-row tile (1 MiB of shared memory).
MAX_AUTO_BLOCK_M = {False: 8, True: 64}
COUNTER_SLOTS = 1 << 16  # split-K tile counters per device (int32, 256 KiB)
MAX_ROUTE_EXPERTS = 1024  # the ROUTE epilogue's last program holds a row of E scores in registers
# Scores the ROUTE epilogue routes at once (rows x the experts' power of two): 16 rows of 128 experts, 16 per thread
# at 4 warps; a taller M tile is routed in chunks of rows (route_chunk_rows)
ROUTE_TILE = 2048
NO_ROUTE = dict(E=1, TOP_K=1, KIND=0, RENORM=False, HAS_BIAS=False, N_GROUP=1, TOPK_GROUP=1, BLOCK_E=1, K_BLOCK=1,
                ROUTE_ROWS=1)
# X elements per load of the NORM prologue on the CUDA cores (BLOCK_M rows x NORM_BLOCK columns): at M=1 one load
# of the whole 2048-wide row, all in flight at once, where narrower loads wait on each other; tensor-core tiles
# (BLOCK_M >= 16) load BLOCK_K columns at a time (wider loads were slower there in the H200 probe of
# docs/FINDINGS.md, which the pass's M <= 4 limit leaves unused by default)
NORM_TILE = 4096
# Automatic CUDA-core tiles (block_k 0 / block_n 0): each program loads its whole K range in one step, so all of
# its weight loads are in flight at once, and each thread holds 128 weight bytes of it (bf16 q/k/v at K 2048: 4
# rows, 4 warps; o_proj at K 4096: 2 rows; FP8 twice the rows). The fixed tiles they replace (4 rows x 1024 at M=1,
# x 256 at M <= 4) took dependent load steps; these are faster at every probed point (bf16 M=1 q/k/v with the norm
# prologue 10.0 -> 8.1 us, M=2 21.3 -> 8.8) and within 0.4 us of the best tile of a grid (docs/DENSE.md).
MAX_AUTO_BLOCK_K = 4096
AUTO_THREAD_BYTES = 128


@triton.jit
def _dense_tile(
    pid_n, pid_k, pid_m, tile0, col0,
    x_ptr, xs_ptr, nw_ptr, r_ptr, h_ptr, xo_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr,
    M, eps, stride_xm, stride_xsm, stride_xsk, stride_wn, stride_wsn, stride_wsk,
    N: tl.constexpr, K: tl.constexpr, N_TOTAL: tl.constexpr, M_TILES: tl.constexpr,
    FP8: tl.constexpr, XQ: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, HAS_NORM_W: tl.constexpr, NORM_BLOCK: tl.constexpr, RESID: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, K_PER_SPLIT: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_lo = pid_k * K_PER_SPLIT
    x_off = offs_m[:, None].to(tl.int64) * stride_xm + (k_lo + offs_k)[None, :]  # X's, R's and RESID's outputs
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    s_row = (pid_n * BLOCK_N) // SBN  # FP8: the weight-scale row of this program's rows
    # RESID: X, the residual and both outputs share X's row stride; the first N tile of the first weight writes the
    # sum and the normed rows over its K slice (every slice and M tile of it: all of them, once)
    writes = (tile0 == 0) & (pid_n == 0)
    if PDL:
        gdc_wait()  # X, the residual, the workspace and the counters may be the previous kernel's memory
        gdc_launch_dependents()  # every program of this grid runs: the next kernel may launch
    if NORM:  # the whole rows' sum of squares, whatever K slice this program owns
        offs_r = tl.arange(0, NORM_BLOCK)
        row_off = offs_m[:, None].to(tl.int64) * stride_xm + offs_r[None, :]
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in tl.static_range(0, K, NORM_BLOCK):  # unrolled: the loads are in flight together
            r_mask = m_mask[:, None] & (offs_r < K - k0)[None, :]
            xr = tl.load(x_ptr + row_off + k0, mask=r_mask, other=0.0).to(tl.float32)
            if RESID:
                rr = tl.load(r_ptr + row_off + k0, mask=r_mask, other=0.0).to(tl.float32)
                xr = round_as(xr + rr, x_ptr.dtype.element_ty)
            sq += tl.sum(xr * xr, axis=1)
        rstd = tl.where(m_mask, tl.rsqrt(sq / K + eps), 0.0)  # rows past M stay 0 even at eps = 0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        k_mask = offs_k < K - (k_lo + kk)
        xk_mask = m_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + x_off + kk, mask=xk_mask, other=0.0)
        if RESID:
            r = tl.load(r_ptr + x_off + kk, mask=xk_mask, other=0.0)
            x = round_as(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty)
            if writes:
                tl.store(h_ptr + x_off + kk, x, mask=xk_mask)
        if NORM:
            xn = round_as(x.to(tl.float32) * rstd[:, None], x_ptr.dtype.element_ty)
            if HAS_NORM_W:
                nw = tl.load(nw_ptr + k_lo + kk + offs_k, mask=k_mask, other=0.0)
                xn = round_as(xn * nw.to(tl.float32)[None, :], x_ptr.dtype.element_ty)
            x = xn.to(x_ptr.dtype.element_ty)  # exact: already a value of X's dtype
            if RESID:
                if writes:
                    tl.store(xo_ptr + x_off + kk, x, mask=xk_mask)
        w = tl.load(w_ptrs + kk, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
        if DOT:
            if FP8 and not XQ:
                w = w.to(x_ptr.dtype.element_ty)  # exact: every e4m3 value is a bf16/fp16/fp32 value
            if IEEE:
                part = tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w))
            if FP8:
                # the whole K tile lies in one quant block (BLOCK_K <= SBK). A slice's last step can lie past K
                # (K_PER_SPLIT rounds up; its x and w are masked to 0): it reads the last block's scales, not the
                # memory past the scale tensors, where a NaN would make 0 * NaN
                kb = tl.minimum((k_lo + kk) // SBK, (K - 1) // SBK)
                w_s = tl.load(ws_ptr + s_row * stride_wsn + kb * stride_wsk)
                if XQ:
                    a_s = tl.load(xs_ptr + offs_m * stride_xsm + kb * stride_xsk, mask=m_mask, other=0.0)
                    acc += part * (a_s * w_s)[:, None]
                else:
                    acc += part * w_s
            else:
                acc += part
        else:
            xf = x.to(tl.float32)
            if FP8:  # each X element times its block's scales (L1-resident loads), then the plain product
                kb = (k_lo + kk + offs_k) // SBK
                w_s = tl.load(ws_ptr + s_row * stride_wsn + kb * stride_wsk, mask=k_mask, other=0.0)
                if XQ:
                    a_s = tl.load(xs_ptr + offs_m[:, None] * stride_xsm + kb[None, :] * stride_xsk,
                                  mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                    xf = xf * a_s * w_s[None, :]
                else:
                    xf = xf * w_s[None, :]
            acc += tl.sum(xf[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    out_mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
        stored = pid_k == 0  # the one slice: this program wrote its Y tile
    else:
        p_ptrs = part_ptr + offs_m[:, None].to(tl.int64) * N_TOTAL + (col0 + offs_n)[None, :]
        tl.store(p_ptrs + pid_k.to(tl.int64) * M * N_TOTAL, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is issued before the release below
        cnt = cnt_ptr + (tile0 + pid_n) * M_TILES + pid_m
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(p_ptrs + s * M * N_TOTAL, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt, 0)  # the next call finds every counter at zero
        stored = arrived == SPLIT_K - 1
    return stored


@triton.jit
def _route_tail(
    stored, pid_m, y_ptr, cnt_ptr, rb_ptr, rw_ptr, ri_ptr, M, scaling,
    TILES: tl.constexpr, BLOCK_M: tl.constexpr, SLOT: tl.constexpr,
    E: tl.constexpr, TOP_K: tl.constexpr, KIND: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_E: tl.constexpr, K_BLOCK: tl.constexpr,
    ROUTE_ROWS: tl.constexpr,
):
    """ROUTE: each program that wrote a Y tile of the router's logits counts it for its M tile (acq_rel, GPU scope);
    the program that writes the last one reads the tile's rows back (from L2) and routes them together, as fused_topk
    does one row (`route_rows`: the same weights to the bit), ROUTE_ROWS rows at a time (route_chunk_rows), then
    leaves the counter at zero."""
    if stored:
        tl.debug_barrier()  # every thread's logits are issued before the release below
        cnt = cnt_ptr + SLOT - pid_m
        done = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if done == TILES - 1:
            cols = tl.arange(0, BLOCK_E)
            k_offs = tl.arange(0, K_BLOCK)[None, :]
            for r0 in tl.static_range(0, BLOCK_M, ROUTE_ROWS):
                in_tile = r0 + tl.arange(0, ROUTE_ROWS)
                rows = pid_m * BLOCK_M + in_tile
                in_m = ((in_tile < BLOCK_M) & (rows < M))[:, None]  # rows past the tile: masked, routed and dropped
                x = tl.load(y_ptr + rows[:, None].to(tl.int64) * E + cols[None, :], mask=in_m & (cols < E)[None, :],
                            other=float("-inf"), cache_modifier=".cg").to(tl.float32)
                x = tl.where(in_m, x, 0.0)  # finite: a padding row's arithmetic stays quiet
                top_w, top_i = route_rows(x, cols, rb_ptr, E, TOP_K, KIND, RENORM, HAS_BIAS, N_GROUP, TOPK_GROUP,
                                          BLOCK_E, K_BLOCK)
                out = rows[:, None].to(tl.int64) * TOP_K + k_offs
                out_mask = in_m & (k_offs < TOP_K)
                tl.store(rw_ptr + out, (top_w * scaling).to(rw_ptr.dtype.element_ty), mask=out_mask)
                tl.store(ri_ptr + out, top_i.to(tl.int64), mask=out_mask)
            tl.atomic_xchg(cnt, 0)


@triton.jit(do_not_specialize=["M"])  # M only bounds masks: one compile serves every M of a tile
def _dense_kernel(
    x_ptr, xs_ptr, nw_ptr, r_ptr, h_ptr, xo_ptr, part_ptr, cnt_ptr, rb_ptr, rw_ptr, ri_ptr, scaling,
    w0_ptr, ws0_ptr, b0_ptr, y0_ptr, w1_ptr, ws1_ptr, b1_ptr, y1_ptr,
    w2_ptr, ws2_ptr, b2_ptr, y2_ptr, w3_ptr, ws3_ptr, b3_ptr, y3_ptr,
    M, eps, stride_xm, stride_xsm, stride_xsk,
    stride_wn0, stride_wn1, stride_wn2, stride_wn3, stride_wsn0, stride_wsn1, stride_wsn2, stride_wsn3, stride_wsk,
    N0: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr, N3: tl.constexpr,
    T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr, NUM_W: tl.constexpr,
    HB0: tl.constexpr, HB1: tl.constexpr, HB2: tl.constexpr, HB3: tl.constexpr,
    K: tl.constexpr, N_TOTAL: tl.constexpr, M_TILES: tl.constexpr,
    FP8: tl.constexpr, XQ: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
    NORM: tl.constexpr, HAS_NORM_W: tl.constexpr, NORM_BLOCK: tl.constexpr, RESID: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, K_PER_SPLIT: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
    ROUTE: tl.constexpr, SLOT: tl.constexpr, E: tl.constexpr, TOP_K: tl.constexpr, KIND: tl.constexpr,
    RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    BLOCK_E: tl.constexpr, K_BLOCK: tl.constexpr, ROUTE_ROWS: tl.constexpr, PDL: tl.constexpr,
):
    # Tiles of weight i are T_i .. T_{i+1}-1 of axis 0 (T0 = 0): one branch per weight, pruned past NUM_W.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    if pid < T1:
        stored = _dense_tile(pid, pid_k, pid_m, 0, 0,
                    x_ptr, xs_ptr, nw_ptr, r_ptr, h_ptr, xo_ptr,
                    w0_ptr, ws0_ptr, b0_ptr, y0_ptr, part_ptr, cnt_ptr,
                    M, eps, stride_xm, stride_xsm, stride_xsk, stride_wn0, stride_wsn0, stride_wsk,
                    N0, K, N_TOTAL, M_TILES, FP8, XQ, SBN, SBK, HB0, NORM, HAS_NORM_W, NORM_BLOCK, RESID,
                    BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, K_PER_SPLIT, DOT, IEEE, PDL)
        if ROUTE:  # one weight, the router: its N tiles are T1
            _route_tail(stored, pid_m, y0_ptr, cnt_ptr, rb_ptr, rw_ptr, ri_ptr, M, scaling, T1, BLOCK_M, SLOT,
                        E, TOP_K, KIND, RENORM, HAS_BIAS, N_GROUP, TOPK_GROUP, BLOCK_E, K_BLOCK, ROUTE_ROWS)
    elif NUM_W > 1:
        if pid < T2:
            _dense_tile(pid - T1, pid_k, pid_m, T1, N0,
                        x_ptr, xs_ptr, nw_ptr, r_ptr, h_ptr, xo_ptr,
                        w1_ptr, ws1_ptr, b1_ptr, y1_ptr, part_ptr, cnt_ptr,
                        M, eps, stride_xm, stride_xsm, stride_xsk, stride_wn1, stride_wsn1, stride_wsk,
                        N1, K, N_TOTAL, M_TILES, FP8, XQ, SBN, SBK, HB1, NORM, HAS_NORM_W, NORM_BLOCK, RESID,
                        BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, K_PER_SPLIT, DOT, IEEE, PDL)
        elif NUM_W > 2:
            if pid < T3:
                _dense_tile(pid - T2, pid_k, pid_m, T2, N0 + N1,
                            x_ptr, xs_ptr, nw_ptr, r_ptr, h_ptr, xo_ptr,
                            w2_ptr, ws2_ptr, b2_ptr, y2_ptr, part_ptr, cnt_ptr,
                            M, eps, stride_xm, stride_xsm, stride_xsk, stride_wn2, stride_wsn2, stride_wsk,
                            N2, K, N_TOTAL, M_TILES, FP8, XQ, SBN, SBK, HB2, NORM, HAS_NORM_W, NORM_BLOCK, RESID,
                            BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, K_PER_SPLIT, DOT, IEEE, PDL)
            elif NUM_W > 3:
                _dense_tile(pid - T3, pid_k, pid_m, T3, N0 + N1 + N2,
                            x_ptr, xs_ptr, nw_ptr, r_ptr, h_ptr, xo_ptr,
                            w3_ptr, ws3_ptr, b3_ptr, y3_ptr, part_ptr, cnt_ptr,
                            M, eps, stride_xm, stride_xsm, stride_xsk, stride_wn3, stride_wsn3, stride_wsk,
                            N3, K, N_TOTAL, M_TILES, FP8, XQ, SBN, SBK, HB3, NORM, HAS_NORM_W, NORM_BLOCK, RESID,
                            BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, K_PER_SPLIT, DOT, IEEE, PDL)


@dataclass(frozen=True)
class DenseConfig:
    """Launch tiles. block_m 0: next power of two of M up to MAX_AUTO_BLOCK_M (DOT=True: at least 16); block_k 0: all
    of K in one step, up to MAX_AUTO_BLOCK_K; block_n 0: rows for AUTO_THREAD_BYTES weight bytes per thread per step
    (CUDA-core product only); split_k 0: enough K slices that N tiles x slices reach `programs_per_sm` x the SM count
    (each slice at least 2 x block_k long)."""

    dot: bool = False
    block_m: int = 0
    block_n: int = 4
    block_k: int = 512
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2


# Default tiles per weight kind ("bf16" serves every unquantized dtype): rows of (largest M, config), first match
# wins. Adopting a `bench/dense.py --sweep` result is an edit of these rows.
DEFAULT_TILES: dict[str, tuple[tuple[float, DenseConfig], ...]] = {
    "bf16": (
        (4, DenseConfig(block_n=0, block_k=0)),
        (math.inf, DenseConfig(dot=True, block_n=16, block_k=128, num_stages=4)),
    ),
    "fp8": (
        (1, DenseConfig(block_n=0, block_k=0)),
        (4, DenseConfig(block_n=4, block_k=512)),
        (math.inf, DenseConfig(dot=True, block_n=16, block_k=128, num_stages=4)),
    ),
    # FP8 weights, float X (no x_scale): the automatic CUDA-core tiles at every M the dense pass runs it (<= 4), their
    # rows counted in FP8 bytes; the tensor-core tile past that converts the weights to X's dtype before the dot
    "fp8_weight_only": (
        (4, DenseConfig(block_n=0, block_k=0)),
        (math.inf, DenseConfig(dot=True, block_n=16, block_k=128, num_stages=4)),
    ),
}


def tile_kind(fp8: bool, weight_only: bool = False) -> str:
    """The DEFAULT_TILES key of a call: float weights, FP8 weights with FP8 X (W8A8), or FP8 weights with float X."""
    return ("fp8_weight_only" if weight_only else "fp8") if fp8 else "bf16"


def default_config(m: int, fp8: bool, weight_only: bool = False) -> DenseConfig:
    for max_m, cfg in DEFAULT_TILES[tile_kind(fp8, weight_only)]:
        if m <= max_m:
            return cfg
    raise ValueError(f"dense DEFAULT_TILES has no row for M={m} (last bound must be inf)")


def _pow2(v: int, name: str, lo: int = 1) -> None:
    if v < lo or v & (v - 1):
        raise ValueError(f"dense config {name}={v} must be a power of two >= {lo}")


@dataclass(frozen=True)
class Launch:
    """What one group's launch uses, derived from a DenseConfig and the shapes."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    m_tiles: int
    tiles: tuple[int, ...]  # N tiles per weight


@functools.lru_cache(maxsize=256)  # pure in hashable arguments; called per launch
def plan_launch(
    cfg: DenseConfig, m: int, ns: tuple[int, ...], k: int, block_shape: tuple[int, int] | None, sms: int
) -> Launch:
    """Resolve the automatic fields of `cfg` for M=m, weights of ns rows each and K=k (FP8 when block_shape)."""
    bk = cfg.block_k or min(MAX_AUTO_BLOCK_K, triton.next_power_of_2(k))
    weight_bytes = 1 if block_shape is not None else 2  # the automatic rows count 2 bytes for every float dtype
    bm = cfg.block_m or min(triton.next_power_of_2(max(m, 1)), MAX_AUTO_BLOCK_M[cfg.dot])
    # past one row of X the fp32 [BLOCK_M, rows, K] product, not the weight, fills the registers: FP8 on the CUDA
    # cores takes the float rows there (its doubled rows ran 2-3.5x slower than M=1 at M=2-4 on the H100)
    per_row = bk * (2 if bm > 1 and not cfg.dot else weight_bytes)
    bn = cfg.block_n or max(1, AUTO_THREAD_BYTES * 32 * cfg.num_warps // per_row)
    _pow2(bn, "block_n")
    _pow2(bk, "block_k", 16)
    if block_shape is not None:
        sbn, sbk = block_shape
        bn = math.gcd(bn, sbn)  # a program's rows inside one scale row block
        if cfg.dot:
            bk = min(bk, sbk)  # one quant block per K step
    if cfg.dot:
        bn = max(bn, 16)
    bk = min(bk, max(16, triton.next_power_of_2(k)))
    if cfg.dot:
        bm = max(bm, 16)
    _pow2(bm, "block_m")
    m_tiles = triton.cdiv(m, bm)
    tiles = tuple(triton.cdiv(n, bn) for n in ns)
    k_steps = triton.cdiv(k, bk)
    split = cfg.split_k
    if split == 0:
        split, want = 1, cfg.programs_per_sm * sms
        while sum(tiles) * m_tiles * split < want and k_steps // (2 * split) >= 2:
            split *= 2
    split = max(1, min(split, k_steps))
    k_per_split = triton.cdiv(k_steps, split) * bk
    split = triton.cdiv(k, k_per_split)  # no empty slices
    return Launch(bm, bn, bk, split, k_per_split, m_tiles, tiles)


_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor | None:
    """The device's split-K counters (zeros), or None inside a CUDA-graph capture that would have to create them."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs per split suffice to test the split-K path
    return torch.cuda.get_device_properties(device).multi_processor_count


def dense_gemv(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    x_scale: torch.Tensor | None = None,
    weight_scales: list[torch.Tensor] | None = None,
    block_shape: tuple[int, int] | None = None,
    out_dtype: torch.dtype | None = None,
    config: DenseConfig | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float | None = None,
    residual: torch.Tensor | None = None,
    route: tuple | None = None,
) -> list[torch.Tensor]:
    """Y_i = X W_i^T + b_i for X [M, K]; with weight_scales, W_i is FP8 and dequantized per block: X fp8 with
    x_scale [M, ceil(K/SBK)] (W8A8), or X float with no x_scale (weight-only: Y = X dequant(W)^T in fp32).

    Weights [N_i, K] must be contiguous in K. Outputs are [M, N_i] in out_dtype (default: X's dtype). `config`
    overrides DEFAULT_TILES. `norm_eps` given (float X: the float or the weight-only form): X is first RMSNorm-ed
    row by row with that eps and, when given, `norm_weight` [K] in X's dtype (the NORM prologue, module docstring).
    `residual` [M, K] in X's dtype (with norm_eps only): the norm's input is H = X + residual, rounded to X's dtype,
    and the outputs are [Y_0, ..., H, the normed H]. `route` (one weight, the router; fused_topk's arguments after
    the logits: top_k, kind, renormalize, correction_bias, n_group, topk_group, routed_scaling_factor, weights_dtype):
    the logits are also routed (the ROUTE epilogue, in the same launch where the counters allow), their weights and
    ids appended."""
    m, k = x.shape
    fp8 = weight_scales is not None
    xq = fp8 and x_scale is not None
    if fp8 and not xq and x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dense_gemv: FP8 weights without x_scale (weight-only) need a float X; got {x.dtype}")
    if norm_eps is not None and xq:
        raise ValueError("dense_gemv: the RMSNorm prologue (norm_eps) takes a float X (the float or the FP8 "
                         "weight-only form), not an FP8 X with x_scale")
    if norm_weight is not None and norm_eps is None:
        raise ValueError("dense_gemv: norm_weight needs norm_eps (the RMSNorm prologue is on when norm_eps is given)")
    if residual is not None and (norm_eps is None or residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"dense_gemv: residual must come with norm_eps and be X's shape and dtype "
                         f"{list(x.shape)}/{x.dtype}, got {list(residual.shape)}/{residual.dtype}")
    if route is not None and (len(weights) != 1 or fp8):
        raise ValueError("dense_gemv: route takes one float weight (the router)")
    if norm_weight is not None and norm_weight.stride(0) != 1:
        norm_weight = norm_weight.contiguous()
    dtype = out_dtype or x.dtype
    outs = [torch.empty(m, w.shape[0], dtype=dtype, device=x.device) for w in weights]
    sums = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(2)] if residual is not None \
        else []
    routed = []
    if route is not None:
        top_k, w_dtype = route[0], route[7]
        routed = [torch.empty(m, top_k, dtype=w_dtype or torch.float32, device=x.device),
                  torch.empty(m, top_k, dtype=torch.int64, device=x.device)]
    if m == 0:
        return outs + sums + routed
    if x.stride(-1) != 1 or (residual is not None and x.stride() != (k, 1)):
        x = x.contiguous()
    if residual is not None and residual.stride() != x.stride():
        residual = residual.contiguous()
    cfg = config or default_config(m, fp8, weight_only=fp8 and not xq)
    sms = _sm_count(x.device)
    for g0 in range(0, len(weights), MAX_WEIGHTS):
        sl = slice(g0, g0 + MAX_WEIGHTS)
        fused = _launch_group(x, weights[sl], biases[sl], x_scale, weight_scales[sl] if fp8 else None, block_shape,
                              outs[sl], cfg, sms, norm_weight, norm_eps, residual, sums, route, routed)
    if route is not None and not fused:  # no counters for the epilogue: the routing kernel of its own
        from moefx.kernels.moe_routing import fused_topk_triton

        routed = list(fused_topk_triton(outs[0], *route))
    return outs + sums + routed


def _launch_group(x, weights, biases, x_scale, weight_scales, block_shape, outs, cfg, sms, norm_weight,
                  norm_eps, residual, sums, route, routed) -> bool:
    """Launch one group; whether the ROUTE epilogue ran in it (False without `route`)."""
    m, k = x.shape
    fp8 = weight_scales is not None
    xq = fp8 and x_scale is not None
    ns = tuple(int(w.shape[0]) for w in weights)
    lp = plan_launch(cfg, m, ns, k, block_shape if fp8 else None, sms)
    counters = None
    if lp.split_k > 1 or route is not None:
        counters = _counters(x.device)
        if lp.split_k > 1 and (counters is None or sum(lp.tiles) * lp.m_tiles > COUNTER_SLOTS):
            lp = plan_launch(replace(cfg, split_k=1), m, ns, k, block_shape if fp8 else None, sms)
    # ROUTE's counters are the buffer's last M_TILES slots, past the split-K tiles' first ones
    routing = route is not None and counters is not None and \
        (sum(lp.tiles) + 1) * lp.m_tiles <= COUNTER_SLOTS and route_supported(ns[0], route[4])
    n_total = sum(ns)
    part = torch.empty(lp.split_k, m, n_total, dtype=torch.float32, device=x.device) if lp.split_k > 1 else outs[0]
    counters = counters if lp.split_k > 1 or routing else outs[0]
    pad = MAX_WEIGHTS - len(weights)
    ws = list(weights) + [weights[0]] * pad
    bs = [b if b is not None else outs[0] for b in biases] + [outs[0]] * pad
    ys = list(outs) + [outs[0]] * pad
    scales = list(weight_scales) + [weight_scales[0]] * pad if fp8 else [outs[0]] * MAX_WEIGHTS
    xs = x_scale if xq else x
    xs_strides = (x_scale.stride(0), x_scale.stride(1)) if xq else (0, 0)
    wsn = [s.stride(0) for s in scales] if fp8 else [0] * MAX_WEIGHTS
    wsk = scales[0].stride(1) if fp8 else 0
    if fp8 and any(s.stride(1) != wsk for s in scales):
        scales = [s.contiguous() for s in scales]
        wsn, wsk = [s.stride(0) for s in scales], 1
    args = []
    for i in range(MAX_WEIGHTS):
        args += [ws[i], scales[i], bs[i], ys[i]]
    norm = norm_eps is not None
    route_key = (route[0], route[1], route[2], route[3] is not None, route[4], route[5]) if routing else None
    grid, kw = _group_launch(cfg, lp, ns, tuple(b is not None for b in biases), block_shape if fp8 else None, k,
                             x.dtype == torch.float32, norm, norm_weight is not None, residual is not None, route_key,
                             step_pdl(x.device), xq)
    r, h, xo = (residual, *sums) if residual is not None else (x, x, x)
    rb, rw, ri = ((route[3] if route[3] is not None else outs[0]), *routed) if routing else (x, x, x)
    _dense_kernel[grid](
        x, xs, norm_weight if norm_weight is not None else x, r, h, xo, part, counters, rb, rw, ri,
        float(route[6]) if routing else 1.0, *args,
        m, float(norm_eps) if norm else 0.0, x.stride(0), *xs_strides,
        *[w.stride(0) for w in ws], *wsn, wsk, **kw,
    )
    return routing


@functools.lru_cache(maxsize=64)  # pure in its arguments; asked per launch
def route_supported(num_experts: int, n_group: int) -> bool:
    """Whether the ROUTE epilogue takes this router: the routing kernel's shapes, one row of scores in registers."""
    return num_experts <= MAX_ROUTE_EXPERTS and kernel_supports(num_experts, n_group) is None


def route_chunk_rows(block_m: int, num_experts: int, num_warps: int) -> int:
    """Rows the ROUTE epilogue routes together (its ROUTE_ROWS): the M tile's, at least `num_warps` (the compiler lays
    a [num_warps, BLOCK_E] tile out one row per warp, so each pick's max stays inside a warp, with no shared-memory
    round trip and barrier; the rows past the tile are masked, routed by warps that would otherwise wait) and at most
    ROUTE_TILE scores (powers of two, so the chunks tile BLOCK_M)."""
    block_e = triton.next_power_of_2(num_experts)
    return min(max(block_m, num_warps), max(1, ROUTE_TILE // block_e))


def norm_block(lp: Launch, k: int, dot: bool) -> int:
    """Columns per load of the NORM prologue: BLOCK_K on the tensor cores, else NORM_TILE elements over the tile's
    rows, at least BLOCK_K and at most K."""
    if dot:
        return lp.block_k
    return max(lp.block_k, min(triton.next_power_of_2(k), NORM_TILE // lp.block_m))


@functools.lru_cache(maxsize=512)  # pure in its arguments; asked per launch
def _group_launch(cfg: DenseConfig, lp: Launch, ns: tuple[int, ...], has_bias: tuple[bool, ...],
                  block_shape: tuple[int, int] | None, k: int, ieee: bool, norm: bool,
                  has_norm_w: bool, resid: bool, route: tuple | None,
                  pdl: bool = False, xq: bool = True) -> tuple[tuple[int, int, int], dict]:
    """The grid and the constexpr/launch arguments of one group's launch (`pdl`: a programmatic dependent of the
    kernel before it, kernels/pdl.py; `xq`: with block_shape, X is FP8 with x_scale, else float X, weight-only)."""
    pad = MAX_WEIGHTS - len(ns)
    nn = list(ns) + [1] * pad
    hb = list(has_bias) + [False] * pad
    starts = [0]
    for t in lp.tiles:
        starts.append(starts[-1] + t)
    starts += [starts[-1]] * (MAX_WEIGHTS + 1 - len(starts))
    sbn, sbk = block_shape if block_shape is not None else (1, 1)
    kw = dict(
        N0=nn[0], N1=nn[1], N2=nn[2], N3=nn[3], T1=starts[1], T2=starts[2], T3=starts[3], NUM_W=len(ns),
        HB0=hb[0], HB1=hb[1], HB2=hb[2], HB3=hb[3],
        K=k, N_TOTAL=sum(ns), M_TILES=lp.m_tiles, FP8=block_shape is not None, XQ=block_shape is not None and xq,
        SBN=sbn, SBK=sbk, NORM=norm,
        HAS_NORM_W=has_norm_w, NORM_BLOCK=norm_block(lp, k, cfg.dot) if norm else 1, RESID=resid,
        BLOCK_M=lp.block_m, BLOCK_N=lp.block_n, BLOCK_K=lp.block_k, SPLIT_K=lp.split_k, K_PER_SPLIT=lp.k_per_split,
        DOT=cfg.dot, IEEE=ieee, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ROUTE=route is not None, SLOT=COUNTER_SLOTS - 1,
        **(route_constexprs(ns[0], *route) | dict(ROUTE_ROWS=route_chunk_rows(lp.block_m, ns[0], cfg.num_warps))
           if route is not None else NO_ROUTE),
        PDL=pdl, **pdl_launch(pdl),
    )
    return (starts[len(ns)], lp.split_k, lp.m_tiles), kw
