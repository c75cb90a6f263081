"""MoE calibration tables: which backend is fastest for each M range, measured on one exact device and shape.

A row is keyed exactly (device name, capability, multiprocessor count, E, N, K, top_k, dtype, quant block,
mode) and carries its provenance (date, torch/triton versions, command). Tables are YAML files: the ones
shipped in `moefx/backends/tables/`, the user's folder (`$XDG_CONFIG_HOME/moefx/calibration`, default
`~/.config/moefx/calibration`) and any paths in the config's `calibration` list. Lookups never guess:
a key with no row finds nothing, and the caller runs the plain path.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from moefx.config import MOE_BACKEND_ALIASES, load_data_file
from moefx.log import warn_once
from moefx.machine import cpu_model, unwritable

PACKAGE_TABLES = Path(__file__).parent / "tables"
MODES = ("eager", "capture")
KEY_FIELDS = ("device", "capability", "multiprocessor_count", "E", "N", "K", "top_k", "dtype", "quant_block", "mode")
ROW_FIELDS = ("key", "ranges", "provenance", "timings_us")


def user_table_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "moefx" / "calibration"


def device_identity(device: torch.device | str) -> tuple[str, tuple[int, int] | None, int | None]:
    """(name, capability, multiprocessor count) the way calibration rows spell them; CPUs count threads."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return _cuda_identity(dev.index if dev.index is not None else torch.cuda.current_device())
    if dev.type == "cpu":
        return f"cpu: {cpu_model()}", None, torch.get_num_threads()
    return dev.type, None, None


@functools.cache
def _cuda_identity(index: int) -> tuple[str, tuple[int, int] | None, int | None]:
    props = torch.cuda.get_device_properties(index)
    return props.name, (props.major, props.minor), props.multi_processor_count


