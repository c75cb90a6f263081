"""ModelSignature × ExecutionSignature → Plan. What no provider matched runs the plain path."""

from moefx.signatures import providers  # noqa: F401  (registers the built-in providers)
from moefx.signatures.execution import ExecutionSignature
from moefx.signatures.model import ModelSignature
from moefx.signatures.plan import PassDecision, Plan
from moefx.signatures.registry import PROVIDERS, PlanFragment, Provider, register_provider
from moefx.signatures.resolve import resolve
from moefx.signatures.rules import Rule, load_rules

__all__ = [
    "PROVIDERS",
    "ExecutionSignature",
    "ModelSignature",
    "PassDecision",
    "Plan",
    "PlanFragment",
    "Provider",
    "Rule",
    "load_rules",
    "register_provider",
    "resolve",
]
