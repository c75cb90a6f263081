"""fuse_norm_quant: RMSNorm (or residual add + RMSNorm) followed by dynamic quants -> one fused op.

The norm is recognized by its dataflow in every spelling `quant_fusion.RmsNormProducer` lists; the quants are any
form `quant_patterns.recognize_quant` accepts.
"""

from __future__ import annotations

from moefx.passes.quant_fusion import RMS_NORM_PRODUCER, QuantFusionPass


class FuseNormQuant(QuantFusionPass):
    name = "fuse_norm_quant"
    producer = RMS_NORM_PRODUCER
