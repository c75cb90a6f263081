"""Per-graph compile reports: what each pass rewrote, what it left alone and why, which plan applied."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class CompileReport:
    graph_index: int
    passes: list[str]
    matches: dict[str, int] = field(default_factory=dict)
    # pass name -> reasons a candidate was left unchanged (or a sync that could not be removed)
    skipped: dict[str, list[str]] = field(default_factory=dict)
    plan_decisions: list[str] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0

    def summary(self) -> str:
        rewrites = ", ".join(f"{k}={v}" for k, v in self.matches.items()) or "none"
        return f"graph {self.graph_index}: {self.nodes_before}->{self.nodes_after} nodes, rewrites: {rewrites}"


_lock = threading.Lock()
_reports: list[CompileReport] = []


def new_report(passes: list[str], plan_decisions: list[str]) -> CompileReport:
    with _lock:
        report = CompileReport(len(_reports), list(passes), plan_decisions=list(plan_decisions))
        _reports.append(report)
        return report


def compile_reports() -> list[CompileReport]:
    """Reports for every graph the moefx pass manager ran on in this process, oldest first.

    A graph that inductor serves from its FX-graph or AOT-autograd cache was built by an earlier run with
    the same pass manager uuid; the passes do not run again, so it adds no report here.
    """
    with _lock:
        return list(_reports)


def clear_compile_reports() -> None:
    with _lock:
        _reports.clear()
