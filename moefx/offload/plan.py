"""Offload plan: where expert weights live and how each M is computed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class OffloadPlan:
    experts: str = "gpu"
    source: str = "default"

    def explain_lines(self) -> list[str]:
        return [f"offload experts = {self.experts}  [{self.source}]"]


def offload_plan(ms: Any, es: Any, cfg: Any) -> OffloadPlan:
    if cfg.offload.experts != "gpu":
        return OffloadPlan(cfg.offload.experts, "user config")
    return OffloadPlan()
