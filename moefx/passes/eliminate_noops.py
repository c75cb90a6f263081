"""eliminate_noops: drop reshapes, slices, expands and casts that return their input unchanged.

Inductor already removes the simplest no-ops; what survives into the post-grad graph are chains that
are no-ops only together: `x.view(-1, 128).view(x.shape)` around a per-group computation, or an exact
round-trip cast such as bf16 -> fp32 -> bf16. Such chains sit between the ops a fusion looks for and stop
patterns from matching. Every rewrite here is exact: the value of each rewritten node is unchanged.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from moefx.passes import fx as _fx
from moefx.passes.base import MoefxPass, PassContext
from moefx.passes.fx import RESHAPES

aten = torch.ops.aten
prims = torch.ops.prims

_SAME_SHAPE_NOOPS = {aten.expand.default, aten.alias.default, aten.slice.Tensor}
_CASTS = {prims.convert_element_type.default, aten._to_copy.default}
# Casting a value up to one of these dtypes and back down is exact (every source value is representable).
_LOSSLESS_UP = {
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}


def _val(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _plain_cast(node: torch.fx.Node) -> bool:
    """A dtype-only cast: `convert_element_type`, or `_to_copy` with nothing but dtype/device/layout."""
    if node.target is prims.convert_element_type.default:
        return True
    return node.target is aten._to_copy.default and not set(node.kwargs) - {"dtype", "device", "layout"}


def _keeps_value(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    out, inp = _val(node), _val(source)
    return (
        out is not None
        and inp is not None
        and out.dtype == inp.dtype
        and out.device == inp.device
        and _same_shape(out, inp)
    )


def _touches_io(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    # A copy may be relied on for not aliasing a graph input or output: keep those.
    return source.op == "placeholder" or any(u.op == "output" for u in node.users)


def _replacement(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose value `node` equals, or None."""
    src = node.args[0] if node.args else None
    if not isinstance(src, torch.fx.Node):
        return None
    if node.target in RESHAPES:
        # Collapse reshape chains to their first input; the collapse itself happens in run().
        while src.op == "call_function" and src.target in RESHAPES:
            src = src.args[0]
        return src if _keeps_value(node, src) else None
    if node.target in _SAME_SHAPE_NOOPS:
        if node.target is aten.slice.Tensor:
            step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
            if step != 1:
                return None
        return src if _keeps_value(node, src) else None
    if node.target in _CASTS and _plain_cast(node) and not _touches_io(node, src):
        if _keeps_value(node, src):
            return src
        inner = src.args[0] if src.op == "call_function" and src.target in _CASTS and _plain_cast(src) else None
        mid, outer = _val(src), _val(node)
        if isinstance(inner, torch.fx.Node) and mid is not None and outer is not None:
            if mid.dtype in _LOSSLESS_UP.get(outer.dtype, ()) and _keeps_value(node, inner):
                return inner
    return None


class EliminateNoops(MoefxPass):
    name = "eliminate_noops"
    uuid_files = (_fx.__file__,)

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        rewrites = 0
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            target = _replacement(node)
            if target is not None:
                node.replace_all_uses_with(target)
                graph.erase_node(node)
                rewrites += 1
            elif node.target in RESHAPES and _is_chain(node):
                # reshape(reshape(x, a), b) == reshape(x, b): skip the middle so patterns see one reshape.
                root = node.args[0]
                while root.op == "call_function" and root.target in RESHAPES:
                    root = root.args[0]
                node.args = (root, *node.args[1:])
                node.target = aten.reshape.default
                rewrites += 1
        return rewrites


def _is_chain(node: torch.fx.Node) -> bool:
    src = node.args[0]
    return isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target in RESHAPES
