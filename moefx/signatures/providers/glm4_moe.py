"""GLM-4.5 / GLM-4.5-Air (`glm4_moe`): DeepSeek-V3-style router (sigmoid + correction bias, optional
group top-k), one shared expert, dense first layers, GQA attention."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moefx.signatures.registry import MOE_REQUIRED, Provider, register_provider


@register_provider
class Glm4Moe(Provider):
    name = "glm4_moe"
    family = "glm4_moe"
    model_types = ("glm4_moe",)
    requires = (*MOE_REQUIRED, "num_shared_experts", "first_dense_layers", "n_group", "topk_group")
    routings = ("sigmoid_bias_group_topk", "sigmoid_bias")

    @classmethod
    def implied(cls, get: Callable[[str], Any]) -> dict[str, Any]:
        grouped = (get("n_group") or 1) > 1
        shared, width = get("n_shared_experts"), get("moe_intermediate_size")
        return {
            "routing": "sigmoid_bias_group_topk" if grouped else "sigmoid_bias",
            "shared_expert_intermediate_size": shared * width if shared is not None and width is not None else None,
        }
