"""cpu: the MoE expert sum computed on the host CPU for host-resident expert weights (docs/OFFLOAD.md).

Inputs may live on the GPU (they are copied to the host and the result is copied back); the weights must be
in host memory. Only routed experts are touched. SiLU experts and float weights only: FP8 block-quantized experts
are not computed here (the offload store quantizes to per-channel int8 itself when MOEFX_OFFLOAD_INT8 is on).
"""

from __future__ import annotations

import torch

from moefx.backends.registry import MoEBackend, MoeCall, register_backend
from moefx.offload.cpu_experts import ExpertStore, cpu_moe


@register_backend
class CpuBackend(MoEBackend):
    name = "cpu"
    devices = ("cpu", "cuda")

    def unsupported_reason(self, call: MoeCall) -> str | None:
        activation, gate_limit, w13, w2 = call.activation, call.gate_limit, call.w13, call.w2
        if activation != "silu" or gate_limit is not None:
            return f"cpu backend computes unclamped SiLU experts only, not {activation} (limit {gate_limit})"
        if w13.device.type != "cpu" or w2.device.type != "cpu":
            return "cpu backend needs expert weights in host memory"
        if call.w13_scale is not None:
            return "cpu backend does not compute FP8 block-quantized experts"
        if not w13.dtype.is_floating_point:
            return f"cpu backend takes float expert weights, got {w13.dtype}"
        return super().unsupported_reason(call)

    def run(self, call: MoeCall) -> torch.Tensor:
        reason = self.unsupported_reason(call)
        if reason:
            raise ValueError(reason)
        out = cpu_moe(ExpertStore(call.w13, call.w2), call.hidden.cpu(), call.topk_ids.cpu(), call.topk_weights.cpu())
        return out.to(call.hidden.device, non_blocking=True)
