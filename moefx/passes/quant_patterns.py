"""What fuse_act_quant and fuse_norm_quant share: recognizing a dynamic activation quant by its dataflow and
constants, and the rewrite of "producer -> quant" into one fused op.

Recognition works on the post-grad graph as it is, whatever the spelling of the user's code:
- Canonical views. Reshapes/views/unsqueezes (flat order kept) and exact upcasts (bf16/fp16 -> fp32) are
  looked through in any order, so `y.float().view(-1, 128)` and `y.view(-1, 128).float()` are one form.
  `amax(abs(x))`, `max(abs(x), dim)[0]`, `abs(x).float().amax()` and torchao's `max(-min(amin, 0), max(amax, 0))`
  are one "amax per group". A clamp applied to a bf16/fp16 amax before its fp32 cast (SGLang) is the fp32
  clamp with the bound rounded to that dtype (rounding is monotonic and the amax is representable there),
  which is how the two orders are told apart exactly.
- A quant expression is: a cast to float8_e4m3fn or int8 of `y_fp32 (/ scale | * (1 / scale) | * (qmax / amax))`,
  through clamps (and `round` for int8), where the scale is amax per token or per group of the same y, then
  [max(., eps)] -> / qmax -> [UE8M0] -> [max(., min_scale)] (or the UE8M0 after that clamp), all in fp32. The
  grouping is read from shapes: the divided view of y is [..., g] and its scale [..., 1] (g = H: per token).
- It is fused only if moefx's op computes the same value at every rounding step; anything else is left alone
  with the exact reason (`Reject`), the user's file:line, and reported in the compile report.
Producers are recognized the same way, in `quant_fusion.py`, beside the pass base that fuses them.

A pass (`quant_fusion.QuantFusionPass`) then replaces the producer and every quant of its output with one fused
op.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx

from moefx.ops import fused_quant  # noqa: F401  (registers the moefx ops used below)
from moefx.ops.quant import FP8_MAX, INT8_MAX, QuantScheme
from moefx.passes import fx as _fx
from moefx.passes.fx import LOW_DTYPES, dtype_of, is_call, location, val

aten = torch.ops.aten
prims = torch.ops.prims
moefx_ops = torch.ops.moefx
FP8 = torch.float8_e4m3fn
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
QUANT = moefx_ops.quant.default
CAST = prims.convert_element_type.default
_OPS_DIR = Path(__file__).resolve().parent.parent / "ops"
DEPENDENCY_FILES = (
    str(Path(__file__).resolve()),
    str(_OPS_DIR / "fused_quant.py"),
    str(_OPS_DIR / "quant.py"),
    str(_OPS_DIR.parent / "kernels" / "act_quant.py"),
    _fx.__file__,
)

# Ops that keep values and the flat (row-major) order of elements: looked through everywhere.
VIEW_OPS = frozenset({
    aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims, aten.clone.default, aten.alias.default,
})
REDUCTIONS = frozenset({aten.amax.default, aten.max.dim, aten.max.default, aten.amin.default})
OTHER_QUANT_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint8") if hasattr(torch, n)
)


class Reject(Exception):
    """A candidate moefx cannot fuse exactly; `node` is where the recognized form stops."""

    def __init__(self, node: Any, reason: str) -> None:
        super().__init__(reason)
        self.node = node
        self.reason = reason


class NotMine(Exception):
    """The value is not produced by this pass's kind of producer."""


# ---------------------------------------------------------------------------------------------- graph helpers


