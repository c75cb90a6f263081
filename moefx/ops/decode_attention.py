"""`moefx::decode_attention`: attention of one query position per sequence over a KV cache, GQA without repeat_kv.

    out [B, Hq, 1, D] = softmax(q k^T * scale (+ mask)) v,  q [B, Hq, 1, D],  k, v [B, Hkv, L, D],  Hq % Hkv == 0,
    mask None | [B, L] bool (True: attend) | [B, L] float (added to the scores)

What it replaces in a decode step (H200, Qwen3-30B-A3B widths, B=1, a 256-position static cache, compiled): the
cuDNN SDPA kernel (7.9 us per layer) plus the kernels that expand K/V to every query head and lay the inputs out
for it (about 6 us per layer). CUDA runs the Triton kernel of `moefx/kernels/decode_attn.py`, one launch per call
(fp32 accumulation; bf16/fp16 probabilities for the value product, as flash attention does); the CPU, and shapes
the kernel does not take, run the reference: torch's SDPA over the expanded heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moefx.kernels.availability import triton_available
from moefx.kernels.memo import ShapeMemo, tensor_meta

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128, 256)
# Key positions per program before they are split over several programs: one 64-position block, so no program
# waits on a chain of blocks: at B=1 decode (32 q / 4 KV heads, head 128) 64 positions beat 128 and 256, and 32
# gains nothing (docs/FINDINGS.md: 5.1 us per layer over a 256-position cache, against 7.5 at 128 and 8.7 at 256,
# measured with a separate combine kernel). The combine runs in the last program of each (sequence, KV head)
# (kernels/decode_attn.py), so fewer, longer slices would only save it loads: one [G, D] fp32 partial per slice,
# all issued together (at 150-300 positions 3-5 of them, 4 KB each at G=8, from L2), where a longer slice adds a
# block to the serial chain of every program. On the H100 with this kernel (B=1, 160 of 256 positions written):
# 64-position slices 5.10 us, 128 7.34, one program per KV head 8.34.
SPLIT_POSITIONS = 64
TARGET_PROGRAMS = 264  # two per SM on an H200: splitting further only adds combine work
# At most this many slices (the last program of each (sequence, KV head) reads every slice's partials, 8 a step).
# H100, B=1 (`bench/attention.py`, docs/FINDINGS.md), a 4096-long cache: 64 slices 25.18 us, 32 17.35, 16 20.54,
# 8 27.18; at 1024 (16 slices taken) 32 10.22, 16 10.24, 8 9.86; at 256 and 512 the op takes fewer either way.
MAX_SPLITS = 32


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> str | None:
    """Why the kernel cannot take these inputs (None: it can)."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[2] != 1:
        return f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (need one query position)"
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        return f"q {tuple(q.shape)} does not group over k {tuple(k.shape)}"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}"
    if q.shape[3] not in HEAD_DIMS:
        return f"head_dim {q.shape[3]} (the kernel takes {list(HEAD_DIMS)})"
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "a last dim that is not contiguous"
    if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != (q.shape[0], k.shape[2])):
        return f"mask of shape {tuple(mask.shape)} (need [B, L])"
    return None


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                               scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    m = None if mask is None else mask[:, None, None, :]
    attn_mask = m if m is None or m.dtype == torch.bool else m.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def splits_for(batch: int, kv_heads: int, length: int) -> int:
    """Slices of the key positions: SPLIT_POSITIONS each, fewer where the sequences and heads already fill the GPU,
    and at most MAX_SPLITS (longer slices past that)."""
    if length <= SPLIT_POSITIONS:
        return 1
    want = -(-TARGET_PROGRAMS // (batch * kv_heads))
    return min(want, -(-length // SPLIT_POSITIONS), MAX_SPLITS)


_CHECKED = ShapeMemo()


def _use_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the Triton kernels take this call: decided from metadata only, once per key (kernels/memo.py)."""
    key = (tensor_meta(q), tensor_meta(k), tensor_meta(v), None if mask is None else tensor_meta(mask))
    found = _CHECKED.get(key)
    if found is None:
        found = _CHECKED.put(key, q.is_cuda and triton_available() and unsupported_reason(q, k, v, mask) is None)
    return found


@torch.library.custom_op("moefx::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    if _use_kernel(q, k, v, mask):
        from moefx.kernels.decode_attn import decode_attention_triton

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        decode_attention_triton(q, k, v, mask, scale, out, splits_for(q.shape[0], k.shape[1], k.shape[2]))
        return out
    return decode_attention_reference(q, k, v, mask, scale)


@decode_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
