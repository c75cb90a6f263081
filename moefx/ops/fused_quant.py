"""moefx quant custom ops: dynamic activation quant, alone or fused into the SiLU-mul / RMSNorm producing it.

Op signatures (all `torch.ops.moefx.*`, functional, fake impls registered; CPU runs the reference in
`moefx/ops/quant.py`, CUDA runs the Triton kernels in `moefx/kernels/act_quant.py`):

Scheme arguments, shared by every quant op, always last and in this order (`QuantScheme.args()` builds them):
  kind: str            "fp8_group" | "fp8_token" | "int8_token" | "int8_group"
  group_size: int      group width for *_group kinds (128, 64, any positive; Triton needs a power of two);
                       ignored by *_token kinds (pass 0)
  eps: float           amax lower bound BEFORE dividing: scale = max(amax, eps) / qmax  (SGLang / DeepSeek); 0 = off
  min_scale: float     scale lower bound AFTER dividing (and after UE8M0): scale = max(scale, min_scale)
                       (vLLM QuantFP8: 1/(448*512)); 0 = off
  qmax: float          448.0 for FP8 e4m3, 127.0 for INT8; 0.0 selects that default
  scale_ue8m0: bool    scale = exp2(ceil(log2(scale))) (power-of-two scales, still stored as fp32)
  column_major_scales: bool   scales [..., G] stored with the last two dims transposed (vLLM layout)
  tma_aligned_scales: bool    2-D only: scales [M, G] with stride (1, ceil(M/4)*4) (DeepGEMM/SGLang layout)
  scaling: str         how y meets the scale (default "divide"): "divide" q = y / scale; "reciprocal"
                       q = y * (1 / scale) (vLLM per-token, torchao, DeepGEMM); "qmax_over_amax"
                       q = y * ((1 / amax) * qmax) (DeepGEMM's early cast), the stored scale still amax / qmax
  ue8m0_after_min_scale: bool   UE8M0 rounding after the min-scale clamp (vLLM 0.33) instead of before it

Quant math (exactly what eager user code computes): amax = max|y| per group/token in fp32;
scale = max(amax, eps) / qmax [-> ue8m0] [-> max(., min_scale)] (or the clamp before the UE8M0), the division
done as eager PyTorch does
`tensor / python_float` on that device: IEEE division on CPU, amax * fl32(1/qmax) on CUDA (scales differ by
one ulp between the two in about half the groups; the op follows the device it runs on). So user code
`amax / 448.0` matches on both devices; `amax * (1/448)` matches on CUDA only and `amax / tensor(448.)` on CPU
only -- elsewhere ~0.1% of FP8 codes differ by one (exact fp8 ties are common, a one-ulp scale breaks them);
FP8: q = clamp(y_fp32 / scale, -qmax, qmax).to(float8_e4m3fn)  (IEEE division, round to nearest even);
INT8: q = clamp(torch.round(y_fp32 / scale), -qmax, qmax).to(int8)  (half to even); `/ scale` is replaced by the
product the `scaling` argument names, each step rounded to fp32 as eager rounds it. A clamp of (-128, 127) on
INT8 is equivalent because |y/scale| <= qmax whenever scale comes from amax.
Outputs: q [..., H'] (float8_e4m3fn or int8, contiguous) and scales fp32 [..., G] (per token: [..., 1]).

Ops:
  moefx::quant(x, *scheme) -> (q, scale)                                          y = x
  moefx::silu_mul_quant(x, *scheme) -> (q, scale)        x [..., 2N], gate first: y = silu(x[..., :N]) * x[..., N:]
  moefx::silu_mul_quant_split(gate, up, *scheme) -> (q, scale)                    y = silu(gate) * up
      SiLU-mul rounding (eager bf16/fp16): silu computed in fp32 and rounded to the input dtype, the product
      computed in fp32 and rounded to the input dtype, then quantized. fp32 inputs: no rounding.
  moefx::rms_norm_quant(x, weight?, norm_eps, weight_in_fp32, *scheme) -> (q, scale)
      weight_in_fp32=False (transformers RMSNorm, vLLM forward_native):
          y = weight * (x32 * rsqrt(mean(x32^2) + norm_eps)).to(x.dtype)   (mul in promote(weight, x) dtype)
      weight_in_fp32=True (F.rms_norm / aten._fused_rms_norm):
          y = (x32 * rsqrt(mean(x32^2) + norm_eps) * weight32).to(x.dtype)
  moefx::add_rms_norm_quant(x, residual, weight?, norm_eps, weight_in_fp32, fp32_residual_sum, *scheme)
      -> (q, scale, new_residual)     new_residual = (x32 + residual32).to(x.dtype); the norm reads the rounded
      sum (fp32_residual_sum=False, transformers) or the fp32 sum (True, vLLM forward_native with residual).

moefx's own unfused forms (what `moefx.quantize` and model code may emit; the passes fuse them):
  moefx::silu_mul(x) -> y;  moefx::rms_norm(x, weight?, norm_eps, weight_in_fp32) -> y;
  moefx::add_rms_norm(x, residual, weight?, norm_eps, weight_in_fp32, fp32_residual_sum) -> (y, new_residual);
  each followed by moefx::quant(y, *scheme) is exactly the fused op.

Quantized GEMMs live in moefx/ops/block_gemm.py (moefx::fp8_block_gemm, moefx::int8_gemm); weight quantizers
`quant_weight_fp8_block` / `quant_weight_int8_channel` (dense [N, K] and expert [E, N, K]) in moefx/ops/quant.py.
Python helpers: `moefx.ops.QuantScheme(...).args()` and `moefx.ops.PRESETS`.
"""

