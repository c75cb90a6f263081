"""The MoE backend contract and registry. One backend per file; each registers itself by name.

Shapes (transformers 5 layout): hidden [M, H], topk_ids [M, k] (int), topk_weights [M, k],
w13 [E, 2I, H] (gate rows first, then up rows), w2 [E, H, I]. FP8 block-quant weights are
float8_e4m3fn with `w13_scale` [E, ceil(2I/bn), ceil(H/bk)] and `w2_scale` [E, ceil(H/bn), ceil(I/bk)]
(dequantized weight = fp8 value * scale, the `weight_scale_inv` checkpoint convention) and
`block_shape` (bn, bk), usually (128, 128). Output: [M, H] in hidden's dtype,
sum_j topk_weights[m, j] * down(act(gate(x_m)) * up(x_m)) over expert topk_ids[m, j], where `activation` names act
(moefx/kernels/activation.py: silu, gelu, gelu_tanh) and `gate_limit`, when given, clamps gate to <= limit and up
to [-limit, limit] first.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from moefx.kernels.moe_call import MoeCall


class MoEBackend:
    """A backend implements `run(call)`; `__call__` is the keyword front for direct calls (tests, the offload
    ring's tile compute) and `apply` what the op calls."""

    name: ClassVar[str]
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    # True where `run` also takes `residual` ([M, H], hidden's dtype) and returns residual + out, the sum
    # rounded to hidden's dtype first (as a separate add would see it): moefx::moe_experts_residual then adds no
    # launch of its own.
    adds_residual: ClassVar[bool] = False

    def unsupported_reason(self, call: MoeCall) -> str | None:
        """None when this backend can run `call` (its routing may be None: `MoeCall.unrouted`), else a short reason
        (shown in the plan/log)."""
        if call.hidden.device.type not in self.devices:
            return f"{self.name} does not run on {call.hidden.device.type}"
        return None

    def __call__(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
        w2: torch.Tensor, *, residual: torch.Tensor | None = None, **options: object,
    ) -> torch.Tensor:
        """The experts' sum of `MoeCall(hidden, topk_ids, topk_weights, w13, w2, **options)` (options: w13_scale,
        w2_scale, block_shape, activation, gate_limit), plus `residual` when given."""
        if options.get("block_shape") is not None:
            options["block_shape"] = tuple(options["block_shape"])
        return self.apply(MoeCall(hidden, topk_ids, topk_weights, w13, w2, **options), residual)

    def apply(self, call: MoeCall, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' sum for `call`, plus `residual` when given: added by the backend where it can
        (`adds_residual`), else by one add here; either way rounded as a separate add would."""
        if residual is None:
            return self.run(call)
        if self.adds_residual:
            return self.run(call, residual)
        return residual + self.run(call)

    def run(self, call: MoeCall, residual: torch.Tensor | None = None) -> torch.Tensor:
        """[M, H] in hidden's dtype; `residual` is only passed where `adds_residual`."""
        raise NotImplementedError(f"MoE backend {self.name!r} defines no run(call: MoeCall), which the op calls "
                                  f"(the backend contract, moefx/backends/registry.py)")


BACKENDS: dict[str, MoEBackend] = {}


def register_backend(cls: type[MoEBackend]) -> type[MoEBackend]:
    if cls.name in BACKENDS:
        raise ValueError(f"MoE backend {cls.name!r} is registered twice")
    BACKENDS[cls.name] = cls()
    return cls


def dequant_block(w: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int]) -> torch.Tensor:
    """fp8 [.., N, K] with per-(bn x bk)-block scales [.., ceil(N/bn), ceil(K/bk)] -> float32."""
    bn, bk = block_shape
    n, k = w.shape[-2], w.shape[-1]
    s = scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return w.to(torch.float32) * s.to(torch.float32)
