"""Built-in model definitions: tiny Qwen3-MoE / DeepSeek-V3 for demos/tests and published MoE geometries."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["build_model", "qwen3_moe_config", "tiny_deepseek_v3_config", "tiny_qwen3_moe_config"]

if TYPE_CHECKING:
    from moefx.models.tiny import build_model, qwen3_moe_config, tiny_deepseek_v3_config, tiny_qwen3_moe_config


def __getattr__(name: str) -> Any:
    """The builders load torch and transformers on first use (PEP 562), so `moefx.models.catalog` (the CLI's
    help lists its names) imports neither."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("moefx.models.tiny"), name)