from __future__ import annotations

import torch

from moefx.kernels.availability import triton_missing
from moefx.log import warn_once
from moefx.ops import quant as R

_SCHEME = "str kind, int group_size, float eps, float min_scale, float qmax, bool scale_ue8m0, " \
    "bool column_major_scales, bool tma_aligned_scales, str scaling=\"divide\", bool ue8m0_after_min_scale=False"


_LIB = torch.library.Library("moefx", "FRAGMENT")  # other moefx files define more ops in the same namespace


def _define(name: str, args: str, rets: str) -> None:
    _LIB.define(f"{name}({args}) -> {rets}")


_define("quant", f"Tensor x, {_SCHEME}", "(Tensor, Tensor)")
_define("silu_mul_quant", f"Tensor x, {_SCHEME}", "(Tensor, Tensor)")
_define("silu_mul_quant_split", f"Tensor gate, Tensor up, {_SCHEME}", "(Tensor, Tensor)")
_define("rms_norm_quant", f"Tensor x, Tensor? weight, float norm_eps, bool weight_in_fp32, {_SCHEME}",
        "(Tensor, Tensor)")
_define("add_rms_norm_quant",
        f"Tensor x, Tensor residual, Tensor? weight, float norm_eps, bool weight_in_fp32, bool fp32_residual_sum, "
        f"{_SCHEME}", "(Tensor, Tensor, Tensor)")
_define("silu_mul", "Tensor x", "Tensor")
_define("rms_norm", "Tensor x, Tensor? weight, float norm_eps, bool weight_in_fp32", "Tensor")
_define("add_rms_norm",
        "Tensor x, Tensor residual, Tensor? weight, float norm_eps, bool weight_in_fp32, bool fp32_residual_sum",
        "(Tensor, Tensor)")


def _outputs(x_lead: tuple[int, ...], h: int, device: torch.device, scheme: tuple) -> tuple[torch.Tensor, ...]:
    """Allocate (q, scales) with the layouts the scheme asks for; validates the scheme."""
    kind, group_size, _, _, _, _, col, tma, _, _ = R.full_scheme(scheme)
    R.check_scheme(*scheme)
    q = torch.empty((*x_lead, h), dtype=R.out_dtype(kind), device=device)
    s = R.empty_scales(tuple(x_lead), R.num_groups(kind, group_size, h), device, col, tma)
    return q, s


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} dtype {t.dtype} is unsupported; valid: float32, bfloat16, float16")


def _check_silu(x: torch.Tensor) -> None:
    _check_float("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"silu_mul input last dim {x.shape[-1]} must be even ([..., 2N], gate then up)")


def _check_split(gate: torch.Tensor, up: torch.Tensor) -> None:
    _check_float("gate", gate)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)}/{gate.dtype} and up {tuple(up.shape)}/{up.dtype} must match")


def _check_norm(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None = None) -> None:
    _check_float("x", x)
    if weight is not None and weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm weight shape {tuple(weight.shape)} must be ({x.shape[-1]},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)}/{residual.dtype} must match x {tuple(x.shape)}/{x.dtype}")


