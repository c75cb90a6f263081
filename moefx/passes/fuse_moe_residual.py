"""fuse_moe_residual: `residual + moe_experts(x, ...)` -> one `moefx::moe_experts_residual` call.

A decoder layer ends with the residual add of its MoE block's output. Unfused it is one more kernel per layer in
the decode step (48 layers, B=1 on the H200: a 1.1 us kernel plus its launch boundary, docs/FINDINGS.md); the gemv
backend adds the residual in its down kernel's epilogue instead. Exact: the experts' sum is rounded to the output
dtype first and then added as the graph's add does (backends without the epilogue run the same add after).
Matched: `aten.add.Tensor` of the op's output (through reshapes) and a tensor of the add's shape and dtype, the
op's output read by nothing else; the op's `[M, H]` output shape is given to the residual by a reshape, and the add's
shape back to the sum by another (symbolic sizes as `sym_size` nodes of the residual, `fx.sizes_of`).
"""

from __future__ import annotations

import torch
import torch.fx

from moefx.backends import op as _op  # noqa: F401  (registers the two ops)
from moefx.passes.base import MoefxPass, PassContext
from moefx.passes.fx import RESHAPES, call, is_call, meta_val, sizes_of, source_of

aten = torch.ops.aten
MOE = torch.ops.moefx.moe_experts.default
MOE_RESIDUAL = torch.ops.moefx.moe_experts_residual.default


def _moe_behind(node: object) -> torch.fx.Node | None:
    """The moe_experts node `node` is (through reshapes that read nothing else), or None."""
    while is_call(node, *RESHAPES) and len(node.users) == 1:
        node = node.args[0]
    return node if is_call(node, MOE) and len(node.users) == 1 else None


def _problem(add: torch.fx.Node, moe: torch.fx.Node, residual: object) -> str | None:
    out, res, val = meta_val(add), meta_val(residual), meta_val(moe)
    if add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return "an add with alpha"
    if not all(isinstance(t, torch.Tensor) for t in (out, res, val)):
        return "the residual is not a tensor"
    if res.shape != out.shape or res.dtype != val.dtype or out.dtype != val.dtype:
        return f"residual {tuple(res.shape)}/{res.dtype} does not match the sum {tuple(out.shape)}/{out.dtype}"
    if res.numel() != val.numel():
        return f"residual of {res.numel()} elements for an experts output of {val.numel()}"
    if not isinstance(val.shape[-1], int):
        return "the hidden size is not static"
    return None


class FuseMoeResidual(MoefxPass):
    name = "fuse_moe_residual"

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        done = 0
        for add in list(graph.nodes):
            if not is_call(add, aten.add.Tensor):
                continue
            for side in (0, 1):
                moe = _moe_behind(add.args[side])
                if moe is None:
                    continue
                residual = add.args[1 - side]
                why = _problem(add, moe, residual)
                if why is not None:
                    ctx.skip(f"MoE residual add at {source_of(add)} left alone: {why}")
                    break
                self._rewrite(graph, add, moe, residual)
                ctx.note(f"residual add at {source_of(add)} into moefx::moe_experts_residual")
                done += 1
                break
        return done

    @staticmethod
    def _rewrite(graph: torch.fx.Graph, add: torch.fx.Node, moe: torch.fx.Node, residual: torch.fx.Node) -> None:
        with graph.inserting_before(add):  # both the op's arguments and the residual are defined by here
            rows = call(graph, aten.reshape.default, (residual, [-1, meta_val(moe).shape[-1]]))
            fused = call(graph, MOE_RESIDUAL, (rows, *moe.args), dict(moe.kwargs))
            out = call(graph, aten.reshape.default, (fused, sizes_of(graph, residual)))  # the add's shape
        add.replace_all_uses_with(out)
        graph.erase_node(add)  # the op and its reshapes have no reader left: the manager's dead-code pass drops them
