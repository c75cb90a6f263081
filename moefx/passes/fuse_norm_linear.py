"""fuse_norm_linear: RMSNorm (or residual add + RMSNorm) -> `moefx::dense_linear` -> one fused call.

Every decoder layer starts with its input norm, then q/k/v (one dense_linear call after fuse_sibling_linears); its
MoE block starts with the post-attention residual add and norm, then the router. Unfused each is a kernel of its own
per layer in the decode step; the fused call computes it in the GEMV kernel's prologue instead (backends/dense.py,
kernels/dense_gemm.py):
- `moefx::rms_norm_dense_linear` for a plain norm whose output only the linear reads (the input norm);
- `moefx::add_rms_norm_dense_linear` for a residual add + norm, whose sum (the next residual) and normed rows (the
  experts read them too) become outputs of the call: the kernel writes both, so other readers keep theirs.
Exact: the fused call runs the backend dense_linear would run for the same x and weights, off the kernel it computes
the add and norm with transformers' torch ops and then that backend's linears (upstream: bit for bit the unfused
graph where the norm is written as transformers writes it; the other spellings fuse_norm_quant accepts, `x * x` or
`sum / H`, differ at most in the variance's summation order), and the kernel rounds where the add and norm do.
Matched: a float dense_linear whose x is, through reshapes that keep the last dim, the output y of a plain RMSNorm
as fuse_norm_quant recognizes it (the weight applied after the downcast, in the input's dtype, or no weight; in an
fp32 graph the weight orders are one computation), of its input or of a residual sum in the input's dtype. A plain
norm's y and those reshapes have no other reader (DCE then drops the norm); the residual form's readers of y and of
the sum are moved to the call's outputs, which it places right after y. Left alone with the reason: a plain norm
with other readers, the fp32-sum residual form (vLLM's), a weight applied in fp32 to a bf16/fp16 input (one
rounding, not the op's two), calls the prologue would not speed up (`_not_gemv`). FP8 weight-only
calls (float x, no x_scale: what fp8_weight_only writes at decode M) fuse the same way, their weight scales and
block shape carried into the fused op; W8A8 FP8 calls are not looked at: the activation quant sits between norm
and linear, and fuse_norm_quant fuses the two.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from moefx.backends.dense import select_backend
from moefx.backends.dense_policy import GEMV
from moefx.kernels.availability import triton_missing
from moefx.passes import linear_forms as lf
from moefx.passes import quant_fusion as qf
from moefx.passes import quant_patterns as qp
from moefx.passes.base import MoefxPass, PassContext
from moefx.passes.fx import RESHAPES, call, dtype_of, is_call, meta_val, sizes_of, source_of

aten = torch.ops.aten
NORM_DENSE = torch.ops.moefx.rms_norm_dense_linear.default
ADD_NORM_DENSE = torch.ops.moefx.add_rms_norm_dense_linear.default


def _behind_views(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The value `node` reshapes (through any reshapes) and those reshapes, outermost first."""
    views = []
    while is_call(node, *RESHAPES):
        views.append(node)
        node = node.args[0]
    return node, views


def _as_rows(graph: torch.fx.Graph, t: torch.fx.Node, views: list[torch.fx.Node]) -> torch.fx.Node:
    """`t` through the same reshapes as the norm's output on its way to the linear (innermost first)."""
    for v in reversed(views):
        t = call(graph, v.target, (t, *v.args[1:]), dict(v.kwargs))
    return t


def _residual(match: qp.ProducerMatch) -> bool:
    return match.label in qf.ADD_LABELS


def _problem(match: qp.ProducerMatch, y: torch.fx.Node, views: list[torch.fx.Node], node: torch.fx.Node) -> str | None:
    residual = _residual(match)
    why = qf.plain_norm_problem(match, residual)
    if why:
        return f"the norm is {why}"
    x = match.args[0]
    if dtype_of(y) != dtype_of(x):
        return f"the norm's output is {dtype_of(y)} for a {dtype_of(x)} input"
    if not qp.same_shape(qp.shape_of(x), qp.shape_of(y)):
        return f"the norm output {list(qp.shape_of(y))} is not its input's shape {list(qp.shape_of(x))}"
    if views and not qp.same_size(qp.shape_of(views[0])[-1], qp.shape_of(y)[-1]):
        return "a reshape between norm and linear changes the last dim"
    if residual:
        return _late_problem(match, y, views, node)
    readers = [u for n in (y, *views) for u in n.users]
    if len(readers) != len(views) + 1:
        return f"the normed tensor has {len(readers) - len(views)} readers, not only this call"
    return None


def _late_problem(match: qp.ProducerMatch, y: torch.fx.Node, views: list[torch.fx.Node],
                  node: torch.fx.Node) -> str | None:
    """Why the residual form's call cannot sit right after y: what it reads must come before y, what reads the sum
    outside the norm after it."""
    where = {n: i for i, n in enumerate(y.graph.nodes)}
    reads: list[torch.fx.Node] = []
    torch.fx.node.map_arg([[a for v in views for a in v.args[1:]], node.args[1], node.args[2]], reads.append)
    if any(where[n] > where[y] for n in reads):
        return "the linear's weights or the reshapes' sizes are computed after the norm"
    if any(where[u] < where[y] for s in match.residual for u in s.users if u not in match.nodes):
        return "the residual sum has a reader before the norm's output"
    return None