def _norm_out_dtype(x: torch.Tensor, weight: torch.Tensor | None, weight_in_fp32: bool) -> torch.dtype:
    if weight is None or weight_in_fp32:
        return x.dtype
    return torch.promote_types(weight.dtype, x.dtype)


def _ref_quant_into(y: torch.Tensor, q: torch.Tensor, s: torch.Tensor, scheme: tuple) -> None:
    kind, gs, eps, min_scale, _, ue8m0, _, _, scaling, late = R.full_scheme(scheme)
    qv, sv = R.ref_quant(y, kind, gs, eps, min_scale, R.check_scheme(*scheme), ue8m0, scaling, late)
    q.copy_(qv)
    s.copy_(sv)


def _resolved(scheme: tuple) -> tuple[tuple, float]:
    """(the whole scheme tuple, its effective qmax): what the Triton launcher takes."""
    full = R.full_scheme(scheme)
    return full, R.check_scheme(*full)


def _triton_ok(t: torch.Tensor, scheme: tuple) -> bool:
    """CUDA tensors run the Triton kernels; anything they do not cover runs the reference, with a warning."""
    if t.device.type != "cuda" or triton_missing():
        return False
    kind, gs = scheme[0], scheme[1]
    if kind.endswith("_group") and (gs & (gs - 1)) != 0:
        warn_once(f"moefx quant: group_size={gs} is not a power of two; CUDA runs the PyTorch reference")
        return False
    return True


# --- implementations (CompositeExplicitAutograd: CPU and CUDA; CUDA dispatches to Triton) --------------------

def _quant_impl(x: torch.Tensor, *scheme) -> tuple[torch.Tensor, torch.Tensor]:
    _check_float("x", x)
    q, s = _outputs(x.shape[:-1], x.shape[-1], x.device, scheme)
    if _triton_ok(x, scheme):
        from moefx.kernels import act_quant as T

        T.launch(T.MODE_PLAIN, q, s, *_resolved(scheme), x)
    else:
        _ref_quant_into(x, q, s, scheme)
    return q, s


def _silu_mul_quant_impl(x: torch.Tensor, *scheme) -> tuple[torch.Tensor, torch.Tensor]:
    _check_silu(x)
    n = x.shape[-1] // 2
    q, s = _outputs(x.shape[:-1], n, x.device, scheme)
    if _triton_ok(x, scheme):
        from moefx.kernels import act_quant as T

        T.launch(T.MODE_SILU, q, s, *_resolved(scheme), x[..., :n], x[..., n:])
    else:
        _ref_quant_into(R.ref_silu_mul(x), q, s, scheme)
    return q, s


def _silu_mul_quant_split_impl(gate: torch.Tensor, up: torch.Tensor, *scheme) -> tuple[torch.Tensor, torch.Tensor]:
    _check_split(gate, up)
    q, s = _outputs(gate.shape[:-1], gate.shape[-1], gate.device, scheme)
    if _triton_ok(gate, scheme):
        from moefx.kernels import act_quant as T

        T.launch(T.MODE_SILU, q, s, *_resolved(scheme), gate, up)
    else:
        _ref_quant_into(R.ref_silu_mul_split(gate, up), q, s, scheme)
    return q, s


