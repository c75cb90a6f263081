"""Mixtral (8x7B, 8x22B): softmax top-2, renormalized; each expert is `intermediate_size` wide."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moefx.signatures.registry import Provider, register_provider


@register_provider
class Mixtral(Provider):
    name = "mixtral"
    family = "mixtral"
    model_types = ("mixtral",)

    @classmethod
    def implied(cls, get: Callable[[str], Any]) -> dict[str, Any]:
        return {
            "routing": "softmax",
            "norm_topk_prob": True,
            "moe_intermediate_size": get("intermediate_size"),
            "num_shared_experts": 0,
            "first_dense_layers": 0,
        }
