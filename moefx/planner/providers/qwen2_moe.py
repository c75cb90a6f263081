"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): softmax top-k plus one gated shared expert."""

from __future__ import annotations

from moefx.planner.registry import MOE_REQUIRED, Provider, register_provider


@register_provider
class Qwen2Moe(Provider):
    name = "qwen2_moe"
    family = "qwen2_moe"
    model_types = ("qwen2_moe",)
    requires = (*MOE_REQUIRED, "shared_expert_intermediate_size")
