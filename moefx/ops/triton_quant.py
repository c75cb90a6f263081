"""Triton kernels for the moefx quant ops: one launch computes the producer (copy, SiLU-mul, RMSNorm or
residual-add + RMSNorm), keeps each quant group in registers and writes q and its scale in one pass.

Bit-exactness with eager PyTorch on CUDA: exp/rsqrt use libdevice (the functions eager's kernels call),
every division is IEEE round-to-nearest (`div_rn`), and intermediates are rounded to the dtypes eager rounds
to (see moefx/ops/quant.py). Remaining differences come from reduction order in the RMSNorm variance only.
The launcher accepts CPU tensors too so the kernels are tested under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

MODE_PLAIN, MODE_SILU, MODE_NORM, MODE_ADD_NORM = 0, 1, 2, 3

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# Triton's interpreter has no libdevice; there numpy's IEEE functions stand in (same results up to ulps in exp).
if os.environ.get("TRITON_INTERPRET") == "1":

    @triton.jit
    def _div(a, b):
        return a / b

    @triton.jit
    def _exp(x):
        return tl.exp(x)

    @triton.jit
    def _rsqrt(x):
        return tl.math.rsqrt(x)

    @triton.jit
    def _pow2_ceil(x):
        return tl.math.exp2(tl.math.ceil(tl.math.log2(x)))

    @triton.jit
    def _rint(x):  # 1.5 * 2**23: (x + c) - c rounds |x| < 2**22 half to even in fp32 arithmetic
        return (x + 12582912.0) - 12582912.0

    # The interpreter's bf16/fp8 downcasts round ties away and drop carries: round exactly in fp32 first.
    @triton.jit
    def _rne_bits(v, DROP: tl.constexpr):
        b = v.to(tl.int32, bitcast=True)  # two's-complement adds give the same bits as unsigned ones
        b = (b + ((1 << (DROP - 1)) - 1) + ((b >> DROP) & 1)) & (-(1 << DROP))
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _rne_bf16(v):
        return _rne_bits(v, 16)

    @triton.jit
    def _to_fp8(v):
        sub = _rint(tl.abs(v) * 512.0) * (1.0 / 512.0)
        sign = v.to(tl.int32, bitcast=True) & (-2147483648)
        sub = (sub.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)  # keeps -0.0 like torch
        return tl.where(tl.abs(v) < 0.015625, sub, _rne_bits(v, 20)).to(tl.float8e4nv)

else:

    @triton.jit
    def _div(a, b):
        return libdevice.div_rn(a, b)

    @triton.jit
    def _exp(x):
        return libdevice.exp(x)

    @triton.jit
    def _rsqrt(x):
        return libdevice.rsqrt(x)

    @triton.jit
    def _pow2_ceil(x):
        return libdevice.exp2(libdevice.ceil(libdevice.log2(x)))

    @triton.jit
    def _rint(x):
        return libdevice.rint(x)

    @triton.jit
    def _rne_bf16(v):
        return v.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)

    @triton.jit
    def _to_fp8(v):
        return v.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _round_to(v, DT: tl.constexpr):
    if DT == tl.bfloat16:
        v = _rne_bf16(v)
    elif DT == tl.float16:
        v = v.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
    return v


@triton.jit
def _quant_kernel(
    X, U, RES, W, NEWRES, Q, S,
    M, H,
    stride_xm, stride_um, stride_rm, stride_sm, stride_sg,
    eps, min_scale, qmax, norm_eps, inv_h,
    MODE: tl.constexpr, IN_DT: tl.constexpr, Y_DT: tl.constexpr, IS_FP8: tl.constexpr,
    HAS_W: tl.constexpr, W_FP32: tl.constexpr, FP32_SUM: tl.constexpr, UE8M0: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < M
    mask = rmask[:, None] & (cols < H)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if MODE == 1:
        u = tl.load(U + rows64[:, None] * stride_um + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sg = _round_to(_div(x, 1.0 + _exp(-x)), IN_DT)
        y = _round_to(sg * u, IN_DT)
    elif MODE >= 2:
        if MODE == 3:
            r = tl.load(RES + rows64[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            x = x + r
            tl.store(NEWRES + rows64[:, None] * H + cols[None, :], _round_to(x, IN_DT).to(IN_DT), mask=mask)
            if not FP32_SUM:
                x = _round_to(x, IN_DT)
        var = tl.sum(x * x, axis=1) * inv_h
        rstd = _rsqrt(var + norm_eps)
        y = x * rstd[:, None]
        if HAS_W:
            w = tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)
            if W_FP32:
                y = _round_to(y * w[None, :], IN_DT)
            else:
                y = _round_to(_round_to(y, IN_DT) * w[None, :], Y_DT)
        else:
            y = _round_to(y, IN_DT)
    else:
        y = x

    NG: tl.constexpr = BLOCK_H // GROUP
    y3 = tl.reshape(y, (BLOCK_M, NG, GROUP))
    amax = tl.max(tl.abs(y3), axis=2)
    amax = tl.maximum(amax, eps)
    scale = _div(amax, qmax)
    if UE8M0:
        scale = _pow2_ceil(scale)
    scale = tl.maximum(scale, min_scale)
    v = _div(y3, scale[:, :, None])
    v = tl.minimum(tl.maximum(v, -qmax), qmax)
    if IS_FP8:
        qv = _to_fp8(v)
    else:
        qv = _rint(v).to(tl.int8)
    qv = tl.reshape(qv, (BLOCK_M, BLOCK_H))
    tl.store(Q + rows64[:, None] * H + cols[None, :], qv, mask=mask)
    groups = pid_h * NG + tl.arange(0, NG)
    n_groups = (H + GROUP - 1) // GROUP
    smask = rmask[:, None] & (groups < n_groups)[None, :]
    tl.store(S + rows64[:, None] * stride_sm + groups[None, :] * stride_sg, scale, mask=smask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> 2-D [M, H] with unit last stride (a view whenever possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _tiles(mode: int, grouped: bool, group: int, m: int, h: int) -> tuple[int, int, int, int]:
    """(GROUP, BLOCK_M, BLOCK_H, num_warps). Row-wise work (norms, per-token scales) keeps the whole row."""
    hp = triton.next_power_of_2(h)
    if mode >= MODE_NORM or not grouped:
        block_h = max(hp, group if grouped else 1)
        warps = 4 if block_h <= 2048 else (8 if block_h <= 8192 else 16)
        return (group if grouped else block_h), 1, block_h, warps
    block_h = max(group, min(hp, 1024))
    block_m = 1 if m <= 256 else 4
    return group, block_m, block_h, 4


def launch(
    mode: int,
    q: torch.Tensor,
    s: torch.Tensor,
    scheme: tuple,
    x: torch.Tensor,
    u: torch.Tensor | None = None,
    *,
    weight: torch.Tensor | None = None,
    norm_eps: float = 0.0,
    weight_in_fp32: bool = False,
    y_dtype: torch.dtype | None = None,
    fp32_residual_sum: bool = False,
    new_residual: torch.Tensor | None = None,
) -> None:
    """Fill q [..., H] and s [..., G] (any layout) from x (and up / residual `u`). Tensors may live on CPU
    (interpreter) or CUDA. `scheme` is the tuple of `QuantScheme.args()`; it must already be validated."""
    from moefx.ops.quant import check_scheme

    kind, group_size, eps, min_scale, _, ue8m0, _, _ = scheme
    qmax = check_scheme(*scheme)
    h = x.shape[-1]
    x2 = _rows(x)
    m = x2.shape[0]
    if m == 0 or h == 0:
        return
    u2 = _rows(u) if u is not None else x2
    if s.dim() == 2:
        s2 = s
    elif s.is_contiguous():
        s2 = s.view(-1, s.shape[-1])
    else:
        s2 = torch.empty((m, s.shape[-1]), dtype=s.dtype, device=s.device)
    grouped = kind.endswith("_group")
    group, block_m, block_h, warps = _tiles(mode, grouped, group_size, m, h)
    in_dt = _TL_DTYPES[x.dtype]
    w = weight.contiguous() if weight is not None else x2
    res = new_residual if new_residual is not None else x2
    grid = (triton.cdiv(m, block_m), triton.cdiv(h, block_h))
    _quant_kernel[grid](
        x2, u2, u2, w, res, q.view(-1, h), s2,
        m, h,
        x2.stride(0), u2.stride(0), u2.stride(0), s2.stride(0), s2.stride(1),
        float(eps), float(min_scale), qmax, float(norm_eps), 1.0 / h,
        MODE=mode, IN_DT=in_dt, Y_DT=_TL_DTYPES[y_dtype or x.dtype], IS_FP8=kind.startswith("fp8"),
        HAS_W=weight is not None, W_FP32=weight_in_fp32, FP32_SUM=fp32_residual_sum, UE8M0=ue8m0,
        GROUP=group, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=warps,
    )
    if s2 is not s and s2.data_ptr() != s.data_ptr():
        s.copy_(s2.view(s.shape))
