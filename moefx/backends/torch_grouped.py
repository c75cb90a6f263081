"""torch_grouped: sort pairs by expert, then two `torch._grouped_mm` calls (CUTLASS on Hopper).

For large M (FLOP-bound) where the CUTLASS grouped GEMM beats the Triton kernels. Offsets come from
searchsorted on the sorted ids, so there is no host sync and no data-dependent shape: CUDA-graph
capturable. CUDA: bf16 only, H and I multiples of 8 (16-byte aligned rows), no FP8 (block-128 scaling
has no grouped_mm kernel here). CPU: torch's own grouped_mm (bf16/fp32). Needs torch >= 2.8.
`unsupported_reason` names the device, dtype or shape that rules an input out.
"""

from __future__ import annotations

import torch

from moefx.backends.common import shape_problem
from moefx.backends.registry import MoEBackend, MoeCall, register_backend
from moefx.kernels.activation import gate_up


def cuda_grouped_mm_problem(hidden: torch.Tensor, w2: torch.Tensor) -> str | None:
    """Why `torch._grouped_mm` on CUDA cannot take these activations and experts (the forward backend and the
    backward share it), or None."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no _grouped_mm"
    if hidden.dtype != torch.bfloat16:
        return f"torch._grouped_mm on CUDA takes bf16, not {hidden.dtype}"
    if torch.cuda.get_device_capability(hidden.device) < (8, 0):
        return "torch._grouped_mm needs compute capability >= 8.0"
    if hidden.shape[1] % 8 or w2.shape[2] % 8:
        return f"torch._grouped_mm needs H={hidden.shape[1]} and I={w2.shape[2]} multiples of 8"
    return None


def torch_grouped_moe(call: MoeCall) -> torch.Tensor:
    hidden, topk_ids, w13, w2 = call.hidden.contiguous(), call.topk_ids, call.w13, call.w2
    m, h = hidden.shape
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order].to(torch.int32)
    bounds = torch.arange(1, w13.shape[0] + 1, dtype=torch.int32, device=hidden.device)
    offs = torch.searchsorted(sorted_e, bounds).to(torch.int32)
    x = hidden[order // top_k]
    gate, up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(gate_up(gate, up, call.activation, call.gate_limit), w2.transpose(1, 2), offs=offs)
    y = y * call.topk_weights.reshape(-1)[order, None].to(y.dtype)
    pair_out = torch.empty_like(y).index_copy_(0, order, y)
    return pair_out.view(m, top_k, h).sum(dim=1)


@register_backend
class TorchGroupedBackend(MoEBackend):
    name = "torch_grouped"

    def unsupported_reason(self, call: MoeCall) -> str | None:
        reason = super().unsupported_reason(call) or shape_problem(call)
        if reason:
            return reason
        hidden = call.hidden
        if not hasattr(torch, "_grouped_mm"):
            return f"torch {torch.__version__} has no _grouped_mm"
        if call.w13_scale is not None:
            return "torch_grouped has no FP8 block-quant path"
        if hidden.is_cuda:
            return cuda_grouped_mm_problem(hidden, call.w2)
        if hidden.dtype == torch.float16:
            return "torch._grouped_mm on CPU takes bf16/fp32"
        return None

    def run(self, call: MoeCall) -> torch.Tensor:
        if call.w13_scale is not None:
            raise ValueError("torch_grouped has no FP8 path (w13_scale given); valid backends: grouped, gemv, "
                             "reference")
        return torch_grouped_moe(call)
