"""MoE backend policy: which backend runs for each M range, and the table row (or override) that says so.

Precedence, highest first: the config's `moe_backend`, the environment (`MOEFX_MOE_BACKEND`, or the on/off
switch `MOEFX_USE_GEMV`), rule pins, then the calibration row whose key matches exactly. No row means
`upstream` (transformers' own experts path for HF models, `reference` for direct `moe_experts` calls): a
threshold is never guessed. Eager and CUDA-graph-capture calls have separate rows, and the choice depends
on shapes only (M = token rows of the call), so a captured graph never switches backend on data.

Rule pins (`pins`, from the signature rules) are a mapping with `backend: NAME` (every M) or
`ranges: "gemv@1-16,grouped@17-"` (or a list of {backend, min_m, max_m}), optional `mode: eager|capture`
(default both) and `source` (shown in the plan).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moefx.backends.calibration import (
    MODES,
    CalibrationKey,
    MRange,
    device_identity,
    find_row,
    merge_ranges,
    parse_ranges,
    ranges_text,
    validate_ranges,
)
from moefx.backends.registry import BACKENDS
from moefx.config import MOE_BACKENDS
from moefx.env import get_setting, setting_raw, setting_source
from moefx.log import warn_once

UPSTREAM = "upstream"
# Backends that wait on the host inside a call (reference: torch.unique/.tolist; cpu: copies the activations to
# host memory and computes there), so they cannot run inside CUDA-graph capture.
HOST_SYNCING_BACKENDS = frozenset({"reference", "cpu"})
# On/off switches of one backend each (on forces it, off turns its M ranges upstream), the older spelling of
# MOEFX_MOE_BACKEND; they must agree with it.
BACKEND_SWITCHES: dict[str, str] = {"MOEFX_USE_GEMV": "gemv"}
PIN_FIELDS = ("backend", "ranges", "mode", "source")


@dataclass(frozen=True)
class EnvOverride:
    forced: str | None = None  # a backend name forced for every call, None = auto
    source: str = ""
    disabled: frozenset[str] = frozenset()  # backends a backend switch turned off (their ranges run upstream)


def _enum_setting(environ: Mapping[str, str]) -> tuple[str, str]:
    return get_setting("MOEFX_MOE_BACKEND", environ), setting_source("MOEFX_MOE_BACKEND", environ)


def env_token() -> tuple[str | None, ...]:
    """The raw values of every variable `env_override()` reads: part of the op's memo key (kernels/memo.py)."""
    return (*setting_raw("MOEFX_MOE_BACKEND"), *(raw for var in BACKEND_SWITCHES for raw in setting_raw(var)))


def env_override(environ: Mapping[str, str] | None = None) -> EnvOverride:
    """Validated backend override from the environment; a backend switch that contradicts the enum is an error."""
    env = os.environ if environ is None else environ
    enum, enum_source = _enum_setting(env)
    forced = None if enum == "auto" else enum
    source = enum_source if forced else ""
    disabled: set[str] = set()
    for var, backend in BACKEND_SWITCHES.items():
        on = get_setting(var, env)
        if on is None:
            continue
        raw = env[var].strip()
        if forced is not None and (on != (forced == backend)):
            raise ValueError(
                f"conflicting MoE backend settings: {var}={raw!r} and MOEFX_MOE_BACKEND={enum!r}; "
                f"set only MOEFX_MOE_BACKEND (valid choices: {list(MOE_BACKENDS)})"
            )
        warn_once(f"environment variable {var} is an older spelling of MOEFX_MOE_BACKEND; use that (value kept)")
        if on and forced is None:
            forced, source = backend, f"env {var}"
        elif not on:
            disabled.add(backend)
    return EnvOverride(forced, source, frozenset(disabled))


@dataclass(frozen=True)
class MoePolicy:
    """M ranges -> backend for one mode, with where the ranges came from."""

    ranges: tuple[MRange, ...]
    source: str

    @classmethod
    def single(cls, backend: str, source: str) -> MoePolicy:
        return cls((MRange(backend, 1, None),), source)

    def backend_for(self, m: int) -> str:
        for r in self.ranges:
            if r.contains(m):
                return r.backend
        return self.ranges[0].backend  # M = 0: nothing runs, any backend answers

    def without(self, disabled: frozenset[str], why: str) -> MoePolicy:
        if not any(r.backend in disabled for r in self.ranges):
            return self
        ranges = [MRange(UPSTREAM if r.backend in disabled else r.backend, r.min_m, r.max_m) for r in self.ranges]
        return MoePolicy(validate_ranges(merge_ranges(ranges), self.source), f"{self.source}; {why}")


def policy_spec(policies: Mapping[str, MoePolicy]) -> str:
    """The compact string the op takes: 'eager=gemv@1-16,grouped@17-;capture=upstream@1-'."""
    return ";".join(f"{mode}={ranges_text(policies[mode].ranges)}" for mode in MODES)


