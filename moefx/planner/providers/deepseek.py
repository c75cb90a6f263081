"""DeepSeek-V2/V3 (MLA attention, routed + shared experts, dense first layers).

V2 scores with softmax (group-limited top-k when `topk_method` says so); V3 scores with sigmoid plus a
correction bias and group top-k. transformers' config classes do not keep `scoring_func`, so these
facts come from the architecture when the config omits them (`moefx/facts/architectures.py`).
"""

from __future__ import annotations

from moefx.planner.registry import MOE_REQUIRED, Provider, register_provider

_DEEPSEEK_REQUIRED = (*MOE_REQUIRED, "num_shared_experts", "first_dense_layers", "kv_lora_rank")


@register_provider
class DeepseekV2(Provider):
    name = "deepseek_v2"
    family = "deepseek"
    model_types = ("deepseek_v2",)
    requires = _DEEPSEEK_REQUIRED
    routings = ("softmax", "softmax_group_topk")


@register_provider
class DeepseekV3(Provider):
    name = "deepseek_v3"
    family = "deepseek"
    model_types = ("deepseek_v3",)
    requires = (*_DEEPSEEK_REQUIRED, "n_group", "topk_group")
    routings = ("sigmoid_bias_group_topk", "sigmoid_bias")