def shape_of(node: Any) -> tuple:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def scalar(x: Any) -> float | None:
    """A Python number argument (not a graph value), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def same_size(a: Any, b: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def same_shape(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def is_one(dims: tuple) -> bool:
    """`dims` is exactly (1,) (a trailing broadcast dim)."""
    return len(dims) == 1 and isinstance(dims[0], int) and dims[0] == 1


def numel(shape: tuple) -> Any:
    n = 1
    for s in shape:
        n = n * s
    return n


def norm_dims(dims: Any, ndim: int) -> list[int]:
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted(d % ndim for d in dims)


def round_to(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=torch.float32).to(dtype).float())


def fmt_num(v: float) -> str:
    return f"{v:g}"


def describe(node: Any) -> str:
    if not isinstance(node, torch.fx.Node):
        return repr(node)
    what = node.name if node.op != "call_function" else f"{node.name} ({node.target})"
    return f"{what} at {location(node)}"


def strip_views(node: Any, taken: set | None = None) -> Any:
    """Look through value-and-order-preserving ops; collects the nodes passed in `taken`."""
    while is_call(node, *VIEW_OPS):
        if taken is not None:
            taken.add(node)
        node = node.args[0]
    return node


def is_upcast(node: Any) -> bool:
    """A cast that changes no value: to fp32 from fp32/bf16/fp16, or to the dtype the value already has."""
    if not is_call(node, CAST):
        return False
    src, dst = dtype_of(node.args[0]), node.args[1]
    return src == dst or (dst == torch.float32 and src in FLOAT_DTYPES)


def strip_exact(node: Any, taken: set | None = None) -> Any:
    """Look through views and exact upcasts in any order."""
    while is_call(node, *VIEW_OPS) or is_upcast(node):
        if taken is not None:
            taken.add(node)
        node = node.args[0]
    return node


def is_zeros(node: Any) -> bool:
    if is_call(node, aten.full.default):
        return scalar(node.args[1]) == 0.0
    return is_call(node, aten.zeros.default, aten.zeros_like.default)


# -------------------------------------------------------------------------------------------- quant recognition


@dataclass
class QuantMatch:
    """One recognized dynamic quant of `source`."""

    q: torch.fx.Node  # the node holding the quantized values (the cast, or getitem 0 of moefx::quant)
    source: torch.fx.Node  # y: the tensor being quantized
    scheme: QuantScheme
    label: str
    scale_outputs: list[torch.fx.Node]  # nodes holding the scale values (any layout keeping the group order)
    nodes: set[torch.fx.Node]  # every node computing q or the scale from y (source excluded)
    anchor: torch.fx.Node  # the node the report points at


@dataclass
class _Amax:
    node: torch.fx.Node  # the reduction's output (fp32 or low precision, exact)
    data: torch.fx.Node  # the tensor reduced (base after views/upcasts)
    shape: tuple  # shape of the reduced view (last dim = group)


def _parse_amax(node: Any, taken: set) -> _Amax:
    """The amax per group/token of |x| behind `node` (views and upcasts already stripped by the caller)."""
    local: set = set()
    if is_call(node, operator.getitem) and node.args[1] == 0 and is_call(node.args[0], aten.max.dim):
        local.add(node)
        red = node.args[0]
        dims = [red.args[1]]
    elif is_call(node, aten.amax.default):
        red = node
        dims = list(red.args[1]) if len(red.args) > 1 else []
    elif is_call(node, aten.maximum.default):
        return _parse_minmax(node, taken)
    elif is_call(node, aten.max.default):
        raise Reject(node, "the scale is one per tensor (max over all elements); the fused ops scale per token or "
                           "per group")
    else:
        found = node.target if isinstance(node, torch.fx.Node) and node.op == "call_function" else node
        raise Reject(node, f"the scale does not come from an amax per token or group (found {found})")
    local.add(red)
    x = red.args[0]
    xin = strip_exact(x, local)
    if not is_call(xin, aten.abs.default):
        raise Reject(red, "the reduction is not over |x| (no abs before the max)")
    local.add(xin)
    rshape = shape_of(x)
    if not dims or norm_dims(dims, len(rshape)) != [len(rshape) - 1]:
        raise Reject(red, f"the amax reduces dims {dims} of a {len(rshape)}-d view, not its last dim")
    data = strip_exact(xin.args[0], local)
    taken |= local
    return _Amax(node, data, rshape)


def _parse_minmax(node: torch.fx.Node, taken: set) -> _Amax:
    """torchao's symmetric qparams: max(-min(amin(x), 0), max(amax(x), 0)) == max|x| (exact)."""
    local = {node}
    parts = {}
    for a in node.args:
        if is_call(a, aten.neg.default) and is_call(a.args[0], aten.minimum.default):
            parts["min"] = (a, a.args[0])
        elif is_call(a, aten.maximum.default):
            parts["max"] = (a, a)
    if set(parts) != {"min", "max"}:
        raise Reject(node, "an elementwise maximum that is not max(-min(amin(x), 0), max(amax(x), 0))")
    bases, shapes = [], []
    for key, want in (("min", aten.amin.default), ("max", aten.amax.default)):
        outer, inner = parts[key]
        local |= {outer, inner}
        red = next((a for a in inner.args if is_call(a, want)), None)
        zero = next((a for a in inner.args if a is not red), None)
        if red is None or not is_zeros(zero):
            raise Reject(inner, "an elementwise min/max against something other than 0")
        local |= {red, zero}
        rshape = shape_of(red.args[0])
        if norm_dims(red.args[1], len(rshape)) != [len(rshape) - 1]:
            raise Reject(red, "the amin/amax does not reduce the last dim")
        bases.append(strip_exact(red.args[0], local))
        shapes.append(rshape)
    if bases[0] is not bases[1]:
        raise Reject(node, "amin and amax are taken of different tensors")
    taken |= local
    return _Amax(node, bases[0], shapes[0])


