"""moefx: fast Mixture-of-Experts LLM inference with torch.compile."""

from moefx.audit import audit_syncs
from moefx.compile import backend
from moefx.config import CompilationConfig, OffloadConfig, PassConfig
from moefx.explain import explain_fusions
from moefx.integrations import transformers as _transformers  # noqa: F401  registers experts_implementation="moefx"
from moefx.optimize import optimize
from moefx.quantize import quantize
from moefx.reports import CompileReport, clear_compile_reports, compile_reports

__version__ = "0.1.0"

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
    "quantize",
]
