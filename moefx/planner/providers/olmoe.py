"""OLMoE (OLMoE-1B-7B): softmax top-8 over 64 experts; each expert is `intermediate_size` wide."""

from __future__ import annotations

from moefx.planner.registry import Provider, register_provider


@register_provider
class Olmoe(Provider):
    name = "olmoe"
    family = "olmoe"
    model_types = ("olmoe",)
