"""Read MoE geometry from a module's expert weights when its config does not say (or there is none).

Only geometry is inferable (experts, hidden and expert widths, dtype); top_k and
routing are not, so a signature built from weights alone never matches a provider: it is there for
the MoE backend's shape keys and for the user's rules.
"""

from __future__ import annotations

from typing import Any

import torch

_COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def is_stacked_experts(module: torch.nn.Module) -> bool:
    """A transformers-5 style experts module: 3-D `gate_up_proj` and `down_proj` tensors (the experts stacked)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3


def _fused_geometry(experts: torch.nn.Module) -> tuple[int, int, int] | None:
    """(E, H, I) from fused 3-D `gate_up_proj` / `down_proj` parameters, either layout."""
    if not is_stacked_experts(experts):
        return None
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if gate_up.shape[0] != down.shape[0]:
        return None
    e = gate_up.shape[0]
    if gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]:  # [E, 2I, H], [E, H, I]
        return e, down.shape[1], down.shape[2]
    if gate_up.shape[2] == 2 * down.shape[1] and gate_up.shape[1] == down.shape[2]:  # [E, H, 2I], [E, I, H]
        return e, gate_up.shape[1], down.shape[1]
    return None


def _list_geometry(experts: torch.nn.Module) -> tuple[int, int, int] | None:
    """(E, H, I) from a ModuleList of per-expert MLPs with gate_proj/w1 linears."""
    if not isinstance(experts, torch.nn.ModuleList) or len(experts) == 0:
        return None
    first = experts[0]
    gate = getattr(first, "gate_proj", None) or getattr(first, "w1", None)
    weight = getattr(gate, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    return len(experts), weight.shape[1], weight.shape[0]


def _compute_dtype(module: torch.nn.Module) -> str | None:
    embed = getattr(module, "get_input_embeddings", None)
    weight = getattr(embed(), "weight", None) if callable(embed) else None
    if isinstance(weight, torch.Tensor) and weight.dtype in _COMPUTE_DTYPES:
        return str(weight.dtype).replace("torch.", "")
    for p in module.parameters():
        if p.dtype in _COMPUTE_DTYPES:
            return str(p.dtype).replace("torch.", "")
    return None


def _unsharded(experts: torch.nn.Module, geometry: tuple[int, ...]) -> tuple[int, ...]:
    """The model's (E, H, I) from one rank's shard (`moefx.parallel.shard_model` notes the split on the module;
    transformers' DTensor weights already report the full shape)."""
    spec = getattr(experts, "moefx_shard", {}).get("gate_up_proj")
    if spec is None:
        return geometry
    e, h, i = geometry
    return (spec.full, h, i) if spec.dim == 0 else (e, h, spec.full // 2)


def infer_from_module(module: Any) -> dict[str, Any]:
    """Facts read from weights; empty when the module has no recognizable expert weights."""
    if not isinstance(module, torch.nn.Module):
        return {}
    facts: dict[str, Any] = {}
    dtype = _compute_dtype(module)
    if dtype is not None:
        facts["dtype"] = dtype
    if type(module).__name__.endswith("ForCausalLM"):
        facts["architectures"] = (type(module).__name__,)
    shapes = set()
    for name, child in module.named_modules():
        if not name.endswith("experts"):
            continue
        geometry = _fused_geometry(child) or _list_geometry(child)
        if geometry is not None:
            shapes.add(_unsharded(child, tuple(int(x) for x in geometry)))
    if len(shapes) == 1:  # mixed expert shapes: no single geometry to report
        (e, h, i) = shapes.pop()
        facts.update(num_experts=e, hidden_size=h, moe_intermediate_size=i)
    return facts
