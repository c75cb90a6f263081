"""ModelSignature × ExecutionSignature → Plan. What no provider matched runs the plain path."""

from moefx.signatures.execution import ExecutionSignature
from moefx.signatures.model import ModelSignature
from moefx.signatures.plan import PassDecision, Plan
from moefx.signatures.resolve import resolve

__all__ = ["ExecutionSignature", "ModelSignature", "PassDecision", "Plan", "resolve"]
