"""What fuse_norm_quant and fuse_act_quant share beyond recognizing the quant (`quant_patterns.py`): the
producers they fuse, recognized by their dataflow, and the pass base that replaces a producer and every quant of
its output with one fused op.

A producer's `recognize(y)` returns a ProducerMatch, raises Reject (its kind, not fusable, with the reason) or
NotMine. PRODUCERS lists them in pipeline order: a quant pass asks each which made y, so that a quant of the other
pass's producer is left to that pass (and reported as such when that pass is off). The fused op's q/k/v users
that each quantize the same normed input with one scheme share it; the q, scale and new-residual users are
rewired and the rest removed. Quants of one value with different schemes, or a producer whose intermediate values
are used elsewhere, are left alone with the reason.

RMSNorm (fuse_norm_quant's): n = x32 * rsqrt(mean(x32^2, -1) + eps) (`pow(x, 2)` or `x * x`, `mean` or `sum / H`),
then one of
- `weight * n.to(dtype)` / `n.to(dtype) * weight` (transformers, vLLM): the weight after the downcast,
- `(n * weight32).to(dtype)` (`F.rms_norm`, vLLM's IR op with an fp32 weight, Gemma's `1 + weight`): the weight
  in fp32, one rounding (the weight operand may be any [H] tensor, e.g. Gemma's `1.0 + w.float()`),
- `n.to(dtype)` (no weight),
where x32 is the upcast input, the upcast of a residual sum `residual + x` in the input dtype (transformers,
Gemma: the rounded sum feeds the norm) or the fp32 sum `x.float() + residual.float()` (vLLM: the fp32 sum
feeds the norm, its downcast is the new residual). moefx's `moefx::rms_norm` / `moefx::add_rms_norm` and
vLLM's IR ops `vllm_ir.rms_norm` / `vllm_ir.fused_add_rms_norm` (native semantics) are taken as they are.
eps is read from the graph; the fused op rounds where the matched code rounds. `x / sqrt(var + eps)` rounds
differently from `x * rsqrt(var + eps)` and is left alone with that reason.

SiLU-mul (fuse_act_quant's): `silu(gate) * up` with silu as `aten.silu` or its decomposition `g / (1 + exp(-g))`
(in fp32, rounded once to the input dtype as eager rounds it), the product in the input dtype; gate and up either
two tensors (transformers' MLP: `act_fn(gate_proj(x)) * up_proj(x)`) or the two halves of one tensor, by slices or
a split (vLLM `SiluAndMul.forward_native`, `x.chunk(2, -1)`); and moefx's own `moefx::silu_mul`. Forms whose
rounding the fused op does not reproduce are left alone with the reason: `x * sigmoid(x)` (sigmoid rounded to the
input dtype first), a product computed in fp32 and rounded once.
"""

from __future__ import annotations

import operator
from typing import Any, ClassVar, Protocol

import torch
import torch.fx

from moefx.passes.base import MoefxPass, PassContext, log
from moefx.passes.fx import LOW_DTYPES, call, dtype_of, is_call, location, source_line
from moefx.passes.quant_patterns import (
    CAST,
    DEPENDENCY_FILES,
    FLOAT_DTYPES,
    QUANT,
    NotMine,
    ProducerMatch,
    QuantMatch,
    Reject,
    _cast_label,
    aten,
    dedupe_casts,
    describe,
    is_upcast,
    moefx_ops,
    norm_dims,
    quant_candidates,
    recognize_moefx_quant,
    recognize_quant,
    reshaped,
    same_shape,
    scalar,
    shape_of,
    strip_views,
)


class Producer(Protocol):
    pass_name: str  # the quant pass that fuses it
    kind: str  # what it is, in reports

    def recognize(self, y: torch.fx.Node) -> ProducerMatch: ...


# ------------------------------------------------------------------------------------------------------ RMSNorm

RMS_NORM = moefx_ops.rms_norm.default
ADD_RMS_NORM = moefx_ops.add_rms_norm.default
_TORCH_BELOW_2_13 = tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13)


def _vllm_ir_ops() -> tuple[object, object]:
    ns = getattr(torch.ops, "vllm_ir", None)
    rms = getattr(getattr(ns, "rms_norm", None), "default", None) if ns is not None else None
    add = getattr(ns, "fused_add_rms_norm", None) if ns is not None else None
    return rms, add


