"""Dense-linear policy: which backend runs each `moefx::dense_linear` call, from calibration rows of the device.

Rows are keyed exactly like the MoE ones (device name, capability, multiprocessor count, N, K, dtype, quant block,
mode), with N the list of the call's weight rows: q/k/v in one call (`N: [4096, 512, 512]`) is its own row, as its
cuBLAS peer is three calls. dtype is the activation dtype (the output dtype for FP8 block weights, whose activations
are e4m3). They live under `dense_rows:` in the same YAML table folders as the MoE rows (`calibration.table_paths`),
usually a file of their own (`moefx calibrate --model M` writes them). A key with no row runs `upstream`: the call's
linears one by one, exactly the unfused computation; a threshold is never guessed.

Precedence per call, highest first: the op's `backend` argument when not "auto" (the config's `dense_backend`,
which the passes write into every call), `MOEFX_DENSE_BACKEND`, the exact row (up to the largest M it measured),
upstream. Eager and CUDA-graph
capture calls have separate rows, and the choice depends on shapes only (M = rows of X), so a captured graph never
switches backend on data.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moefx.backends import calibration
from moefx.backends.calibration import MODES, device_identity, dtype_name
from moefx.backends.policy import UPSTREAM, MoePolicy
from moefx.env import get_setting, setting_raw, setting_source

GEMV = "gemv"
RUNNERS = (GEMV, UPSTREAM)
TABLE_KEY = "dense_rows"
KEY_FIELDS = ("device", "capability", "multiprocessor_count", "N", "K", "dtype", "quant_block", "mode")
ENV = "MOEFX_DENSE_BACKEND"


@dataclass(frozen=True)
class DenseKey:
    device: str
    capability: tuple[int, int] | None
    multiprocessor_count: int | None
    N: tuple[int, ...]
    K: int
    dtype: str
    quant_block: tuple[int, int] | None
    mode: str

    def describe(self) -> str:
        cap = "cap=none" if self.capability is None else f"cap={self.capability[0]}.{self.capability[1]}"
        quant = "none" if self.quant_block is None else f"{self.quant_block[0]}x{self.quant_block[1]}"
        n = ",".join(str(v) for v in self.N)
        return (f"{self.device} {cap} sms={self.multiprocessor_count} N={n} K={self.K} {self.dtype} "
                f"quant={quant} mode={self.mode}")

    def to_yaml(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "capability": list(self.capability) if self.capability is not None else None,
            "multiprocessor_count": self.multiprocessor_count,
            "N": list(self.N),
            "K": self.K,
            "dtype": self.dtype,
            "quant_block": list(self.quant_block) if self.quant_block is not None else None,
            "mode": self.mode,
        }

    @classmethod
    def from_yaml(cls, data: Any, where: str) -> DenseKey:
        calibration.check_key_fields(data, where, KEY_FIELDS)
        ns = data["N"]
        if not isinstance(ns, list) or not ns or not all(_positive(v) for v in ns):
            raise ValueError(f"{where}: key field 'N' must be a non-empty list of positive integers, got {ns!r}")
        if not _positive(data["K"]):
            raise ValueError(f"{where}: key field 'K' must be a positive integer, got {data['K']!r}")
        return cls(
            device=str(data["device"]),
            capability=calibration._pair(data["capability"], "capability", where),
            multiprocessor_count=data["multiprocessor_count"],
            N=tuple(ns),
            K=data["K"],
            dtype=str(data["dtype"]),
            quant_block=calibration._pair(data["quant_block"], "quant_block", where),
            mode=data["mode"],
        )


def _positive(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


# Dense rows have the MoE rows' layout (ranges, provenance, timings) with a DenseKey as their key.
DenseRow = calibration.CalibrationRow


def _row_from_yaml(data: Any, where: str) -> DenseRow:
    return calibration.parse_row(data, where, DenseKey.from_yaml, backends=RUNNERS, label="dense row")


def load_dense_table(path: str | os.PathLike[str]) -> list[DenseRow]:
    """The `dense_rows` of one table file, validated (a file without them has none)."""
    return calibration.load_section(path, TABLE_KEY, _row_from_yaml, row_prefix="dense")


def find_dense_row(key: DenseKey, extra: Sequence[str] = ()) -> DenseRow | None:
    """The row with exactly this key (first in lookup order), or None. Cached until `calibration.invalidate()`."""
    return calibration.find_row(key, extra, load=load_dense_table)


@functools.lru_cache(maxsize=256)
def _row_policy(key: DenseKey, generation: int) -> tuple[MoePolicy, int | None, str] | None:
    """(the row's policy, the largest M it measured, its source) for `key`, built once per table generation: the
    op asks per call."""
    row = find_dense_row(key)
    if row is None:
        return None
    top = max((int(m) for ts in row.timings_us.values() for m in ts), default=None)
    return MoePolicy(row.ranges, row.source), top, row.source


def write_dense_row(path: str | os.PathLike[str], row: DenseRow) -> str:
    """Add `row` to the table at `path` (replacing one with the same key; other sections kept); returns its id."""
    header = "# moefx dense-linear calibration rows (moefx calibrate --model M). Keyed exactly; see docs/DENSE.md.\n"
    return calibration.write_section(path, TABLE_KEY, row, load_dense_table, header, row_prefix="dense")


def dense_key(
    device: torch.device | str,
    ns: Sequence[int],
    k: int,
    dtype: torch.dtype | str,
    quant_block: Sequence[int] | None,
    mode: str,
) -> DenseKey:
    name, cap, sms = device_identity(device)
    return DenseKey(name, cap, sms, tuple(int(n) for n in ns), int(k), dtype_name(dtype),
                    tuple(int(b) for b in quant_block) if quant_block is not None else None, mode)  # type: ignore[arg-type]


def env_token() -> tuple[str | None, ...]:
    """The raw values of the variables `env_override()` reads: part of the op's memo key (kernels/memo.py)."""
    return setting_raw(ENV)


def env_override() -> tuple[str | None, str]:
    """(backend forced by MOEFX_DENSE_BACKEND or None, its source)."""
    value = get_setting(ENV)
    return (None, "") if value == "auto" else (value, setting_source(ENV))


def requested(m: int, backend: str, key: DenseKey) -> tuple[str, str]:
    """(backend name, where the choice came from) for one call of M rows."""
    if backend != "auto":
        return backend, "forced by the caller"
    forced, source = env_override()
    if forced:
        return forced, source
    found = _row_policy(key, calibration._generation)
    if found is None:
        return UPSTREAM, f"no calibration row ({key.mode})"
    policy, top, source = found
    name = policy.backend_for(m)
    # A row's last range is open-ended, but the small-M kernel is only measured on the row's grid: past it (a
    # prefill of thousands of rows), the plain linears run.
    if name != UPSTREAM and top is not None and m > top:
        return UPSTREAM, f"{source}: M={m} is past the calibrated grid (largest M {top})"
    return name, source


# ------------------------------------------------------------------------------------------------ the plan


@dataclass
class DenseEntry:
    """One projection shape of the model and, per mode, the M ranges its calls will run."""

    label: str
    key: str  # the eager key, described
    policies: dict[str, MoePolicy] = field(default_factory=dict)

    @property
    def applies(self) -> bool:
        return any(r.backend != UPSTREAM for p in self.policies.values() for r in p.ranges)


@dataclass
class DensePlan:
    """The dense section of a Plan: the requested backend and each projection shape's per-mode ranges."""

    backend: str = "auto"
    source: str = "calibration"
    entries: list[DenseEntry] = field(default_factory=list)
    reason: str = ""  # why no projection shapes are listed

    @property
    def applies(self) -> bool:
        return any(e.applies for e in self.entries)

    def explain_lines(self) -> list[str]:
        lines = [f"dense backend = {self.backend}  [{self.source}] (calls of fuse_sibling_linears / dense_linears)"]
        if self.reason:
            lines.append(f"dense projections = none  [{self.reason}]")
        for e in self.entries:
            lines.append(f"dense {e.label} key = {e.key}  [shape from the model signature]")
            for mode in MODES:
                pol = e.policies[mode]
                for r in pol.ranges:
                    hi = "inf" if r.max_m is None else str(r.max_m)
                    lines.append(f"dense {e.label} {mode} M {r.min_m}..{hi} = {r.backend}  [{pol.source}]")
        return lines


def model_projections(ms: Any, es: Any) -> tuple[list[tuple[str, tuple[int, ...], int, bool]], str]:
    """(label, N per weight, K, quantized?) of the linears a decode step of this model runs per device, or a reason.

    Attention: q/k/v as one call and o; MoE: the router (never quantized by moefx.quantize); dense layers' and shared
    experts' gate/up as one call and down. Tensor parallel: column-parallel N and row-parallel K divided by tp.
    """
    h, heads = ms.hidden_size, ms.num_heads
    if not h or not heads:
        return [], "model signature lacks hidden_size or num_heads"
    tp = max(int(es.tp_size), 1)
    out: list[tuple[str, tuple[int, ...], int, bool]] = []
    if ms.attention != "mla":
        hd = ms.head_dim or h // heads
        kv = ms.num_kv_heads or heads
        if heads % tp == 0 and (kv % tp == 0 or kv < tp):
            q, kvn = heads * hd // tp, max(kv // tp, 1) * hd
            out += [("q/k/v", (q, kvn, kvn), h, True), ("o", (h,), q, True)]
    if ms.num_experts:
        out.append(("router", (int(ms.num_experts),), h, False))
    for label, inter in (("shared experts", ms.shared_expert_intermediate_size if ms.num_shared_experts else None),
                         ("mlp", ms.intermediate_size if ms.first_dense_layers else None)):
        if inter and inter % tp == 0:
            i = inter // tp
            out += [(f"{label} gate/up", (i, i), h, True), (f"{label} down", (h,), i, True)]
    return out, "" if out else "no projection shape follows from the signature"


def dense_plan(ms: Any, es: Any, cfg: Any) -> DensePlan:
    """Resolve the dense section of the plan: what each projection's calls will run (module docstring: precedence)."""
    from moefx.backends.policy import _quant_block

    forced, env_source = env_override()
    if cfg.dense_backend != "auto":
        plan = DensePlan(cfg.dense_backend, "user config")
    elif forced:
        plan = DensePlan(forced, env_source)
    else:
        plan = DensePlan()
    projections, why = model_projections(ms, es)
    dtype = es.dtype or ms.dtype
    if dtype is None:
        projections, why = [], "no dtype in the model or execution signature"
    quant, quant_why = _quant_block(ms)
    if quant_why:
        projections, why = [], quant_why
    plan.reason = why
    if es.device_type == "cuda":
        ident = (str(es.device_name), tuple(es.capability) if es.capability else None, es.multiprocessor_count)
    else:
        ident = device_identity(es.device_type)
    for label, ns, k, quantized in projections:
        entry = DenseEntry(label, "")
        for mode in MODES:
            key = DenseKey(*ident, ns, k, str(dtype), quant if quantized else None, mode)  # type: ignore[arg-type]
            if mode == "eager":
                entry.key = key.describe().replace(" mode=eager", "")
            if plan.backend != "auto":
                entry.policies[mode] = MoePolicy.single(plan.backend, plan.source)
                continue
            row = find_dense_row(key, tuple(cfg.calibration))
            entry.policies[mode] = (MoePolicy(row.ranges, row.source) if row is not None
                                    else MoePolicy.single(UPSTREAM, f"no calibration row for {mode}"))
        plan.entries.append(entry)
    return plan


def has_rows_for(ms: Any, es: Any) -> tuple[bool, str]:
    """Whether a shipped or user table has a row that runs gemv for one of this model's projections here (the
    providers' preference for the dense passes: without one they would only add a custom-op call per linear)."""
    from moefx.config import CompilationConfig

    plan = dense_plan(ms, es, CompilationConfig())
    if plan.backend != "auto":  # MOEFX_DENSE_BACKEND decides every call, rows or not
        return plan.backend == GEMV, f"dense backend {plan.backend} [{plan.source}]"
    hits = [e.label for e in plan.entries if e.applies]
    if hits:
        return True, f"dense calibration rows for {', '.join(hits)} on this device"
    return False, f"no dense calibration row runs gemv for this model's projections here ({plan.reason or 'no rows'})"
