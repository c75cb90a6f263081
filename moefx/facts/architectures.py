"""What an architecture fixes whatever its config says: the family of each model_type moefx knows, and the facts
its configs may leave out.

`ModelSignature.from_config` reads this table after the config's own keys, and fills only the fields the config
leaves unset. A provider registered for a model_type this table does not know adds its row
(`moefx.planner.register_provider` passes the provider's `family` and `implied`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Getter = Callable[[str], Any]  # reads one key of the raw config (text-model keys first)


@dataclass(frozen=True)
class Architecture:
    family: str
    implied: Callable[[Getter], dict[str, Any]]


def _mla(get: Getter) -> dict[str, Any]:
    """DeepSeek's shared-expert width (n_shared x expert width) and head_dim as transformers defines it for MLA
    (the rotary part, qk_rope_head_dim)."""
    shared, width = get("n_shared_experts"), get("moe_intermediate_size")
    return {
        "shared_expert_intermediate_size": shared * width if shared is not None and width is not None else None,
        "head_dim": get("qk_rope_head_dim"),
    }


def _sigmoid_bias(get: Getter) -> str:
    """DeepSeek-V3's router kind: sigmoid plus a correction bias, group top-k when there are groups."""
    return "sigmoid_bias_group_topk" if (get("n_group") or 1) > 1 else "sigmoid_bias"


def _deepseek_v2(get: Getter) -> dict[str, Any]:
    # transformers' config classes do not keep `scoring_func`: V2 scores with softmax, group-limited by topk_method.
    routing = {"greedy": "softmax", "group_limited_greedy": "softmax_group_topk"}.get(get("topk_method"))
    return {"routing": routing, **_mla(get)}


def _deepseek_v3(get: Getter) -> dict[str, Any]:
    return {"routing": _sigmoid_bias(get), **_mla(get)}


def _glm4_moe(get: Getter) -> dict[str, Any]:
    shared, width = get("n_shared_experts"), get("moe_intermediate_size")
    return {
        "routing": _sigmoid_bias(get),
        "shared_expert_intermediate_size": shared * width if shared is not None and width is not None else None,
    }


def _mixtral(get: Getter) -> dict[str, Any]:
    # Mixtral renormalizes its top-2 weights; each expert is `intermediate_size` wide.
    return {"routing": "softmax", "norm_topk_prob": True, "moe_intermediate_size": get("intermediate_size"),
            "num_shared_experts": 0, "first_dense_layers": 0}


def _olmoe(get: Getter) -> dict[str, Any]:
    return {"routing": "softmax", "moe_intermediate_size": get("intermediate_size"), "num_shared_experts": 0,
            "first_dense_layers": 0}


def _qwen2_moe(get: Getter) -> dict[str, Any]:
    shared = get("shared_expert_intermediate_size")
    return {"routing": "softmax", "num_shared_experts": (1 if shared else 0) if shared is not None else None,
            "first_dense_layers": 0}


def _qwen3_moe(get: Getter) -> dict[str, Any]:
    return {"routing": "softmax", "num_shared_experts": 0, "first_dense_layers": 0}


# model_type -> its architecture
ARCHITECTURES: dict[str, Architecture] = {
    "deepseek_v2": Architecture("deepseek", _deepseek_v2),
    "deepseek_v3": Architecture("deepseek", _deepseek_v3),
    "glm4_moe": Architecture("glm4_moe", _glm4_moe),
    "mixtral": Architecture("mixtral", _mixtral),
    "olmoe": Architecture("olmoe", _olmoe),
    "qwen2_moe": Architecture("qwen2_moe", _qwen2_moe),
    "qwen3_moe": Architecture("qwen3_moe", _qwen3_moe),
}


def architecture_for(model_type: str | None) -> Architecture | None:
    return ARCHITECTURES.get(model_type) if model_type is not None else None


def register_architecture(model_type: str, family: str, implied: Callable[[Getter], dict[str, Any]]) -> None:
    """Add the row of a model_type this table does not know; a known one keeps its row, and must name its family."""
    known = ARCHITECTURES.get(model_type)
    if known is None:
        ARCHITECTURES[model_type] = Architecture(family, implied)
    elif known.family != family:
        raise ValueError(f"model_type {model_type!r} is of family {known.family!r}, not {family!r}")