def _scale_steps(node: Any, taken: set) -> tuple[list[tuple], _Amax, torch.fx.Node]:
    """Walk the scale back to its amax: returns (steps in forward order, amax, the last arithmetic node).

    Steps: ("max", c) a lower clamp, ("div", q) division by a Python number, ("ue8m0",) exp2(ceil(log2(.))).
    """
    steps: list[tuple] = []
    final = None
    cur = node
    while True:
        cur = strip_views(cur, taken)
        if final is None and isinstance(cur, torch.fx.Node):
            final = cur
        dt = dtype_of(cur)
        if is_call(cur, aten.clamp_min.default) or (is_call(cur, aten.clamp.default) and
                                                    (len(cur.args) < 3 or cur.args[2] is None)):
            c = scalar(cur.args[1]) if len(cur.args) > 1 else scalar(cur.kwargs.get("min"))
            if c is None:
                raise Reject(cur, "the scale is clamped by a runtime value, not a constant")
            if dt in LOW_DTYPES:
                c = round_to(c, dt)  # max(a, c) rounded to dt == max(a, rn(c)) for an a representable in dt
            steps.append(("max", c))
        elif is_call(cur, aten.div.Tensor) and not isinstance(cur.args[1], torch.fx.Node):
            q = scalar(cur.args[1])
            if dt != torch.float32:
                raise Reject(cur, f"the scale is divided in {dt} (the fused op keeps fp32 scales)")
            steps.append(("div", q))
        elif is_call(cur, aten.exp2.default) or (is_call(cur, aten.pow.Scalar) and scalar(cur.args[0]) == 2.0):
            inner = cur.args[0] if is_call(cur, aten.exp2.default) else cur.args[1]
            if not (is_call(inner, aten.ceil.default) and is_call(inner.args[0], aten.log2.default)):
                raise Reject(cur, "a power of two of something other than ceil(log2(scale))")
            if dt != torch.float32:
                raise Reject(cur, f"the UE8M0 rounding runs in {dt}")
            lg = inner.args[0]
            taken |= {inner, lg}
            steps.append(("ue8m0",))
            taken.add(cur)
            cur = lg.args[0]
            if is_call(cur, aten.abs.default):  # |scale| == scale (scales are >= 0)
                taken.add(cur)
                cur = cur.args[0]
            continue
        elif is_call(cur, CAST):
            src = cur.args[0]
            sdt = dtype_of(src)
            if cur.args[1] != torch.float32 or sdt not in FLOAT_DTYPES:
                raise Reject(cur, f"the scale is cast to {cur.args[1]}")
            if sdt in LOW_DTYPES:
                inner = strip_views(src, taken)
                if is_call(inner, CAST) and is_call(inner.args[0], aten.clamp_min.default) and \
                        dtype_of(inner.args[0]) == torch.float32:
                    # a clamp of a low-precision amax, decomposed as upcast -> clamp -> downcast
                    clamp = inner.args[0]
                    c = scalar(clamp.args[1])
                    if c is None:
                        raise Reject(clamp, "the scale is clamped by a runtime value, not a constant")
                    steps.append(("max", round_to(c, sdt)))
                    taken |= {cur, inner, clamp}
                    cur = clamp.args[0]
                    if not (is_upcast(strip_views(cur)) or is_call(strip_views(cur), *REDUCTIONS, operator.getitem)):
                        raise Reject(clamp, f"the scale is rounded to {sdt}")
                    continue
                if not _is_low_precision_amax(inner):
                    raise Reject(cur, f"the scale is computed in {sdt} and rounded there (the fused op keeps fp32 "
                                      f"scales)")
        elif is_call(cur, aten.mul.Tensor) and not isinstance(cur.args[1], torch.fx.Node):
            raise Reject(cur, f"the scale is amax * {cur.args[1]} (the fused op divides by qmax)")
        else:
            break
        taken.add(cur)
        cur = cur.args[0]
    amax = _parse_amax(cur, taken)
    steps.reverse()
    return steps, amax, final


