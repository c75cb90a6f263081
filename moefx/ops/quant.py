"""Quant schemes and the reference (eager PyTorch) math behind every moefx quant op.

The reference is the contract the Triton kernels are tested against, so every rounding step is explicit:
it rounds exactly where eager user code rounds (see each function). It is also the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KINDS = ("fp8_group", "fp8_token", "int8_token", "int8_group")
# How the quantized value is formed from y and the scale (all fp32, each step rounded as eager rounds it):
#   divide          q = y / scale                    (vLLM group path, SGLang, DeepSeek, textbook code)
#   reciprocal      q = y * (1 / scale)              (vLLM per-token path, torchao, DeepGEMM's `x * (1 / sf)` cast)
#   qmax_over_amax  q = y * ((1 / amax_clamped) * qmax)  (DeepGEMM's `x * (448.0 / amax)` cast, as its traced
#                   graph computes it); the stored scale is still amax_clamped / qmax
SCALINGS = ("divide", "reciprocal", "qmax_over_amax")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
INT8_MAX = 127.0


@dataclass(frozen=True)
class QuantScheme:
    """The scalar arguments every `moefx::*quant*` op takes after its tensors, in this order."""

    kind: str = "fp8_group"
    group_size: int = 128
    eps: float = 1e-10
    min_scale: float = 0.0
    qmax: float = 0.0
    scale_ue8m0: bool = False
    column_major_scales: bool = False
    tma_aligned_scales: bool = False
    scaling: str = "divide"
    # UE8M0 rounding after the min-scale clamp (vLLM 0.33's QuantFP8) instead of before it
    ue8m0_after_min_scale: bool = False

    def args(self) -> tuple:
        return (
            self.kind,
            self.group_size,
            self.eps,
            self.min_scale,
            self.qmax,
            self.scale_ue8m0,
            self.column_major_scales,
            self.tma_aligned_scales,
            self.scaling,
            self.ue8m0_after_min_scale,
        )


def full_scheme(scheme: tuple) -> tuple:
    """The scheme tuple with the trailing optional arguments filled in (callers may pass the first 8 only;
    the dispatcher hands Python kernels exactly what the caller passed)."""
    return tuple(scheme) + _DEFAULT_ARGS[len(scheme):]


_DEFAULT_ARGS = QuantScheme().args()

PRESETS: dict[str, QuantScheme] = {
    "fp8_group128": QuantScheme("fp8_group", 128),
    "fp8_group64": QuantScheme("fp8_group", 64),
    "fp8_token": QuantScheme("fp8_token", 0),
    "int8_token": QuantScheme("int8_token", 0),
    "int8_group128": QuantScheme("int8_group", 128),
}


def check_scheme(
    kind: str,
    group_size: int,
    eps: float,
    min_scale: float,
    qmax: float,
    scale_ue8m0: bool,
    column_major_scales: bool,
    tma_aligned_scales: bool,
    scaling: str = "divide",
    ue8m0_after_min_scale: bool = False,
) -> float:
    """Validate the scheme arguments (ValueError naming the bad one); returns the effective qmax."""
    if kind not in KINDS:
        raise ValueError(f"quant kind={kind!r} is invalid; valid choices: {list(KINDS)}")
    if scaling not in SCALINGS:
        raise ValueError(f"quant scaling={scaling!r} is invalid; valid choices: {list(SCALINGS)}")
    grouped = kind.endswith("_group")
    if grouped and group_size <= 0:
        raise ValueError(f"group_size={group_size} is invalid for kind={kind!r}; it must be a positive integer")
    if not grouped and (column_major_scales or tma_aligned_scales):
        raise ValueError(f"column_major_scales/tma_aligned_scales apply only to *_group kinds, not kind={kind!r}")
    if eps < 0 or min_scale < 0:
        raise ValueError(f"eps={eps} and min_scale={min_scale} must be >= 0")
    if qmax < 0:
        raise ValueError(f"qmax={qmax} must be >= 0 (0 selects the kind's default)")
    if qmax == 0:
        qmax = FP8_MAX if kind.startswith("fp8") else INT8_MAX
    if kind.startswith("fp8") and qmax > FP8_MAX:
        raise ValueError(f"qmax={qmax} exceeds the float8_e4m3fn range {FP8_MAX}")
    if kind.startswith("int8") and qmax > INT8_MAX:
        raise ValueError(f"qmax={qmax} exceeds the int8 range {INT8_MAX}")
    return float(qmax)


def num_groups(kind: str, group_size: int, h: int) -> int:
    return -(-h // group_size) if kind.endswith("_group") else 1


def out_dtype(kind: str) -> torch.dtype:
    return FP8_DTYPE if kind.startswith("fp8") else torch.int8


def empty_scales(
    lead: tuple[int, ...], groups: int, device: torch.device, column_major: bool, tma_aligned: bool
) -> torch.Tensor:
    """fp32 scales [*lead, groups] in the requested memory layout.

    column-major: the last two dims are stored transposed (vLLM's `.transpose(-2,-1).contiguous().transpose(-1,-2)`);
    TMA-aligned (2-D only, DeepGEMM / SGLang layout): column-major with the row count padded to a multiple of 4,
    i.e. shape [M, G], stride (1, ceil(M/4)*4).
    """
    shape = (*lead, groups)
    if tma_aligned:
        if len(lead) != 1:
            raise ValueError(f"tma_aligned_scales needs a 2-D input, got leading shape {tuple(lead)}")
        m = lead[0]
        am = -(-m // 4) * 4
        return torch.empty_strided((m, groups), (1, am), dtype=torch.float32, device=device)
    if column_major:
        if len(lead) < 1:
            raise ValueError("column_major_scales needs an input with at least 2 dims")
        t = torch.empty((*lead[:-1], groups, lead[-1]), dtype=torch.float32, device=device)
        return t.transpose(-2, -1)
    return torch.empty(shape, dtype=torch.float32, device=device)


def ref_quant(
    x: torch.Tensor,
    kind: str,
    group_size: int,
    eps: float,
    min_scale: float,
    qmax: float,
    scale_ue8m0: bool,
    scaling: str = "divide",
    ue8m0_after_min_scale: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference dynamic quant of `x` [..., H] -> (q [..., H], contiguous fp32 scales [..., G]).

    Per group (or per token): amax = max|x| (exact, in fp32); amax = max(amax, eps);
    scale = amax / qmax (IEEE fp32 division); UE8M0: scale = exp2(ceil(log2(scale)));
    scale = max(scale, min_scale) (UE8M0 after this clamp when `ue8m0_after_min_scale`);
    y = x_fp32 / scale (IEEE division), or x_fp32 * (1 / scale) (`scaling="reciprocal"`), or
    x_fp32 * ((1 / amax) * qmax) (`scaling="qmax_over_amax"`), each operation rounded to fp32.
    FP8: q = clamp(y, -qmax, qmax).to(float8_e4m3fn) (round to nearest even).
    INT8: q = clamp(round(y), -qmax, qmax).to(int8), round = torch.round (half to even).
    A partial last group (H % group_size != 0) behaves as zero-padded, like vLLM's QuantFP8.
    """
    h = x.shape[-1]
    lead = x.shape[:-1]
    gs = group_size if kind.endswith("_group") else h
    g = -(-h // gs)
    xf = x.float()
    if g * gs != h:
        xf = F.pad(xf, (0, g * gs - h))
    xg = xf.reshape(*lead, g, gs)
    amax = xg.abs().amax(dim=-1, keepdim=True)
    if eps > 0:
        amax = amax.clamp(min=eps)
    scale = amax / qmax
    if scale_ue8m0 and not ue8m0_after_min_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    if min_scale > 0:
        scale = scale.clamp(min=min_scale)
    if scale_ue8m0 and ue8m0_after_min_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    if scaling == "divide":
        y = xg / scale
    elif scaling == "reciprocal":
        y = xg * scale.reciprocal()
    else:
        y = xg * (amax.reciprocal() * qmax)
    if kind.startswith("fp8"):
        q = y.clamp(-qmax, qmax).to(FP8_DTYPE)
    else:
        q = torch.round(y).clamp(-qmax, qmax).to(torch.int8)
    q = q.reshape(*lead, g * gs)[..., :h]
    return q, scale.reshape(*lead, g)


def ref_silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :N]) * x[..., N:] in x's dtype, as eager computes it: silu in fp32 rounded to x.dtype,
    then the product in fp32 rounded to x.dtype (vLLM SiluAndMul.forward_native, transformers' MLP)."""
    n = x.shape[-1] // 2
    return F.silu(x[..., :n]) * x[..., n:]


def ref_silu_mul_split(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with the same roundings as `ref_silu_mul`."""
    return F.silu(gate) * up


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_in_fp32: bool) -> torch.Tensor:
    """RMSNorm with the two weight conventions real code uses.

    weight_in_fp32=False (transformers LlamaRMSNorm/Qwen3RMSNorm, vLLM RMSNorm.forward_native):
      n = (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype); y = weight * n   (in the promoted dtype of weight, x)
    weight_in_fp32=True (torch.nn.functional.rms_norm / aten._fused_rms_norm):
      y = (x32 * rsqrt(mean(x32^2) + eps) * weight).to(x.dtype)         (one rounding)
    """
    x32 = x.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        y = x32 * r
        if weight is not None:
            y = y * weight
        return y.to(x.dtype)
    n = (x32 * r).to(x.dtype)
    return n if weight is None else weight * n


def ref_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    weight_in_fp32: bool,
    fp32_residual_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), new_residual) with new_residual = (x + residual) rounded to x.dtype.

    fp32_residual_sum=False (transformers decoder layers): the norm reads the rounded sum.
    fp32_residual_sum=True (vLLM RMSNorm.forward_native with residual): the norm reads the fp32 sum
    x32 + residual32 before rounding.
    """
    s32 = x.float() + residual.float()
    new_res = s32.to(x.dtype)
    src = s32 if fp32_residual_sum else new_res
    x32 = src.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        y = x32 * r
        if weight is not None:
            y = y * weight
        return y.to(x.dtype), new_res
    n = (x32 * r).to(x.dtype)
    return (n if weight is None else weight * n), new_res


# fp32 bytes of the slice of a weight quantized at a time: the float32 temporaries of quantizing a weight stay a
# few times this, whatever the weight's size (a 48-layer model's experts are quantized on the GPU they sit on).
WEIGHT_CHUNK_BYTES = 64 << 20


def _chunks(w: torch.Tensor, row_align: int, pad_k: int, chunk_bytes: int):
    """(w3 [L, N, K] view of w, slices (experts, rows)) covering w in pieces whose padded fp32 copy is about
    `chunk_bytes`: whole experts where one fits, else row ranges in multiples of `row_align`."""
    n, k = w.shape[-2:]
    w3 = w.reshape(1, n, k) if w.dim() == 2 else w if w.dim() == 3 else w.flatten(0, -3)
    rows_pad = -(-n // row_align) * row_align
    per_row = pad_k * 4
    per_expert = rows_pad * per_row
    if per_expert <= chunk_bytes:
        step = max(1, chunk_bytes // per_expert)
        return w3, [(slice(e, min(e + step, w3.shape[0])), slice(0, n)) for e in range(0, w3.shape[0], step)]
    rows = max(1, chunk_bytes // (per_row * row_align)) * row_align
    return w3, [(slice(e, e + 1), slice(r, min(r + rows, n))) for e in range(w3.shape[0]) for r in range(0, n, rows)]


def _out(w: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None, q_dtype: torch.dtype,
         scale_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        return (torch.empty(w.shape, dtype=q_dtype, device=w.device),
                torch.empty(scale_shape, dtype=torch.float32, device=w.device))
    q, scale = out
    for name, t, shape, dtype in (("q", q, tuple(w.shape), q_dtype), ("scale", scale, scale_shape, torch.float32)):
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != w.device:
            raise ValueError(f"out {name} is {tuple(t.shape)}/{t.dtype} on {t.device} (contiguous: "
                             f"{t.is_contiguous()}); expected a contiguous {shape}/{dtype} on {w.device}")
    return q, scale


def _fp8_block(w: torch.Tensor, block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block quantization of one slice [L, n, k] (n a multiple of block_n except at the weight's end)."""
    *lead, n, k = w.shape
    nb, kb = -(-n // block_n), -(-k // block_k)
    wp = F.pad(w.float(), (0, kb * block_k - k, 0, nb * block_n - n))
    blocks = wp.reshape(*lead, nb, block_n, kb, block_k)
    scale = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(*lead, nb * block_n, kb * block_k)[..., :n, :k], scale.reshape(*lead, nb, kb)


def quant_weight_fp8_block(
    w: torch.Tensor, block_n: int = 128, block_k: int = 128, out: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunk_bytes: int = WEIGHT_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [..., N, K] -> (float8_e4m3fn [..., N, K], `weight_scale_inv` fp32 [..., ceil(N/bn), ceil(K/bk)]),
    dequantized w = q * scale per block; works for dense [N, K] and expert [E, N, K] weights.

    Per (bn x bk) block: scale = max(amax|w|, 1e-12) / 448 (fp32), q = clamp(w / scale).to(e4m3fn); a partial
    block at the end of N or K behaves as zero-padded. Blocks are independent, so the weight is quantized a slice
    of whole experts or whole block rows at a time (`chunk_bytes` of fp32 each) into `out` (preallocated
    contiguous q and scale, e.g. the quantized module's parameters) or new tensors: the result is the same for
    every chunk size, and the temporaries stay bounded."""
    *lead, n, k = w.shape
    nb, kb = -(-n // block_n), -(-k // block_k)
    q, scale = _out(w, out, FP8_DTYPE, (*lead, nb, kb))
    w3, chunks = _chunks(w, block_n, kb * block_k, chunk_bytes)
    q3, s3 = q.view(w3.shape), scale.view(w3.shape[0], nb, kb)
    for experts, rows in chunks:
        qc, sc = _fp8_block(w3[experts, rows], block_n, block_k)
        q3[experts, rows] = qc
        s3[experts, rows.start // block_n:-(-rows.stop // block_n)] = sc
    return q, scale


def quant_weight_int8_channel(
    w: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None, chunk_bytes: int = WEIGHT_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [..., N, K] -> (int8 [..., N, K], fp32 per-output-channel scale [..., N]); w ~= q * scale.

    Per row: scale = max(amax|w|, 1e-12) / 127 (fp32), q = clamp(round(w / scale)).to(int8), round half to even;
    rows are independent, so it runs a slice at a time into `out` as `quant_weight_fp8_block` does."""
    *lead, n, k = w.shape
    q, scale = _out(w, out, torch.int8, (*lead, n))
    w3, chunks = _chunks(w, 1, k, chunk_bytes)
    q3, s3 = q.view(w3.shape), scale.view(w3.shape[:2])
    for experts, rows in chunks:
        wf = w3[experts, rows].float()
        sc = wf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / INT8_MAX
        q3[experts, rows] = torch.round(wf / sc).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        s3[experts, rows] = sc.squeeze(-1)
    return q, scale