def is_policy_spec(text: str) -> bool:
    return "=" in text


@functools.lru_cache(maxsize=256)
def parse_policy_spec(text: str) -> dict[str, MoePolicy]:
    out: dict[str, MoePolicy] = {}
    for part in text.split(";"):
        mode, _, ranges = part.partition("=")
        mode = mode.strip()
        if mode not in MODES or mode in out:
            raise ValueError(f"MoE policy spec {text!r}: mode {mode!r} is invalid or repeated; valid: {list(MODES)}")
        out[mode] = MoePolicy(parse_ranges(ranges, f"MoE policy spec {text!r}"), "policy spec")
    missing = [m for m in MODES if m not in out]
    if missing:
        raise ValueError(f"MoE policy spec {text!r} lacks modes {missing}")
    return out


@dataclass
class MoePlan:
    """The MoE section of a Plan: the requested backend and, per mode, the M ranges that will run."""

    backend: str = "auto"
    source: str = "no calibration row"
    policies: dict[str, MoePolicy] = field(default_factory=dict)
    key: str = ""  # the calibration key looked up (eager form), for explain()

    def policy(self, mode: str) -> MoePolicy:
        return self.policies.get(mode) or MoePolicy.single(UPSTREAM, self.source)

    @property
    def applies(self) -> bool:
        """True when some M range in some mode runs a moefx backend (not upstream)."""
        return any(r.backend != UPSTREAM for mode in MODES for r in self.policy(mode).ranges)

    def spec(self) -> str:
        return policy_spec({mode: self.policy(mode) for mode in MODES})

    def explain_lines(self) -> list[str]:
        lines = [f"moe backend = {self.backend}  [{self.source}]"]
        if self.key:
            lines.append(f"moe calibration key = {self.key}")
        for mode in MODES:
            pol = self.policy(mode)
            for r in pol.ranges:
                hi = "inf" if r.max_m is None else str(r.max_m)
                lines.append(f"moe {mode} M {r.min_m}..{hi} = {r.backend}  [{pol.source}]")
        return lines


def _pins_policies(pins: Mapping[str, Any]) -> tuple[dict[str, MoePolicy], str]:
    bad = [k for k in pins if k not in PIN_FIELDS]
    if bad or ("backend" in pins) == ("ranges" in pins):
        raise ValueError(f"MoE pins {dict(pins)!r}: need exactly one of 'backend'/'ranges'; valid fields {PIN_FIELDS}")
    source = str(pins.get("source") or "rule pin")
    where = f"MoE pins from {source}"
    if "backend" in pins:
        pol = MoePolicy.single(str(pins["backend"]), source)
    elif isinstance(pins["ranges"], str):
        pol = MoePolicy(parse_ranges(pins["ranges"], where), source)
    else:
        items = pins["ranges"]
        if not isinstance(items, list) or not all(isinstance(r, Mapping) for r in items):
            raise ValueError(f"{where}: 'ranges' must be a string or a list of {{backend, min_m, max_m}}")
        ranges = [MRange(str(r["backend"]), r["min_m"], r.get("max_m")) for r in items]
        pol = MoePolicy(validate_ranges(ranges, where), source)
    valid = sorted({*MOE_BACKENDS, *BACKENDS} - {"auto"})
    unknown = sorted({r.backend for r in pol.ranges} - set(valid))
    if unknown:
        raise ValueError(f"{where}: unknown MoE backend {unknown}; valid choices: {valid}")
    modes = MODES if pins.get("mode") is None else (pins["mode"],)
    if any(m not in MODES for m in modes):
        raise ValueError(f"{where}: mode {pins.get('mode')!r} is invalid; valid choices: {list(MODES)}")
    return {m: pol for m in modes}, source


def _quant_block(ms: Any) -> tuple[tuple[int, int] | None, str]:
    """FP8 block shape of the expert weights (None = unquantized), or a reason the format has no rows."""
    method = getattr(ms, "quant_method", None)
    if not method:
        return None, ""
    block = getattr(ms, "quant_block_shape", None)
    wdtype = getattr(ms, "quant_weight_dtype", None) or ""
    if not wdtype.startswith("float8") or not block or len(block) != 2:
        return None, f"quantization {method!r} ({wdtype or 'unknown dtype'}) is not a block-FP8 format"
    return (int(block[0]), int(block[1])), ""