def _is_low_precision_amax(node: Any) -> bool:
    node = strip_views(node)
    if is_call(node, operator.getitem):
        node = node.args[0]
    return is_call(node, aten.amax.default, aten.max.dim, aten.max.default) and dtype_of(node) in LOW_DTYPES + (None,)


def _merge_max(steps: list[tuple]) -> list[tuple]:
    out: list[tuple] = []
    for s in steps:
        if s[0] == "max" and out and out[-1][0] == "max":
            out[-1] = ("max", max(out[-1][1], s[1]))
        else:
            out.append(s)
    return out


def _scale_params(steps: list[tuple], node: Any) -> dict[str, Any]:
    """Map the scale steps onto the op's pipeline: [max eps] / qmax [ue8m0] [max min_scale] | ... [max] ue8m0."""
    kinds = "".join({"max": "m", "div": "d", "ue8m0": "u"}[s[0]] for s in steps)
    if not re.fullmatch(r"m?d(u?m?|mu)", kinds):
        chain = " -> ".join(s[0] if len(s) == 1 else f"{s[0]} {fmt_num(s[1])}" for s in steps) or "amax"
        raise Reject(node, f"the scale is amax -> {chain}; the fused op computes amax -> [max eps] -> / qmax -> "
                           f"[UE8M0] -> [max min_scale]")
    p: dict[str, Any] = {"eps": 0.0, "min_scale": 0.0, "ue8m0": "u" in kinds, "late": kinds.endswith("mu")}
    d = kinds.index("d")
    p["qmax"] = steps[d][1]
    if d == 1:
        p["eps"] = steps[0][1]
    after = [s[1] for s in steps[d + 1:] if s[0] == "max"]  # at most one (the pattern above)
    if after:
        p["min_scale"] = after[0]
    if p["eps"] < 0 or p["min_scale"] < 0:
        raise Reject(node, f"negative eps {p['eps']} / min scale {p['min_scale']}")
    return p