def check_key_fields(data: Any, where: str, fields: tuple[str, ...]) -> None:
    """ValueError unless a table row's `key` is a mapping of exactly `fields` with a valid mode."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: 'key' must be a mapping with fields {list(fields)}")
    missing = [f for f in fields if f not in data]
    extra = [f for f in data if f not in fields]
    if missing or extra:
        raise ValueError(f"{where}: key fields missing {missing} / unknown {extra}; valid fields: {list(fields)}")
    if data["mode"] not in MODES:
        raise ValueError(f"{where}: key mode {data['mode']!r} is invalid; valid choices: {list(MODES)}")


@dataclass(frozen=True)
class CalibrationKey:
    device: str
    capability: tuple[int, int] | None
    multiprocessor_count: int | None
    E: int
    N: int
    K: int
    top_k: int
    dtype: str
    quant_block: tuple[int, int] | None
    mode: str

    def describe(self) -> str:
        cap = "cap=none" if self.capability is None else f"cap={self.capability[0]}.{self.capability[1]}"
        quant = "none" if self.quant_block is None else f"{self.quant_block[0]}x{self.quant_block[1]}"
        return (
            f"{self.device} {cap} sms={self.multiprocessor_count} E={self.E} N={self.N} K={self.K} "
            f"top_k={self.top_k} {self.dtype} quant={quant} mode={self.mode}"
        )

    def to_yaml(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "capability": list(self.capability) if self.capability is not None else None,
            "multiprocessor_count": self.multiprocessor_count,
            "E": self.E,
            "N": self.N,
            "K": self.K,
            "top_k": self.top_k,
            "dtype": self.dtype,
            "quant_block": list(self.quant_block) if self.quant_block is not None else None,
            "mode": self.mode,
        }

    @classmethod
    def from_yaml(cls, data: Any, where: str) -> CalibrationKey:
        check_key_fields(data, where, KEY_FIELDS)
        for name in ("E", "N", "K", "top_k"):
            if isinstance(data[name], bool) or not isinstance(data[name], int) or data[name] < 1:
                raise ValueError(f"{where}: key field {name!r} must be a positive integer, got {data[name]!r}")
        return cls(
            device=str(data["device"]),
            capability=_pair(data["capability"], "capability", where),
            multiprocessor_count=data["multiprocessor_count"],
            E=data["E"],
            N=data["N"],
            K=data["K"],
            top_k=data["top_k"],
            dtype=str(data["dtype"]),
            quant_block=_pair(data["quant_block"], "quant_block", where),
            mode=data["mode"],
        )


def _pair(value: Any, name: str, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(isinstance(v, int) for v in value):
        raise ValueError(f"{where}: key field {name!r} must be null or a pair of integers, got {value!r}")
    return (value[0], value[1])


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).replace("torch.", "")


def key_for_tensors(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    block_shape: Sequence[int] | None,
    mode: str,
) -> CalibrationKey:
    """The row key of one `moe_experts` call (N = 2I rows of w13, K = H)."""
    name, cap, sms = device_identity(hidden.device)
    return CalibrationKey(
        device=name,
        capability=cap,
        multiprocessor_count=sms,
        E=int(w13.shape[0]),
        N=int(w13.shape[1]),
        K=int(w13.shape[2]),
        top_k=int(topk_ids.shape[-1]),
        dtype=dtype_name(hidden.dtype),
        quant_block=tuple(int(b) for b in block_shape) if block_shape is not None else None,  # type: ignore[arg-type]
        mode=mode,
    )


@dataclass(frozen=True)
class MRange:
    """Backend `backend` for min_m <= M <= max_m (max_m None = no upper bound)."""

    backend: str
    min_m: int
    max_m: int | None

    def __post_init__(self) -> None:
        # a backend's other name (a table, pin or policy spec written with it) runs as the backend it names
        object.__setattr__(self, "backend", MOE_BACKEND_ALIASES.get(self.backend, self.backend))

    def contains(self, m: int) -> bool:
        return m >= self.min_m and (self.max_m is None or m <= self.max_m)

    def text(self) -> str:
        hi = "" if self.max_m is None else str(self.max_m)
        return f"{self.backend}@{self.min_m}-{hi}"


def validate_ranges(ranges: Sequence[MRange], where: str) -> tuple[MRange, ...]:
    """Ranges must start at M=1, be contiguous and end unbounded, so every M has exactly one backend."""
    if not ranges:
        raise ValueError(f"{where}: 'ranges' is empty; it must cover M from 1 with no upper bound at the end")
    expect = 1
    for i, r in enumerate(ranges):
        if r.min_m != expect:
            raise ValueError(f"{where}: range {i} ({r.text()}) starts at M={r.min_m}, expected M={expect}")
        last = i == len(ranges) - 1
        if (r.max_m is None) != last:
            raise ValueError(f"{where}: only the last range is unbounded; range {i} is {r.text()}")
        if r.max_m is not None:
            if r.max_m < r.min_m:
                raise ValueError(f"{where}: range {i} ({r.text()}) ends before it starts")
            expect = r.max_m + 1
    return tuple(ranges)


def parse_ranges(text: str, where: str) -> tuple[MRange, ...]:
    """'gemv@1-16,grouped@17-' -> ranges (the compact form used in policy specs and rule pins)."""
    out = []
    for part in text.split(","):
        backend, sep, span = part.strip().partition("@")
        lo, dash, hi = span.partition("-")
        if not sep or not dash or not backend or not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"{where}: range {part.strip()!r} must look like 'backend@MIN-MAX' or 'backend@MIN-'")
        out.append(MRange(backend, int(lo), int(hi) if hi else None))
    return validate_ranges(out, where)


def ranges_text(ranges: Iterable[MRange]) -> str:
    return ",".join(r.text() for r in ranges)


@dataclass(frozen=True)
class CalibrationRow:
    key: Any  # CalibrationKey (MoE rows) or dense_policy.DenseKey (dense rows)
    ranges: tuple[MRange, ...]
    provenance: dict[str, Any]
    source: str  # "file.yaml#3" (1-based row number)
    timings_us: dict[str, dict[int, float]] = field(default_factory=dict, compare=False)

    def to_yaml(self) -> dict[str, Any]:
        return {
            "key": self.key.to_yaml(),
            "ranges": [{"backend": r.backend, "min_m": r.min_m, "max_m": r.max_m} for r in self.ranges],
            "provenance": dict(self.provenance),
            "timings_us": {b: {int(m): round(float(t), 2) for m, t in ts.items()} for b, ts in self.timings_us.items()},
        }


def _row_from_yaml(data: Any, where: str) -> CalibrationRow:
    return parse_row(data, where, CalibrationKey.from_yaml)


def parse_row(data: Any, where: str, key_from_yaml: Callable[[Any, str], Any], backends: Collection[str] = (),
              label: str = "row") -> CalibrationRow:
    """One table row (MoE or dense: `key_from_yaml` reads the key); `backends`, when given, are the valid names."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a {label} must be a mapping with fields {list(ROW_FIELDS)}")
    extra = [f for f in data if f not in ROW_FIELDS]
    if extra or "key" not in data or "ranges" not in data or "provenance" not in data:
        raise ValueError(
            f"{where}: {label} needs 'key', 'ranges', 'provenance' (optional 'timings_us'); unknown fields {extra}"
        )
    key = key_from_yaml(data["key"], where)
    raw = data["ranges"]
    fields = {"backend", "min_m", "max_m"}
    if not isinstance(raw, list) or not all(isinstance(r, dict) and set(r) == fields for r in raw):
        raise ValueError(f"{where}: 'ranges' must be a list of {{backend, min_m, max_m}} mappings")
    ranges = validate_ranges([MRange(str(r["backend"]), r["min_m"], r["max_m"]) for r in raw], where)
    bad = sorted({r.backend for r in ranges} - set(backends)) if backends else []
    if bad:
        what = label.replace("row", "backend")
        raise ValueError(f"{where}: {what} {bad} is invalid; valid choices: {list(backends)}")
    prov = data["provenance"]
    if not isinstance(prov, dict) or not prov.get("date"):
        raise ValueError(f"{where}: 'provenance' must be a mapping with at least a 'date' (where the row came from)")
    timings = {MOE_BACKEND_ALIASES.get(str(b), str(b)): {int(m): float(t) for m, t in ts.items()}
               for b, ts in (data.get("timings_us") or {}).items()}
    return CalibrationRow(key, ranges, prov, where, timings)