def _normalized(n: torch.fx.Node, nodes: set) -> tuple[torch.fx.Node, float, torch.fx.Node]:
    """(x32, eps, rsqrt node) when n = x32 * rsqrt(mean(x32^2, -1, keepdim) + eps); else NotMine / Reject."""
    if is_call(n, aten.div.Tensor) and is_call(n.args[1], aten.sqrt.default):
        raise Reject(n, "RMSNorm written as x / sqrt(var + eps); the fused op multiplies by rsqrt (other rounding)")
    if not is_call(n, aten.mul.Tensor):
        raise NotMine
    pairs = [(n.args[0], n.args[1]), (n.args[1], n.args[0])]
    for _, r in pairs:
        if is_call(r, aten.reciprocal.default) and is_call(r.args[0], aten.sqrt.default):
            raise Reject(r, "RMSNorm written as x * (1 / sqrt(var + eps)); the fused op uses rsqrt (other rounding)")
    found = [(x, r) for x, r in pairs if is_call(r, aten.rsqrt.default)]
    if not found:
        raise NotMine
    x32, r = found[0]
    add = r.args[0]
    if not is_call(add, aten.add.Tensor, aten.add.Scalar):
        raise NotMine
    var, eps = add.args[:2]
    if scalar(eps) is None:
        var, eps = eps, var
    if scalar(eps) is None:
        if isinstance(eps, torch.fx.Node) and eps.op == "placeholder":
            raise Reject(add, "the RMSNorm eps is a runtime value, not a constant (compile with "
                              "torch._dynamo.config.specialize_float=True, as moefx.optimize does)")
        raise NotMine
    local = {n, r, add}
    h = shape_of(x32)[-1] if shape_of(x32) else None
    if is_call(var, aten.mean.dim):
        sq, dims, keep = var.args[0], var.args[1], (var.args[2] if len(var.args) > 2 else var.kwargs.get("keepdim"))
    elif is_call(var, aten.div.Tensor) and is_call(var.args[0], aten.sum.dim_IntList) and scalar(var.args[1]) == h:
        local.add(var)
        s = var.args[0]
        var = s
        sq, dims, keep = s.args[0], s.args[1], (s.args[2] if len(s.args) > 2 else s.kwargs.get("keepdim"))
    else:
        raise NotMine
    local.add(var)
    if not keep or norm_dims(dims, len(shape_of(sq))) != [len(shape_of(sq)) - 1]:
        raise Reject(var, "the RMSNorm variance is not a mean over the last dim with keepdim")
    if is_call(sq, aten.pow.Tensor_Scalar) and scalar(sq.args[1]) == 2.0 and sq.args[0] is x32:
        pass
    elif is_call(sq, aten.mul.Tensor) and sq.args[0] is x32 and sq.args[1] is x32:
        pass
    else:
        raise NotMine
    local.add(sq)
    if dtype_of(x32) != torch.float32 or dtype_of(n) != torch.float32:
        raise Reject(n, f"the RMSNorm is computed in {dtype_of(n)}, not fp32")
    nodes |= local
    return x32, float(eps), r


def _weight(w: torch.fx.Node, h: int) -> torch.fx.Node:
    if tuple(shape_of(w)) != (h,) or dtype_of(w) not in FLOAT_DTYPES:
        raise Reject(w, f"the RMSNorm weight is {list(shape_of(w))}/{dtype_of(w)}, not a [{h}] float tensor")
    return w


PLAIN_LABELS = ("RMSNorm", "RMSNorm (no weight)", "RMSNorm (weight in fp32)")  # the one-input norms' labels
ADD_LABELS = tuple(f"residual add + {label}" for label in PLAIN_LABELS)  # the sum rounded to the input dtype first


def plain_norm_problem(match: ProducerMatch, residual: bool = False) -> str | None:
    """Why a recognized norm is not transformers' RMSNorm op for op (`ref_rms_norm(x, w, eps, False)`: the weight,
    if any, in the input's dtype and applied after the downcast; in an fp32 graph both weight orders are that one
    computation), which the ops fusing a norm into another kernel reproduce; with `residual`, of a residual sum
    rounded to the input dtype (transformers' `residual + hidden_states`). None: it is."""
    labels, arity = (ADD_LABELS, 6) if residual else (PLAIN_LABELS, 4)
    if match.label not in labels or len(match.args) != arity or (residual and match.args[5]):
        return f"a {match.label}, not a {'residual add + ' if residual else ''}plain RMSNorm"
    x, weight, _, w_fp32 = match.args[1:5] if residual else match.args
    dtype = dtype_of(x)
    if weight is not None and dtype_of(weight) != dtype:
        return f"its weight is {dtype_of(weight)} for a {dtype} input"
    if w_fp32 and dtype != torch.float32:
        return f"its weight is applied in fp32 to a {dtype} input (one rounding; the fused op rounds twice)"
    return None


