"""`moefx::qk_norm_rope_cache`: a decode step's per-head q/k RMSNorm, rotary embedding and KV-cache write in one op.

    q_out [B, Hq, S, D] = rope(rms_norm(q, q_weight)),  keys[:, :, positions] = rope(rms_norm(k, k_weight)),
    values[:, :, positions] = v,   q [B, S, Hq, D], k/v [B, S, Hkv, D], cos/sin [B | 1, S, D], positions: S integers

This is what a Qwen3-style attention computes between its q/k/v projections and the attention itself
(transformers' `q_norm`/`k_norm`, `apply_rotary_pos_emb` with `rotate_half`, then `StaticLayer.update`'s
`index_copy_`); the `fuse_qk_norm_rope` pass puts it in place of those ops. Compiled unfused, inductor makes three
kernels of it per layer (q norm + RoPE; k norm + RoPE + key write; value write: 48 layers, B=1 on the H200,
docs/FINDINGS.md); CUDA runs one Triton kernel (`moefx/kernels/norm_rope_cache.py`), other devices and shapes the
reference below.

Rounding is the eager code's: the norm in fp32 (`x * rsqrt(mean(x^2) + eps)`), rounded to the input dtype, times
the weight in that dtype; each RoPE product rounded, then their sum (`q * cos + rotate_half(q) * sin`). The kernel
differs from the reference only in the order of the variance's sum (and, in fp32, where the compiler contracts a
product and a sum into one FMA).
"""

from __future__ import annotations

import torch

from moefx.kernels.availability import triton_available
from moefx.kernels.memo import ShapeMemo, tensor_meta
from moefx.ops.quant import ref_rms_norm

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (32, 64, 128, 256)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor, positions: torch.Tensor) -> str | None:
    """Why the kernel cannot take these inputs (None: it can)."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        return f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (need [B, S, H, D] each)"
    b, s, _, d = q.shape
    if d not in HEAD_DIMS:
        return f"head_dim {d} (the kernel takes {list(HEAD_DIMS)})"
    if q.dtype not in DTYPES or any(t.dtype != q.dtype for t in (k, v, cos, sin, keys, values)):
        return "q, k, v, cos, sin and the caches do not share one of " + str([str(t) for t in DTYPES])
    if (q_weight is None) != (k_weight is None) or any(
            w is not None and (tuple(w.shape) != (d,) or w.dtype != q.dtype) for w in (q_weight, k_weight)):
        return "the norm weights are not both [D] tensors of q's dtype (or both absent)"
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, b) or tuple(cos.shape[1:]) != (s, d):
        return f"cos/sin of shape {tuple(cos.shape)} (need [B or 1, S, D] = [{b}, {s}, {d}])"
    if keys.shape != values.shape or keys.dim() != 4 or keys.shape[0] != b or keys.shape[1] != k.shape[2] or \
            keys.shape[3] != d:
        return f"caches of shape {tuple(keys.shape)} for k {tuple(k.shape)}"
    if positions.numel() != s or positions.dtype not in (torch.int64, torch.int32):
        return f"positions {tuple(positions.shape)}/{positions.dtype} (need S integers)"
    tensors = (q, k, v, cos, sin, keys, values) + tuple(w for w in (q_weight, k_weight) if w is not None)
    if any(t.stride(-1) != 1 for t in tensors):
        return "a last dim that is not contiguous"
    if not positions.is_contiguous():
        return "positions that are not contiguous"
    return None


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def qk_norm_rope_cache_reference(q, k, v, q_weight, k_weight, eps: float, cos, sin, keys, values,
                                 positions) -> torch.Tensor:
    """The eager computation the op replaces (and the oracle of the kernel's tests): writes the caches in place."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q_out = _rope(ref_rms_norm(q, q_weight, eps, False).transpose(1, 2), c, s)
    k_out = _rope(ref_rms_norm(k, k_weight, eps, False).transpose(1, 2), c, s)
    keys.index_copy_(2, positions.reshape(-1), k_out)
    values.index_copy_(2, positions.reshape(-1), v.transpose(1, 2))
    return q_out.contiguous()


_CHECKED = ShapeMemo()


def _use_kernel(*args: torch.Tensor | None) -> bool:
    """Whether the Triton kernel takes this call: decided from metadata only, once per key (kernels/memo.py)."""
    key = tuple(None if t is None else tensor_meta(t) for t in args)
    found = _CHECKED.get(key)
    if found is None:
        found = _CHECKED.put(key, args[0].is_cuda and triton_available() and unsupported_reason(*args) is None)
    return found


@torch.library.custom_op("moefx::qk_norm_rope_cache", mutates_args=("keys", "values"))
def qk_norm_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    if _use_kernel(q, k, v, q_weight, k_weight, cos, sin, keys, values, positions):
        from moefx.kernels.norm_rope_cache import qk_norm_rope_cache_triton

        out = torch.empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype, device=q.device)
        qk_norm_rope_cache_triton(q, k, v, q_weight, k_weight, eps, cos, sin, keys, values, positions, out)
        return out
    return qk_norm_rope_cache_reference(q, k, v, q_weight, k_weight, eps, cos, sin, keys, values, positions)


@qk_norm_rope_cache.register_fake
def _(q, k, v, q_weight, k_weight, eps, cos, sin, keys, values, positions) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
