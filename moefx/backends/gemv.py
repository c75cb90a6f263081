"""gemv: small-M (decode) MoE that reads only the selected experts' weights, once, at full bandwidth.

No sort: experts are indexed straight from topk_ids; gate and up rows are streamed together and
the gate activation (SiLU, GELU, GELU-tanh) times up is applied before the down
projection; the routing weight and the top-k sum are applied in
registers (two Triton launches on CUDA, see kernels/moe_gemv.py). Weights touched per call grow
with M*k, so this backend is for M up to ~8; the policy picks it from measured crossovers.
Contract (the dispatch op relies on it): on CUDA `__call__` launches only fixed-shape work, no host
sync, CUDA-graph capturable. FP8 block-quant weights when `w13_scale` is given (block_shape scales);
activations stay in fp32 (bandwidth is the same as w8a8 and the result is closer to the oracle).
CPU: the same per-(token, slot) algorithm in PyTorch. `unsupported_reason` names the device, dtype or
shape that rules an input out.
"""

from __future__ import annotations

import torch

from moefx.backends.common import TritonMoEBackend
from moefx.backends.registry import MoeCall, dequant_block, register_backend
from moefx.kernels.activation import gate_up

CPU_PAIR_CHUNK = 16


def gemv_torch(call: MoeCall) -> torch.Tensor:
    """Per (token, slot) pair: gather the expert's rows, fused gate/up, act-mul, down, weighted top-k sum."""
    hidden, topk_ids, w13, w2, w13_scale, w2_scale = call.hidden, call.topk_ids, call.w13, call.w2, call.w13_scale, \
        call.w2_scale
    m, h = hidden.shape
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    x = hidden.float().repeat_interleave(top_k, dim=0)
    tw = call.topk_weights.reshape(-1).float()
    fp8 = w13_scale is not None
    pair_out = torch.empty(m * top_k, h, dtype=torch.float32, device=hidden.device)
    for p0 in range(0, ids.numel(), CPU_PAIR_CHUNK):
        e = ids[p0 : p0 + CPU_PAIR_CHUNK]
        w_gu = dequant_block(w13[e], w13_scale[e], call.block_shape) if fp8 else w13[e].float()
        w_d = dequant_block(w2[e], w2_scale[e], call.block_shape) if fp8 else w2[e].float()
        gate, up = torch.bmm(w_gu, x[p0 : p0 + CPU_PAIR_CHUNK, :, None]).squeeze(-1).chunk(2, dim=-1)
        act = gate_up(gate, up, call.activation, call.gate_limit) * tw[p0 : p0 + CPU_PAIR_CHUNK, None]
        pair_out[p0 : p0 + CPU_PAIR_CHUNK] = torch.bmm(w_d, act[:, :, None]).squeeze(-1)
    return pair_out.view(m, top_k, h).sum(dim=1).to(hidden.dtype)


@register_backend
class GemvBackend(TritonMoEBackend):
    name = "gemv"
    torch_path = staticmethod(gemv_torch)
    adds_residual = True  # in the down kernel's epilogue: the layer's last residual add is no launch of its own

    def cuda_kernel(self, call: MoeCall, residual: torch.Tensor | None = None) -> torch.Tensor:
        from moefx.kernels.moe_gemv import gemv_moe

        return gemv_moe(call, residual=residual)
