"""`moefx.explain_fusions(fn, *args)`: every quant candidate in `fn`'s compiled graph, fused or not, and why.

It captures the post-grad graph inductor would compile for `fn(*args)` (no code generation), runs moefx's quant
fusion passes on it and lists each candidate with the user's file:line: what was fused into which op, and for
each quant left alone the exact reason. The same lines are in `compile_reports()` after a real compile.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moefx.config import CompilationConfig

_LOCATED = re.compile(r"^(.+?:\d+): (.*)$", re.S)


@dataclass(frozen=True)
class FusionCandidate:
    pass_name: str
    fused: bool
    location: str  # file:line of the user's code ("" when unknown)
    detail: str  # what was fused into which op, or what was left alone and why


@dataclass
class FusionExplanation:
    candidates: list[FusionCandidate] = field(default_factory=list)
    off: list[str] = field(default_factory=list)  # quant passes the config turned off: their candidates go unlisted

    @property
    def fused(self) -> list[FusionCandidate]:
        return [c for c in self.candidates if c.fused]

    @property
    def left_alone(self) -> list[FusionCandidate]:
        return [c for c in self.candidates if not c.fused]

    def __str__(self) -> str:
        lines = [f"{len(self.candidates)} quant candidate(s): {len(self.fused)} fused, "
                 f"{len(self.left_alone)} left alone"]
        lines += [f"  pass {name} is off (pass_config.{name}=false): its candidates are not looked for"
                  for name in self.off]
        for c in sorted(self.candidates, key=lambda c: (not c.fused, c.location)):
            tag = "fused" if c.fused else "left alone"
            lines.append(f"  [{tag}] {c.location or '?'} ({c.pass_name})\n      {c.detail}")
        return "\n".join(lines)


def _candidate(pass_name: str, fused: bool, text: str) -> FusionCandidate:
    m = _LOCATED.match(text)
    return FusionCandidate(pass_name, fused, m.group(1) if m else "", m.group(2) if m else text)


def explain_fusions(fn: Callable[..., Any], *args: Any, dynamic_rows: bool = False,
                    config: Any = None) -> FusionExplanation:
    """Explain which SiLU-mul / RMSNorm -> quant candidates of `fn(*args)` moefx fuses, and why not the others.

    Both quant fusion passes run, through the pass manager as in a compile (so each candidate that neither
    takes is listed once), except one that `config`'s pass_config turns off (`fuse_act_quant: false`), which is
    named as off. `dynamic_rows`: make dim 0 of every input with 2+ dims symbolic, as in serving.
    """
    from moefx.passes import PassManager
    from moefx.passes.quant_fusion import PRODUCERS
    from moefx.passes.quant_patterns import post_grad_graph

    cfg = CompilationConfig.from_any(config)
    names = [producer.pass_name for producer in PRODUCERS]
    off = [n for n in names if getattr(cfg.pass_config, n, None) is False]
    graph = post_grad_graph(fn, list(args), dynamic_rows=dynamic_rows)
    manager = PassManager(cfg, [n for n in names if n not in off])
    report = manager.run_passes(graph)
    out = FusionExplanation(off=off)
    for name in manager.enabled:
        out.candidates += [_candidate(name, True, t) for t in report.rewrites.get(name, [])]
        out.candidates += [_candidate(name, False, t) for t in report.skipped.get(name, [])]
    return out
