"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): softmax top-k routing, no shared expert."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moefx.signatures.registry import Provider, register_provider


@register_provider
class Qwen3Moe(Provider):
    name = "qwen3_moe"
    family = "qwen3_moe"
    model_types = ("qwen3_moe",)

    @classmethod
    def implied(cls, get: Callable[[str], Any]) -> dict[str, Any]:
        return {"routing": "softmax", "num_shared_experts": 0, "first_dense_layers": 0}
