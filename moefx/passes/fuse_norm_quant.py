"""fuse_norm_quant: RMSNorm (or residual add + RMSNorm) followed by dynamic quants -> one fused op.

The RMSNorm is recognized by its dataflow: n = x32 * rsqrt(mean(x32^2, -1) + eps) (`pow(x, 2)` or `x * x`,
`mean` or `sum / H`), then one of
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
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from moefx.passes.fx import LOW_DTYPES, dtype_of, is_call, source_line
from moefx.passes.quant_patterns import (
    CAST,
    FLOAT_DTYPES,
    NotMine,
    ProducerMatch,
    QuantFusionPass,
    Reject,
    aten,
    is_upcast,
    moefx_ops,
    norm_dims,
    same_shape,
    scalar,
    shape_of,
    strip_views,
)

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


class FuseNormQuant(QuantFusionPass):
    name = "fuse_norm_quant"
    producer_kind = "RMSNorm"

    def recognize_producer(self, y: torch.fx.Node) -> ProducerMatch:
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
        if w_fp32 and _TORCH_BELOW_2_13 and "rms_norm(" in source_line(rsqrt):
            # On torch 2.11 the fused bf16 F.rms_norm + INT8 per-token form differed from eager in ~5% of codes
            # (tests/test_fuse_norm_quant.py); exactness is verified on torch 2.13 and 2.14 only.
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
