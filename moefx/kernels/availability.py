"""Whether Triton can be imported, and the one reason moefx gives where it cannot.

Triton is not a dependency of moefx: PyTorch's CUDA wheels bring it, its CPU wheels do not, and on the CPU no
moefx path launches a Triton kernel. The modules that hold Triton kernels import `triton` at their top, so every
place that imports one of them asks `triton_missing()` first (or imports it only behind `triton_available()`);
without Triton the passes and backends that would launch a kernel are off, each giving `TRITON_MISSING` as its
reason, and the process says once why. Imports nothing heavy (no torch) and no other moefx package at module
level, so any layer may use it.
"""

from __future__ import annotations

import functools
import importlib.util

TRITON_MISSING = "triton is not installed"


@functools.cache
def triton_available() -> bool:
    """True when `import triton` can succeed in this interpreter."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def triton_missing() -> str | None:
    """None where Triton imports; else `TRITON_MISSING`, after one line per process saying what is off and why."""
    if triton_available():
        return None
    _say_once()
    return TRITON_MISSING


def module_file(name: str) -> str:
    """The source file of module `name`, found without running it (a Triton kernel module's, for a pass's cache
    key, where triton may be missing)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ImportError(f"no source file for module {name!r}")
    return spec.origin


@functools.cache
def _say_once() -> None:
    from moefx.log import progress_logger

    progress_logger().info(
        "%s: the passes and backends that launch a Triton kernel are off (they matter on CUDA; PyTorch's CUDA "
        "wheels bring Triton, its CPU wheels do not); every other path runs", TRITON_MISSING)
