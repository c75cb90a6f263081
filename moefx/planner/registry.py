"""Providers: one class per model family that turns a matching signature into a plan fragment.

A provider declares exactly which `model_types` it knows and which signature fields it needs. It
declines (returns None, with the reason recorded) when the model_type is not declared, a needed field
is missing, the routing kind or quantization format is not one it knows. A new model_type of the same
family therefore runs the plain path until someone adds it to `model_types`. What an architecture fixes
(`implied`) is a fact: moefx's own families keep it in `moefx/facts/architectures.py`, and a provider for a
model_type that table does not know adds its `family` and `implied` there when it is registered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from moefx.facts.architectures import register_architecture
from moefx.facts.execution import ExecutionSignature
from moefx.facts.model import ModelSignature
from moefx.planner.preferences import PlanFragment, moe_causal_lm_fragment

# Fields every MoE provider needs before it may plan anything.
MOE_REQUIRED = (
    "model_type",
    "dtype",
    "hidden_size",
    "num_layers",
    "vocab_size",
    "num_experts",
    "top_k",
    "moe_intermediate_size",
    "hidden_act",
    "routing",
    "norm_topk_prob",
)


class Provider:
    name: ClassVar[str]
    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    requires: ClassVar[tuple[str, ...]] = MOE_REQUIRED
    routings: ClassVar[tuple[str, ...]] = ("softmax",)
    # Expert activations the MoE backends implement (silu(gate) * up).
    activations: ClassVar[tuple[str, ...]] = ("silu",)

    @classmethod
    def implied(cls, get: Callable[[str], Any]) -> dict[str, Any]:
        """Facts the architecture fixes whatever the config says (`get` reads the raw config), for a model_type
        `moefx/facts/architectures.py` does not know. Only used for fields the config leaves unset."""
        return {}

    @classmethod
    def decline_reason(cls, ms: ModelSignature, es: ExecutionSignature) -> str | None:
        if ms.model_type not in cls.model_types:
            return f"model_type {ms.model_type!r} is not one of {list(cls.model_types)}"
        missing = [name for name in cls.requires if getattr(ms, name) is None]
        if missing:
            hint = " (the config states no dtype: set it there or give the ExecutionSignature a dtype)" \
                if "dtype" in missing else ""
            return f"missing signature fields {missing}{hint}"
        if ms.routing not in cls.routings:
            return f"routing {ms.routing!r} is not one of {list(cls.routings)}"
        if ms.hidden_act not in cls.activations:
            return f"expert activation {ms.hidden_act!r} is not one of {list(cls.activations)}"
        if ms.quant_method is not None and ms.quant_weight_dtype is None:
            return f"quantization {ms.quant_method!r} is not a format moefx understands"
        return None

    @classmethod
    def fragment(cls, ms: ModelSignature, es: ExecutionSignature) -> PlanFragment:
        return moe_causal_lm_fragment(cls.name, ms, es)

    @classmethod
    def plan(cls, ms: ModelSignature, es: ExecutionSignature) -> PlanFragment | None:
        """The fragment for this signature, or None whenever the provider declines."""
        return None if cls.decline_reason(ms, es) is not None else cls.fragment(ms, es)


PROVIDERS: dict[str, type[Provider]] = {}


def register_provider(cls: type[Provider]) -> type[Provider]:
    """Class decorator: make `cls` match its declared model_types (each model_type has one provider)."""
    for attr in ("name", "family", "model_types"):
        if not getattr(cls, attr, None):
            raise ValueError(f"provider {cls.__name__} must set {attr!r}")
    if cls.name in PROVIDERS:
        raise ValueError(f"provider {cls.name!r} is registered twice")
    for other in PROVIDERS.values():
        clash = set(cls.model_types) & set(other.model_types)
        if clash:
            raise ValueError(f"provider {cls.name!r} claims model_types {sorted(clash)} owned by {other.name!r}")
    for model_type in cls.model_types:
        register_architecture(model_type, cls.family, cls.implied)
    PROVIDERS[cls.name] = cls
    return cls


def provider_for(model_type: str | None) -> type[Provider] | None:
    """The provider that declares `model_type`, if any."""
    for provider in PROVIDERS.values():
        if model_type in provider.model_types:
            return provider
    return None


def match(ms: ModelSignature, es: ExecutionSignature) -> tuple[PlanFragment | None, str]:
    """(fragment, why) from the provider that declares ms.model_type; (None, why not) otherwise."""
    if ms.model_type is None:
        return None, "the config states no model_type"
    provider = provider_for(ms.model_type)
    if provider is None:
        return None, f"no provider declares model_type {ms.model_type!r}"
    reason = provider.decline_reason(ms, es)
    if reason is not None:
        return None, f"provider {provider.name} declined: {reason}"
    fragment = provider.plan(ms, es)
    if fragment is None:
        return None, f"provider {provider.name} declined"
    return fragment, f"provider {provider.name} matched model_type {ms.model_type!r}"