def _not_gemv(x: torch.fx.Node, weights: list, backend: str, scales: list, block: list | None) -> str | None:
    """Why the prologue would not pay off for this call in a captured step (None: it would).

    Off the gemv kernel the fused op computes the norm as separate torch ops, several kernels where inductor makes
    one, so a prefill (M past the policy's gemv rows, or not static) keeps its norm. On the tensor-core tiles (M >
    4) every program re-reads its 16 rows over all of K before streaming weights, slower than a norm kernel of its
    own in a probe on the H200 (docs/FINDINGS.md)."""
    xv, ws = meta_val(x), [meta_val(w) for w in weights]
    if not isinstance(xv, torch.Tensor) or not all(isinstance(w, torch.Tensor) for w in ws):
        return "the call's inputs have no fake values"
    if any(not isinstance(d, int) for d in xv.shape):
        return "its row count is not static (the dense policy decides per M)"
    m = xv.numel() // max(xv.shape[-1], 1)
    missing = triton_missing()
    if missing:
        return missing
    from moefx.kernels.dense_gemm import default_config

    if default_config(m, False).dot:
        return f"M={m} runs the tensor-core tiles, where the prologue costs more than the norm kernel it saves"
    sv = [meta_val(s) for s in scales]
    name = select_backend(xv, ws, sv, block, None, backend, capturing=True)
    return None if name == GEMV else f"the dense policy runs M={m} {name}, not the gemv kernel with the norm prologue"


def _out_dtype_problem(x: torch.fx.Node, out_dtype: torch.dtype | None) -> str | None:
    """The fused ops write x's dtype: an FP8 weight-only call that writes another stays as it is."""
    if out_dtype is not None and out_dtype != dtype_of(x):
        return f"the call writes {out_dtype} for a {dtype_of(x)} input (the fused ops write the input's dtype)"
    return None


class FuseNormLinear(MoefxPass):
    name = "fuse_norm_linear"
    uuid_files = (*lf.DEPENDENCY_FILES, qf.__file__, qp.__file__)

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        done = 0
        for node in list(graph.nodes):
            if not is_call(node, lf.DENSE):
                continue
            x, weights, biases, x_scale, scales, block, out_dtype, backend = node.args
            if x_scale is not None:  # W8A8: the activation quant sits between norm and linear, fuse_norm_quant's
                continue
            y, views = _behind_views(x)
            try:
                match = qf.RMS_NORM_PRODUCER.recognize(y)
            except qp.NotMine:
                continue
            except qp.Reject as r:
                ctx.skip(f"RMSNorm before the dense_linear at {source_of(node)} left alone: {r.reason}")
                continue
            what = match.label.split(" (")[0]
            why = _problem(match, y, views, node) or _out_dtype_problem(x, out_dtype) or \
                _not_gemv(x, weights, backend, scales, block)
            if why:
                ctx.skip(f"{what} at {source_of(y)} not fused into the dense_linear at {source_of(node)}: {why}")
                continue
            fp8 = (list(scales), list(block) if block is not None else None)
            if _residual(match):
                self._rewrite_residual(graph, node, match, y, views, weights, biases, backend, fp8)
            else:
                self._rewrite(graph, node, match, views, weights, biases, backend, fp8)
            op = "add_rms_norm_dense_linear" if _residual(match) else "rms_norm_dense_linear"
            form = " with FP8 weight-only weights" if scales else ""
            ctx.note(f"{what} at {source_of(y)} into the dense_linear at {source_of(node)} (moefx::{op}{form})")
            done += 1
        return done

    @staticmethod
    def _rewrite_residual(graph: torch.fx.Graph, node: torch.fx.Node, match: qp.ProducerMatch, y: torch.fx.Node,
                          views: list[torch.fx.Node], weights: list, biases: list, backend: str, fp8: tuple) -> None:
        a, b, weight, eps = match.args[:4]
        total = match.residual[0]  # the sum node (the norm's input)
        n = len(weights)
        with graph.inserting_before(y.next):  # what it reads is defined by y (_late_problem); its readers follow
            residual, x = (_as_rows(graph, t, views) for t in (a, b))  # transformers' `residual + hidden_states`
            fused = call(graph, ADD_NORM_DENSE, (x, residual, weight, eps, list(weights), list(biases), backend, *fp8))
            fused.meta["stack_trace"] = node.meta.get("stack_trace")
            got = [call(graph, operator.getitem, (fused, i)) for i in range(n + 2)]
            h, normed = got[n:]
            if views:  # back to the norm's shape for the readers of the sum and of y
                h = call(graph, aten.reshape.default, (h, sizes_of(graph, a)))
                normed = call(graph, aten.reshape.default, (normed, sizes_of(graph, a)))
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        y.replace_all_uses_with(normed)
        total.replace_all_uses_with(h, delete_user_cb=lambda u: u not in match.nodes)

    @staticmethod
    def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node, match: qp.ProducerMatch, views: list[torch.fx.Node],
                 weights: list, biases: list, backend: str, fp8: tuple) -> None:
        x, weight, eps, _ = match.args
        with graph.inserting_before(node):  # the norm's input and weight and the views' sizes are defined by here
            fused = call(graph, NORM_DENSE, (_as_rows(graph, x, views), weight, eps, list(weights), list(biases),
                                             backend, *fp8))
            fused.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_all_uses_with(fused)
        graph.erase_node(node)  # the norm and its views have no reader left: the manager's dead-code pass drops them