class RmsNormProducer:
    """fuse_norm_quant's producer: RMSNorm, or residual add + RMSNorm (also read by fuse_norm_linear and
    fuse_qk_norm_rope, which fuse the same norms into other ops)."""

    pass_name = "fuse_norm_quant"
    kind = "RMSNorm"

    def recognize(self, y: torch.fx.Node) -> ProducerMatch:
        own = self._own_op(y)
        if own is not None:
            return own
        dtype = dtype_of(y)
        if dtype not in FLOAT_DTYPES:
            raise NotMine
        nodes: set = {y}
        weight, w_fp32 = None, False
        # 1. how the weight is applied, down to the fp32 normalized value n
        if is_call(y, CAST) and y.args[1] in LOW_DTYPES and dtype_of(y.args[0]) == torch.float32:
            inner = y.args[0]
            if is_call(inner, aten.mul.Tensor) and not self._is_normalized(inner):
                a, b = inner.args[:2]
                n, weight = (a, b) if self._is_normalized(a) else (b, a)
                nodes.add(inner)
                w_fp32 = True
            else:
                n = inner
        elif is_call(y, aten.mul.Tensor) and not self._is_normalized(y):
            a, b = y.args[:2]
            for nt, w in ((a, b), (b, a)):
                if not isinstance(nt, torch.fx.Node) or not isinstance(w, torch.fx.Node):
                    continue
                core = nt
                if is_call(core, CAST) and core.args[1] in FLOAT_DTYPES and dtype_of(core.args[0]) == torch.float32:
                    core = core.args[0]
                if self._is_normalized(core):
                    nodes.add(nt)
                    n, weight = core, w
                    w_fp32 = dtype_of(nt) == torch.float32 and dtype_of(w) == torch.float32 and nt is core
                    break
            else:
                for nt in (a, b):  # the specific reason when an operand is a norm written another way
                    core = nt.args[0] if is_call(nt, CAST) else nt
                    if isinstance(core, torch.fx.Node):
                        try:
                            _normalized(core, set())
                        except NotMine:
                            pass
                raise NotMine
        else:
            n = y
        x32, eps, rsqrt = _normalized(n, nodes)
        h = shape_of(x32)[-1]
        if not isinstance(h, int):
            raise Reject(y, "the hidden size is not static")
        if weight is not None:
            weight = _weight(strip_upcast(weight), h) if w_fp32 else _weight(weight, h)
        # 2. the input: upcast x, a residual sum rounded to the input dtype, or vLLM's fp32 sum
        residual_out: list[torch.fx.Node] = []
        if is_call(x32, aten.add.Tensor) and all(is_upcast(a) for a in x32.args[:2]) and \
                dtype_of(x32.args[0].args[0]) in LOW_DTYPES:
            a, b = (p.args[0] for p in x32.args[:2])
            in_dtype = dtype_of(a)
            self._check_pair(a, b, x32)
            nodes |= {x32, *x32.args[:2]}
            residual_out = [u for u in x32.users if is_call(u, CAST) and u.args[1] == in_dtype]
            args = (a, b, weight, eps, w_fp32, True)
            label = "residual add (fp32 sum) + RMSNorm"
        else:
            x = x32.args[0] if is_upcast(x32) and dtype_of(x32.args[0]) in LOW_DTYPES else x32
            if x is not x32:
                nodes.add(x32)
            in_dtype = dtype_of(x)
            if is_call(x, aten.add.Tensor) and all(isinstance(p, torch.fx.Node) for p in x.args[:2]) and \
                    dtype_of(x.args[0]) == dtype_of(x.args[1]) == in_dtype and \
                    same_shape(shape_of(x.args[0]), shape_of(x.args[1])) and same_shape(shape_of(x), shape_of(y)):
                nodes.add(x)
                residual_out = [x]
                args = (x.args[0], x.args[1], weight, eps, w_fp32, False)
                label = "residual add + RMSNorm"
            else:
                args = (x, weight, eps, w_fp32)
                label = "RMSNorm"
        if in_dtype not in FLOAT_DTYPES or (dtype != in_dtype and not (weight is not None and not w_fp32)):
            raise Reject(y, f"the RMSNorm output is {dtype} for a {in_dtype} input")
        if _TORCH_BELOW_2_13 and "rms_norm(" in source_line(rsqrt):
            # On torch 2.11 the fused bf16 F.rms_norm + INT8 per-token form differed from eager in ~5% of codes
            # (tests/test_fuse_norm_quant.py); exactness is verified on torch 2.13 and 2.14 only. Every F.rms_norm
            # form is left alone there: 2.11 decomposes some of them with the weight applied after the downcast,
            # a form the check above would otherwise take.
            raise Reject(rsqrt, f"F.rms_norm fusion is verified exact on torch >= 2.13 only (this is "
                                f"{torch.__version__})")
        op = moefx_ops.add_rms_norm_quant.default if len(args) == 6 else moefx_ops.rms_norm_quant.default
        label += " (weight in fp32)" if w_fp32 else ("" if weight is not None else " (no weight)")
        return ProducerMatch(label, op, args, nodes, residual_out, anchor=y)

    @staticmethod
    def _is_normalized(n: torch.fx.Node) -> bool:
        try:
            _normalized(n, set())
        except (NotMine, Reject):
            return False
        return True

    @staticmethod
    def _check_pair(a: torch.fx.Node, b: torch.fx.Node, at: torch.fx.Node) -> None:
        if dtype_of(a) != dtype_of(b) or not same_shape(shape_of(a), shape_of(b)):
            raise Reject(at, f"residual {list(shape_of(b))}/{dtype_of(b)} and input {list(shape_of(a))}/{dtype_of(a)} "
                             f"differ (broadcasting or mixed-precision add)")

    def _own_op(self, y: torch.fx.Node) -> ProducerMatch | None:
        """moefx's unfused ops and vLLM's IR ops, whose semantics are the fused op's."""
        ir_rms, ir_add = _vllm_ir_ops()
        if is_call(y, RMS_NORM):
            return ProducerMatch("moefx::rms_norm", moefx_ops.rms_norm_quant.default, tuple(y.args), {y}, anchor=y)
        if ir_rms is not None and is_call(y, ir_rms):
            x, w, eps = y.args[:3]
            if len(y.args) > 3 and y.args[3] is not None:
                raise Reject(y, "vLLM rms_norm with variance_size (a partial-width variance)")
            w_fp32 = w is not None and dtype_of(w) == torch.float32 and dtype_of(x) != torch.float32
            return ProducerMatch("vLLM IR rms_norm", moefx_ops.rms_norm_quant.default, (x, w, eps, w_fp32), {y},
                                 anchor=y)
        if is_call(y, operator.getitem) and y.args[1] == 0:
            t = y.args[0]
            items = {u.args[1]: u for u in t.users if is_call(u, operator.getitem)}
            if is_call(t, ADD_RMS_NORM):
                return ProducerMatch("moefx::add_rms_norm", moefx_ops.add_rms_norm_quant.default, tuple(t.args),
                                     {y, t}, [items[1]] if 1 in items else [], anchor=y)
            if ir_add is not None and isinstance(t, torch.fx.Node) and t.op == "call_function" and \
                    getattr(t.target, "overloadpacket", None) is ir_add:
                x, r, w, eps = t.args[:4]
                if len(t.args) > 4 and t.args[4] is not None:
                    raise Reject(t, "vLLM fused_add_rms_norm with variance_size (a partial-width variance)")
                w_fp32 = w is not None and dtype_of(w) == torch.float32 and dtype_of(x) != torch.float32
                return ProducerMatch("vLLM IR fused_add_rms_norm", moefx_ops.add_rms_norm_quant.default,
                                     (x, r, w, eps, w_fp32, True), {y, t}, [items[1]] if 1 in items else [],
                                     anchor=y)
        return None


