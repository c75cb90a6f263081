"""One MoE call: the data arguments of `moefx::moe_experts`, as every layer passes them (the op, the backends and
their checks, the kernels' launchers and PyTorch paths, offload and calibrate).

Shapes and the FP8 block convention are the backend contract's (moefx/backends/registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class MoeCall:
    """Built once per op call (backends/op.py) or per direct call of a backend (`MoEBackend.__call__`).
    `block_shape` is a tuple. `topk_ids` / `topk_weights` are None only in a call that is checked before its routing
    is known (`unrouted`: what `MoEBackend.unsupported_reason` reads is the rest). Compared by identity
    (`eq=False`): it holds tensors."""

    hidden: torch.Tensor
    topk_ids: torch.Tensor | None
    topk_weights: torch.Tensor | None
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    block_shape: tuple[int, int] | None = None
    activation: str = "silu"
    gate_limit: float | None = None

    @classmethod
    def unrouted(
        cls,
        hidden: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor | None = None,
        block_shape: tuple[int, int] | None = None,
        activation: str = "silu",
        gate_limit: float | None = None,
    ) -> MoeCall:
        """The call a backend's support check reads: tokens, weights and gate, no routing yet."""
        bs = tuple(block_shape) if block_shape is not None else None
        return cls(hidden, None, None, w13, w2, w13_scale, None, bs, activation, gate_limit)
