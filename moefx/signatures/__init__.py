"""The published import path of signatures and planning: `from moefx.signatures import ModelSignature, resolve`.

It only hands names on: the facts live in `moefx.facts`, the planner in `moefx.planner`, and no moefx module
imports this one.
"""

from moefx.facts import ExecutionSignature, ModelSignature
from moefx.planner import (
    MOE_REQUIRED,
    PROVIDERS,
    PassDecision,
    Plan,
    PlanFragment,
    Provider,
    Rule,
    load_rules,
    register_provider,
    resolve,
)

__all__ = [
    "MOE_REQUIRED",
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
