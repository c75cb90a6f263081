"""rewrite_sampler_syncs: remove device->host syncs from sampling graphs by exact, sync-free rewrites.

A sync stalls the GPU every decode step and forbids CUDA-graph capture. What this pass rewrites:

* `.item()` (`_local_scalar_dense`) whose every use is tensor math with a Python scalar (arithmetic,
  comparison, clamp, `full`, `masked_fill`): the value stays a 0-d tensor. Arithmetic on bf16/fp16 runs
  in fp32 and rounds once, as eager's scalar ops do, so results are bit-identical.
* `x[mask] = v` (`index_put` with one boolean mask and a single value), and the same fill through the
  coordinates of one `nonzero(mask)` -> `where(mask, v, x)`; the `nonzero` goes when nothing else reads it.
* `torch.multinomial(probs, n)` (n == 1, or without replacement) -> the exponential race
  `argmax(probs / q)`, `q ~ Exp(1)` (top-n for n > 1): the same distribution without the validity
  check that reads back to the host. It draws a different random stream, so it only runs under the
  sub-toggle `sampler_exponential_race`.

Anything else that syncs (`nonzero`, boolean-mask gathers, `.item()` that feeds control flow or a
shape, multinomial with replacement) is reported with its source line and left unchanged.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from moefx.passes import fx as _fx
from moefx.passes.base import MoefxPass, PassContext
from moefx.passes.fx import LOW_DTYPES, call, meta_val, source_of

aten = torch.ops.aten
prims = torch.ops.prims

_ARITH = {
    aten.add.Tensor: aten.add.Tensor,
    aten.add.Scalar: aten.add.Tensor,
    aten.sub.Tensor: aten.sub.Tensor,
    aten.sub.Scalar: aten.sub.Tensor,
    aten.mul.Tensor: aten.mul.Tensor,
    aten.mul.Scalar: aten.mul.Tensor,
    aten.div.Tensor: aten.div.Tensor,
    aten.div.Scalar: aten.div.Tensor,
    aten.pow.Tensor_Scalar: aten.pow.Tensor_Tensor,
}
_CMP = {
    getattr(aten, name).Scalar if via == "Scalar" else getattr(aten, name).Tensor: getattr(aten, name).Tensor
    for name in ("lt", "le", "gt", "ge", "eq", "ne")
    for via in ("Scalar", "Tensor")
}
_CLAMP = {aten.clamp_min.default: aten.clamp_min.Tensor, aten.clamp_max.default: aten.clamp_max.Tensor}

# Ops that read data back to the host and have no exact static-shape form in general.
_REPORT_ONLY = {
    aten.nonzero.default: "nonzero has a data-dependent output shape (use a masked form or nonzero_static)",
    aten.masked_select.default: "masked_select has a data-dependent output shape (use torch.where)",
    aten.is_nonzero.default: "is_nonzero returns a Python bool (host control flow)",
    aten.equal.default: "torch.equal returns a Python bool (host control flow)",
    aten.repeat_interleave.Tensor: "repeat_interleave with tensor repeats has a data-dependent shape",
    aten._unique2.default: "unique has a data-dependent output shape",
    aten.unique_consecutive.default: "unique_consecutive has a data-dependent output shape",
}


def _numel_is_one(val: torch.Tensor) -> bool:
    return all(statically_known_true(s == 1) for s in val.shape)


def _as_0d(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    return node if meta_val(node).dim() == 0 else call(graph, aten.reshape.default, (node, []))


def _cast(graph: torch.fx.Graph, node: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    if meta_val(node).dtype == dtype:
        return node
    return call(graph, prims.convert_element_type.default, (node, dtype))


class _ItemRewriter:
    """Rewrites one `_local_scalar_dense` node's users, or explains why it cannot."""

    def __init__(self, graph: torch.fx.Graph, item: torch.fx.Node) -> None:
        self.graph, self.item = graph, item
        self.src = item.args[0]
        self.src_dtype = meta_val(self.src).dtype

    def unsupported(self, user: torch.fx.Node) -> str | None:
        if user.op != "call_function":
            return f"its value is a graph output ({user.op})"
        out, src = meta_val(user), meta_val(self.src)
        if isinstance(out, torch.Tensor) and out.device != src.device:
            return f"the scalar lives on {src.device} and its user on {out.device} (no device sync to remove)"
        target = user.target
        if target is aten.full.default:
            ok = len(user.args) == 2 and user.args[1] is self.item and self.item not in user.args[0]
            return None if ok else "it feeds the shape of full()"
        if target is aten.scalar_tensor.default:
            return None if user.args[0] is self.item else "unsupported use"
        if target is aten.masked_fill.Scalar:
            return None if user.args[2] is self.item and user.args[0] is not self.item else "unsupported use"
        if target in _ARITH or target in _CMP or target in _CLAMP:
            if len(user.args) != 2 or user.args[1] is not self.item or user.args[0] is self.item:
                return f"it is the left operand of {target}"
            if user.kwargs.get("alpha", 1) != 1:
                return f"{target} uses alpha"
            x = meta_val(user.args[0])
            if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
                return f"{target} has no tensor operand"
            if self.src_dtype.is_floating_point and not x.dtype.is_floating_point:
                return f"a float scalar would promote the integer tensor in {target}"
            if target in _ARITH and out.dtype != x.dtype:
                return f"{target} changes dtype {x.dtype}->{out.dtype}"
            return None
        return f"it feeds {target} (host control flow, a shape or a Python scalar op)"

    def rewrite(self) -> None:
        graph = self.graph
        for user in list(self.item.users):
            with graph.inserting_before(user):
                scalar = _as_0d(graph, self.src)
                target = user.target
                if target is aten.full.default:
                    dtype = user.kwargs.get("dtype") or meta_val(user).dtype
                    filled = call(graph, aten.expand.default, (_cast(graph, scalar, dtype), user.args[0]))
                    new = call(graph, aten.clone.default, (filled,), {"memory_format": torch.contiguous_format})
                elif target is aten.scalar_tensor.default:
                    new = _cast(graph, scalar, user.kwargs.get("dtype") or meta_val(user).dtype)
                elif target is aten.masked_fill.Scalar:
                    x, mask = user.args[0], user.args[1]
                    value = _cast(graph, scalar, meta_val(x).dtype)
                    new = call(graph, aten.where.self, (mask, value, x))
                else:
                    new = self._binary(user, scalar)
            user.replace_all_uses_with(new)
            graph.erase_node(user)
        graph.erase_node(self.item)

    def _binary(self, user: torch.fx.Node, scalar: torch.fx.Node) -> torch.fx.Node:
        graph, x = self.graph, user.args[0]
        dtype = meta_val(x).dtype
        if user.target not in _ARITH:
            # Comparisons and clamps convert a Python scalar to the tensor's dtype first.
            table = _CMP if user.target in _CMP else _CLAMP
            return call(graph, table[user.target], (x, _cast(graph, scalar, dtype)))
        # Arithmetic with a Python scalar runs in fp32 for bf16/fp16 and rounds once (eager's opmath).
        compute = torch.float32 if dtype in LOW_DTYPES else dtype
        out = call(graph, _ARITH[user.target], (_cast(graph, x, compute), _cast(graph, scalar, compute)))
        return _cast(graph, out, dtype)


