"""The gate activations `moefx::moe_experts` computes: out = down(act(gate(x)) * up(x)), one name per activation.

Each entry gives the PyTorch function (the reference paths, in the caller's dtype), its derivative (the backward,
in fp32 or fp64) and the integer the Triton kernels take as their `ACT` constexpr (one epilogue variant each:
`kernels/moe_epilogue.py`). transformers' activation modules map onto these names by type (`module_types`), so an
experts module with any of them runs the op; one with another activation falls back, naming it.
`gate_limit` (the op's other gate argument) clamps before the activation, as DeepSeek-V4, GLM-5-Next and HY-V4
do: gate <= limit, -limit <= up <= limit ("clamped SwiGLU"); the kernels' LIMIT constexpr (0: none).
gelu_tanh is the tanh approximation 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2 / pi), which equals
x * sigmoid(2 k (x + 0.044715 x^3)): the kernels compute that form (no tanh needed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_K = math.sqrt(2.0 / math.pi)
_C = 0.044715


def _silu_grad(g: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(g)
    return s * (1.0 + g * (1.0 - s))


def _gelu_grad(g: torch.Tensor) -> torch.Tensor:
    cdf = 0.5 * (1.0 + torch.erf(g * (1.0 / math.sqrt(2.0))))
    return cdf + g * torch.exp(-0.5 * g * g) * (1.0 / math.sqrt(2.0 * math.pi))


def _gelu_tanh_grad(g: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(_K * (g + _C * g * g * g))
    return 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _K * (1.0 + 3.0 * _C * g * g)


@dataclass(frozen=True)
class Activation:
    name: str
    kernel_id: int  # the Triton kernels' ACT constexpr
    fn: Callable[[torch.Tensor], torch.Tensor]
    grad: Callable[[torch.Tensor], torch.Tensor]  # d act / d g, elementwise
    # transformers.activations class names (looked up by name: some exist only in some versions), torch modules and
    # plain functions an experts module may hold as its act_fn
    hf_classes: tuple[str, ...] = ()
    torch_modules: tuple[type, ...] = ()
    functions: tuple[Callable, ...] = ()


ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("silu", 0, F.silu, _silu_grad, ("SiLUActivation",), (torch.nn.SiLU,), (F.silu,)),
        Activation("gelu", 1, F.gelu, _gelu_grad, ("GELUActivation",), (), (F.gelu,)),
        Activation(
            "gelu_tanh", 2, lambda g: F.gelu(g, approximate="tanh"), _gelu_tanh_grad,
            ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation", "AccurateGELUActivation"),
        ),
    )
}


def gate_up(gate: torch.Tensor, up: torch.Tensor, activation: str, limit: float | None = None) -> torch.Tensor:
    """act(gate) * up, with the clamped-SwiGLU limit when given: gate clamped to <= limit, up to [-limit, limit]."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return get_activation(activation).fn(gate) * up


def check_limit(limit: float | None) -> None:
    if limit is not None and not limit > 0:
        raise ValueError(f"moe_experts gate_limit={limit!r} is invalid: a clamp limit > 0, or None for no clamp")


def get_activation(name: str) -> Activation:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"moe_experts activation={name!r} is invalid; valid choices: {sorted(ACTIVATIONS)}") from None


def module_types() -> tuple[tuple[type, str], ...]:
    """(activation module class, the op's name for it) for the transformers and torch classes the op computes.

    torch's `nn.GELU` is not listed: its name depends on `approximate` (`gelu_name`)."""
    import transformers.activations as hf_act

    out: list[tuple[type, str]] = []
    for a in ACTIVATIONS.values():
        out += [(c, a.name) for c in (getattr(hf_act, n, None) for n in a.hf_classes) if isinstance(c, type)]
        out += [(c, a.name) for c in a.torch_modules]
    return tuple(out)


def function_names() -> dict[Callable, str]:
    """Plain functions (`act_fn = F.silu`) and the op's name for each."""
    return {f: a.name for a in ACTIVATIONS.values() for f in a.functions}


def gelu_name(act: torch.nn.GELU) -> str:
    return "gelu" if act.approximate == "none" else "gelu_tanh"