def recognize_quant(cast: torch.fx.Node) -> QuantMatch:
    """Recognize the quant ending at `cast` (a cast to float8_e4m3fn or int8), or raise Reject."""
    target = cast.args[1]
    fp8 = target == FP8
    if not fp8 and target != torch.int8:
        raise Reject(cast, f"casts to {target}; the fused ops produce float8_e4m3fn or int8")
    taken: set = {cast}
    lo, hi, rounded = -math.inf, math.inf, False
    v = cast.args[0]
    while True:
        v = strip_views(v, taken)
        if is_call(v, aten.clamp_min.default, aten.clamp_max.default, aten.clamp.default):
            if v.target is aten.clamp.default:
                bounds = [scalar(v.args[1]) if len(v.args) > 1 else scalar(v.kwargs.get("min")),
                          scalar(v.args[2]) if len(v.args) > 2 else scalar(v.kwargs.get("max"))]
            elif v.target is aten.clamp_min.default:
                bounds = [scalar(v.args[1]), None]
            else:
                bounds = [None, scalar(v.args[1])]
            if any(isinstance(b, torch.fx.Node) for b in v.args[1:]):
                raise Reject(v, "the quantized values are clamped by a runtime value")
            lo = max(lo, bounds[0]) if bounds[0] is not None else lo
            hi = min(hi, bounds[1]) if bounds[1] is not None else hi
        elif is_call(v, aten.round.default):
            if fp8:
                raise Reject(v, "rounds to integers before the fp8 cast")
            rounded = True
        elif is_call(v, aten.add.Tensor) and not fp8 and any(is_zeros(a) for a in v.args):
            taken |= {a for a in v.args if is_zeros(a)}  # torchao's zero point 0 (sign of zero is lost in int8)
            v = next(a for a in v.args if not is_zeros(a))
            continue
        elif is_upcast(v):
            pass
        else:
            break
        taken.add(v)
        v = v.args[0]
    if dtype_of(v) != torch.float32:
        raise Reject(v, f"the value cast to {target} is {dtype_of(v)}, not fp32 (rounded before the cast)")
    if not fp8 and not rounded:
        raise Reject(cast, "no round() before the int8 cast (the cast truncates toward zero)")
    scaled = v
    taken.add(scaled)
    mult = None
    if is_call(scaled, aten.div.Tensor) and isinstance(scaled.args[1], torch.fx.Node):
        data, scale, scaling = scaled.args[0], scaled.args[1], "divide"
    elif is_call(scaled, aten.mul.Tensor) and all(isinstance(a, torch.fx.Node) for a in scaled.args[:2]):
        a, b = scaled.args[:2]
        data, mult = (a, b) if is_one(shape_of(b)[-1:]) else (b, a)
        m = strip_views(mult, taken)
        while is_call(m, aten.mul.Tensor) and scalar(m.args[1]) == 1.0:  # `1.0 / s` is reciprocal(s) * 1.0
            taken.add(m)
            m = strip_views(m.args[0], taken)
        if is_call(m, aten.reciprocal.default):
            taken.add(m)
            scale, scaling = m.args[0], "reciprocal"
        elif is_call(m, aten.mul.Tensor) and is_call(m.args[0], aten.reciprocal.default) and \
                scalar(m.args[1]) is not None:
            taken |= {m, m.args[0]}
            scale, scaling = m.args[0].args[0], "qmax_over_amax"
        else:
            raise Reject(m, "the values are multiplied by something other than 1 / scale or qmax / amax")
    else:
        raise Reject(scaled, "the value cast is not x / scale or x * (1 / scale)")
    dshape = shape_of(data)
    mshape = shape_of(scale if mult is None else mult)
    source = strip_exact(data, taken)
    sdt = dtype_of(source)
    if sdt not in FLOAT_DTYPES:
        raise Reject(source, f"quantizes a {sdt} tensor")
    steps, amax, final = _scale_steps(scale, taken)
    if amax.data is not source:
        raise Reject(amax.node, f"the amax is taken of {amax.data.name}, the values divided are {source.name}")
    if scaling == "qmax_over_amax":
        if [s[0] for s in steps] not in ([], ["max"]):
            raise Reject(scale, "qmax / amax with an amax that is not just clamped")
        p = {"eps": steps[0][1] if steps else 0.0, "min_scale": 0.0, "ue8m0": False, "late": False,
             "qmax": _qmax_of(mult)}
        outputs = [u for u in final.users if is_call(u, aten.div.Tensor) and scalar(u.args[1]) == p["qmax"]]
        taken |= set(outputs)
    else:
        p = _scale_params(_merge_max(steps), scale)
        outputs = [final]
    # grouping, read from shapes: the divided view [..., g] against its scale [..., 1] in the same flat order
    ysh = shape_of(source)
    h = ysh[-1] if ysh else None
    g = dshape[-1] if dshape else None
    if not isinstance(h, int) or not isinstance(g, int):
        raise Reject(source, "the hidden size is not static (mark only the token dimension dynamic)")
    if not (len(mshape) == len(dshape) and is_one(mshape[-1:]) and same_shape(mshape[:-1], dshape[:-1])):
        raise Reject(scaled, f"the scale {list(mshape)} does not broadcast once per row of the {list(dshape)} view")
    if amax.shape[-1] != g or not same_size(numel(amax.shape), numel(dshape)):
        raise Reject(amax.node, f"the amax groups {amax.shape[-1]} elements, the division {g}")
    if g != h and h % g:
        raise Reject(scaled, f"groups of {g} do not divide the hidden size {h}")
    kind = ("fp8_" if fp8 else "int8_") + ("token" if g == h else "group")
    qmax = p["qmax"]
    limit = FP8_MAX if fp8 else INT8_MAX
    if qmax is None or not 0 < qmax <= limit:
        raise Reject(scale, f"{'fp8' if fp8 else 'int8'} max {qmax} is outside (0, {limit}]")
    if lo > -qmax or hi < qmax:
        raise Reject(cast, f"the values are clamped to [{fmt_num(lo)}, {fmt_num(hi)}] but scaled to +-{fmt_num(qmax)}")
    scheme = QuantScheme(kind, 0 if g == h else g, p["eps"], p["min_scale"], qmax, p["ue8m0"], False, False,
                         scaling, p["late"] and p["ue8m0"])
    taken.discard(source)
    return QuantMatch(cast, source, scheme, quant_label(scheme), outputs, taken, cast)