def _expert_split(es: Any) -> tuple[int, int]:
    """(ways the expert intermediate dim is split, ways the experts are placed) on this execution.

    Experts are either sliced over the TP ranks (N = 2I / tp) or placed whole over the EP ranks (E / ep), as
    transformers' and vLLM's plans shard them; the layout detected from the model's weights decides where known.
    """
    tp, ep = max(int(es.tp_size), 1), max(int(es.ep_size), 1)
    layout = getattr(getattr(es, "parallel", None), "experts", None)
    if layout == "replicated":
        return 1, 1
    if layout == "tp":
        return tp, 1
    return (1, ep) if ep > 1 else (tp, 1)


def _row_key(ms: Any, es: Any, mode: str) -> tuple[CalibrationKey | None, str]:
    """The calibration key for this model on this execution, or None with the reason it cannot be formed."""
    needed = {"num_experts": ms.num_experts, "hidden_size": ms.hidden_size,
              "moe_intermediate_size": ms.moe_intermediate_size, "top_k": ms.top_k}
    missing = [k for k, v in needed.items() if not v]
    if missing:
        return None, f"model signature lacks {missing}"
    dtype = es.dtype or ms.dtype
    if dtype is None:
        return None, "no dtype in the model or execution signature"
    tp, ep = _expert_split(es)
    inter, experts = int(ms.moe_intermediate_size), int(ms.num_experts)
    if inter % tp or experts % ep:
        return None, f"moe_intermediate_size {inter} / tp {tp} or experts {experts} / ep {ep} does not divide"
    quant, why = _quant_block(ms)
    if why:
        return None, why
    if es.device_type == "cuda":
        name, cap, sms = es.device_name, es.capability, es.multiprocessor_count
    else:
        name, cap, sms = device_identity(es.device_type)
    key = CalibrationKey(
        device=str(name),
        capability=tuple(cap) if cap is not None else None,  # type: ignore[arg-type]
        multiprocessor_count=sms,
        E=experts // ep,
        N=2 * inter // tp,
        K=int(ms.hidden_size),
        top_k=int(ms.top_k),
        dtype=str(dtype).replace("torch.", ""),
        quant_block=quant,
        mode=mode,
    )
    return key, ""


def _capture_safe(pol: MoePolicy) -> MoePolicy:
    unsafe = frozenset(r.backend for r in pol.ranges) & HOST_SYNCING_BACKENDS
    if not unsafe:
        return pol
    return pol.without(unsafe, f"{', '.join(sorted(unsafe))} waits on the host: upstream inside capture")


def moe_plan(ms: Any, es: Any, cfg: Any, pins: dict | None = None) -> MoePlan:
    """Resolve the MoE section of the plan (see the module docstring for the precedence)."""
    env = env_override()
    if cfg.moe_backend != "auto":
        if env.forced and env.forced != cfg.moe_backend:
            warn_once(f"config moe_backend={cfg.moe_backend!r} wins over {env.source}={env.forced!r}")
        return _forced(cfg.moe_backend, "user config")
    if env.forced:
        return _forced(env.forced, env.source)
    if pins:
        policies, source = _pins_policies(pins)
        plan = MoePlan("auto", source)
    else:
        policies, plan = {}, MoePlan("auto", "calibration")
    from_rows: list[str] = []
    for mode in MODES:
        if mode in policies:
            continue
        key, why = _row_key(ms, es, mode)
        if key is None:
            policies[mode] = MoePolicy.single(UPSTREAM, why)
            continue
        if mode == "eager":
            plan.key = key.describe().replace(" mode=eager", "")
            tp, ep = _expert_split(es)
            if tp > 1 or ep > 1:
                plan.key += (f"  (per rank: E = {ms.num_experts} / ep {ep}, "
                             f"N = 2 x {ms.moe_intermediate_size} / tp {tp})")
        row = find_row(key, tuple(cfg.calibration))
        if row is None:
            policies[mode] = MoePolicy.single(UPSTREAM, f"no calibration row for {mode}")
        else:
            policies[mode] = MoePolicy(row.ranges, row.source)
            from_rows.append(mode)
    if env.disabled:
        why = f"{sorted(env.disabled)} turned off by {sorted(BACKEND_SWITCHES)}"
        policies = {m: p.without(env.disabled, why) for m, p in policies.items()}
    policies["capture"] = _capture_safe(policies["capture"])
    plan.policies = policies
    if not pins:
        plan.source = _calibration_summary(from_rows)
    return plan


def _calibration_summary(from_rows: list[str]) -> str:
    """What the calibration lookup found, for the `moe backend = auto` line (the per-range lines say why)."""
    if not from_rows:
        return "no calibration row matched: upstream for every M"
    missing = [m for m in MODES if m not in from_rows]
    return "calibration rows for every mode" if not missing else f"calibration row for {from_rows}, none for {missing}"


def _forced(backend: str, source: str) -> MoePlan:
    policies = {m: MoePolicy.single(backend, source) for m in MODES}
    policies["capture"] = _capture_safe(policies["capture"])
    return MoePlan(backend, source, policies)