def strip_upcast(w: torch.fx.Node) -> torch.fx.Node:
    """The weight before an exact upcast to fp32 (the op upcasts it itself)."""
    inner = strip_views(w)
    return inner.args[0] if is_upcast(inner) else w


# ----------------------------------------------------------------------------------------------------- SiLU-mul

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


class SiluMulProducer:
    """fuse_act_quant's producer: SiLU-mul."""

    pass_name = "fuse_act_quant"
    kind = "SiLU-mul"

    def recognize(self, y: torch.fx.Node) -> ProducerMatch:
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


RMS_NORM_PRODUCER = RmsNormProducer()
SILU_MUL_PRODUCER = SiluMulProducer()
PRODUCERS: tuple[Producer, ...] = (RMS_NORM_PRODUCER, SILU_MUL_PRODUCER)  # pipeline order


# ---------------------------------------------------------------------------------------------------- the base

class QuantFusionPass(MoefxPass):
    """Base of fuse_act_quant and fuse_norm_quant: each fuses the quants of its `producer` (one of PRODUCERS)."""

    uuid_files = (*DEPENDENCY_FILES, __file__)
    producer: ClassVar[Producer]

    def _owner(self, y: torch.fx.Node) -> tuple[Producer | None, Any]:
        """The producer that made y, and its match (a ProducerMatch or a Reject): the first of PRODUCERS that does
        not answer NotMine."""
        for producer in PRODUCERS:
            try:
                return producer, producer.recognize(y)
            except NotMine:
                continue
            except Reject as r:
                return producer, r
        return None, None

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        dedupe_casts(graph)
        enabled = set(ctx.enabled or (self.name,))
        by_source: dict[torch.fx.Node, list[QuantMatch]] = {}
        for cand in quant_candidates(graph):
            try:
                matches = recognize_moefx_quant(cand) if cand.target is QUANT else [recognize_quant(cand)]
            except Reject as r:
                ctx.skip(f"{location(cand)}: {_cast_label(cand)} left alone: {r.reason} ({describe(r.node)})")
                continue
            for m in matches:
                by_source.setdefault(m.source, []).append(m)
        fused = 0
        for y, quants in by_source.items():
            owner, prod = self._owner(y)
            head = f"{location(quants[0].anchor)}: {quants[0].label} of {y.name}"
            if owner is None:
                ctx.skip(f"{head} left alone: its input {describe(y)} is not a SiLU-mul or RMSNorm output")
                continue
            if owner.pass_name != self.name:
                if owner.pass_name not in enabled:
                    ctx.skip(f"{head} left alone: its producer is a {owner.kind}; {owner.pass_name} is off")
                continue
            if isinstance(prod, Reject):
                ctx.skip(f"{head} left alone: {prod.reason} ({describe(prod.node)})")
                continue
            why = self._fuse(graph, y, quants, prod, ctx)
            if why is not None:
                ctx.skip(f"{head} left alone: {why}")
            else:
                fused += 1
        if fused:
            graph.eliminate_dead_code()
        return fused

    def _fuse(self, graph: torch.fx.Graph, y: torch.fx.Node, quants: list[QuantMatch], prod: ProducerMatch,
              ctx: PassContext) -> str | None:
        """Replace `prod` and `quants` with one fused op; returns None, or why not."""
        schemes = {q.scheme for q in quants}
        if len(schemes) != 1:
            return f"{y.name} feeds quants with {len(schemes)} different schemes"
        scheme = schemes.pop()
        qnodes = set().union(*(q.nodes for q in quants))
        keep = {q.q for q in quants} | {s for q in quants for s in q.scale_outputs} | set(prod.residual)
        inner = (prod.nodes | qnodes) - keep
        for n in sorted(inner, key=lambda n: n.name):
            stray = [u for u in n.users if u not in inner and u not in keep]
            if stray:
                users = ", ".join(sorted({describe(u) for u in stray})[:3])
                return f"{n.name} ({location(n)}) also feeds {users}; fusing would compute it twice"
        inputs = [a for a in prod.args if isinstance(a, torch.fx.Node)]
        inputs += list(graph.find_nodes(op="placeholder"))[-1:]
        order = {n: i for i, n in enumerate(graph.nodes)}
        last = max(inputs, key=lambda n: order[n])
        try:
            with graph.inserting_after(last):
                fused = call(graph, prod.op, (*prod.args, *scheme.args()))
            with graph.inserting_after(fused):
                q_out = call(graph, operator.getitem, (fused, 0))
            with graph.inserting_after(q_out):
                s_out = call(graph, operator.getitem, (fused, 1))
            tail = s_out
            if prod.residual:
                with graph.inserting_after(s_out):
                    tail = call(graph, operator.getitem, (fused, 2))
            res_out = tail
            repl: list[tuple[torch.fx.Node, torch.fx.Node]] = []
            with graph.inserting_after(tail):
                for q in quants:
                    repl.append((q.q, reshaped(graph, q_out, q.q)))
                    repl += [(s, reshaped(graph, s_out, s)) for s in q.scale_outputs]
                repl += [(r, reshaped(graph, res_out, r)) for r in prod.residual]
        except Reject as r:
            return r.reason
        for old, new in repl:
            if dtype_of(old) != dtype_of(new):
                raise AssertionError(f"{self.name}: {old.name} {dtype_of(old)} replaced by {dtype_of(new)}")
            old.replace_all_uses_with(new)
        if any(order.get(u, len(order)) <= order[last] for _, new in repl for u in new.users):
            from torch._inductor.pattern_matcher import stable_topological_sort

            stable_topological_sort(graph)
        note = f"{location(quants[0].anchor)}: {prod.label} + {quants[0].label} -> {prod.op}"
        if len(quants) > 1:
            note += f" (shared by {len(quants)} quants)"
        ctx.note(note)
        log.debug("%s fused %s", self.name, note)
        return None
