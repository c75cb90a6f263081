"""User rules in YAML: match signature fields, then enable/disable passes or pin the MoE backend.

Schema (see docs/SIGNATURES.md and examples/rules.yaml):

    rules:
      - name: optional label
        match:                     # every condition must hold; a field that is unknown (None) never matches
          family: qwen3_moe        # scalar: equality (for tuple fields such as cpu_isa: "contains")
          device_name: {regex: "H(100|200)"}
          num_experts: {min: 64, max: 256}
          model_type: {in: [qwen3_moe, qwen2_moe]}
          execution.dtype: bfloat16   # `model.` / `execution.` prefix where both signatures have the field
        passes: {fuse_act_quant: true, last_token_logits: false}
        moe: {backend: gemv}       # or {ranges: "gemv@1-16,grouped@17-"}; optional mode: eager|capture

The first rule that matches wins. A malformed rule raises ValueError naming the file and rule index.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moefx.config import MODES, MOE_BACKEND_ALIASES, MOE_BACKENDS, PassConfig, did_you_mean, load_data_file
from moefx.facts.execution import DEVICE_TYPES, ExecutionSignature
from moefx.facts.model import ModelSignature
from moefx.log import warn_once
from moefx.planner.registry import PROVIDERS

_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelSignature)}
_EXEC_FIELDS = {f.name for f in dataclasses.fields(ExecutionSignature)}
_OPERATORS = ("eq", "in", "min", "max", "regex")
_RULE_KEYS = ("name", "match", "passes", "moe")
RULES_VERSIONS = (1,)  # rule-file schema versions this moefx reads


def pass_toggles() -> tuple[str, ...]:
    """Boolean PassConfig toggles: the names rules and MOEFX_PASSES may set."""
    hints = typing.get_type_hints(PassConfig)
    return tuple(f.name for f in dataclasses.fields(PassConfig) if hints[f.name] == (bool | None))


@dataclass(frozen=True)
class Condition:
    side: str  # "model" | "execution"
    field: str
    op: str
    value: Any

    def holds(self, ms: ModelSignature, es: ExecutionSignature) -> bool:
        actual = getattr(ms if self.side == "model" else es, self.field)
        if self.op == "eq" and self.value is None:
            return actual is None
        if actual is None:
            return False
        if self.op == "eq":
            if isinstance(actual, tuple) and not isinstance(self.value, tuple):
                return self.value in actual
            return actual == self.value
        if self.op == "in":
            return actual in self.value
        if self.op == "regex":
            return re.search(self.value, str(actual)) is not None
        if isinstance(actual, bool) or not isinstance(actual, (int, float)):
            return False
        return actual >= self.value if self.op == "min" else actual <= self.value


@dataclass(frozen=True)
class Rule:
    source: str
    index: int
    name: str | None = None
    conditions: tuple[Condition, ...] = ()
    passes: dict[str, bool] = field(default_factory=dict)
    moe: dict[str, str] | None = None

    @property
    def label(self) -> str:
        return f"rule {self.source}#{self.index}" + (f" ({self.name})" if self.name else "")

    def matches(self, ms: ModelSignature, es: ExecutionSignature) -> bool:
        return all(c.holds(ms, es) for c in self.conditions)


def _where(source: str, index: int) -> str:
    return f"{source}: rules[{index}]"


def _side(key: str, where: str) -> tuple[str, str]:
    prefix, dot, name = key.partition(".")
    if dot:
        if prefix not in ("model", "execution"):
            raise ValueError(f"{where}: match key {key!r}: prefix must be 'model.' or 'execution.'")
        valid = _MODEL_FIELDS if prefix == "model" else _EXEC_FIELDS
        if name not in valid:
            raise ValueError(f"{where}: match key {key!r}: unknown {prefix} field; valid: {sorted(valid)}")
        return prefix, name
    sides = [s for s, names in (("model", _MODEL_FIELDS), ("execution", _EXEC_FIELDS)) if key in names]
    if not sides:
        raise ValueError(
            f"{where}: match key {key!r} is not a signature field; valid: {sorted(_MODEL_FIELDS | _EXEC_FIELDS)}"
        )
    if len(sides) == 2:
        raise ValueError(f"{where}: match key {key!r} is in both signatures; write model.{key} or execution.{key}")
    return sides[0], key


def _frozen(value: Any) -> Any:
    """YAML lists -> tuples, so `capability: [9, 0]` compares equal to the signature's (9, 0)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _conditions(key: str, spec: Any, where: str) -> list[Condition]:
    side, name = _side(key, where)
    if not isinstance(spec, dict):
        spec = {"eq": spec}
    if not spec:
        raise ValueError(f"{where}: match key {key!r} has an empty condition; operators: {list(_OPERATORS)}")
    out = []
    for op, value in spec.items():
        if op not in _OPERATORS:
            raise ValueError(f"{where}: match key {key!r}: unknown operator {op!r}; valid: {list(_OPERATORS)}")
        if op in ("min", "max") and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{where}: match key {key!r}: {op} must be a number, got {value!r}")
        if op == "in" and not isinstance(value, list):
            raise ValueError(f"{where}: match key {key!r}: 'in' must be a list, got {value!r}")
        if op == "regex":
            try:
                re.compile(str(value))
            except re.error as exc:
                raise ValueError(f"{where}: match key {key!r}: bad regex {value!r}: {exc}") from exc
            value = str(value)
        out.append(Condition(side, name, op, _frozen(value)))
    for cond in out:
        _check_reachable(cond, key, where)
    return out


