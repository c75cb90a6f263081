"""GLM-4.5 / GLM-4.5-Air (`glm4_moe`): DeepSeek-V3-style router (sigmoid + correction bias, optional
group top-k), one shared expert, dense first layers, GQA attention."""

from __future__ import annotations

from moefx.planner.registry import MOE_REQUIRED, Provider, register_provider


@register_provider
class Glm4Moe(Provider):
    name = "glm4_moe"
    family = "glm4_moe"
    model_types = ("glm4_moe",)
    requires = (*MOE_REQUIRED, "num_shared_experts", "first_dense_layers", "n_group", "topk_group")
    routings = ("sigmoid_bias_group_topk", "sigmoid_bias")
