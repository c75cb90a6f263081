"""eliminate_noops: drop reshapes, slices, expands and casts that return their input unchanged.

Such nodes appear between the ops a fusion looks for (a `view` to the same shape, a full-range
slice, a cast to the dtype the tensor already has) and stop patterns from matching. Only nodes
whose result is provably identical to the input (same shape, dtype, and full range) are removed.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from moefx.passes.base import MoefxPass, PassContext, register_pass

aten = torch.ops.aten
prims = torch.ops.prims

_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_CASTS = {prims.convert_element_type.default, aten._to_copy.default}
_SLICES = {aten.slice.Tensor}


def _val(node: object) -> torch.Tensor | None:
    val = getattr(node, "meta", {}).get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _is_noop(node: torch.fx.Node) -> bool:
    out, inp = _val(node), _val(node.args[0]) if node.args else None
    if out is None or inp is None or out.dtype != inp.dtype or out.device != inp.device:
        return False
    if not _same_shape(out, inp):
        return False
    if node.target in _RESHAPES:
        return True
    if node.target in _CASTS:
        if node.target is aten._to_copy.default:
            # A real copy may be relied on for not aliasing a graph input or output: keep those.
            extra = set(node.kwargs) - {"dtype", "device", "layout"}
            touches_io = node.args[0].op == "placeholder" or any(u.op == "output" for u in node.users)
            return not extra and not touches_io and out.stride() == inp.stride()
        return True
    if node.target in _SLICES:
        step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
        return step == 1
    return False


@register_pass
class EliminateNoops(MoefxPass):
    name = "eliminate_noops"
    order = 0

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        removed = 0
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in (_RESHAPES | _CASTS | _SLICES) and _is_noop(node):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                removed += 1
        return removed
