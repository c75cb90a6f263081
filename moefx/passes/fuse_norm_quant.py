"""fuse_norm_quant: RMSNorm (or residual add + RMSNorm) followed by a dynamic quant -> one fused op.

Producers matched: transformers' RMSNorm (fp32 upcast, `pow(2).mean(-1, keepdim=True)`, `rsqrt(var + eps)`,
downcast, then `weight * x`), `torch.nn.functional.rms_norm` (weight applied in fp32, one rounding), the
same two after a residual add `residual + x` (the new residual is kept as an output), vLLM's
`RMSNorm.forward_native` (`x * weight`; with a residual the fp32 sum feeds the norm), and moefx's own
`moefx::rms_norm` / `moefx::add_rms_norm`. Quants matched: `moefx::quant` and the native forms in
`quant_patterns.quant_forms()`. eps is read from the match; the fused op rounds where the matched code
rounds (the residual sum and the normalized value to the input dtype).
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

from moefx.passes.base import PassContext, register_pass
from moefx.passes.quant_patterns import (
    FLOAT_DTYPES,
    MAGIC_NORM_EPS,
    Producer,
    QuantFusionPass,
    insert_call,
    insert_getitem,
    moefx_ops,
    quant_users,
)

RMS_NORM = moefx_ops.rms_norm.default
ADD_RMS_NORM = moefx_ops.add_rms_norm.default


def _hf_rms_norm(x, weight, eps):
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def _hf_rms_norm_op(x, weight, eps):
    return moefx_ops.rms_norm(x, weight, eps, False)


def _f_rms_norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _f_rms_norm_op(x, weight, eps):
    return moefx_ops.rms_norm(x, weight, eps, True)


def _add_hf_rms_norm(x, residual, weight, eps):
    s = residual + x
    return _hf_rms_norm(s, weight, eps), s


def _add_hf_rms_norm_op(x, residual, weight, eps):
    y, s = moefx_ops.add_rms_norm(x, residual, weight, eps, False, False)
    return y, s


def _add_f_rms_norm(x, residual, weight, eps):
    s = residual + x
    return _f_rms_norm(s, weight, eps), s


def _add_f_rms_norm_op(x, residual, weight, eps):
    y, s = moefx_ops.add_rms_norm(x, residual, weight, eps, True, False)
    return y, s


def _vllm_rms_norm(x, weight, eps):
    """vLLM `RMSNorm.forward_native` without residual: like transformers but `x * weight`."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(dim=-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return h.to(x.dtype) * weight


def _vllm_add_rms_norm(x, residual, weight, eps):
    """vLLM `RMSNorm.forward_native` with residual: the sum stays fp32 for the norm, rounded for the residual."""
    orig_dtype = x.dtype
    h = x.to(torch.float32) + residual.to(torch.float32)
    new_residual = h.to(orig_dtype)
    variance = h.pow(2).mean(dim=-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return h.to(orig_dtype) * weight, new_residual


def _vllm_add_rms_norm_op(x, residual, weight, eps):
    y, s = moefx_ops.add_rms_norm(x, residual, weight, eps, False, True)
    return y, s


_TORCH_BELOW_2_13 = tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13)


@register_pass
class FuseNormQuant(QuantFusionPass):
    name = "fuse_norm_quant"
    order = 50
    unfused_targets = (RMS_NORM, ADD_RMS_NORM)

    @classmethod
    def producers(cls) -> list[Producer]:
        x, w, eps = (4, 256), (256,), {"eps": MAGIC_NORM_EPS}
        # The residual-add forms first: they contain the plain ones and must win when both match.
        return [
            Producer("add_hf_rms_norm", _add_hf_rms_norm, _add_hf_rms_norm_op, (x, x, w), eps),
            Producer("add_f_rms_norm", _add_f_rms_norm, _add_f_rms_norm_op, (x, x, w), eps),
            Producer("vllm_add_rms_norm", _vllm_add_rms_norm, _vllm_add_rms_norm_op, (x, x, w), eps),
            Producer("hf_rms_norm", _hf_rms_norm, _hf_rms_norm_op, (x, w), eps),
            Producer("f_rms_norm", _f_rms_norm, _f_rms_norm_op, (x, w), eps),
            Producer("vllm_rms_norm", _vllm_rms_norm, _hf_rms_norm_op, (x, w), eps),
        ]

    @classmethod
    def producer_reason(cls, prod: Producer, match) -> str | None:
        if prod.name in ("f_rms_norm", "add_f_rms_norm") and _TORCH_BELOW_2_13:
            # On torch 2.11 the fused bf16 F.rms_norm + INT8 per-token form differed from eager in ~5% of codes
            # (tests/test_fuse_norm_quant.py); exactness is verified on torch 2.13 and 2.14 only.
            return f"F.rms_norm fusion is verified exact on torch >= 2.13 only (this is {torch.__version__})"
        x = match.kwargs["x"].meta.get("val")
        w = match.kwargs["weight"].meta.get("val")
        if x is None or w is None or x.dtype not in FLOAT_DTYPES or w.dtype not in FLOAT_DTYPES:
            return "input or weight is not an fp32/bf16/fp16 tensor"
        if tuple(w.shape) != (x.shape[-1],):
            return f"weight shape {tuple(w.shape)} is not ({x.shape[-1]},)"
        if "residual" in match.kwargs:
            r = match.kwargs["residual"].meta.get("val")
            if r is None or r.shape != x.shape or r.dtype != x.dtype:
                return "residual and input differ in shape or dtype (broadcasting or mixed-precision add)"
        return None

    def fuse(self, graph: torch.fx.Graph, node: torch.fx.Node, ctx: PassContext) -> int:
        if node.target is RMS_NORM:
            y, residual = node, None
        else:
            items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
            if len(items) != len(node.users) or 0 not in items:
                return 0
            y, residual = items[0], items.get(1)
        quants, why = quant_users(y)
        if why is not None:
            ctx.skip(f"{node.name} ({node.target}) not fused: {why}")
            return 0
        scheme = tuple(quants[0].args[1:])
        op = moefx_ops.rms_norm_quant.default if node.target is RMS_NORM else moefx_ops.add_rms_norm_quant.default
        with graph.inserting_before(node):
            fused = insert_call(graph, op, (*node.args, *scheme))
            new_residual = insert_getitem(graph, fused, 2) if residual is not None else None
        for q in quants:
            q.replace_all_uses_with(fused)
            graph.erase_node(q)
        if residual is not None:
            residual.replace_all_uses_with(new_residual)
            graph.erase_node(residual)
        if y is not node:
            graph.erase_node(y)
        graph.erase_node(node)
        return 1
