"""grouped: sort/align tokens per expert on the GPU, then two grouped GEMMs (Triton fused MoE).

For M from ~16 up: each expert's weight tile is read from HBM once per call and reused from L2 by
that expert's row blocks; the gate activation times up is fused into GEMM 1, the routing weight into GEMM 2.
Contract (the dispatch op relies on it): `__call__` launches only fixed-shape work on CUDA: the
align stage sizes its buffers for the worst case M*k + E*(BLOCK_M-1), there is no host sync and no
data-dependent shape, so it is CUDA-graph capturable. FP8 block-quant (w8a8) when `w13_scale` is
given: activations are quantized per token and group of block_shape[1]. CPU: the same algorithm
(align, per-expert blocks, fused activation, weighted sum, w8a8 rounding) in PyTorch.
`unsupported_reason` names the device, dtype or shape that rules an input out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moefx.backends.common import TritonMoEBackend, qdq_rows
from moefx.backends.registry import MoeCall, dequant_block, register_backend
from moefx.kernels.activation import gate_up
from moefx.kernels.moe_align_ref import moe_align_torch

CPU_BLOCK_M = 16


def grouped_torch(call: MoeCall, block_m: int = CPU_BLOCK_M) -> torch.Tensor:
    """PyTorch version of the grouped algorithm, over the same padded block layout as the kernels."""
    hidden, topk_ids, w13, w2, w13_scale, w2_scale = call.hidden, call.topk_ids, call.w13, call.w2, call.w13_scale, \
        call.w2_scale
    block_shape = call.block_shape
    m, h = hidden.shape
    top_k = topk_ids.shape[1]
    num_pairs = m * top_k
    fp8 = w13_scale is not None
    sorted_ids, expert_ids, num_post = moe_align_torch(topk_ids, w13.shape[0], block_m)
    n = int(num_post)
    pairs = sorted_ids[:n].long()
    block_expert = expert_ids[: n // block_m].long().repeat_interleave(block_m)
    x = qdq_rows(hidden, block_shape[1]) if fp8 else hidden.float()
    tw = call.topk_weights.reshape(-1).float()
    pair_out = torch.zeros(num_pairs, h, dtype=torch.float32, device=hidden.device)
    for e in torch.unique_consecutive(block_expert).tolist():
        sel = pairs[(block_expert == e) & (pairs < num_pairs)]
        w_gu = dequant_block(w13[e], w13_scale[e], block_shape) if fp8 else w13[e].float()
        w_d = dequant_block(w2[e], w2_scale[e], block_shape) if fp8 else w2[e].float()
        gate, up = F.linear(x[sel // top_k], w_gu).chunk(2, dim=-1)
        act = gate_up(gate, up, call.activation, call.gate_limit)
        act = qdq_rows(act, block_shape[1]) if fp8 else act.to(hidden.dtype).float()
        pair_out[sel] = F.linear(act, w_d) * tw[sel, None]
    return pair_out.to(hidden.dtype).view(m, top_k, h).sum(dim=1, dtype=torch.float32).to(hidden.dtype)


@register_backend
class GroupedBackend(TritonMoEBackend):
    name = "grouped"
    torch_path = staticmethod(grouped_torch)
    fp8_min_block_k = 32

    def cuda_kernel(self, call: MoeCall) -> torch.Tensor:
        from moefx.kernels.moe_grouped import fused_moe

        return fused_moe(call)
