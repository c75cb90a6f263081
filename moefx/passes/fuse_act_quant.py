"""fuse_act_quant: SiLU-mul followed by dynamic activation quants -> one `moefx::silu_mul_quant*` op.

The SiLU-mul is recognized by its dataflow: `silu(gate) * up` with silu as `aten.silu` or its decomposition
`g / (1 + exp(-g))` (in fp32, rounded once to the input dtype as eager rounds it), the product in the input
dtype; gate and up either two tensors (transformers' MLP: `act_fn(gate_proj(x)) * up_proj(x)`) or the two
halves of one tensor, by slices or a split (vLLM `SiluAndMul.forward_native`, `x.chunk(2, -1)`); and
moefx's own `moefx::silu_mul`. The quants are any form `quant_patterns.recognize_quant` accepts. Forms whose
rounding the fused op does not reproduce are left alone with the reason: `x * sigmoid(x)` (sigmoid rounded
to the input dtype first), a product computed in fp32 and rounded once.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from moefx.passes.fx import dtype_of, is_call, source_line
from moefx.passes.quant_patterns import (
    CAST,
    FLOAT_DTYPES,
    NotMine,
    ProducerMatch,
    QuantFusionPass,
    Reject,
    aten,
    moefx_ops,
    same_shape,
    scalar,
    shape_of,
)

SILU_MUL = moefx_ops.silu_mul.default


def _silu_input(a: torch.fx.Node, dtype: torch.dtype, nodes: set) -> torch.fx.Node | None:
    """g when `a` is silu(g) rounded to `dtype` the way eager rounds F.silu; None when it is no SiLU."""
    if is_call(a, aten.silu.default) and dtype_of(a.args[0]) == dtype:
        nodes.add(a)
        return a.args[0]
    sig = _sigmoid_form(a, dtype)
    if sig is not None:
        nodes |= sig[1]
        return sig[0]
    inner = a
    if dtype != torch.float32:
        if not (is_call(a, CAST) and a.args[1] == dtype and dtype_of(a.args[0]) == torch.float32):
            return None
        inner = a.args[0]
    local = {a, inner}
    if not is_call(inner, aten.div.Tensor):
        return None
    g32, den = inner.args[:2]
    if not is_call(den, aten.add.Tensor):
        return None
    ex, one = den.args[:2]
    if scalar(one) is None and scalar(ex) == 1.0:
        ex, one = one, ex
    if scalar(one) != 1.0 or not is_call(ex, aten.exp.default) or not is_call(ex.args[0], aten.neg.default) \
            or ex.args[0].args[0] is not g32:
        return None
    local |= {den, ex, ex.args[0]}
    if dtype == torch.float32:
        gate = g32
    else:
        if not (is_call(g32, CAST) and g32.args[1] == torch.float32 and dtype_of(g32.args[0]) == dtype):
            return None
        local.add(g32)
        gate = g32.args[0]
    nodes |= local
    return gate


def _sigmoid_form(a: torch.fx.Node, dtype: torch.dtype) -> tuple[torch.fx.Node, set] | None:
    """x * sigmoid(x): torch's core decomposition of silu (torch < 2.13 inductor) when computed in fp32 and
    rounded once; user code `g * torch.sigmoid(g)` rounds sigmoid on its own first and is rejected."""
    inner = a.args[0] if is_call(a, CAST) and a.args[1] == dtype and dtype != torch.float32 else a
    if not is_call(inner, aten.mul.Tensor):
        return None
    x, s = inner.args[:2]
    p = x if is_call(s, aten.sigmoid.default) and s.args[0] is x else (
        s if is_call(x, aten.sigmoid.default) and x.args[0] is s else None)
    if p is None:
        return None
    sig = s if p is x else x
    if dtype == torch.float32:
        if "silu" in source_line(inner):  # F.silu decomposed by this torch
            return p, {inner, sig}
    elif inner is not a and dtype_of(inner) == torch.float32 and is_call(p, CAST) and dtype_of(p.args[0]) == dtype:
        return p.args[0], {a, inner, sig, p}
    raise Reject(inner, "SiLU written as x * sigmoid(x) (sigmoid rounded on its own before the product); the "
                        "fused op computes silu as x / (1 + exp(-x)), rounded once")


def _halves(gate: torch.fx.Node, up: torch.fx.Node) -> torch.fx.Node | None:
    """x when gate = x[..., :d] and up = x[..., d:] (by slices or a split/chunk) with x.shape[-1] == 2d."""
    def part(n):
        if is_call(n, aten.slice.Tensor):
            x, dim, start, end = (list(n.args) + [0, None, None])[:4]
            nd = len(shape_of(x))
            if dim % nd != nd - 1 or (len(n.args) > 4 and n.args[4] != 1):
                return None
            return x, start or 0, end
        if is_call(n, operator.getitem) and is_call(n.args[0], aten.split.Tensor, aten.split_with_sizes.default):
            sp = n.args[0]
            x = sp.args[0]
            nd = len(shape_of(x))
            dim = sp.args[2] if len(sp.args) > 2 else sp.kwargs.get("dim", 0)
            if dim % nd != nd - 1:
                return None
            sizes = sp.args[1]
            d = sizes[0] if isinstance(sizes, (list, tuple)) else sizes
            return x, n.args[1] * d, (n.args[1] + 1) * d
        return None

    pg, pu = part(gate), part(up)
    if pg is None or pu is None or pg[0] is not pu[0]:
        return None
    x, h = pg[0], shape_of(pg[0])[-1]
    d = shape_of(gate)[-1]
    if not isinstance(h, int) or not isinstance(d, int) or h != 2 * d:
        return None
    end_u = h if pu[2] is None or pu[2] >= h else pu[2]
    if (pg[1], pg[2], pu[1], end_u) != (0, d, d, h):
        return None
    return x


class FuseActQuant(QuantFusionPass):
    name = "fuse_act_quant"
    producer_kind = "SiLU-mul"

    def recognize_producer(self, y: torch.fx.Node) -> ProducerMatch:
        if is_call(y, SILU_MUL):
            return ProducerMatch("moefx::silu_mul", moefx_ops.silu_mul_quant.default, (y.args[0],), {y}, anchor=y)
        dtype = dtype_of(y)
        if is_call(y, CAST) and dtype in FLOAT_DTYPES and is_call(y.args[0], aten.mul.Tensor):
            probe: set = set()
            if any(isinstance(a, torch.fx.Node) and _silu_input(a, torch.float32, probe) is not None
                   for a in y.args[0].args[:2]):
                raise Reject(y, f"SiLU-mul computed in fp32 and rounded once to {dtype}; the fused op rounds silu "
                                f"and the product to the input dtype, as `F.silu(gate) * up` does")
        if not is_call(y, aten.mul.Tensor) or dtype not in FLOAT_DTYPES:
            raise NotMine
        a, b = y.args[:2]
        if not isinstance(a, torch.fx.Node) or not isinstance(b, torch.fx.Node):
            raise NotMine
        nodes: set = {y}
        gate = _silu_input(a, dtype, nodes)
        up = b
        if gate is None:
            gate, up = _silu_input(b, dtype, nodes), a
        if gate is None:
            raise NotMine
        if dtype_of(up) != dtype or dtype_of(gate) != dtype or not same_shape(shape_of(gate), shape_of(up)):
            raise Reject(y, f"gate {list(shape_of(gate))}/{dtype_of(gate)} and up {list(shape_of(up))}/"
                            f"{dtype_of(up)} differ (broadcasting or mixed-dtype product)")
        x = _halves(gate, up)
        if x is not None:
            return ProducerMatch("SiLU-mul (gate and up halves of one tensor)", moefx_ops.silu_mul_quant.default,
                                 (x,), nodes | {gate, up}, anchor=y)
        return ProducerMatch("SiLU-mul (gate and up tensors)", moefx_ops.silu_mul_quant_split.default, (gate, up),
                             nodes, anchor=y)
