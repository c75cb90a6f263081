"""DeepSeek-V2/V3 (MLA attention, routed + shared experts, dense first layers).

V2 scores with softmax (group-limited top-k when `topk_method` says so); V3 scores with sigmoid plus a
correction bias and group top-k. transformers' config classes do not keep `scoring_func`, so these
facts come from the architecture when the config omits them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moefx.signatures.registry import MOE_REQUIRED, Provider, register_provider

_DEEPSEEK_REQUIRED = (*MOE_REQUIRED, "num_shared_experts", "first_dense_layers", "kv_lora_rank")


def _mla_facts(get: Callable[[str], Any]) -> dict[str, Any]:
    """Shared-expert width (n_shared x expert width) and head_dim as transformers defines it for MLA
    (the rotary part, qk_rope_head_dim)."""
    shared, width = get("n_shared_experts"), get("moe_intermediate_size")
    return {
        "shared_expert_intermediate_size": shared * width if shared is not None and width is not None else None,
        "head_dim": get("qk_rope_head_dim"),
    }


@register_provider
class DeepseekV2(Provider):
    name = "deepseek_v2"
    family = "deepseek"
    model_types = ("deepseek_v2",)
    requires = _DEEPSEEK_REQUIRED
    routings = ("softmax", "softmax_group_topk")

    @classmethod
    def implied(cls, get: Callable[[str], Any]) -> dict[str, Any]:
        method = get("topk_method")
        routing = {"greedy": "softmax", "group_limited_greedy": "softmax_group_topk"}.get(method)
        return {"routing": routing, **_mla_facts(get)}


@register_provider
class DeepseekV3(Provider):
    name = "deepseek_v3"
    family = "deepseek"
    model_types = ("deepseek_v3",)
    requires = (*_DEEPSEEK_REQUIRED, "n_group", "topk_group")
    routings = ("sigmoid_bias_group_topk", "sigmoid_bias")

    @classmethod
    def implied(cls, get: Callable[[str], Any]) -> dict[str, Any]:
        grouped = (get("n_group") or 1) > 1
        return {
            "routing": "sigmoid_bias_group_topk" if grouped else "sigmoid_bias",
            **_mla_facts(get),
        }
