"""Triton kernels of `moefx::decode_attention`: one query position per sequence against a KV cache, GQA-aware.

Each program takes one (sequence, KV head) and one slice of the key positions (a compile-time length: static cache
lengths come in steps of 256, so the variants stay few), holds the query rows of that head's
group (Hq / Hkv heads, padded to 16 rows for `tl.dot`) and runs an online softmax over its positions, skipping
blocks the mask rules out entirely (the unwritten tail of a static cache). With one slice the program writes the
output; with several it writes (max, sum, weighted values) per slice and a second kernel combines them.
The launcher accepts CPU tensors too, so the kernels run under TRITON_INTERPRET=1 in the tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefx.kernels.pdl import pdl_launch, step_pdl

BLOCK_L = 64


@triton.jit
def _decode_attn_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, stride_mb, stride_ml,
    stride_ob, stride_oh, kv_heads, length, scale,
    PER_SPLIT: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    MASK: tl.constexpr, MASK_BOOL: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
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
        slot = (pid * tl.num_programs(1) + split) * G_PAD + rows
        width = D + 2
        tl.store(part_ptr + slot[:, None] * width + dims[None, :], acc)
        tl.store(part_ptr + slot * width + D, m_i)
        tl.store(part_ptr + slot * width + D + 1, l_i)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _combine_kernel(
    part_ptr, out_ptr, kv_heads, splits, stride_ob, stride_oh,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the partials are the attention kernel's writes
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    row = tl.program_id(1)
    b = pid // kv_heads
    head = (pid % kv_heads) * G + row
    s = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, D)
    ok = s < splits
    width = D + 2
    slot = (pid * splits + s) * G_PAD + row
    m = tl.load(part_ptr + slot * width + D, mask=ok, other=float("-inf"))
    l_s = tl.load(part_ptr + slot * width + D + 1, mask=ok, other=0.0)
    acc = tl.load(part_ptr + slot[:, None] * width + dims[None, :], mask=ok[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(ok & (m > float("-inf")), tl.exp(m - m_all), 0.0)
    total = tl.sum(l_s * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(out_ptr + b * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def decode_attention_triton(q, k, v, mask, scale: float, out, splits: int) -> None:
    """out [B, Hq, 1, D] = softmax(q k^T * scale + mask) v for q [B, Hq, 1, D], k/v [B, Hkv, L, D], mask None or
    [B, L] (bool: keep; float: added), last dims contiguous. `splits` slices of the key positions (1: one kernel)."""
    import torch

    batch, hq, _, d = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    mask_kind = None if mask is None else mask.dtype == torch.bool
    p = _launch_plan(batch, hq, d, kv_heads, length, splits, mask_kind, q.dtype == torch.float32,
                     step_pdl(q.device))
    part = (torch.empty(p.part_numel, dtype=torch.float32, device=q.device) if p.splits > 1 else out)
    mask_args = (mask, mask.stride(0), mask.stride(1)) if mask is not None else (q, 0, 0)
    _decode_attn_kernel[p.grid](
        q, k, v, mask_args[0], out, part,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        mask_args[1], mask_args[2], out.stride(0), out.stride(1), kv_heads, length, scale, **p.kw,
    )
    if p.splits > 1:
        _combine_kernel[p.combine_grid](part, out, kv_heads, p.splits, out.stride(0), out.stride(1), **p.combine_kw)


@dataclass(frozen=True)
class _Plan:
    splits: int
    part_numel: int
    grid: tuple[int, int]
    kw: dict
    combine_grid: tuple[int, int]
    combine_kw: dict


@functools.lru_cache(maxsize=512)  # pure in its arguments (shapes); asked per call
def _launch_plan(batch: int, hq: int, d: int, kv_heads: int, length: int, splits: int, mask_bool: bool | None,
                 ieee: bool, pdl: bool = False) -> _Plan:
    """Slices, buffer size, grids and constexpr arguments of one call shape (mask_bool None: no mask; `pdl`: both
    kernels as programmatic dependents, kernels/pdl.py)."""
    g = hq // kv_heads
    g_pad = max(16, triton.next_power_of_2(g))
    per_split = -(-length // splits)
    per_split = -(-per_split // BLOCK_L) * BLOCK_L  # whole blocks per slice
    splits = -(-length // per_split)
    kw = dict(PER_SPLIT=per_split, G=g, G_PAD=g_pad, D=d, BLOCK=BLOCK_L, MASK=mask_bool is not None,
              MASK_BOOL=bool(mask_bool), SPLIT=splits > 1, IEEE=ieee, PDL=pdl, num_warps=4, **pdl_launch(pdl))
    combine_kw = dict(G=g, G_PAD=g_pad, D=d, SPLITS_PAD=triton.next_power_of_2(splits), PDL=pdl, num_warps=1,
                      **pdl_launch(pdl))
    return _Plan(splits, batch * kv_heads * splits * g_pad * (d + 2), (batch * kv_heads, splits), kw,
                 (batch * kv_heads, g), combine_kw)
