"""Post-grad FX passes. `PIPELINE` (in `manager`) lists every pass in the order they run; `PASS_REGISTRY` maps
their toggle names to them in that order."""

from moefx.passes.base import MoefxPass, PassContext
from moefx.passes.manager import PASS_REGISTRY, PIPELINE, PassManager

__all__ = ["PASS_REGISTRY", "PIPELINE", "MoefxPass", "PassContext", "PassManager"]