def _rms_norm_quant_impl(
    x: torch.Tensor, weight: torch.Tensor | None, norm_eps: float, weight_in_fp32: bool, *scheme
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_norm(x, weight)
    q, s = _outputs(x.shape[:-1], x.shape[-1], x.device, scheme)
    if _triton_ok(x, scheme):
        from moefx.kernels import act_quant as T

        T.launch(T.MODE_NORM, q, s, *_resolved(scheme), x, weight=weight, norm_eps=norm_eps,
                 weight_in_fp32=weight_in_fp32, y_dtype=_norm_out_dtype(x, weight, weight_in_fp32))
    else:
        _ref_quant_into(R.ref_rms_norm(x, weight, norm_eps, weight_in_fp32), q, s, scheme)
    return q, s


def _add_rms_norm_quant_impl(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    norm_eps: float,
    weight_in_fp32: bool,
    fp32_residual_sum: bool,
    *scheme,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_norm(x, weight, residual)
    q, s = _outputs(x.shape[:-1], x.shape[-1], x.device, scheme)
    new_res = torch.empty_like(x, memory_format=torch.contiguous_format)
    if _triton_ok(x, scheme):
        from moefx.kernels import act_quant as T

        T.launch(T.MODE_ADD_NORM, q, s, *_resolved(scheme), x, residual, weight=weight, norm_eps=norm_eps,
                 weight_in_fp32=weight_in_fp32, y_dtype=_norm_out_dtype(x, weight, weight_in_fp32),
                 fp32_residual_sum=fp32_residual_sum, new_residual=new_res)
    else:
        y, r = R.ref_add_rms_norm(x, residual, weight, norm_eps, weight_in_fp32, fp32_residual_sum)
        _ref_quant_into(y, q, s, scheme)
        new_res.copy_(r)
    return q, s, new_res


def _silu_mul_impl(x: torch.Tensor) -> torch.Tensor:
    _check_silu(x)
    return R.ref_silu_mul(x).contiguous()


def _rms_norm_impl(x: torch.Tensor, weight: torch.Tensor | None, norm_eps: float, weight_in_fp32: bool) -> torch.Tensor:
    _check_norm(x, weight)
    return R.ref_rms_norm(x, weight, norm_eps, weight_in_fp32).contiguous()


def _add_rms_norm_impl(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    norm_eps: float,
    weight_in_fp32: bool,
    fp32_residual_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_norm(x, weight, residual)
    y, r = R.ref_add_rms_norm(x, residual, weight, norm_eps, weight_in_fp32, fp32_residual_sum)
    return y.contiguous(), r.contiguous()


# --- fake (meta) implementations: same shapes, dtypes and strides as the real ones ---------------------------

def _quant_fake(x: torch.Tensor, *scheme) -> tuple[torch.Tensor, torch.Tensor]:
    _check_float("x", x)
    return _outputs(x.shape[:-1], x.shape[-1], x.device, scheme)


def _silu_mul_quant_fake(x: torch.Tensor, *scheme) -> tuple[torch.Tensor, torch.Tensor]:
    _check_silu(x)
    return _outputs(x.shape[:-1], x.shape[-1] // 2, x.device, scheme)


def _silu_mul_quant_split_fake(gate: torch.Tensor, up: torch.Tensor, *scheme) -> tuple[torch.Tensor, torch.Tensor]:
    _check_split(gate, up)
    return _outputs(gate.shape[:-1], gate.shape[-1], gate.device, scheme)


def _rms_norm_quant_fake(x, weight, norm_eps, weight_in_fp32, *scheme):
    _check_norm(x, weight)
    return _outputs(x.shape[:-1], x.shape[-1], x.device, scheme)


def _add_rms_norm_quant_fake(x, residual, weight, norm_eps, weight_in_fp32, fp32_residual_sum, *scheme):
    _check_norm(x, weight, residual)
    q, s = _outputs(x.shape[:-1], x.shape[-1], x.device, scheme)
    return q, s, torch.empty_like(x, memory_format=torch.contiguous_format)


def _silu_mul_fake(x):
    _check_silu(x)
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _rms_norm_fake(x, weight, norm_eps, weight_in_fp32):
    _check_norm(x, weight)
    return x.new_empty(x.shape, dtype=_norm_out_dtype(x, weight, weight_in_fp32))


def _add_rms_norm_fake(x, residual, weight, norm_eps, weight_in_fp32, fp32_residual_sum):
    _check_norm(x, weight, residual)
    return x.new_empty(x.shape, dtype=_norm_out_dtype(x, weight, weight_in_fp32)), x.new_empty(x.shape)


for _name, _impl, _fake in (
    ("quant", _quant_impl, _quant_fake),
    ("silu_mul_quant", _silu_mul_quant_impl, _silu_mul_quant_fake),
    ("silu_mul_quant_split", _silu_mul_quant_split_impl, _silu_mul_quant_split_fake),
    ("rms_norm_quant", _rms_norm_quant_impl, _rms_norm_quant_fake),
    ("add_rms_norm_quant", _add_rms_norm_quant_impl, _add_rms_norm_quant_fake),
    ("silu_mul", _silu_mul_impl, _silu_mul_fake),
    ("rms_norm", _rms_norm_impl, _rms_norm_fake),
    ("add_rms_norm", _add_rms_norm_impl, _add_rms_norm_fake),
):
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"moefx::{_name}", _fake, lib=_LIB)

OPS = ("quant", "silu_mul_quant", "silu_mul_quant_split", "rms_norm_quant", "add_rms_norm_quant",
       "silu_mul", "rms_norm", "add_rms_norm")
