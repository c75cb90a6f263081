"""Triton kernel of `moefx::qk_norm_rope_cache`: one program per (token, head) over q's heads and then k's.

A q program normalizes its head row, rotates it and writes it to `out`; a k program does the same into the key
cache at the token's position and copies the token's value row into the value cache. A head row (D <= 256) is
two halves in registers, so the rotation needs no shuffle: lo' = lo * cos_lo - hi * sin_lo, hi' = hi * cos_hi +
lo * sin_hi, each product rounded to the input dtype as the eager code rounds it. The launcher accepts CPU
tensors too, so the kernel runs under TRITON_INTERPRET=1 in the tests.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefx.kernels.pdl import pdl_launch, step_pdl
from moefx.kernels.rounding import round_as


@triton.jit
def _qk_norm_rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, keys_ptr, values_ptr, pos_ptr, out_ptr,
    seq, eps,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_cb, stride_cs, stride_sb, stride_ss,
    stride_kcb, stride_kch, stride_kcl, stride_vcb, stride_vch, stride_vcl, stride_ob, stride_oh, stride_os,
    HQ: tl.constexpr, D: tl.constexpr, HAS_W: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the decode step's chain (kernels/pdl.py): q/k/v are the previous kernel's output
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    head = tl.program_id(1)
    b = row // seq
    s = row % seq
    dtype = q_ptr.dtype.element_ty
    half = tl.arange(0, D // 2)
    if head < HQ:
        src = q_ptr + b * stride_qb + s * stride_qs + head * stride_qh
        w_ptr = qw_ptr
        dst = out_ptr + b * stride_ob + head * stride_oh + s * stride_os
    else:
        kvh = head - HQ
        pos = tl.load(pos_ptr + s).to(tl.int64)  # positions: S elements (a write position's [1] tensor at S=1)
        src = k_ptr + b * stride_kb + s * stride_ks + kvh * stride_kh
        w_ptr = kw_ptr
        dst = keys_ptr + b * stride_kcb + kvh * stride_kch + pos * stride_kcl
        dims = tl.arange(0, D)
        v_row = tl.load(v_ptr + b * stride_vb + s * stride_vs + kvh * stride_vh + dims)
        tl.store(values_ptr + b * stride_vcb + kvh * stride_vch + pos * stride_vcl + dims, v_row)
    lo = tl.load(src + half).to(tl.float32)
    hi = tl.load(src + D // 2 + half).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / D + eps)
    lo = round_as(lo * rstd, dtype)
    hi = round_as(hi * rstd, dtype)
    if HAS_W:
        lo = round_as(lo * tl.load(w_ptr + half).to(tl.float32), dtype)
        hi = round_as(hi * tl.load(w_ptr + D // 2 + half).to(tl.float32), dtype)
    c = cos_ptr + b * stride_cb + s * stride_cs
    sn = sin_ptr + b * stride_sb + s * stride_ss
    c_lo, c_hi = tl.load(c + half).to(tl.float32), tl.load(c + D // 2 + half).to(tl.float32)
    s_lo, s_hi = tl.load(sn + half).to(tl.float32), tl.load(sn + D // 2 + half).to(tl.float32)
    out_lo = round_as(lo * c_lo, dtype) + round_as(-hi * s_lo, dtype)
    out_hi = round_as(hi * c_hi, dtype) + round_as(lo * s_hi, dtype)
    tl.store(dst + half, round_as(out_lo, dtype).to(dtype))  # exact: already a value of dtype
    tl.store(dst + D // 2 + half, round_as(out_hi, dtype).to(dtype))


def qk_norm_rope_cache_triton(q, k, v, q_weight, k_weight, eps: float, cos, sin, keys, values, positions,
                              out) -> None:
    """The op's contract (moefx/ops/rope_cache.py) for inputs `unsupported_reason` accepts; `out` [B, Hq, S, D]."""
    batch, seq, hq, d = q.shape
    hkv = k.shape[2]
    bc = 0 if cos.shape[0] == 1 else cos.stride(0)
    bs = 0 if sin.shape[0] == 1 else sin.stride(0)
    has_w = q_weight is not None
    pdl = step_pdl(q.device)
    _qk_norm_rope_cache_kernel[(batch * seq, hq + hkv)](
        q, k, v, q_weight if has_w else q, k_weight if has_w else k, cos, sin, keys, values, positions, out,
        seq, eps,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), bc, cos.stride(1), bs, sin.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        HQ=hq, D=d, HAS_W=has_w, PDL=pdl, num_warps=1, **pdl_launch(pdl),
    )
