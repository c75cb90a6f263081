"""Triton kernel of `moefx::decode_attention`: one query position per sequence against a KV cache, GQA-aware.

Each program takes one (sequence, KV head) and one slice of the key positions (a compile-time length: static cache
lengths come in steps of 256, so the variants stay few), holds the query rows of that head's group (Hq / Hkv heads,
padded to 16 rows for `tl.dot`) and runs an online softmax over its positions, skipping the blocks the mask rules out
entirely (the unwritten tail of a static cache): their K and V loads, or (SPECULATE, short slices: SPECULATE_BLOCKS)
only their arithmetic, K and V then being loaded with the mask rather than after it. With one slice the program
writes the output. With several, one launch still does all of it, as the dense GEMV does its split-K: each program
writes (weighted values, max, sum) of its slice to a workspace, then adds one to its (sequence, KV head)'s counter
(acq_rel, GPU scope); the program that arrives last reads every slice's partials back in slice order
(COMBINE_UNROLL slices a step, their loads in flight together), rescales them to the common max, sums them, writes
the output and resets the counter to zero. The sum's order is the slices', never the arrival order, so the result
is deterministic (and, on the interpreter, bit-equal to a second kernel combining the same partials); one launch
saves that kernel's launch and boundary, about 1-1.5 us on the H100 even inside a CUDA graph. The counters live in
a per-device buffer that every call leaves at zero, allocated outside CUDA-graph capture (a call captured before it
exists runs one slice).
PDL (the decode step's chain, kernels/pdl.py): the kernel waits for the previous one before anything it reads
(the counters too), then lets its own dependent launch.
The launcher accepts CPU tensors too, so the kernel runs under TRITON_INTERPRET=1 in the tests.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefx.kernels.pdl import pdl_launch, step_pdl

BLOCK_L = 64
MAX_SPLITS = 64
# Slices the combine reads per step, unrolled (their loads in flight together): unrolled over 32 the sm_90 build spills
# registers (Qwen3-30B-A3B's attention, tests/compile_sm90.py); at batch 1 over 150-300 positions one step reads all
COMBINE_UNROLL = 8
COUNTER_SLOTS = 4096  # (sequence, KV head) counters per device (int32): splits_for asks for slices below 264 pairs
# With SPECULATE_DEFAULT on, slices of at most this many blocks load each block's K and V together with its mask
# (SPECULATE), not after it: a kept block then waits on one global-memory round trip instead of a chain of them
# (after the mask, the sm_90a build issues V only once K sits in shared memory for its dot). Batch 1 over a
# 256-position cache takes about 5 us on the H100 where its bytes take about 0.1: the time is such round trips, one
# after another.
# The price is the K and V of blocks the mask drops whole (a static cache's unwritten tail), read for nothing: small
# next to the round trip saved in the short slices of short caches, which are latency-bound; longer slices come from
# long caches or from batches whose programs already fill the GPU, where bytes set the time, so they keep the loads
# behind the mask.
SPECULATE_BLOCKS = 2
# Whether calls that do not say take the rule above: off. On the H100 the speculated loads did not pay at the
# engine's short caches (B=1 over 256 positions 5.22 against 5.16 us; 8 layers end to end 1399 against 1417 tok/s)
# and lost at B=16 (13.09 against 12.13 us); they won 0.35-1.1 us at B=1 over 512-1024 positions
# (docs/FINDINGS.md, "The attention loads timed").
SPECULATE_DEFAULT = False


@triton.jit
def _decode_attn_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_ptr, cnt_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, stride_mb, stride_ml,
    stride_ob, stride_oh, kv_heads, length, scale,
    PER_SPLIT: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    MASK: tl.constexpr, MASK_BOOL: tl.constexpr, SPLIT: tl.constexpr, SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr,
    G_COMB: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, SPECULATE: tl.constexpr,
):
    if PDL:  # the decode step's chain (kernels/pdl.py): q and the cache rows are the previous kernel's writes
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // kv_heads
    kvh = pid % kv_heads
    rows = tl.arange(0, G_PAD)
    dims = tl.arange(0, D)
    row_ok = rows < G
    heads = kvh * G + rows
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    start = split * PER_SPLIT
    stop = tl.minimum(start + PER_SPLIT, length)
    for offset in range(0, PER_SPLIT, BLOCK):
        pos = start + offset + tl.arange(0, BLOCK)
        ok = pos < stop
        if MASK:
            mvals = tl.load(mask_ptr + b * stride_mb + pos * stride_ml, mask=ok, other=0)
        if SPECULATE:  # K and V in flight with the mask: a kept block waits on one round trip, not on a chain of them
            k_all = tl.load(k_base + pos[:, None] * stride_kl + dims[None, :], mask=ok[:, None], other=0.0)
            v_all = tl.load(v_base + pos[:, None] * stride_vl + dims[None, :], mask=ok[:, None], other=0.0)
        if MASK:
            if MASK_BOOL:
                keep = ok & (mvals != 0)
                bias = tl.zeros([BLOCK], tl.float32)
            else:
                bias = mvals.to(tl.float32)
                keep = ok & (bias > float("-inf"))
        else:
            keep = ok
            bias = tl.zeros([BLOCK], tl.float32)
        if tl.max(keep.to(tl.int32), axis=0) > 0:
            if SPECULATE:
                # positions the mask drops (a static cache's unwritten rows) may hold NaN or inf, and 0 * NaN is NaN:
                # zeroed as the masked loads below zero them, so both forms compute the same bits
                k = tl.where(keep[:, None], k_all, 0.0)
                v = tl.where(keep[:, None], v_all, 0.0)
            else:
                k = tl.load(k_base + pos[:, None] * stride_kl + dims[None, :], mask=keep[:, None], other=0.0)
                v = tl.load(v_base + pos[:, None] * stride_vl + dims[None, :], mask=keep[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale + bias[None, :]
            s = tl.where(keep[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
    if SPLIT:
        # slot of (this sequence and KV head, slice s, row r): (pid * splits + s) * G_PAD + r, D + 2 floats each
        splits = tl.num_programs(1)
        width = D + 2
        base = pid * splits * G_PAD
        slot = base + split * G_PAD + rows
        tl.store(part_ptr + slot[:, None] * width + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ptr + slot * width + D, m_i, mask=row_ok)
        tl.store(part_ptr + slot * width + D + 1, l_i, mask=row_ok)
        tl.debug_barrier()  # every thread's partial is issued before the release below
        arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:  # the last slice of this (sequence, KV head) to finish combines all of them
            c_rows = tl.arange(0, G_COMB)
            c_ok = c_rows < G
            s_all = tl.arange(0, SPLITS_PAD)
            s_live = s_all < splits
            stat = (base + s_all[None, :] * G_PAD + c_rows[:, None]) * width + D  # [G_COMB, SPLITS_PAD]
            stat_ok = c_ok[:, None] & s_live[None, :]
            m = tl.load(part_ptr + stat, mask=stat_ok, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(part_ptr + stat + 1, mask=stat_ok, other=0.0, cache_modifier=".cg")
            m_all = tl.max(m, axis=1)
            m_all = tl.where(m_all > float("-inf"), m_all, 0.0)  # rows with no kept position: every weight is 0
            w = tl.where(m > float("-inf"), tl.exp(m - m_all[:, None]), 0.0)
            total = tl.sum(l_s * w, axis=1)
            out = tl.zeros([G_COMB, D], tl.float32)
            for c0 in range(0, splits, CHUNK):  # each chunk unrolled: its slices' loads are in flight together
                for j in tl.static_range(CHUNK):
                    s_slot = base + (c0 + j) * G_PAD + c_rows
                    s_ok = c_ok & (tl.zeros([G_COMB], tl.int32) + c0 + j < splits)
                    m_s = tl.load(part_ptr + s_slot * width + D, mask=s_ok, other=float("-inf"),
                                  cache_modifier=".cg")
                    w_s = tl.where(m_s > float("-inf"), tl.exp(m_s - m_all), 0.0)
                    acc_s = tl.load(part_ptr + s_slot[:, None] * width + dims[None, :], mask=s_ok[:, None],
                                    other=0.0, cache_modifier=".cg")
                    out += acc_s * w_s[:, None]
            # a row with every position masked: 0 / 0, as with one slice (padded rows divide by 1, never stored)
            out = out / tl.where(c_ok, total, 1.0)[:, None]
            c_heads = kvh * G + c_rows
            tl.store(out_ptr + b * stride_ob + c_heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=c_ok[:, None])
            tl.atomic_xchg(cnt_ptr + pid, 0)  # the next call finds every counter at zero
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                            out: torch.Tensor, splits: int, speculate: bool | None = None) -> None:
    """out [B, Hq, 1, D] = softmax(q k^T * scale + mask) v for q [B, Hq, 1, D], k/v [B, Hkv, L, D], mask None or
    [B, L] (bool: keep; float: added), last dims contiguous. `splits` slices of the key positions (at most
    MAX_SPLITS; 1: no partials). One launch either way; several slices need the device's counters (module
    docstring): a call captured in a CUDA graph before they exist, or with more (sequence, KV head) pairs than
    COUNTER_SLOTS, runs one slice. `speculate`: K and V loaded with the mask (True) or after it (False); None
    decides (`speculates`). Both forms give the same bits."""
    batch, hq, _, d = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    mask_kind = None if mask is None else mask.dtype == torch.bool
    args = (batch, hq, d, kv_heads, length, min(splits, MAX_SPLITS), mask_kind, q.dtype == torch.float32,
            step_pdl(q.device), speculate)
    p = _launch_plan(*args)
    counters = out
    if p.splits > 1:
        counters = _counters(q.device) if batch * kv_heads <= COUNTER_SLOTS else None
        if counters is None:
            p = _launch_plan(*args[:5], 1, *args[6:])
    part = (torch.empty(p.part_numel, dtype=torch.float32, device=q.device) if p.splits > 1 else out)
    mask_args = (mask, mask.stride(0), mask.stride(1)) if mask is not None else (q, 0, 0)
    _decode_attn_kernel[p.grid](
        q, k, v, mask_args[0], out, part, counters,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        mask_args[1], mask_args[2], out.stride(0), out.stride(1), kv_heads, length, scale, **p.kw,
    )


_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor | None:
    """The device's slice counters (zeros), or None inside a CUDA-graph capture that would have to create them (with
    a warning, which Python's default filter shows once: that graph runs one slice per (sequence, KV head)). Warned
    through `warnings`, not moefx.log: kernel modules import no other moefx package."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            warnings.warn("moefx decode_attention: captured before its slice counters exist on this device, so the "
                          "graph runs one slice per (sequence, KV head), slower; one call outside the capture creates "
                          "them", stacklevel=3)
            return None
        buf = _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


