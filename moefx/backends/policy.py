"""MoE backend policy: which backend runs for each M range, and the calibration row that says so."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class MoePlan:
    backend: str = "upstream"
    source: str = "no calibration row"

    def explain_lines(self) -> list[str]:
        return [f"moe backend = {self.backend}  [{self.source}]"]


def moe_plan(ms: Any, es: Any, cfg: Any) -> MoePlan:
    if cfg.moe_backend != "auto":
        return MoePlan(cfg.moe_backend, "user config")
    return MoePlan()
