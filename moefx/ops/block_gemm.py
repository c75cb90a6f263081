"""Quantized GEMMs for `moefx.quantize`: FP8 block-scaled (w8a8, DeepSeek-V3 / Qwen3-FP8 layout) and
per-channel INT8 (w8a8, per-token activations).

Ops (`torch.ops.moefx.*`, fake impls registered):
  fp8_block_gemm(a, a_scale, w, w_scale, block_n, block_k, bias?, out_dtype) -> out [..., N]
      a: float8_e4m3fn [..., K]; a_scale: fp32 [..., ceil(K/block_k)] (any strides: the column-major and
      TMA-aligned layouts of moefx::quant are accepted); w: float8_e4m3fn [N, K];
      w_scale: fp32 [ceil(N/block_n), ceil(K/block_k)] (`weight_scale_inv`: dequantized w = w * scale).
      out = sum_k (a * a_scale) (w * w_scale)^T, fp32 accumulation, + bias, rounded once to out_dtype.
  int8_gemm(a, a_scale, w, w_scale, bias?, out_dtype) -> out [..., N]
      a: int8 [..., K]; a_scale: fp32 [..., 1]; w: int8 [N, K]; w_scale: fp32 [N] (per output channel).
      out = ((a @ w^T in exact int32) * a_scale * w_scale) + bias, rounded once to out_dtype.
CPU runs the reference (fp32 dequant + matmul; `torch._int_mm` for INT8); CUDA runs, for FP8, the Triton
kernel (moefx/kernels/fp8_gemm.py) at M <= 16 and torch._scaled_mm's blockwise scaling above, where this torch
has it (measured faster there; see SCALED_MM_MIN_M), and for INT8 `torch._int_mm` + an fp32 epilogue.
"""

from __future__ import annotations

import torch

from moefx.kernels.availability import triton_missing
from moefx.ops.fused_quant import _LIB

_LIB.define("fp8_block_gemm(Tensor a, Tensor a_scale, Tensor w, Tensor w_scale, int block_n, int block_k, "
            "Tensor? bias, ScalarType out_dtype) -> Tensor")
