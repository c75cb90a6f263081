"""Input checks and PyTorch helpers shared by the gemv / grouped / torch_grouped backends (no Triton import)."""

from __future__ import annotations

import torch

from moefx.backends.registry import MoEBackend, MoeCall
from moefx.kernels.availability import triton_missing
from moefx.kernels.memo import device_capability, on_device

FP8_MAX = 448.0
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def shape_problem(call: MoeCall) -> str | None:
    """Why these weights/activations don't follow the registry layout, or None."""
    hidden, w13, w2, w13_scale, block_shape = call.hidden, call.w13, call.w2, call.w13_scale, call.block_shape
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        return f"expected hidden [M, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(hidden.shape)}, " \
               f"{tuple(w13.shape)}, {tuple(w2.shape)}"
    e, two_i, h = w13.shape
    if hidden.shape[1] != h or w2.shape != (e, h, two_i // 2) or two_i % 2:
        return f"shape mismatch: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
    if hidden.dtype not in FLOAT_DTYPES:
        return f"hidden dtype {hidden.dtype} not in bf16/fp16/fp32"
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        return "weights must be contiguous in their last dim"
    if w13.device != hidden.device or w2.device != hidden.device:
        return f"weights on {w13.device}/{w2.device}, hidden on {hidden.device}"
    if w13_scale is None:
        if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
            return f"weight dtype {w13.dtype}/{w2.dtype} differs from hidden {hidden.dtype} (and no FP8 scales)"
        return None
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        return f"FP8 scales given but weights are {w13.dtype}/{w2.dtype}, not float8_e4m3fn"
    if block_shape is None:
        return "FP8 weights need block_shape"
    bn, bk = block_shape
    if bk < 16 or bk & (bk - 1) or bn % 16:
        return f"FP8 block_shape {block_shape}: need bk a power of two >= 16 and bn a multiple of 16"
    if h % bk or (two_i // 2) % bk or (two_i // 2) % bn or h % bn:
        return f"FP8 needs H={h} and I={two_i // 2} to be multiples of block_shape {block_shape}"
    return None


def cuda_fp8_problem(call: MoeCall, min_block_k: int = 0) -> str | None:
    if call.w13_scale is None or not call.hidden.is_cuda:
        return None
    if device_capability(call.hidden.device) < (8, 9):
        return "FP8 tensor-core dot needs compute capability >= 8.9"
    if call.block_shape[1] < min_block_k:
        return f"FP8 tensor-core dot needs a quant block k >= {min_block_k} on CUDA, got {call.block_shape}"
    return None


class TritonMoEBackend(MoEBackend):
    """A backend that runs a Triton kernel on CUDA and the same algorithm in PyTorch elsewhere.

    Subclasses give `cuda_kernel` and `torch_path`, both taking the `MoeCall`, and
    `fp8_min_block_k` when their CUDA kernel feeds FP8 quant blocks to a tensor-core dot (Triton's e4m3 dot on
    Hopper takes K >= 32 per step)."""

    fp8_min_block_k = 0

    def unsupported_reason(self, call: MoeCall) -> str | None:
        reason = super().unsupported_reason(call) or shape_problem(call)
        if reason is None and call.hidden.is_cuda:
            missing = triton_missing()
            if missing:
                return f"{self.name} needs Triton on CUDA: {missing}"
            reason = cuda_fp8_problem(call, self.fp8_min_block_k)
        return reason

    def run(self, call: MoeCall, residual: torch.Tensor | None = None) -> torch.Tensor:
        if call.hidden.is_cuda:
            with on_device(call.hidden.device):  # Triton launches on the current device
                if residual is not None:  # only where adds_residual (MoEBackend.apply)
                    return self.cuda_kernel(call, residual=residual)
                out = self.cuda_kernel(call)
        else:
            out = self.torch_path(call)
        return out if residual is None else residual + out

    def cuda_kernel(self, call: MoeCall) -> torch.Tensor:
        raise NotImplementedError

    def torch_path(self, call: MoeCall) -> torch.Tensor:
        raise NotImplementedError


def qdq_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 values after per-row, per-`group`-columns e4m3 quantize + dequantize (the w8a8 activation path)."""
    m, k = x.shape
    g = x.float().reshape(m, k // group, group)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).reshape(m, k)
