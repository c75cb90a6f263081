"""reference: a plain loop over experts in PyTorch. Always available; the correctness oracle (fp64 inputs are computed
in fp64, so `torch.autograd.gradcheck` can run the op on it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moefx.backends.registry import MoEBackend, MoeCall, dequant_block, register_backend
from moefx.kernels.activation import gate_up


@register_backend
class ReferenceBackend(MoEBackend):
    name = "reference"

    def run(self, call: MoeCall) -> torch.Tensor:
        hidden, topk_ids, topk_weights, w13, w2 = call.hidden, call.topk_ids, call.topk_weights, call.w13, call.w2
        w13_scale, w2_scale, block_shape = call.w13_scale, call.w2_scale, call.block_shape
        quantized = w13_scale is not None
        compute = torch.float32 if quantized else hidden.dtype
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs (gradcheck)
        out = torch.zeros(hidden.shape[0], w2.shape[1], dtype=acc, device=hidden.device)
        for e in torch.unique(topk_ids).tolist():
            token, slot = torch.where(topk_ids == e)
            gate_up_w = dequant_block(w13[e], w13_scale[e], block_shape) if quantized else w13[e]
            down_w = dequant_block(w2[e], w2_scale[e], block_shape) if quantized else w2[e]
            x = hidden[token].to(compute)
            gate, up = F.linear(x, gate_up_w.to(compute)).chunk(2, dim=-1)
            y = F.linear(gate_up(gate, up, call.activation, call.gate_limit), down_w.to(compute))
            out.index_add_(0, token, y.to(acc) * topk_weights[token, slot, None].to(acc))
        return out.to(hidden.dtype)
