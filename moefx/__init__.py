"""moefx: fast Mixture-of-Experts LLM inference with torch.compile.

The public names load on first use (PEP 562), so `import moefx` and the `moefx --help` / `--version` CLI
start without importing torch, transformers or inductor. The first public name touched loads all of them.
`experts_implementation="moefx"` is registered with transformers as soon as both are imported, in either order
(`_RegisterWhenImported`), so `import moefx` before `from_pretrained(..., experts_implementation="moefx")` works.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "CompilationConfig": "moefx.config",
    "OffloadConfig": "moefx.config",
    "PassConfig": "moefx.config",
    "CompileReport": "moefx.reports",
    "clear_compile_reports": "moefx.reports",
    "compile_reports": "moefx.reports",
    "audit_syncs": "moefx.audit",
    "backend": "moefx.compile",
    "explain_fusions": "moefx.explain",
    "optimize": "moefx.optimize",
    "precompile": "moefx.precompile",
    "quantize": "moefx.quantize",
}

__all__ = [
    "CompilationConfig",
    "CompileReport",
    "OffloadConfig",
    "PassConfig",
    "__version__",
    "audit_syncs",
    "backend",
    "clear_compile_reports",
    "compile_reports",
    "explain_fusions",
    "optimize",
    "precompile",
    "quantize",
]

if TYPE_CHECKING:
    from moefx.audit import audit_syncs
    from moefx.compile import backend
    from moefx.config import CompilationConfig, OffloadConfig, PassConfig
    from moefx.explain import explain_fusions
    from moefx.optimize import optimize
    from moefx.precompile import precompile
    from moefx.quantize import quantize
    from moefx.reports import CompileReport, clear_compile_reports, compile_reports


def _load_all() -> None:
    importlib.import_module("moefx.integrations.transformers")  # registers experts_implementation="moefx"
    for name, module in _EXPORTS.items():
        globals()[name] = getattr(importlib.import_module(module), name)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moefx' has no attribute {name!r}")
    _load_all()
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _Package(types.ModuleType):
    """Keeps `moefx.optimize` / `moefx.quantize` the functions when their same-named submodules are imported
    first (the import system would otherwise bind the submodule over the lazily loaded name)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


class _RegisterWhenImported(importlib.abc.MetaPathFinder):
    """Registers moefx's experts implementation right after transformers' experts interface module is imported."""

    TARGET = "transformers.integrations.moe"

    def __init__(self) -> None:
        self.busy = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.TARGET or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        run = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
            importlib.import_module("moefx.integrations.transformers")  # its import registers "moefx"

        spec.loader.exec_module = exec_module
        return spec


if _RegisterWhenImported.TARGET in sys.modules:
    importlib.import_module("moefx.integrations.transformers")
elif not any(isinstance(f, _RegisterWhenImported) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenImported())
