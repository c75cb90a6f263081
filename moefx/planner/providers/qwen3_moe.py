"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): softmax top-k routing, no shared expert."""

from __future__ import annotations

from moefx.planner.registry import Provider, register_provider


@register_provider
class Qwen3Moe(Provider):
    name = "qwen3_moe"
    family = "qwen3_moe"
    model_types = ("qwen3_moe",)