def _registered_families() -> tuple[str, ...]:
    return tuple(sorted({p.family for p in PROVIDERS.values()}))


def _check_reachable(cond: Condition, key: str, where: str) -> None:
    """An equality or `in` condition on a value no signature can hold would never match, and say nothing:
    a device_type or mode outside the ExecutionSignature's choices is a ValueError; a family that no registered
    provider declares is a warning (only a hand-written signature that states it can have it)."""
    if cond.op not in ("eq", "in") or cond.value is None:
        return
    values = cond.value if cond.op == "in" else (cond.value,)
    if cond.side == "execution" and cond.field in ("device_type", "mode"):
        valid = DEVICE_TYPES if cond.field == "device_type" else MODES
        bad = [v for v in values if v not in valid]
        if bad:
            raise ValueError(f"{where}: match key {key!r}: {bad[0]!r} is no value an ExecutionSignature can hold, "
                             f"so the rule would never match; valid choices: {list(valid)}"
                             f"{did_you_mean(str(bad[0]), valid)}")
    elif (cond.side, cond.field) == ("model", "family"):
        families = _registered_families()
        bad = [v for v in values if v not in families]
        if bad:
            warn_once(f"{where}: match key {key!r}: no registered provider has family {bad[0]!r}, so the rule "
                      f"matches only a hand-written signature that states it; registered families: {list(families)}"
                      f"{did_you_mean(str(bad[0]), families)}")


def _passes(spec: Any, where: str) -> dict[str, bool]:
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: 'passes' must be a mapping of pass name to true/false")
    valid = pass_toggles()
    for name, value in spec.items():
        if name not in valid:
            raise ValueError(f"{where}: unknown pass {name!r}; valid passes: {list(valid)}")
        if not isinstance(value, bool):
            raise ValueError(f"{where}: pass {name!r} must be true or false, got {value!r}")
    return dict(spec)


def _moe(spec: Any, where: str) -> dict[str, str]:
    shape = "{backend: NAME} or {ranges: 'gemv@1-16,grouped@17-'}, optionally with mode: eager|capture"
    if not isinstance(spec, dict) or set(spec) - {"backend", "ranges", "mode"} or ("backend" in spec) == (
        "ranges" in spec
    ):
        raise ValueError(f"{where}: 'moe' must be {shape}")
    out: dict[str, str] = {}
    if spec.get("mode") is not None:
        if spec["mode"] not in ("eager", "capture"):
            raise ValueError(f"{where}: moe mode {spec['mode']!r} is invalid; valid choices: ['eager', 'capture']")
        out["mode"] = spec["mode"]
    backends = [b for b in MOE_BACKENDS if b != "auto"]
    if "backend" in spec:
        backend = MOE_BACKEND_ALIASES.get(spec["backend"], spec["backend"])
        if backend not in backends:
            raise ValueError(f"{where}: moe backend {spec['backend']!r} is invalid; valid choices: {backends}")
        return {**out, "backend": backend}
    from moefx.backends.calibration import parse_ranges

    ranges = parse_ranges(str(spec["ranges"]), f"{where}: moe ranges")
    bad = sorted({r.backend for r in ranges} - set(backends))
    if bad:
        raise ValueError(f"{where}: moe ranges name unknown backends {bad}; valid choices: {backends}")
    return {**out, "ranges": str(spec["ranges"])}


def parse_rule(data: Any, source: str, index: int) -> Rule:
    where = _where(source, index)
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a rule must be a mapping with keys {list(_RULE_KEYS)}")
    unknown = sorted(set(data) - set(_RULE_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown rule keys {unknown}; valid keys: {list(_RULE_KEYS)}")
    match = data.get("match")
    if not isinstance(match, dict) or not match:
        raise ValueError(f"{where}: 'match' must be a non-empty mapping of signature field to condition")
    if "passes" not in data and "moe" not in data:
        raise ValueError(f"{where}: a rule must set 'passes' and/or 'moe'")
    name = data.get("name")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"{where}: 'name' must be a string")
    conditions = [c for key, spec in match.items() for c in _conditions(str(key), spec, where)]
    return Rule(
        source=source,
        index=index,
        name=name,
        conditions=tuple(conditions),
        passes=_passes(data.get("passes", {}), where),
        moe=_moe(data["moe"], where) if "moe" in data else None,
    )


def load_rules(path: str | Path) -> list[Rule]:
    """Parse and validate a rule file; rules keep file order (the first match wins)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"rule file {str(p)!r} does not exist")
    data = load_data_file(p, "rule file")
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
        raise ValueError(f"rule file {str(p)!r} must be a mapping with a 'rules' list")
    extra = sorted(set(data) - {"rules", "version"})
    if extra:
        raise ValueError(f"rule file {str(p)!r}: unknown top-level keys {extra}; valid keys: ['rules', 'version']")
    version = data.get("version", 1)
    if version not in RULES_VERSIONS or isinstance(version, bool):
        raise ValueError(f"rule file {str(p)!r}: version {version!r} is not supported; valid versions: "
                         f"{list(RULES_VERSIONS)}")
    return [parse_rule(item, str(p), i) for i, item in enumerate(data["rules"])]


def first_match(rules: list[Rule], ms: ModelSignature, es: ExecutionSignature) -> Rule | None:
    return next((r for r in rules if r.matches(ms, es)), None)
