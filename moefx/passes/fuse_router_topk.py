"""fuse_router_topk: `moefx::add_rms_norm_dense_linear` (the router) -> `moefx::fused_topk` -> one
`moefx::add_rms_norm_route` call.

After fuse_norm_linear a decode step's MoE block starts with the router GEMV (with the post-attention add and norm
in its prologue), then the routing kernel that fuse_moe_routing wrote. The fused call routes the logits in the GEMV
kernel's last program instead (backends/router.py), so the top-k is no kernel of its own. Exact: the routing runs
fused_topk's code on the logits the GEMV stored, so the ids and weights are the unfused graph's.
Matched: a fused_topk call whose logits are output 0 of an add_rms_norm_dense_linear call with one weight and no
bias (the call fuse_norm_linear writes only where the gemv kernel runs it), a router the routing epilogue takes
(`dense_gemm.route_supported`), a correction bias defined before the router call. The other readers of the
call's outputs read the fused call's.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from moefx.backends import dense as _dense  # noqa: F401  (registers moefx::add_rms_norm_dense_linear)
from moefx.backends import router as _router  # (registers moefx::add_rms_norm_route)
from moefx.backends import routing as _routing_op
from moefx.kernels.availability import module_file, triton_missing
from moefx.passes.base import MoefxPass, PassContext
from moefx.passes.fx import call, is_call, meta_val, source_of

ROUTE = torch.ops.moefx.add_rms_norm_route.default
ADD_NORM_DENSE = torch.ops.moefx.add_rms_norm_dense_linear.default  # fuse_norm_linear's output
FUSED_TOPK = torch.ops.moefx.fused_topk.default  # fuse_moe_routing's output


def _router_of(logits: object) -> torch.fx.Node | None:
    """The add_rms_norm_dense_linear call whose output 0 `logits` is, or None."""
    if not is_call(logits, operator.getitem) or logits.args[1] != 0:
        return None
    dense = logits.args[0]
    return dense if is_call(dense, ADD_NORM_DENSE) else None


def _routing_args(topk: torch.fx.Node) -> list | None:
    """fused_topk's arguments after the logits as fuse_moe_routing writes them (all positional), or None."""
    return list(topk.args[1:]) if len(topk.args) == 9 and not topk.kwargs else None


def _problem(dense: torch.fx.Node, route: list) -> str | None:
    x, residual, norm_weight, eps, weights, biases, backend, scales, _ = dense.args
    if scales:
        return "the router call has FP8 weights (the routing epilogue takes a float router)"
    missing = triton_missing()
    if missing:
        return missing
    from moefx.kernels.dense_gemm import route_supported

    if len(weights) != 1 or any(b is not None for b in biases):
        return f"the router call has {len(weights)} weights or a bias"
    w = meta_val(weights[0])
    if not isinstance(w, torch.Tensor) or not route_supported(int(w.shape[0]), int(route[4])):
        return "the routing epilogue does not take this router (experts or groups)"
    bias = route[3]
    if isinstance(bias, torch.fx.Node):
        where = {n: i for i, n in enumerate(dense.graph.nodes)}
        if where[bias] > where[dense]:
            return "the correction bias is computed after the router call"
    return None


class FuseRouterTopk(MoefxPass):
    name = "fuse_router_topk"
    # fuse_norm_linear's file too: what this pass matches is that pass's output.
    uuid_files = (_router.__file__, module_file("moefx.kernels.dense_gemm"), module_file("moefx.kernels.moe_routing"),
                  _routing_op.__file__, module_file("moefx.passes.fuse_norm_linear"))

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        done = 0
        for topk in list(graph.nodes):
            if not is_call(topk, FUSED_TOPK):
                continue
            dense = _router_of(topk.args[0]) if topk.args else None
            route = _routing_args(topk)
            if dense is None or route is None:
                continue
            why = _problem(dense, route)
            if why:
                ctx.skip(f"routing at {source_of(topk)} not fused into the router at {source_of(dense)}: {why}")
                continue
            x, residual, norm_weight, eps, weights, _, backend = dense.args[:7]
            with graph.inserting_before(dense):
                fused = call(graph, ROUTE, (x, residual, norm_weight, eps, weights[0], *route, backend))
                fused.meta["stack_trace"] = dense.meta.get("stack_trace")
                got = [call(graph, operator.getitem, (fused, i)) for i in range(5)]
            for node, first in ((dense, 0), (topk, 3)):
                for use in list(node.users):
                    if not is_call(use, operator.getitem):
                        raise AssertionError(f"{node} is read other than by getitem: {use}")
                    use.replace_all_uses_with(got[first + use.args[1]])
                    graph.erase_node(use)
            graph.erase_node(topk)
            graph.erase_node(dense)
            ctx.note(f"routing at {source_of(topk)} into the router at {source_of(dense)} (moefx::add_rms_norm_route)")
            done += 1
        return done
