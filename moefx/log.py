"""moefx logging: `MOEFX_LOG=debug|info|warning` sets the level; `warn_once` never repeats a message.

Progress lines (what a first call compiles and captures, and how long it took) go to `progress_logger()`,
shown by default so nobody kills a process that is working; `MOEFX_LOG=warning` (or error) silences them, and
other info lines stay hidden unless `MOEFX_LOG=info`.

`warn_once` may be called inside code that `torch.compile` traces (an experts forward that falls back): it is
marked `assume_constant_result`, so dynamo runs it once while tracing (the message must be a constant there, as
every moefx message is) instead of breaking the graph on `warnings.warn`; `fullgraph=True` compiles through it.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from moefx.env import get_setting, setting_source

_warned: set[str] = set()


def log_level() -> str:
    """The validated MOEFX_LOG level (the CLI checks it first, so a bad value is one line, not a traceback)."""
    return get_setting("MOEFX_LOG")


def get_logger(name: str = "moefx") -> logging.Logger:
    logger = logging.getLogger(name)
    root = logging.getLogger("moefx")
    if not getattr(root, "_moefx_configured", False):
        level = log_level()
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[moefx %(levelname)s] %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(level.upper())
        root.propagate = False
        root._moefx_configured = True  # type: ignore[attr-defined]
    return logger


def progress_logger() -> logging.Logger:
    """The `moefx.progress` logger: "moefx: ..." lines on stderr, at INFO unless MOEFX_LOG asks for warning or
    error (read once, when the logger is first set up)."""
    logger = logging.getLogger("moefx.progress")
    if not getattr(logger, "_moefx_configured", False):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("moefx: %(message)s"))
        logger.addHandler(handler)
        asked = log_level() if setting_source("MOEFX_LOG") != "default" else None
        logger.setLevel(asked.upper() if asked in ("warning", "error") else "INFO")
        logger.propagate = False
        logger._moefx_configured = True  # type: ignore[attr-defined]
    return logger


def _warn_once(message: str, category: type[Warning] = UserWarning) -> None:
    """Emit `message` as a Python warning the first time only (per process)."""
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(message, category, stacklevel=3)


def __getattr__(name: str) -> Any:
    """`warn_once` is built on first import, so importing this module (the CLI's `log_level`) does not import
    torch."""
    if name != "warn_once":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    globals()["warn_once"] = torch.compiler.assume_constant_result(_warn_once)
    return globals()["warn_once"]
