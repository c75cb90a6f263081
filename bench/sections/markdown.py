"""Markdown pieces every section uses: number formats, tables, and the run / reproduce / peer / floor header."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Section:
    """One published section: the kept result it renders (`bench/results/<stage>_<device>_<date>.json`) and how.

    `render(result)` returns the section's Markdown; with `reads`, `render(result, other)` also gets that stage's
    kept result (None when there is none)."""

    stage: str
    render: Callable[..., str]
    reads: str | None = None

    def markdown(self, results: dict[str, dict[str, Any]]) -> str:
        r = results[self.stage]
        return self.render(r, results.get(self.reads)) if self.reads else self.render(r)


def num(x: float | None, nd: int = 1) -> str:
    if x is None:
        return "–"
    if abs(x) >= 1000 and nd <= 1:
        return f"{x:.0f}"
    return f"{x:.{nd}f}"


def sig(x: float | None) -> str:
    """About three significant digits: 7787, 541.9, 62.07, 0.731."""
    if x is None:
        return "–"
    return f"{x:.0f}" if x >= 1000 else f"{x:.1f}" if x >= 100 else f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def ratio(a: float | None, b: float | None, nd: int = 2) -> str:
    return "–" if a is None or not b else f"{a / b:.{nd}f}"


def span(values: Iterable[float], nd: int = 2, unit: str = "") -> str:
    vals = sorted(values)
    if not vals:
        return "–"
    lo, hi = f"{vals[0]:.{nd}f}", f"{vals[-1]:.{nd}f}"
    return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"


def runs(selected: Sequence[Any], grid: Sequence[Any]) -> str:
    """Selected grid points as runs of neighbours: 'M = 1–1024', 'M = 1, 1024 and 4096'."""
    idx = sorted(grid.index(s) for s in selected)
    parts, start = [], None
    for j, i in enumerate(idx):
        if start is None:
            start = i
        if j + 1 == len(idx) or idx[j + 1] != i + 1:
            parts.append(f"{grid[start]}" if start == i else f"{grid[start]}–{grid[i]}")
            start = None
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def versions(v: dict[str, str]) -> str:
    return ", ".join(f"{k} {v[k]}" for k in ("torch", "triton", "transformers") if v.get(k))


def section(title: str, r: dict[str, Any], *, what: str, peer: str, floor: str, body: str,
            reproduce: str | None = None) -> str:
    """One workload: the run, how to reproduce it, its peer and floor, then the tables (`body`)."""
    commit = f"commit `{r['commit']}`" if r.get("commit") else (
        f"commit not recorded (results committed in `{r['results_commit']}`)" if r.get("results_commit")
        else "commit not recorded")
    lines = [f"### {title}", "", what, "",
             f"- **Run**: {r['date']}, {r['device']}, {versions(r['versions'])}, {commit}; data `{r['_file']}`"]
    if r.get("source"):
        lines.append(f"- **Source**: {r['source']}")
    lines += [f"- **Reproduce**: {reproduce or '`' + r['command'] + '`'}",
              f"- **Peer**: {peer}", f"- **Floor**: {floor}", "", body.strip(), ""]
    return "\n".join(lines)
