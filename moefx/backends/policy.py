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


def moe_plan(ms: Any, es: Any, cfg: Any, pins: dict | None = None) -> MoePlan:
    """`pins` comes from the first matching signature rule: {"source": "rules.yaml#2", and either
    "backend": name or "ranges": "gemv@1-16,grouped@17-"}. The user's config still wins over a pin."""
    if cfg.moe_backend != "auto":
        return MoePlan(cfg.moe_backend, "user config")
    if pins:
        return MoePlan(pins.get("backend") or pins["ranges"], pins["source"])
    return MoePlan()