def _cast_label(cast: torch.fx.Node) -> str:
    names = {FP8: "fp8", torch.int8: "int8"}
    return f"{names.get(cast.args[1], str(cast.args[1]).replace('torch.', ''))} quant ({cast.name})"


def _qmax_of(mult: Any) -> float | None:
    m = strip_views(mult)
    while is_call(m, aten.mul.Tensor) and scalar(m.args[1]) == 1.0:
        m = strip_views(m.args[0])
    return scalar(m.args[1]) if is_call(m, aten.mul.Tensor) else None


def quant_label(s: QuantScheme) -> str:
    kind = s.kind.replace("_token", " per-token").replace("_group", f" group-{s.group_size}")
    extra = [f"eps {fmt_num(s.eps)}"] if s.eps else []
    extra += [f"min scale {fmt_num(s.min_scale)}"] if s.min_scale else []
    extra += ["UE8M0" + (" after the clamp" if s.ue8m0_after_min_scale else "")] if s.scale_ue8m0 else []
    extra += [{"divide": "x / scale", "reciprocal": "x * (1 / scale)", "qmax_over_amax": "x * (qmax / amax)"}[
        s.scaling]]
    return f"{kind} quant ({', '.join(extra)})"


def recognize_moefx_quant(node: torch.fx.Node) -> list[QuantMatch]:
    """moefx::quant(y, *scheme) as emitted by `moefx.quantize`: the scheme is given."""
    scheme = QuantScheme(*node.args[1:])
    items = {u.args[1]: u for u in node.users if is_call(u, operator.getitem)}
    q = items.get(0)
    if q is None:
        return []
    outs = [items[1]] if 1 in items else []
    return [QuantMatch(q, node.args[0], scheme, quant_label(scheme), outs, {node, *items.values()}, node)]


