"""fuse_act_quant: SiLU-mul followed by a dynamic activation quant -> one `moefx::silu_mul_quant*` op.

Producers matched: vLLM's `SiluAndMul.forward_native` (`F.silu(x[..., :d]) * x[..., d:]`), transformers'
MLP (`act_fn(gate_proj(x)) * up_proj(x)`, separate gate and up) and moefx's own `moefx::silu_mul`.
Quants matched: `moefx::quant` and the native forms in `quant_patterns.quant_forms()`. The fused op
rounds the SiLU and the product to the input dtype exactly as eager does, so it reproduces the
eager result of the matched code (not inductor's fp32-intermediate variant of it).
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from moefx.passes.base import PassContext, register_pass
from moefx.passes.quant_patterns import (
    FLOAT_DTYPES,
    Producer,
    QuantFusionPass,
    insert_call,
    moefx_ops,
    quant_users,
)

aten = torch.ops.aten
SILU_MUL = moefx_ops.silu_mul.default


def _silu_mul_cat(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _silu_mul_cat_op(x):
    return moefx_ops.silu_mul(x)


def _silu_mul_split(gate, up):
    return F.silu(gate) * up


def _silu_mul_split_op(gate, up):
    # The concatenation never runs: stage 3 turns silu_mul(cat(gate, up)) into silu_mul_quant_split.
    return moefx_ops.silu_mul(torch.cat([gate, up], dim=-1))


def _split_inputs(x: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(gate, up) when `x` is cat([gate, up], last dim) of two same-shaped tensors used only here."""
    if x.op != "call_function" or x.target is not aten.cat.default or len(x.users) != 1:
        return None
    parts = x.args[0]
    dim = x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)
    val = x.meta.get("val")
    if len(parts) != 2 or val is None or dim not in (-1, val.dim() - 1):
        return None
    g, u = (p.meta.get("val") for p in parts)
    if g is None or u is None or g.shape != u.shape or g.dtype != u.dtype:
        return None
    return parts[0], parts[1]


@register_pass
class FuseActQuant(QuantFusionPass):
    name = "fuse_act_quant"
    order = 60
    unfused_targets = (SILU_MUL,)

    @classmethod
    def producers(cls) -> list[Producer]:
        return [
            Producer("silu_mul", _silu_mul_cat, _silu_mul_cat_op, ((4, 512),)),
            Producer("silu_mul_split", _silu_mul_split, _silu_mul_split_op, ((4, 256), (4, 256))),
        ]

    @classmethod
    def producer_reason(cls, prod: Producer, match) -> str | None:
        vals = [match.kwargs[k].meta.get("val") for k in ("x", "gate", "up") if k in match.kwargs]
        if any(v is None or v.dtype not in FLOAT_DTYPES for v in vals):
            return "inputs are not fp32/bf16/fp16 tensors"
        if len(vals) == 2 and (vals[0].shape != vals[1].shape or vals[0].dtype != vals[1].dtype):
            return "gate and up differ in shape or dtype (broadcasting product)"
        return None

    def fuse(self, graph: torch.fx.Graph, node: torch.fx.Node, ctx: PassContext) -> int:
        quants, why = quant_users(node)
        if why is not None:
            if node.users:
                ctx.skip(f"{node.name} (moefx::silu_mul) not fused: {why}")
            return 0
        scheme = tuple(quants[0].args[1:])
        split = _split_inputs(node.args[0])
        with graph.inserting_before(node):
            if split is not None:
                fused = insert_call(graph, moefx_ops.silu_mul_quant_split.default, (*split, *scheme))
            else:
                fused = insert_call(graph, moefx_ops.silu_mul_quant.default, (node.args[0], *scheme))
        for q in quants:
            q.replace_all_uses_with(fused)
            graph.erase_node(q)
        graph.erase_node(node)
        return 1
