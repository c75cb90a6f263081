"""fuse_act_quant: SiLU-mul followed by dynamic activation quants -> one `moefx::silu_mul_quant*` op.

The SiLU-mul is recognized by its dataflow in every spelling `quant_fusion.SiluMulProducer` lists; the quants are
any form `quant_patterns.recognize_quant` accepts.
"""

from __future__ import annotations

from moefx.passes.quant_fusion import SILU_MUL_PRODUCER, QuantFusionPass


class FuseActQuant(QuantFusionPass):
    name = "fuse_act_quant"
    producer = SILU_MUL_PRODUCER