_LIB.define("int8_gemm(Tensor a, Tensor a_scale, Tensor w, Tensor w_scale, Tensor? bias, ScalarType out_dtype) "
            "-> Tensor")

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_fp8(a, a_scale, w, w_scale, block_n, block_k, out_dtype) -> None:
    if a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_block_gemm needs float8_e4m3fn a and w, got {a.dtype} and {w.dtype}")
    if w.dim() != 2 or a.shape[-1] != w.shape[1]:
        raise ValueError(f"fp8_block_gemm shapes: a {tuple(a.shape)} and w {tuple(w.shape)} must be [..., K], [N, K]")
    if block_n <= 0 or block_k <= 0:
        raise ValueError(f"block_n={block_n}, block_k={block_k} must be positive")
    n, k = w.shape
    kb = -(-k // block_k)
    if a_scale.shape != (*a.shape[:-1], kb):
        raise ValueError(f"a_scale shape {tuple(a_scale.shape)} must be {(*a.shape[:-1], kb)}")
    if w_scale.shape != (-(-n // block_n), kb):
        raise ValueError(f"w_scale shape {tuple(w_scale.shape)} must be {(-(-n // block_n), kb)}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is invalid; valid: {list(_OUT_DTYPES)}")


def _check_int8(a, a_scale, w, w_scale, out_dtype) -> None:
    if a.dtype != torch.int8 or w.dtype != torch.int8:
        raise ValueError(f"int8_gemm needs int8 a and w, got {a.dtype} and {w.dtype}")
    if w.dim() != 2 or a.shape[-1] != w.shape[1]:
        raise ValueError(f"int8_gemm shapes: a {tuple(a.shape)} and w {tuple(w.shape)} must be [..., K], [N, K]")
    if a_scale.shape != (*a.shape[:-1], 1) or w_scale.numel() != w.shape[0]:
        raise ValueError(f"int8_gemm scales: a_scale {tuple(a_scale.shape)} must be {(*a.shape[:-1], 1)}, "
                         f"w_scale {tuple(w_scale.shape)} must hold {w.shape[0]} values")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is invalid; valid: {list(_OUT_DTYPES)}")


def ref_fp8_block_gemm(a, a_scale, w, w_scale, block_n, block_k, bias, out_dtype) -> torch.Tensor:
    """fp32 dequantize both operands, fp32 matmul (the correctness oracle)."""
    n, k = w.shape
    a32 = a.float() * a_scale.float().repeat_interleave(block_k, dim=-1)[..., :k]
    s = w_scale.float().repeat_interleave(block_n, dim=0)[:n].repeat_interleave(block_k, dim=1)[:, :k]
    out = a32 @ (w.float() * s).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _int_mm(a2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact int32 a2 @ w^T; pads rows to the 17-row minimum `torch._int_mm` needs on CUDA."""
    m = a2.shape[0]
    if a2.is_cuda and m <= 16:
        a2 = torch.nn.functional.pad(a2, (0, 0, 0, 17 - m))
    return torch._int_mm(a2, w.t())[:m]


def _int8_gemm_impl(a, a_scale, w, w_scale, bias, out_dtype) -> torch.Tensor:
    _check_int8(a, a_scale, w, w_scale, out_dtype)
    a2 = a.reshape(-1, a.shape[-1]).contiguous()
    if a2.is_cuda and (a2.shape[1] % 8 or w.shape[0] % 8):
        acc = a2.double() @ w.double().t()  # _int_mm needs K, N multiples of 8; fp64 sums of int8 products are exact
    else:
        acc = _int_mm(a2, w.contiguous())
    out = acc.float() * a_scale.reshape(-1, 1).float() * w_scale.reshape(1, -1).float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype).reshape(*a.shape[:-1], w.shape[0])


# From this M on torch._scaled_mm runs the block-scaled GEMM: it is faster at M = 512 and up (1.8x at 512), the
# Triton kernel at M = 16; M between 16 and 512 is not measured (docs/FINDINGS.md, "Fusions and sampling").
SCALED_MM_MIN_M = 17
_scaled_mm_state: dict[str, str | bool] = {}


def _scaled_mm_reason(a2: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, out_dtype) -> str | None:
    """None when torch._scaled_mm's blockwise (1x128 activation, 128x128 weight) scaling can run this call."""
    if _scaled_mm_state.get("broken"):
        return str(_scaled_mm_state["broken"])
    if (block_n, block_k) != (128, 128) or a2.shape[1] % 128 or w.shape[0] % 128:
        return "blockwise _scaled_mm needs 128x128 blocks and N, K multiples of 128"
    if out_dtype != torch.bfloat16 or torch.cuda.get_device_capability(a2.device) != (9, 0):
        return "blockwise _scaled_mm is used for bf16 output on sm_90 only (the measured configuration)"
    return None


def _scaled_mm(a2, a_s2, w, w_scale, bias) -> torch.Tensor:
    if a_s2.stride() != (1, a_s2.shape[0]):
        a_s2 = a_s2.t().contiguous().t()  # cuBLASLt wants M-major activation scales
    out = torch._scaled_mm(a2, w.t(), scale_a=a_s2, scale_b=w_scale.contiguous().t(), out_dtype=torch.bfloat16)
    return out if bias is None else (out.float() + bias.float()).to(torch.bfloat16)


def _fp8_block_gemm_impl(a, a_scale, w, w_scale, block_n, block_k, bias, out_dtype) -> torch.Tensor:
    _check_fp8(a, a_scale, w, w_scale, block_n, block_k, out_dtype)
    if not a.is_cuda or triton_missing():
        return ref_fp8_block_gemm(a, a_scale, w, w_scale, block_n, block_k, bias, out_dtype)
    from moefx.kernels import fp8_gemm
    from moefx.log import warn_once

    a2 = a.reshape(-1, a.shape[-1]).contiguous()
    a_s2 = a_scale.reshape(-1, a_scale.shape[-1])
    if a2.shape[0] >= SCALED_MM_MIN_M and _scaled_mm_reason(a2, w, block_n, block_k, out_dtype) is None:
        try:
            return _scaled_mm(a2, a_s2, w, w_scale, bias).reshape(*a.shape[:-1], w.shape[0])
        except (RuntimeError, TypeError) as e:  # this torch/cuBLAS lacks blockwise scaling: Triton from now on
            _scaled_mm_state["broken"] = f"torch._scaled_mm blockwise failed: {e}"[:200]
            warn_once(f"moefx fp8_block_gemm: {_scaled_mm_state['broken']}; using the Triton kernel")
    if fp8_gemm.supported(block_n, block_k):
        return fp8_gemm.fp8_block_gemm(a, a_scale, w, w_scale, block_n, block_k, bias, out_dtype)
    warn_once(f"moefx fp8_block_gemm: block ({block_n}, {block_k}) has no Triton kernel; CUDA runs the reference")
    return ref_fp8_block_gemm(a, a_scale, w, w_scale, block_n, block_k, bias, out_dtype)


def _fp8_block_gemm_fake(a, a_scale, w, w_scale, block_n, block_k, bias, out_dtype):
    _check_fp8(a, a_scale, w, w_scale, block_n, block_k, out_dtype)
    return a.new_empty((*a.shape[:-1], w.shape[0]), dtype=out_dtype)


def _int8_gemm_fake(a, a_scale, w, w_scale, bias, out_dtype):
    _check_int8(a, a_scale, w, w_scale, out_dtype)
    return a.new_empty((*a.shape[:-1], w.shape[0]), dtype=out_dtype)


_LIB.impl("fp8_block_gemm", _fp8_block_gemm_impl, "CompositeExplicitAutograd")
_LIB.impl("int8_gemm", _int8_gemm_impl, "CompositeExplicitAutograd")
torch.library.register_fake("moefx::fp8_block_gemm", _fp8_block_gemm_fake, lib=_LIB)
torch.library.register_fake("moefx::int8_gemm", _int8_gemm_fake, lib=_LIB)
