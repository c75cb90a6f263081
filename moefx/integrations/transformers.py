"""transformers integration: `"moefx"` in transformers' ExpertsInterface, and the `optimize` transform using it.

With `from_pretrained(..., experts_implementation="moefx")` or `model.set_experts_implementation("moefx")`,
every experts module decorated with transformers' `use_experts_implementation` runs `moefx::moe_experts`
(backend chosen per call by M). The gate activation is read from the module's `act_fn` by type (SiLU, exact
GELU, GELU's tanh approximation: moefx/kernels/activation.py). What the op cannot take — biases, interleaved
gate/up rows, a custom gate other than a clamped SwiGLU (recognised by running it: `custom_gate_activation`),
another activation, experts without a gate, a post-expert norm — runs transformers' default experts path
(grouped_mm) with a one-time warning naming the reason (issued while tracing under `torch.compile`, without a
graph break); transposed weights are passed as views, and a backend that needs
contiguous rows says so and the op runs that default path. `upstream` ranges of the policy also run it.
The op is differentiable, so training, gradient checkpointing and `retain_grad` work as with grouped_mm.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from moefx.backends.op import moe_experts
from moefx.kernels.activation import ACTIVATIONS, function_names, gate_up, gelu_name, module_types
from moefx.log import warn_once

NAME = "moefx"
_ACT_TYPES = module_types()
_ACT_FUNCTIONS = function_names()


def _default_gate() -> Any:
    from transformers.integrations.moe import _default_apply_gate

    return _default_apply_gate


def activation_name(act: Any) -> str | None:
    """The op's activation name for an experts module's `act_fn`, or None when the op has no such epilogue."""
    if isinstance(act, nn.GELU):
        return gelu_name(act)
    if not isinstance(act, nn.Module):
        return _ACT_FUNCTIONS.get(act)
    for cls, name in _ACT_TYPES:
        if isinstance(act, cls):
            return name
    return None


_LIMIT_ATTRS = ("limit", "swiglu_limit")  # where transformers' clamped-SwiGLU experts keep their clamp
_GATES: dict[tuple, str | None] = {}


def gate_limit(module: nn.Module) -> float | None:
    for name in _LIMIT_ATTRS:
        value = getattr(module, name, None)
        if value is not None:
            return float(value)
    return None


@torch.compiler.assume_constant_result
def custom_gate_activation(cls: type, limit: float | None, act: str | None) -> str | None:
    """The op's activation that `cls._apply_gate` computes, as act(gate clamped to <= limit) * (up clamped to
    [-limit, limit]) (limit None: no clamp), or None. Decided once per (class, limit, act) by running the gate on probe
    values (beyond the limit) against the op's formula, with `act` (the module's act_fn) tried first; under
    torch.compile dynamo runs this while tracing and keeps the answer as a constant."""
    key = (cls, limit, act)
    if key not in _GATES:
        _GATES[key] = _probe_gate(cls, limit, act)
    return _GATES[key]


def _probe_gate(cls: type, limit: float | None, act: str | None) -> str | None:
    span = 3.0 * (limit or 3.0)
    gu = (torch.rand(8, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1) * span
    gate, up = gu.chunk(2, dim=-1)
    for name in dict.fromkeys([a for a in (act, *ACTIVATIONS) if a]):
        stub = types.SimpleNamespace(act_fn=ACTIVATIONS[name].fn, **{attr: limit for attr in _LIMIT_ATTRS})
        try:
            with torch.no_grad():
                out = cls._apply_gate(stub, gu)
        except Exception:  # the gate reads attributes the op has no counterpart for (alpha, softcaps, ...)
            return None
        if out.shape == gate.shape and torch.allclose(out, gate_up(gate, up, name, limit), rtol=1e-5, atol=1e-5):
            return name
    return None


def gate_of(module: nn.Module) -> tuple[str, float | None] | None:
    """(activation, gate limit) the op computes for this module's gate, or None when it computes none of them."""
    act = activation_name(getattr(module, "act_fn", None))
    if getattr(type(module), "_apply_gate", None) is _default_gate():
        return (act, None) if act else None
    limit = gate_limit(module)
    name = custom_gate_activation(type(module), limit, act)
    return (name, limit) if name else None


def is_experts_module(module: nn.Module) -> bool:
    """An experts module whose forward transformers dispatches through its experts interface."""
    return hasattr(module, "is_concatenated") and hasattr(module, "has_gate") and hasattr(module, "down_proj")


def is_fp8_module(module: nn.Module) -> bool:
    return hasattr(module, "down_proj_scale_inv")