def load_table(path: str | os.PathLike[str]) -> list[CalibrationRow]:
    """Rows of one table file, validated; a malformed file is a ValueError naming the file and row."""
    return load_section(path, "rows", _row_from_yaml)


def load_section(path: str | os.PathLike[str], section: str, parse: Callable[[Any, str], CalibrationRow],
                 row_prefix: str = "") -> list[CalibrationRow]:
    """The rows under `section` of one table file (a file without that section has none), each parsed by
    `parse(data, "file.yaml#<row_prefix><n>")`; two rows with one key are an error. The MoE rows live under
    `rows`, the dense-linear rows (backends/dense_policy.py) under `dense_rows`, in the same files."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"calibration table {str(p)!r} is a folder; valid: a table file (.yaml) such as "
                         f"`moefx calibrate --output` writes")
    if not p.is_file():
        raise ValueError(f"calibration table {str(p)!r} does not exist")
    data = load_data_file(p, "calibration table")
    if data is None:
        raise ValueError(f"calibration table {str(p)!r} is empty; valid: a mapping with a 'rows' or 'dense_rows' "
                         f"list (`moefx calibrate` writes one; delete the file to drop its rows)")
    if not isinstance(data, dict) or not isinstance(data.get(section, []), list):
        raise ValueError(f"calibration table {str(p)!r} must be a mapping with a {section!r} list")
    rows = [parse(r, f"{p.name}#{row_prefix}{i + 1}") for i, r in enumerate(data.get(section) or [])]
    seen: dict[Any, str] = {}
    for row in rows:
        if row.key in seen:
            raise ValueError(f"calibration table {str(p)!r}: rows {seen[row.key]} and {row.source} have the same key")
        seen[row.key] = row.source
    return rows


def write_section(path: str | os.PathLike[str], section: str, row: CalibrationRow,
                  load: Callable[[Path], list[CalibrationRow]], header: str, row_prefix: str = "") -> str:
    """Add `row` under `section` of the table at `path` (replacing the row with its key; the file's other sections
    are kept); returns the row's source id."""
    p = Path(path)
    data = (yaml.safe_load(p.read_text()) or {}) if p.is_file() else {}
    rows = [r for r in load(p) if r.key != row.key] if data else []  # an empty file is written afresh
    rows.append(row)
    data[section] = [r.to_yaml() for r in rows]
    tmp = p.with_suffix(p.suffix + ".tmp")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
        tmp.replace(p)
    except OSError as exc:  # the measured row is printed by the caller; the table write must not lose it
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        warn_once(f"calibration table {str(p)!r} could not be written ({type(exc).__name__}: {exc}); the row "
                  f"is not saved")
        return f"(not saved to {p.name})"
    invalidate()
    return f"{p.name}#{row_prefix}{len(rows)}"


def write_problem(path: str | os.PathLike[str]) -> str | None:
    """Why a calibration table cannot be written at `path` (None: it can), so a calibration stops before it
    measures, not after."""
    why = unwritable(Path(path))
    return f"calibration table {str(path)!r} cannot be written ({why}); give --output a writable path" if why else None


def table_paths(extra: Sequence[str] = ()) -> list[Path]:
    """Lookup order: config paths, then the user's folder, then the tables shipped in the package."""
    user = user_table_dir()
    found = [Path(p) for p in extra]
    for folder in (user, PACKAGE_TABLES):
        try:
            if folder.is_dir():
                found.extend(sorted(folder.glob("*.yaml")))
            elif folder.exists():  # e.g. a file where the user folder belongs: said, not silently skipped
                warn_once(f"calibration folder {str(folder)!r} is not a folder; its tables are not used (valid: a "
                          f"folder of *.yaml tables, or nothing there)")
        except OSError as exc:  # an unreadable user folder: the shipped tables still decide
            warn_once(f"calibration folder {str(folder)!r} could not be read ({type(exc).__name__}: {exc}); "
                      f"its tables are not used")
    return found


