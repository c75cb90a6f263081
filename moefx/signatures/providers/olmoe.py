"""OLMoE (OLMoE-1B-7B): softmax top-8 over 64 experts; each expert is `intermediate_size` wide."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moefx.signatures.registry import Provider, register_provider


@register_provider
class Olmoe(Provider):
    name = "olmoe"
    family = "olmoe"
    model_types = ("olmoe",)

    @classmethod
    def implied(cls, get: Callable[[str], Any]) -> dict[str, Any]:
        return {
            "routing": "softmax",
            "moe_intermediate_size": get("intermediate_size"),
            "num_shared_experts": 0,
            "first_dense_layers": 0,
        }
