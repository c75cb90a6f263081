"""Per-graph compile reports: what each pass rewrote, what it left alone and why, which plan applied.

Reports survive inductor's caches. When inductor serves a graph from its FX graph cache (or AOTAutograd's
cache, which loads through it) the passes do not run; so the pass manager stores each report with the cache
entry: it bumps an inductor counter whose name carries the report, `counters["inductor"]`'s delta is saved
in the entry (`CompiledFxGraph.counter_deltas`) and replayed on every cache hit. `compile_reports()` turns
each replay it has not seen into a copy of the report marked `from_cache=True`.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import Counter
from dataclasses import dataclass, field

COUNTER_PREFIX = "moefx_report:"


@dataclass
class CompileReport:
    graph_index: int
    passes: list[str]
    matches: dict[str, int] = field(default_factory=dict)
    # pass name -> reasons a candidate was left unchanged (or a sync that could not be removed)
    skipped: dict[str, list[str]] = field(default_factory=dict)
    # pass name -> one line per rewrite made ("file:line: what -> which op")
    rewrites: dict[str, list[str]] = field(default_factory=dict)
    plan_decisions: list[str] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    # True when the graph was served from inductor's cache and this is the report stored with the entry
    from_cache: bool = False

    def summary(self) -> str:
        rewrites = ", ".join(f"{k}={v}" for k, v in self.matches.items()) or "none"
        cached = " (from the FX graph cache)" if self.from_cache else ""
        return f"graph {self.graph_index}: {self.nodes_before}->{self.nodes_after} nodes, rewrites: {rewrites}{cached}"

    def content(self) -> dict:
        """What the graph's compile decided, without where it sits in this process's list."""
        d = dataclasses.asdict(self)
        d.pop("graph_index")
        d.pop("from_cache")
        return d


_lock = threading.Lock()
_reports: list[CompileReport] = []
_accounted: Counter[str] = Counter()  # per counter key: increments already turned into reports


def _inductor_counters() -> Counter[str]:
    from torch._dynamo.utils import counters

    return counters["inductor"]


def new_report(passes: list[str], plan_decisions: list[str]) -> CompileReport:
    """A report for a graph the passes are about to run on (appended to `compile_reports()`)."""
    with _lock:
        _sync_locked()
        report = CompileReport(len(_reports), list(passes), plan_decisions=list(plan_decisions))
        _reports.append(report)
        return report


def store_with_cache_entry(report: CompileReport) -> None:
    """Record the finished report in inductor's counters, which the FX graph cache saves with the entry."""
    key = COUNTER_PREFIX + json.dumps(report.content(), sort_keys=True, separators=(",", ":"))
    with _lock:
        _inductor_counters()[key] += 1
        _accounted[key] += 1


def _sync_locked() -> None:
    counters = _inductor_counters()
    for key, count in list(counters.items()):
        if not key.startswith(COUNTER_PREFIX):
            continue
        extra = count - _accounted[key]
        if extra < 0:  # someone cleared inductor's counters
            _accounted[key] = count
            continue
        data = json.loads(key[len(COUNTER_PREFIX):])
        for _ in range(extra):
            _reports.append(CompileReport(graph_index=len(_reports), from_cache=True, **data))
        _accounted[key] = count


def compile_reports() -> list[CompileReport]:
    """Reports for every graph compiled with the moefx pass manager in this process, oldest first. A graph
    served from inductor's cache has the report stored with its cache entry, marked `from_cache=True`."""
    with _lock:
        _sync_locked()
        return list(_reports)


def clear_compile_reports() -> None:
    with _lock:
        _sync_locked()
        _reports.clear()
