"""Mixtral (8x7B, 8x22B): softmax top-2, renormalized; each expert is `intermediate_size` wide."""

from __future__ import annotations

from moefx.planner.registry import Provider, register_provider


@register_provider
class Mixtral(Provider):
    name = "mixtral"
    family = "mixtral"
    model_types = ("mixtral",)