def _fp8_reason(module: nn.Module) -> str | None:
    """What in a transformers FP8 experts module the op's block-FP8 contract does not cover, or None."""
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        return "static FP8 activation scales"
    if module.gate_up_proj.dtype != torch.float8_e4m3fn or module.down_proj.dtype != torch.float8_e4m3fn:
        return f"expert weights of dtype {module.gate_up_proj.dtype} (the op takes float8_e4m3fn blocks)"
    if module.gate_up_proj_scale_inv.dtype != torch.float32 or module.down_proj_scale_inv.dtype != torch.float32:
        return f"weight scales of dtype {module.gate_up_proj_scale_inv.dtype} (the op takes float32)"
    block = getattr(module, "block_size", None)
    if not block or len(block) != 2:
        return "per-tensor FP8 weight scales (the op takes 2-D blocks)"
    if getattr(module, "swiglu_alpha", None) is not None:
        return "an alpha SwiGLU gate (gpt-oss style)"
    if getattr(module, "gate_softcap", None) is not None:
        return "a softcapped SwiGLU gate"
    bn, bk = int(block[0]), int(block[1])
    for w, sc in ((module.gate_up_proj, module.gate_up_proj_scale_inv), (module.down_proj, module.down_proj_scale_inv)):
        want = (w.shape[0], -(-w.shape[1] // bn), -(-w.shape[2] // bk))
        if tuple(sc.shape) != want:
            return f"weight scales of shape {tuple(sc.shape)} for blocks {bn}x{bk} (expected {want})"
    return None


def unsupported_reason(module: nn.Module) -> str | None:
    """Why this experts module cannot run `moefx::moe_experts`, or None."""
    return reason_and_gate(module)[0]


def reason_and_gate(module: nn.Module) -> tuple[str | None, tuple[str, float | None] | None]:
    """(why the op cannot run this module or None, the (activation, gate limit) it computes for it): both from
    one look at the module, as each experts forward needs them."""
    if not module.has_gate:
        return "experts without a gate projection", None
    if getattr(module, "has_bias", False):
        return "expert biases", None
    if not module.is_concatenated:
        return "interleaved gate/up rows", None
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert", None
    if is_fp8_module(module):
        return _fp8_reason(module) or _activation_reason(module), None
    gate = gate_of(module)
    if gate is not None:
        return None, gate
    if getattr(type(module), "_apply_gate", None) is not _default_gate():
        return f"a custom gate ({type(module).__name__}._apply_gate)", None
    return _activation_reason(module), None


def _activation_reason(module: nn.Module) -> str | None:
    act = getattr(module, "act_fn", None)
    if activation_name(act) is not None:
        return None
    name = type(act).__name__ if isinstance(act, nn.Module) else getattr(act, "__name__", repr(act))
    return f"activation {name} (the op computes SiLU, GELU, GELU-tanh)"


def _local_routes(module: nn.Module, top_k_index: torch.Tensor, experts: int) -> torch.Tensor:
    """Expert-parallel placement (transformers' `ep_dispatch_experts`, `moefx.parallel.shard_model(experts="ep")`)
    routes a token to another rank's expert as id `experts` with weight 0; the op takes in-range ids only."""
    if getattr(module, "_is_expert_parallel", False):
        return top_k_index.clamp(max=experts - 1)
    return top_k_index


def moefx_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers experts forward `(self, hidden_states, top_k_index, top_k_weights)` through the moefx op."""
    reason, gate = reason_and_gate(self)
    if reason is not None:
        from transformers.integrations.moe import grouped_mm_experts_forward

        warn_once(f"moefx experts: {type(self).__name__} uses {reason}; running transformers' grouped_mm experts")
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    w13, w2 = self.gate_up_proj, self.down_proj
    if self.is_transposed:
        w13, w2 = w13.transpose(-2, -1), w2.transpose(-2, -1)
    backend = getattr(self, "moefx_backend", "auto")
    top_k_index = _local_routes(self, top_k_index, w13.shape[0])
    activation, limit = gate
    return moe_experts(
        hidden_states, top_k_index, top_k_weights, w13, w2, backend=backend, upstream="transformers",
        activation=activation, gate_limit=limit,
    )


def moefx_fp8_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The same for transformers' FP8 experts modules (block-FP8 weights with float32 `*_scale_inv`).

    Their default path needs transformers' hub kernels; the op's plain path here is the reference oracle.
    """
    reason = unsupported_reason(self)
    if reason is not None:
        warn_once(f"moefx experts: {type(self).__name__} uses {reason}; running transformers' own FP8 experts")
        return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    backend = getattr(self, "moefx_backend", "auto")
    top_k_index = _local_routes(self, top_k_index, self.gate_up_proj.shape[0])
    return moe_experts(
        hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, backend=backend,
        w13_scale=self.gate_up_proj_scale_inv, w2_scale=self.down_proj_scale_inv,
        block_shape=tuple(int(b) for b in self.block_size), upstream="transformers",
        activation=activation_name(self.act_fn), gate_limit=getattr(self, "limit", None),
    )


def register() -> None:
    """Make `experts_implementation="moefx"` valid in transformers, bf16/fp16 and FP8 experts (idempotent)."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    pairs = ((ALL_EXPERTS_FUNCTIONS, moefx_experts_forward), (ALL_FP8_EXPERTS_FUNCTIONS, moefx_fp8_experts_forward))
    for interface, fn in pairs:
        if interface.get(NAME) is not fn:
            interface.register(NAME, fn)


def use_moefx_experts(model: nn.Module, plan: Any, cfg: Any) -> list[str]:
    """Set `experts_implementation="moefx"` where the plan's MoE section names a moefx backend for some M."""
    moe = getattr(plan, "moe", None)
    if moe is None or not moe.applies:
        return []
    # Experts the offload transform already took over (host-resident, own forward) stay with it.
    experts = [m for m in model.modules() if is_experts_module(m) and not hasattr(m, "moefx_offload")]
    if not experts or not hasattr(model, "set_experts_implementation"):
        return ["experts left as they are: no transformers experts-interface modules in this model"]
    reasons = {r for r in (unsupported_reason(m) for m in experts) if r}
    if reasons:
        message = f"experts left to transformers: the moefx op does not take {sorted(reasons)}"
        if getattr(cfg, "strict", False) and getattr(cfg, "moe_backend", "auto") not in ("auto", "upstream"):
            raise ValueError(f"config moe_backend={cfg.moe_backend!r} with strict=true: {message}")
        warn_once(f"moefx.optimize: {message}")
        return [message]
    register()
    spec = moe.spec()
    for module in experts:
        module.moefx_backend = spec
    model.set_experts_implementation(NAME)
    return [f"experts_implementation = {NAME} on {len(experts)} experts modules, policy {spec}"]


register()