def looks_like_quant(cast: torch.fx.Node, budget: int = 64) -> bool:
    """A cast to an 8-bit type whose input depends, within its nearest `budget` ops, on a max reduction."""
    frontier, seen = [cast.args[0]], set()
    while frontier and len(seen) < budget:
        n = frontier.pop(0)
        if not isinstance(n, torch.fx.Node) or n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if n.target in REDUCTIONS:
            return True
        frontier += n.all_input_nodes
    return False


def quant_candidates(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Every node that looks like the end of a dynamic quant: 8-bit casts fed by a max reduction, moefx::quant."""
    out = []
    for n in graph.nodes:
        if is_call(n, QUANT):
            out.append(n)
        elif is_call(n, CAST) and (n.args[1] in (FP8, torch.int8) or n.args[1] in OTHER_QUANT_DTYPES) and \
                looks_like_quant(n):
            out.append(n)
    return out


# --------------------------------------------------------------------------------------------------- producers


@dataclass
class ProducerMatch:
    """A recognized producer of y and the fused op that replaces it together with y's quants."""

    label: str
    op: Any  # the fused op (its scheme arguments come last)
    args: tuple  # its arguments before the scheme
    nodes: set[torch.fx.Node]  # every node computing y from the op's inputs (y included)
    residual: list[torch.fx.Node] = field(default_factory=list)  # nodes holding the new residual (op output 2)
    anchor: torch.fx.Node | None = None


# ------------------------------------------------------------------------------------------- graph rewriting


def reshaped(graph: torch.fx.Graph, src: torch.fx.Node, like: torch.fx.Node) -> torch.fx.Node:
    """`src` reshaped to `like`'s shape (same number of elements, flat order kept)."""
    want = shape_of(like)
    if same_shape(shape_of(src), want):
        return src
    dyn = [i for i, s in enumerate(want) if not isinstance(s, int)]
    if len(dyn) > 1:
        raise Reject(like, "more than one dynamic dimension in an output layout")
    sizes = [-1 if i in dyn else s for i, s in enumerate(want)]
    return _fx.call(graph, aten.reshape.default, (src, sizes))


def dedupe_casts(graph: torch.fx.Graph) -> None:
    """Merge repeated identical dtype casts of one tensor (`y.float()` written twice is not CSE'd in
    inference graphs), so one value has one name. Casts are pure."""
    seen: dict[tuple[torch.fx.Node, Any], torch.fx.Node] = {}
    for node in list(graph.find_nodes(op="call_function", target=CAST)):
        if node.kwargs or not isinstance(node.args[0], torch.fx.Node):
            continue
        first = seen.setdefault((node.args[0], node.args[1]), node)
        if first is not node:
            node.replace_all_uses_with(first)
            graph.erase_node(node)


# ------------------------------------------------------------------------------------------------ the passes


# ---------------------------------------------------------------------------------------------- for looking


class _Captured(Exception):
    pass


def post_grad_graph(fn: Callable[..., Any], args: list[Any], dynamic_rows: bool = False) -> torch.fx.Graph:
    """The post-grad graph inductor would hand to moefx's passes for `fn(*args)` (dynamo + AOT + inductor's
    own post-grad passes), captured and returned before code generation. For tests, `explain_fusions` and
    for looking at what a pass sees. `dynamic_rows` makes dim 0 of every input with 2+ dims symbolic (the
    token count of a serving graph; hidden sizes stay static as they are in models)."""
    from torch._inductor.compile_fx import compile_fx

    box: dict[str, torch.fx.Graph] = {}

    def grab(graph: torch.fx.Graph) -> None:
        box["graph"] = graph
        raise _Captured

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": grab,
                                                               "fx_graph_cache": False})

    torch._dynamo.reset()
    if dynamic_rows:
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() >= 2:
                torch._dynamo.mark_dynamic(a, 0)
    try:
        with torch._dynamo.config.patch(specialize_float=True):
            torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)(*args)
    except Exception:
        if "graph" not in box:
            raise
    return box["graph"]
