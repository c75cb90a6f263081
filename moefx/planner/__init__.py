"""The planner: ModelSignature × ExecutionSignature → Plan. What no provider matched runs the plain path.

Above backends, offload, parallel and passes, whose plans it asks for; importing it registers the built-in
providers (`providers/`, one file per family).
"""

from moefx.planner import providers  # noqa: F401  (registers the built-in providers)
from moefx.planner.plan import PassDecision, Plan
from moefx.planner.preferences import PlanFragment
from moefx.planner.registry import MOE_REQUIRED, PROVIDERS, Provider, register_provider
from moefx.planner.resolve import resolve
from moefx.planner.rules import Rule, load_rules

__all__ = [
    "MOE_REQUIRED",
    "PROVIDERS",
    "PassDecision",
    "Plan",
    "PlanFragment",
    "Provider",
    "Rule",
    "load_rules",
    "register_provider",
    "resolve",
]