def _nonzero_mask(indices: list) -> torch.fx.Node | None:
    """The mask when `indices` are the columns 0..k-1 of one `nonzero(mask)` (as_tuple or sliced), else None."""
    sources = []
    for j, idx in enumerate(indices):
        if not isinstance(idx, torch.fx.Node):
            return None
        if idx.target is operator.getitem and getattr(idx.args[0], "target", None) is aten.unbind.int:
            unbind = idx.args[0]
            dim = unbind.args[1] if len(unbind.args) > 1 else unbind.kwargs.get("dim", 0)
            ok = idx.args[1] == j and dim in (1, -1)
            sources.append(unbind.args[0] if ok else None)
        elif idx.target in (aten.select.int, aten.select_copy.int):
            sources.append(idx.args[0] if idx.args[1] in (1, -1) and idx.args[2] == j else None)
        else:
            return None
    nz = sources[0]
    if nz is None or any(src is not nz for src in sources) or nz.target is not aten.nonzero.default:
        return None
    mask = nz.args[0]
    return mask if meta_val(mask) is not None and meta_val(mask).dim() == len(indices) else None


def _masked_index_put(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | str:
    """(x, mask, value) when `node` is `x[mask] = scalar` or `x[mask.nonzero(as_tuple=True)] = scalar`."""
    x, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if len(indices) == 1 and indices[0] is not None and meta_val(indices[0]) is not None:
        mask = indices[0]
        if meta_val(mask).dtype not in (torch.bool, torch.uint8):
            mask = _nonzero_mask(list(indices))
    else:
        mask = _nonzero_mask(list(indices))
    if mask is None:
        return ""  # integer indices: no sync here, nothing to do
    xv, mv, vv = meta_val(x), meta_val(mask), meta_val(values)
    if accumulate:
        return "masked index_put with accumulate=True"
    if mv.dim() > xv.dim() or not all(statically_known_true(a == b) for a, b in zip(mv.shape, xv.shape)):
        return "the mask does not cover the leading dims of the tensor"
    if not _numel_is_one(vv):
        return "assigned values are not a single scalar (their count depends on the mask)"
    return x, mask, values


def _rewrite_index_put(graph: torch.fx.Graph, node: torch.fx.Node, x, mask, values) -> None:
    xv = meta_val(x)
    with graph.inserting_before(node):
        if meta_val(mask).dtype != torch.bool:
            mask = _cast(graph, mask, torch.bool)
        for _ in range(xv.dim() - meta_val(mask).dim()):
            mask = call(graph, aten.unsqueeze.default, (mask, -1))
        value = _cast(graph, _as_0d(graph, values), xv.dtype)
        new = call(graph, aten.where.self, (mask, value, x))
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _multinomial_race(node: torch.fx.Node) -> str | None:
    probs, num_samples = node.args[:2]
    replacement = node.args[2] if len(node.args) > 2 else node.kwargs.get("replacement", False)
    if node.kwargs.get("generator") is not None:
        return "multinomial with an explicit generator"
    if not isinstance(num_samples, int):
        return "multinomial with a symbolic sample count"
    if replacement and num_samples > 1:
        return "multinomial with replacement and more than one sample"
    if not meta_val(probs).dtype.is_floating_point:
        return "multinomial over non-floating probabilities"
    return None


def _rewrite_multinomial(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    probs, num_samples = node.args[:2]
    with graph.inserting_before(node):
        noise = call(graph, aten.exponential.default, (probs,))
        race = call(graph, aten.div.Tensor, (probs, noise))
        if num_samples == 1:
            new = call(graph, aten.argmax.default, (race, -1, True))
        else:
            top = call(graph, aten.topk.default, (race, num_samples, -1))
            new = call(graph, operator.getitem, (top, 1))
    node.replace_all_uses_with(new)
    graph.erase_node(node)


class RewriteSamplerSyncs(MoefxPass):
    name = "rewrite_sampler_syncs"
    uuid_files = (_fx.__file__,)

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        race_on = bool(getattr(ctx.config.pass_config, "sampler_exponential_race", False))
        done = 0
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            target = node.target
            if target is aten._local_scalar_dense.default:
                if meta_val(node.args[0]) is None or not node.users:
                    ctx.skip(f".item() at {source_of(node)} kept: its value is unused or untyped")
                    continue
                rewriter = _ItemRewriter(graph, node)
                reasons = [r for u in node.users if (r := rewriter.unsupported(u))]
                if reasons:
                    why = reasons[0]
                    ctx.skip(f".item() at {source_of(node)} kept: {why}")
                    continue
                rewriter.rewrite()
                done += 1
            elif target is aten.index_put.default:
                found = _masked_index_put(node)
                if isinstance(found, tuple):
                    _rewrite_index_put(graph, node, *found)
                    done += 1
                elif found:
                    ctx.skip(f"boolean index_put at {source_of(node)} kept: {found}")
            elif target is aten.multinomial.default:
                why = _multinomial_race(node) or (None if race_on else "sampler_exponential_race is off")
                if why:
                    ctx.skip(f"multinomial at {source_of(node)} kept: {why}")
                    continue
                _rewrite_multinomial(graph, node)
                done += 1
        if done:
            graph.eliminate_dead_code()  # a nonzero that only fed a rewritten index_put is gone now
        self._report_shape_syncs(graph, ctx)
        return done

    @staticmethod
    def _report_shape_syncs(graph: torch.fx.Graph, ctx: PassContext) -> None:
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is aten.index.Tensor:
                idx = [meta_val(i) for i in node.args[1] if i is not None]
                if any(v is not None and v.dtype in (torch.bool, torch.uint8) for v in idx):
                    ctx.skip(f"boolean-mask indexing at {source_of(node)} kept: data-dependent output shape")
            elif node.target in _REPORT_ONLY:
                ctx.skip(f"{node.target} at {source_of(node)} kept: {_REPORT_ONLY[node.target]}")