_generation = 0


def invalidate() -> None:
    """Forget cached lookups (after a table was written in this process)."""
    global _generation
    _generation += 1
    _index.cache_clear()


@functools.lru_cache(maxsize=64)
def _index(extra: tuple[str, ...], generation: int,
           load: Callable[[str], list[CalibrationRow]]) -> dict[Any, CalibrationRow]:
    index: dict[Any, CalibrationRow] = {}
    for path in table_paths(extra):
        for row in load(path):
            index.setdefault(row.key, row)
    return index


def find_row(key: Any, extra: Sequence[str] = (), load: Callable[[str], list[CalibrationRow]] | None = None
             ) -> CalibrationRow | None:
    """The row with exactly this key (first in lookup order), or None; `load` reads one table file's rows of the
    key's kind (default: the MoE rows, `load_table`).

    Folders are listed once per process (and again after `invalidate()`), so per-call lookups stay cheap.
    """
    return _index(tuple(extra), _generation, load or load_table).get(key)


def crossover_ranges(timings_us: dict[str, dict[int, float]], tolerance: float = 0.03,
                     pinned: Mapping[int, str] | None = None) -> tuple[MRange, ...]:
    """Fastest backend per measured M, turned into contiguous ranges; `pinned` M keep their given backend (the
    points the timing noise left undecided: `moefx calibrate` pins them to the default).

    The previous M's winner is kept while it stays within `tolerance` of the fastest, so timing noise
    between near-equal backends does not split the M axis into slivers; a backend that wins at one grid
    point only, between two points that another backend wins, loses that point to it too (latency is smooth
    in M, so a lone win is noise: eager timings, launch overhead included, jump by 25% from one M to the next).
    Between two measured M with different winners the boundary is where their latencies cross, interpolated
    linearly in log M; the last winner covers every larger M.
    """
    ms = sorted({m for ts in timings_us.values() for m in ts})
    if not ms:
        raise ValueError("no timings to find crossovers from")
    pinned = pinned or {}
    best: list[str] = []
    for m in ms:
        if m in pinned:
            best.append(pinned[m])
            continue
        fastest_t, fastest = min((ts[m], b) for b, ts in sorted(timings_us.items()) if m in ts)
        prev = best[-1] if best else None
        keep = prev is not None and m in timings_us[prev] and timings_us[prev][m] <= fastest_t * (1 + tolerance)
        best.append(prev if keep else fastest)  # type: ignore[arg-type]
    for i in range(1, len(ms) - 1):
        if best[i - 1] == best[i + 1] != best[i] and ms[i] in timings_us[best[i - 1]] and ms[i] not in pinned:
            best[i] = best[i - 1]
    out: list[MRange] = []
    lo = 1
    for i in range(len(ms) - 1):
        a, b = best[i], best[i + 1]
        if a == b:
            continue
        m0, m1 = ms[i], ms[i + 1]
        d0 = timings_us[a][m0] - timings_us[b].get(m0, math.inf)
        d1 = timings_us[a].get(m1, math.inf) - timings_us[b][m1]
        cut = m0
        if math.isfinite(d0) and math.isfinite(d1) and d1 > d0:
            frac = -d0 / (d1 - d0)
            cut = int(math.floor(math.exp(math.log(m0) + frac * (math.log(m1) - math.log(m0)))))
        cut = min(max(cut, m0), m1 - 1)
        if cut >= lo:
            out.append(MRange(a, lo, cut))
            lo = cut + 1
    out.append(MRange(best[-1], lo, None))
    return validate_ranges(merge_ranges(out), "crossovers")


def merge_ranges(ranges: Iterable[MRange]) -> list[MRange]:
    """Join neighbouring ranges that name the same backend."""
    out: list[MRange] = []
    for r in ranges:
        if out and out[-1].backend == r.backend:
            out[-1] = MRange(r.backend, out[-1].min_m, r.max_m)
        else:
            out.append(r)
    return out


def write_row(path: str | os.PathLike[str], row: CalibrationRow) -> str:
    """Add `row` to the table at `path` (replacing a row with the same key); returns the row's source id."""
    header = "# moefx MoE calibration table, written by `moefx calibrate`. Rows are keyed exactly; see docs/MOE.md.\n"
    return write_section(path, "rows", row, load_table, header)
