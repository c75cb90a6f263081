"""Plan: every decision moefx applies to one (model, execution) pair, each with the source that made it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from moefx.facts.execution import ExecutionSignature
from moefx.facts.model import ModelSignature


@dataclass
class PassDecision:
    supported: bool
    preferred: bool
    enabled: bool
    source: str  # who decided: "user config", "env MOEFX_PASSES", "rule f.yaml#2", "provider qwen3_moe", "default off"
    reason: str = ""


@dataclass
class Plan:
    model: ModelSignature
    execution: ExecutionSignature
    profile: str  # provider name, or "unknown"
    passes: dict[str, PassDecision] = field(default_factory=dict)
    moe: Any = None  # moefx.backends.policy.MoePlan
    dense: Any = None  # moefx.backends.dense_policy.DensePlan
    offload: Any = None  # moefx.offload.plan.OffloadPlan
    serving: dict[str, Any] = field(default_factory=dict)
    provenance: list[str] = field(default_factory=list)
    profile_reason: str = ""
    rule: str | None = None  # label of the first matching rule, if any
    serving_sources: dict[str, str] = field(default_factory=dict)

    def pass_enabled(self, name: str) -> bool:
        decision = self.passes.get(name)
        return bool(decision and decision.enabled)

    def enabled_passes(self) -> list[str]:
        return [name for name, d in self.passes.items() if d.enabled]

    def decisions(self) -> list[str]:
        """One line per decision, `what = value  [source] (why)`."""
        lines = [f"profile = {self.profile}  [{self.profile_reason or 'no provider'}]"]
        lines.append(f"rule = {self.rule or 'none'}  [{'first matching rule' if self.rule else 'no rule matched'}]")
        lines.append(self._parallel_line())
        for name, d in self.passes.items():
            state = "on" if d.enabled else "off"
            why = f" ({d.reason})" if d.reason else ""
            lines.append(f"pass {name} = {state}  [{d.source}]{why}")
        for section in (self.moe, self.dense, self.offload):
            if section is not None:
                lines.extend(section.explain_lines())
        for key, value in self.serving.items():
            lines.append(f"serving {key} = {value}  [{self.serving_sources.get(key, 'unknown source')}]")
        return lines

    def _parallel_line(self) -> str:
        es, info = self.execution, self.execution.parallel
        if info is None:
            return f"parallel tp = {es.tp_size}, ep = {es.ep_size}  [set in the execution signature]"
        return f"parallel tp = {es.tp_size}, ep = {es.ep_size}  [{info.source}] ({info.describe()})"

    def explain(self) -> str:
        head = [f"model: {self.model.describe()} (family {self.model.family or 'unknown'})",
                f"execution: {self.execution.describe()}"]
        tail = [f"  applied: {line}" for line in self.provenance]
        return "\n".join(head + ["  " + line for line in self.decisions()] + tail)

    def fingerprint(self, serving: bool = True) -> str:
        """Stable short hash of both signatures and every decision's value: a cache key that can never serve a
        graph built under a different plan. The text saying why (sources, reasons, notes, explain lines,
        provenance) is left out: it may quote what this process measured, such as the free memory a capture cap
        was read from, which differs between two processes that decide the same (`_decisions`). `serving=False`
        leaves out the serving hints too (capture sizes, a cap derived from free memory), which the engine reads
        and no compiled graph does."""
        data = self.to_dict()
        if not serving:
            data.pop("serving")
        blob = json.dumps(_decisions(data), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view (the MoE and offload sections as their explain lines plus fields when dataclasses)."""

        def section(obj: Any) -> Any:
            if obj is None:
                return None
            out = {"lines": obj.explain_lines()}
            if dataclasses.is_dataclass(obj):
                out["fields"] = {k: v for k, v in dataclasses.asdict(obj).items() if _jsonable(v)}
            return out

        return {
            "model": self.model.to_dict(),
            "execution": self.execution.to_dict(),
            "parallel": _parallel_dict(self.execution.parallel),
            "profile": self.profile,
            "profile_reason": self.profile_reason,
            "rule": self.rule,
            "passes": {name: dataclasses.asdict(d) for name, d in self.passes.items()},
            "moe": section(self.moe),
            "dense": section(self.dense),
            "offload": section(self.offload),
            "serving": dict(self.serving),
            "serving_sources": dict(self.serving_sources),
            "provenance": list(self.provenance),
        }


def _parallel_dict(info: Any) -> dict[str, Any] | None:
    """Where the sizes came from, without this process's ranks (every rank's plan is the same)."""
    if info is None:
        return None
    return {k: getattr(info, k) for k in ("tp_size", "ep_size", "world_size", "backend", "experts", "source")}


# Keys of `Plan.to_dict()` (at any depth) whose values explain a decision rather than make it.
_WHY_KEYS = ("source", "sources", "reason", "notes", "provenance")


def _decisions(value: Any) -> Any:
    """`value` without the keys that say why (`_WHY_KEYS`, also as suffixes such as `serving_sources`,
    `profile_reason`), nor a section's explain lines where its fields are kept."""
    if isinstance(value, dict):
        return {k: _decisions(v) for k, v in value.items()
                if not (isinstance(k, str) and (k.endswith(_WHY_KEYS) or (k == "lines" and "fields" in value)))}
    if isinstance(value, (list, tuple)):
        return [_decisions(v) for v in value]
    return value


def _jsonable(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, tuple, dict))