@dataclass(frozen=True)
class _Plan:
    splits: int
    part_numel: int
    grid: tuple[int, int]
    kw: dict


def set_speculate_default(on: bool = False) -> None:
    """SPECULATE_DEFAULT for the calls that follow (no argument: off, the default), the kept launch plans dropped."""
    global SPECULATE_DEFAULT
    SPECULATE_DEFAULT = on
    _launch_plan.cache_clear()


def speculates(length: int, splits: int) -> bool:
    """Whether a call over `length` key positions asking for `splits` slices, and not saying how to load K and V,
    loads them with the mask (SPECULATE_DEFAULT, SPECULATE_BLOCKS)."""
    return SPECULATE_DEFAULT and _slice_positions(length, min(splits, MAX_SPLITS)) <= SPECULATE_BLOCKS * BLOCK_L


def _slice_positions(length: int, splits: int) -> int:
    """Key positions per slice: `splits` slices asked for, rounded up to whole blocks (so possibly fewer slices)."""
    per_split = -(-length // splits)
    return -(-per_split // BLOCK_L) * BLOCK_L


@functools.lru_cache(maxsize=512)  # pure in its arguments (shapes); asked per call
def _launch_plan(batch: int, hq: int, d: int, kv_heads: int, length: int, splits: int, mask_bool: bool | None,
                 ieee: bool, pdl: bool = False, speculate: bool | None = None) -> _Plan:
    """Slices, partials' size, grid and constexpr arguments of one call shape (mask_bool None: no mask; `pdl`: a
    programmatic dependent of the kernel before it, kernels/pdl.py; `speculate` None: `speculates` decides)."""
    g = hq // kv_heads
    g_pad = max(16, triton.next_power_of_2(g))
    per_split = _slice_positions(length, splits)
    if speculate is None:
        speculate = speculates(length, splits)
    splits = -(-length // per_split)
    kw = dict(PER_SPLIT=per_split, G=g, G_PAD=g_pad, D=d, BLOCK=BLOCK_L, MASK=mask_bool is not None,
              MASK_BOOL=bool(mask_bool), SPLIT=splits > 1, SPLITS_PAD=triton.next_power_of_2(splits),
              CHUNK=min(triton.next_power_of_2(splits), COMBINE_UNROLL),
              G_COMB=triton.next_power_of_2(g), IEEE=ieee, PDL=pdl, SPECULATE=speculate, num_warps=4,
              **pdl_launch(pdl))
    return _Plan(splits, batch * kv_heads * splits * g_pad * (d + 2), (batch * kv_heads, splits), kw)
