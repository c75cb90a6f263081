"""torch.library custom ops that moefx passes and backends emit (importing this package registers them)."""

from moefx.ops import block_gemm, fused_quant  # noqa: F401
from moefx.ops.quant import KINDS, PRESETS, QuantScheme

__all__ = ["KINDS", "PRESETS", "QuantScheme"]
