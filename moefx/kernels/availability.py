"""Whether Triton can be imported here, found without importing it."""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
