"""Triton kernels for the moefx quant ops: one launch computes the producer (copy, SiLU-mul, RMSNorm or
residual-add + RMSNorm), keeps each quant group in registers and writes q and its scale in one pass.

Bit-exactness with eager PyTorch: intermediates are rounded to the dtypes eager rounds to (moefx/ops/quant.py);
the scale is formed as eager forms `amax / qmax` on that device (CUDA: amax * fl32(1/qmax)); q = y / scale is
the correctly rounded quotient (Markstein: one IEEE reciprocal per group, two FMAs per element), which matters
because exact fp8 ties are common; the reciprocal forms (`y * (1 / scale)`, `y * (qmax / amax)`) are one IEEE
reciprocal per group and one rounded product per element, as eager computes them.
Rare last-bit differences remain from silu's exp (ex2.approx) and division
(div.full) -- absorbed by the bf16 rounding that follows nearly always -- and the RMSNorm variance sum order.
The launcher accepts CPU tensors too so the kernels are tested under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

MODE_PLAIN, MODE_SILU, MODE_NORM, MODE_ADD_NORM = 0, 1, 2, 3
# The SCALING constexpr of each way moefx/ops/quant.py's `SCALINGS` forms q from y and the scale
SCALING_CODES = {"divide": 0, "reciprocal": 1, "qmax_over_amax": 2}
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # an fp8 qmax below it needs the CLAMP

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
    def _fast_div(a, b):
        return a / b

    @triton.jit
    def _fma(a, b, c):  # the product of two fp32 values is exact in fp64; the sums needed here round once
        return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)

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
    def _exp(x):  # ex2.approx: a few ulps from expf, which the bf16 rounding of silu(x) nearly always absorbs
        return tl.exp(x)

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
    def _fast_div(a, b):  # a * rcp.approx(b), ~2 ulp: only where a rounding to bf16/fp16 or fp8 follows
        rcp = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [b], dtype=tl.float32, is_pure=True,
                                        pack=1)
        return a * rcp

    @triton.jit
    def _fma(a, b, c):
        return tl.fma(a, b, c)

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
def _exact_div(y, s, inv):
    """IEEE y / s from inv = RN(1/s): q0 = y*inv, r = y - q0*s (exact by FMA), RN(q0 + r*inv) is correctly
    rounded (Markstein). Three instructions instead of a full IEEE division per element."""
    q0 = y * inv
    return tl.where(q0 == 0.0, q0, _fma(_fma(-q0, s, y), inv, q0))  # keeps -0.0 / s = -0.0


@triton.jit
def _quant_kernel(
    X, U, RES, W, NEWRES, Q, S,
    M, H,
    stride_xm, stride_um, stride_rm, stride_sm, stride_sg,
    eps, min_scale, qmax, inv_qmax, norm_eps, inv_h,
    MODE: tl.constexpr, IN_DT: tl.constexpr, Y_DT: tl.constexpr, IS_FP8: tl.constexpr,
    HAS_W: tl.constexpr, W_FP32: tl.constexpr, FP32_SUM: tl.constexpr, UE8M0: tl.constexpr,
    UE8M0_LATE: tl.constexpr, SCALING: tl.constexpr, RECIP_SCALE: tl.constexpr, CLAMP: tl.constexpr,
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
        sg = _round_to(_fast_div(x, 1.0 + _exp(-x)), IN_DT)
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
    if NG == 1:
        amax = tl.max(tl.abs(y), axis=1)[:, None]
    else:
        y = tl.reshape(y, (BLOCK_M, NG, GROUP))
        amax = tl.max(tl.abs(y), axis=2)
    amax = tl.maximum(amax, eps)
    if RECIP_SCALE:
        scale = amax * inv_qmax  # eager CUDA computes `tensor / python_float` as tensor * fl32(1 / float)
    else:
        scale = _div(amax, qmax)
    if UE8M0 and not UE8M0_LATE:
        scale = _pow2_ceil(scale)
    scale = tl.maximum(scale, min_scale)
    if UE8M0 and UE8M0_LATE:
        scale = _pow2_ceil(scale)
    if SCALING == 0:  # y / scale
        inv = _div(1.0, scale)
        if NG == 1:
            v = _exact_div(y, scale, inv)
        else:
            v = _exact_div(y, scale[:, :, None], inv[:, :, None])
    else:  # y * (1 / scale), or y * ((1 / amax) * qmax): one rounded product, as eager computes it
        inv = _div(1.0, scale) if SCALING == 1 else _div(1.0, amax) * qmax
        v = y * inv if NG == 1 else y * inv[:, :, None]
    if CLAMP:  # FP8 at qmax = 448: the saturating conversion is the clamp
        v = tl.minimum(tl.maximum(v, -qmax), qmax)
    if IS_FP8:
        qv = _to_fp8(v)
    else:
        qv = _rint(v).to(tl.int8)
    if NG != 1:
        qv = tl.reshape(qv, (BLOCK_M, BLOCK_H))
    tl.store(Q + rows64[:, None] * H + cols[None, :], qv, mask=mask)
    groups = pid_h * NG + tl.arange(0, NG)
    n_groups = (H + GROUP - 1) // GROUP
    smask = rmask[:, None] & (groups < n_groups)[None, :]
    tl.store(S + rows64[:, None] * stride_sm + groups[None, :] * stride_sg, scale, mask=smask)


@functools.lru_cache(maxsize=16)
def _fp32_reciprocal(v: float) -> float:
    """fl32(1 / v) by an fp32 IEEE division, as eager CUDA forms it on the host for `tensor / v`."""
    return float(torch.tensor(1.0) / torch.tensor(v))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> 2-D [M, H] with unit last stride (a view whenever possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _tiles(mode: int, grouped: bool, group: int, m: int, h: int) -> tuple[int, int, int, int]:
    """(GROUP, BLOCK_M, BLOCK_H, num_warps). Row-wise work (norms, per-token scales) keeps the whole row."""
    hp = triton.next_power_of_2(h)
    if mode >= MODE_NORM or not grouped:
        block_h = max(hp, group if grouped else 1)
        warps = 4 if block_h <= 2048 else (8 if block_h <= 8192 and (m > 256 or block_h < 8192) else 16)
        return (group if grouped else block_h), 1, block_h, warps
    block_h = max(group, min(hp, 1024))
    block_m = 1 if m <= 256 else 4
    return group, block_m, block_h, 4


def launch(
    mode: int,
    q: torch.Tensor,
    s: torch.Tensor,
    scheme: tuple,
    qmax: float,
    x: torch.Tensor,
    u: torch.Tensor | None = None,
    *,
    weight: torch.Tensor | None = None,
    norm_eps: float = 0.0,
    weight_in_fp32: bool = False,
    y_dtype: torch.dtype | None = None,
    fp32_residual_sum: bool = False,
    new_residual: torch.Tensor | None = None,
    cuda_semantics: bool | None = None,
) -> None:
    """Fill q [..., H] and s [..., G] (any layout) from x (and up / residual `u`). Tensors may live on CPU
    (interpreter) or CUDA. `scheme` is the whole tuple of `QuantScheme.args()`, validated, and `qmax` its effective
    qmax (moefx/ops/quant.py: `full_scheme`, `check_scheme`). `cuda_semantics` (default: x.is_cuda) computes
    scale = amax * fl32(1/qmax) as eager CUDA does; else IEEE amax / qmax as eager CPU does."""
    kind, group_size, eps, min_scale, _, ue8m0, _, _, scaling, ue8m0_late = scheme
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
    inv_qmax = _fp32_reciprocal(qmax)
    grid = (triton.cdiv(m, block_m), triton.cdiv(h, block_h))
    _quant_kernel[grid](
        x2, u2, u2, w, res, q.view(-1, h), s2,
        m, h,
        x2.stride(0), u2.stride(0), u2.stride(0), s2.stride(0), s2.stride(1),
        float(eps), float(min_scale), qmax, inv_qmax, float(norm_eps), 1.0 / h,
        MODE=mode, IN_DT=in_dt, Y_DT=_TL_DTYPES[y_dtype or x.dtype], IS_FP8=kind.startswith("fp8"),
        HAS_W=weight is not None, W_FP32=weight_in_fp32, FP32_SUM=fp32_residual_sum, UE8M0=ue8m0,
        UE8M0_LATE=ue8m0_late, SCALING=SCALING_CODES[scaling],
        RECIP_SCALE=x.is_cuda if cuda_semantics is None else cuda_semantics,
        CLAMP=not (kind.startswith("fp8") and qmax == E4M3_MAX),
        GROUP=group, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=warps,
        enable_fp_fusion=False,  # eager rounds mean(x^2) before + eps and x*x before summing: no FMA contraction
    )
    if s2 is not s and s2.data_ptr() != s.data_ptr():
        s.copy_(s2.view(s.shape))
