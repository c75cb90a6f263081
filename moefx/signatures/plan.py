"""Plan: every decision moefx applies to one (model, execution) pair, each with the source that made it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moefx.signatures.execution import ExecutionSignature
from moefx.signatures.model import ModelSignature


@dataclass
class PassDecision:
    supported: bool
    preferred: bool
    enabled: bool
    source: str  # who decided: "user config", "provider qwen3_moe", "rule file.yaml#2", "default off", ...
    reason: str = ""


@dataclass
class Plan:
    model: ModelSignature
    execution: ExecutionSignature
    profile: str  # provider name, or "unknown"
    passes: dict[str, PassDecision] = field(default_factory=dict)
    moe: Any = None  # moefx.backends.policy.MoePlan
    offload: Any = None  # moefx.offload.plan.OffloadPlan
    serving: dict[str, Any] = field(default_factory=dict)
    provenance: list[str] = field(default_factory=list)

    def pass_enabled(self, name: str) -> bool:
        decision = self.passes.get(name)
        return bool(decision and decision.enabled)

    def enabled_passes(self) -> list[str]:
        return [name for name, d in self.passes.items() if d.enabled]

    def decisions(self) -> list[str]:
        """One line per decision, `what = value  [source]`."""
        lines = [f"profile = {self.profile}"]
        for name, d in self.passes.items():
            state = "on" if d.enabled else "off"
            why = f" ({d.reason})" if d.reason else ""
            lines.append(f"pass {name} = {state}  [{d.source}]{why}")
        for section in (self.moe, self.offload):
            if section is not None:
                lines.extend(section.explain_lines())
        for key, value in self.serving.items():
            lines.append(f"serving {key} = {value}")
        return lines

    def explain(self) -> str:
        head = [
            f"model: {self.model.model_type or 'unknown'} (family {self.model.family or 'unknown'})",
            f"execution: {self.execution.device_type} {self.execution.device_name or ''} "
            f"mode={self.execution.mode}".rstrip(),
        ]
        return "\n".join(head + ["  " + line for line in self.decisions()])
