"""fuse_moe_routing: a router's scores -> top-k -> weights chain -> one `moefx::fused_topk` launch.

At B=1 decode of Qwen3-30B-A3B the router's `torch.topk` alone (`gatherTopK` + `bitonicSortKVInPlace`, beside
inductor's softmax kernel) takes over twice as long as the whole fused op (docs/FINDINGS.md); the fused op does
scores, top-k, renormalize and scale in one program per row. Matched by dataflow and constants in post-grad graphs:

- softmax -> top-k [-> renormalize] [-> * c]  (Qwen2/3-MoE, OLMoE, Mixtral, DeepSeek-V2 greedy): the softmax
  over the last dim decomposed (amax/sub/exp/sum/div, or a multiply by the sum's `reciprocal`), inductor's CUDA form
  (`prepare_softmax_online`), or `aten._softmax`; computed in fp32 (an fp32 upcast of bf16/fp16 logits is
  dropped: the kernel upcasts the same way); renormalize = `v / v.sum(-1, keepdim=True)`.
- top-k of the logits -> softmax over the k (the other Mixtral formulation).
- sigmoid [+ e_score_correction_bias] [-> group top-k] -> top-k; weights gathered from the sigmoid scores
  [-> / (sum + 1e-20)] [-> * routed_scaling_factor] (DeepSeek-V3, GLM4-MoE): group scores are the sum of
  each group's top-2, the topk_group best kept through scatter (or inductor's one-hot `where` when one group
  is kept) -> unsqueeze/expand/reshape -> bool -> masked to -inf (`masked_fill`, either polarity).

The op returns fp32 weights, or, where every reader casts them to bf16/fp16 (Qwen's `.to(router_logits.dtype)`),
stores them in that dtype (the same rounding; on the H200 the cast was a kernel per layer of its own). When the
top-k values have readers other than the renormalization, the op returns them unnormalized and the graph's
own renormalization (and everything else) reads them. The full probabilities and the logits keep their
other readers (an aux loss, `output_router_logits`): those ops stay; only the top-k chain is replaced.
Selection guarantee and tie rule: moefx/backends/routing.py. Candidates left alone are reported.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx
from torch._inductor import inductor_prims  # noqa: F401  (registers prims.prepare_softmax_online)

from moefx.backends import routing as _routing
from moefx.backends.routing import kernel_supports
from moefx.passes import fx as _fx
from moefx.passes.base import MoefxPass, PassContext
from moefx.passes.fx import LOW_DTYPES, RESHAPES, call, dtype_of, is_call, meta_val, source_of

aten = torch.ops.aten
prims = torch.ops.prims
FUSED_TOPK = torch.ops.moefx.fused_topk.default
_PREPARE_SOFTMAX = prims.prepare_softmax_online.default
_BROADCASTS = RESHAPES | {aten.expand.default, aten.clone.default, aten.unsqueeze.default}
_LOGIT_DTYPES = (torch.float32, *LOW_DTYPES)


def _arg(node: torch.fx.Node, i: int, name: str, default: object = None) -> object:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _last_dim(dims: object, node: object) -> bool:
    """`dims` (an int or a one-element list) names the last dim of `node`'s value."""
    val = meta_val(node)
    if isinstance(dims, (list, tuple)):
        if len(dims) != 1:
            return False
        dims = dims[0]
    return isinstance(val, torch.Tensor) and isinstance(dims, int) and dims % val.dim() == val.dim() - 1


def _getitems(node: torch.fx.Node) -> dict[int, list[torch.fx.Node]]:
    out: dict[int, list[torch.fx.Node]] = {}
    for u in node.users:
        if is_call(u, operator.getitem):
            out.setdefault(u.args[1], []).append(u)
    return out


def _upcast_source(node: torch.fx.Node) -> torch.fx.Node:
    """The bf16/fp16 tensor that `node` upcasts to fp32 exactly, else `node`."""
    if is_call(node, prims.convert_element_type.default) and node.args[1] == torch.float32:
        if dtype_of(node.args[0]) in LOW_DTYPES:
            return node.args[0]
    return node


def _scalar(node: object) -> float | None:
    """The value of a python number, or of a 0-d `full` constant."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    if is_call(node, aten.full.default) and not list(node.args[0]) and isinstance(node.args[1], (int, float)):
        return float(node.args[1])
    if is_call(node, aten.scalar_tensor.default) and isinstance(node.args[0], (int, float)):
        return float(node.args[0])
    return None


def _const_fill(node: object) -> float | None:
    """The fill value of a `full`/`zeros`/`full_like`/`zeros_like` tensor, else None."""
    if is_call(node, aten.full.default, aten.full_like.default):
        return float(node.args[1]) if isinstance(node.args[1], (int, float)) else None
    if is_call(node, aten.zeros.default, aten.zeros_like.default):
        return 0.0
    return None


def _sub_alpha_one(node: torch.fx.Node) -> bool:
    return is_call(node, aten.sub.Tensor) and node.kwargs.get("alpha", 1) == 1


def _softmax_input(p: object) -> torch.fx.Node | None:
    """X when `p` is softmax(X) over X's last dim computed in X's dtype, else None."""
    if is_call(p, aten._softmax.default):
        x, dim, half_to_float = p.args[:3]
        return x if _last_dim(dim, x) and not half_to_float else None
    if is_call(p, aten.div.Tensor):
        num, den = p.args[:2]
    elif is_call(p, aten.mul.Tensor):
        a, b = p.args[:2]
        num, rec = (a, b) if is_call(b, aten.reciprocal.default) else (b, a)
        if not is_call(rec, aten.reciprocal.default):
            return None
        den = rec.args[0]
    else:
        return None
    if not is_call(num, aten.exp.default) or not _sub_alpha_one(num.args[0]):
        return None
    x, m = num.args[0].args[:2]
    if is_call(m, aten.amax.default):
        if m.args[0] is not x or not _last_dim(m.args[1], x) or not _arg(m, 2, "keepdim", False):
            return None
        if not is_call(den, aten.sum.dim_IntList) or den.args[0] is not num or not _last_dim(den.args[1], x):
            return None
        if not _arg(den, 2, "keepdim", False):
            return None
    elif is_call(m, operator.getitem) and is_call(m.args[0], _PREPARE_SOFTMAX) and m.args[1] == 0:
        online = m.args[0]
        if online.args[0] is not x or not _last_dim(online.args[1], x):
            return None
        if not (is_call(den, operator.getitem) and den.args[0] is online and den.args[1] == 1):
            return None
    else:
        return None
    return x


def _renorm_of(v: torch.fx.Node, eps: float) -> torch.fx.Node | None:
    """The node computing v / (v.sum(-1, keepdim=True) [+ eps]) when that is all `v` feeds, else None."""
    users = list(v.users)
    if len(users) != 2:
        return None
    total = next((u for u in users if is_call(u, aten.sum.dim_IntList)), None)
    if total is None or not _last_dim(total.args[1], v) or not _arg(total, 2, "keepdim", False):
        return None
    (out,) = [u for u in users if u is not total]
    den = total
    if eps:
        (den,) = list(total.users) if len(total.users) == 1 else (None,)
        if not is_call(den, aten.add.Tensor) or den.kwargs.get("alpha", 1) != 1:
            return None
        other = den.args[1] if den.args[0] is total else den.args[0]
        if _scalar(other) != eps:
            return None
    elif len(total.users) != 1:
        return None
    if is_call(out, aten.div.Tensor) and out.args[0] is v and out.args[1] is den:
        return out
    if is_call(out, aten.mul.Tensor) and v in out.args[:2]:
        rec = out.args[1] if out.args[0] is v else out.args[0]
        if is_call(rec, aten.reciprocal.default) and rec.args[0] is den and len(rec.users) == 1:
            return out
    return None


def _scaled(tail: torch.fx.Node) -> tuple[torch.fx.Node, float]:
    """(tail * c, c) when `tail`'s only reader multiplies it by a constant, else (tail, 1.0)."""
    if len(tail.users) == 1:
        (u,) = tail.users
        if is_call(u, aten.mul.Tensor) and tail in u.args[:2]:
            c = _scalar(u.args[1] if u.args[0] is tail else u.args[0])
            if c is not None and math.isfinite(c):
                return u, c
    return tail, 1.0


class _Rewrite:
    """One fused_topk call: its arguments, the ids it stands for and the weights node it replaces."""

    def __init__(self, logits, kind, renormalize, bias=None, n_group=1, topk_group=1, scale=1.0, tail=None):
        self.logits, self.kind, self.renormalize, self.bias = logits, kind, renormalize, bias
        self.n_group, self.topk_group, self.scale, self.tail = n_group, topk_group, scale, tail


def _match_softmax(x: torch.fx.Node, values: list[torch.fx.Node]) -> _Rewrite | str:
    src = _softmax_input(x)
    if dtype_of(src) != torch.float32:
        return f"the softmax is computed in {dtype_of(src)}, the kernel's is fp32"
    if len(values) > 1:
        return "the top-k values are read through two getitems"
    tail, renorm = (values[0] if values else None), False
    if tail is not None:
        fused = _renorm_of(tail, 0.0)
        if fused is not None:
            tail, renorm = fused, True
        tail, scale = _scaled(tail)
    else:
        scale = 1.0
    return _Rewrite(_upcast_source(src), "softmax", renorm, scale=scale, tail=tail)


def _match_topk_softmax(x: torch.fx.Node, v: torch.fx.Node, softmax_of: dict) -> _Rewrite | str:
    vv = v
    if len(v.users) == 1:
        (cast,) = v.users
        if is_call(cast, prims.convert_element_type.default) and cast.args[1] == torch.float32:
            vv = cast
    outs = softmax_of.get(vv, [])
    if len(outs) != 1:
        return "the top-k logits feed no single softmax"
    if dtype_of(vv) != torch.float32:
        return f"the softmax over the k is computed in {dtype_of(vv)}, the kernel's is fp32"
    (out,) = outs
    inner = _softmax_nodes(out)
    if any(u not in inner for u in vv.users) or (vv is not v and len(v.users) != 1):
        return "the top-k logits are also read outside the softmax over them"
    return _Rewrite(_upcast_source(x), "topk_softmax", True, tail=out)


def _softmax_nodes(out: torch.fx.Node) -> set[torch.fx.Node]:
    """The nodes of the softmax that `out` is the result of (those that read its input)."""
    if is_call(out, aten._softmax.default):
        return {out}
    num = out.args[0] if is_call(out.args[0], aten.exp.default) else out.args[1]
    sub = num.args[0]
    m = sub.args[1]
    return {sub, m, m.args[0]} if is_call(m, operator.getitem) else {sub, m}


def _is_neg_inf(node: object) -> bool:
    value = _scalar(node)
    if value is None and is_call(node, aten.full.default):
        value = _const_fill(node)
    return value == float("-inf")


def _group_keep(cond: torch.fx.Node, keep_when_true: bool, choice: torch.fx.Node, e: int) -> tuple[int, int] | str:
    """(n_group, topk_group) when `cond` (True = masked unless keep_when_true) keeps the top groups of
    `choice` ranked by the sum of their top-2 experts, as DeepSeek-V3 / GLM4-MoE build it; else why not."""
    n = cond
    while True:
        if is_call(n, aten.bitwise_not.default, aten.logical_not.default):
            keep_when_true, n = not keep_when_true, n.args[0]
        elif is_call(n, prims.convert_element_type.default) and n.args[1] == torch.bool:
            n = n.args[0]
        elif is_call(n, aten.eq.Scalar) and _scalar(n.args[1]) == 0.0:
            keep_when_true, n = not keep_when_true, n.args[0]
        elif is_call(n, aten.ne.Scalar) and _scalar(n.args[1]) == 0.0:
            n = n.args[0]
        else:
            break
    if not keep_when_true:
        return "the -inf mask keeps the groups the top-k did not pick"
    chain = []
    while is_call(n, *_BROADCASTS):
        chain.append(n)
        n = n.args[0]
    while is_call(n, prims.convert_element_type.default):  # 0/1 masks survive any cast
        n = n.args[0]
    group_mask = n
    val = meta_val(group_mask)
    one_hot = is_call(group_mask, aten.where.self)
    if not chain or not (one_hot or is_call(group_mask, aten.scatter.value, aten.scatter.src)) or val is None \
            or val.dim() != 2:
        return "the expert mask is not a per-group mask broadcast over the group's experts"
    groups = val.shape[1]
    if not isinstance(groups, int) or e % groups:
        return f"the group mask has {groups} groups, which do not divide E={e}"
    unsq = chain[-1]
    if not is_call(unsq, aten.unsqueeze.default) or unsq.args[1] not in (-1, 2):
        return "the group mask is not broadcast along a new last dim"
    expand = next((c for c in chain if is_call(c, aten.expand.default)), None)
    if expand is None or tuple(meta_val(expand).shape[1:]) != (groups, e // groups):
        return "the group mask is not expanded to [T, n_group, E / n_group]"
    gidx = _one_hot_index(group_mask, groups) if one_hot else _scatter_index(group_mask)
    if isinstance(gidx, str):
        return gidx
    if not (is_call(gidx, operator.getitem) and gidx.args[1] == 1 and is_call(gidx.args[0], aten.topk.default)):
        return "the kept groups are not a top-k of group scores"
    gtop = gidx.args[0]
    topk_group = gtop.args[1]
    if not _last_dim(_arg(gtop, 2, "dim", -1), gtop.args[0]) or not _arg(gtop, 3, "largest", True):
        return "the kept groups are not the largest group scores"
    gscore = gtop.args[0]
    if is_call(gscore, aten.amax.default):
        return "groups are ranked by their max; the kernel ranks by the sum of the top-2"
    if not is_call(gscore, aten.sum.dim_IntList) or _arg(gscore, 2, "keepdim", False):
        return "group scores are not a sum over each group"
    top2 = gscore.args[0]
    if not (is_call(top2, operator.getitem) and top2.args[1] == 0 and is_call(top2.args[0], aten.topk.default)):
        return "group scores are not a sum of each group's top experts"
    inner = top2.args[0]
    grouped = inner.args[0]
    if inner.args[1] != 2 or not _arg(inner, 3, "largest", True) or not _last_dim(_arg(inner, 2, "dim", -1), grouped):
        return "group scores are not the sum of each group's top-2"
    if not _last_dim(gscore.args[1], grouped):
        return "group scores are not a sum over each group"
    if not is_call(grouped, *RESHAPES) or grouped.args[0] is not choice:
        return "group scores are not computed from the same biased scores"
    if tuple(meta_val(grouped).shape[-2:]) != (groups, e // groups):
        return "group scores do not view the experts as [n_group, E / n_group]"
    return groups, topk_group


def _scatter_index(scatter: torch.fx.Node) -> torch.fx.Node | str:
    """The group ids of `zeros.scatter(1, ids, nonzero)`, else why not."""
    if _const_fill(scatter.args[0]) != 0.0 or _arg(scatter, 1, "dim") not in (1, -1):
        return "the group mask does not start from zeros scattered along the groups"
    fill = _scalar(scatter.args[3]) if scatter.target is aten.scatter.value else _const_fill(scatter.args[3])
    if not fill:
        return "the group mask scatters a zero or unknown value"
    return scatter.args[2]


def _one_hot_index(where: torch.fx.Node, groups: int) -> torch.fx.Node | str:
    """The group ids of `where(ids.expand(T, G) == arange(G), nonzero, 0)`: inductor's joint-graph form of that
    scatter when one group is kept (topk_group=1), else why not."""
    cond, hit, miss = where.args[:3]
    if not _scalar(hit) or _scalar(miss) != 0.0 or not is_call(cond, aten.eq.Tensor):
        return "the group mask is a where() that is not a one-hot of the kept group"
    a, b = cond.args[:2]
    for ids, iota in ((a, b), (b, a)):
        while is_call(iota, *RESHAPES):
            iota = iota.args[0]
        if is_call(iota, prims.iota.default) and iota.args[0] == groups and iota.kwargs.get("start", 0) == 0 \
                and iota.kwargs.get("step", 1) == 1:
            while is_call(ids, aten.expand.default):
                ids = ids.args[0]
            return ids
    return "the group mask is a where() that is not a one-hot of the kept group"


def _match_sigmoid(x: torch.fx.Node, ids: list[torch.fx.Node], values: list[torch.fx.Node], e: int) -> _Rewrite | str:
    choice, mask = x, None
    if is_call(x, aten.where.self):
        cond, a, b = x.args[:3]
        if _is_neg_inf(a):
            choice, mask = b, (cond, False)
        elif _is_neg_inf(b):
            choice, mask = a, (cond, True)
        else:
            return "the masked experts are filled with a value other than -inf"
    sig, bias = choice, None
    if is_call(choice, aten.add.Tensor) and choice.kwargs.get("alpha", 1) == 1:
        a, b = choice.args[:2]
        sig, bias = (a, b) if is_call(a, aten.sigmoid.default) else (b, a)
    if not is_call(sig, aten.sigmoid.default):
        return "the scores are not a sigmoid of the logits"
    if dtype_of(sig) != torch.float32:
        return f"the sigmoid is computed in {dtype_of(sig)}, the kernel's is fp32"
    if dtype_of(choice) != torch.float32:
        return f"the biased scores are {dtype_of(choice)}, the kernel's are fp32"
    if bias is not None:
        bval = meta_val(bias)
        if not isinstance(bval, torch.Tensor) or tuple(bval.shape) != (e,) or not bval.dtype.is_floating_point:
            return f"the score correction is not a bias of shape [E={e}]"
    groups, topk_group = 1, 1
    if mask is not None:
        found = _group_keep(*mask, choice, e)
        if isinstance(found, str):
            return found
        groups, topk_group = found
    if values:
        return "the top-k values of the biased scores are read"
    gathers = [u for i in ids for u in i.users
               if is_call(u, aten.gather.default) and u.args[0] is sig and u.args[2] is i]
    gathers = [g for g in gathers if _arg(g, 1, "dim") in (1, -1)]
    if not gathers:
        return "the weights are not the sigmoid scores gathered at the chosen ids"
    tail, renorm = gathers[0], False
    fused = _renorm_of(tail, _routing.SIGMOID_RENORM_EPS)
    if fused is not None:
        tail, renorm = fused, True
    tail, scale = _scaled(tail)
    return _Rewrite(_upcast_source(sig.args[0]), "sigmoid", renorm, bias, groups, topk_group, scale, tail)


def _classify(topk: torch.fx.Node, softmax_of: dict) -> _Rewrite | str | None:
    """The rewrite for a router top-k, why a router top-k is left alone, or None for other top-ks."""
    x, k = topk.args[:2]
    outs = _getitems(topk)
    ids, values = outs.get(1, []), outs.get(0, [])
    if not ids:
        return None
    xval = meta_val(x)
    if _softmax_input(x) is not None:
        family = "softmax"
    elif is_call(x, aten.where.self, aten.add.Tensor, aten.sigmoid.default) and "sigmoid" in _producers(x):
        family = "sigmoid"
    elif len(values) == 1 and _feeds_softmax(values[0], softmax_of):
        family = "topk_softmax"
    elif is_call(x, prims.convert_element_type.default) and _softmax_input(x.args[0]) is not None:
        return f"the probabilities are rounded to {dtype_of(x)} before the top-k; the kernel ranks fp32"
    elif is_call(x, aten.where.self) and "softmax" in _producers(x, 2):
        return "softmax scores masked by group (group-limited greedy): the kernel's group top-k is sigmoid's"
    else:
        return None
    if not _arg(topk, 3, "largest", True) or not _last_dim(_arg(topk, 2, "dim", -1), x):
        return "the top-k is not of the largest values along the experts dim"
    if not isinstance(xval, torch.Tensor) or xval.dim() != 2:
        return "the router scores are not [T, E]"
    e = xval.shape[1]
    if not isinstance(e, int) or not isinstance(k, int):
        return "E or k is not a constant"
    if family == "softmax":
        found = _match_softmax(x, values)
    elif family == "sigmoid":
        found = _match_sigmoid(x, ids, values, e)
    else:
        found = _match_topk_softmax(x, values[0], softmax_of)
    if isinstance(found, str):
        return found
    why = kernel_supports(e, found.n_group)
    if why is None and dtype_of(found.logits) not in _LOGIT_DTYPES:
        why = f"router logits are {dtype_of(found.logits)}"
    return why or found


def _producers(node: torch.fx.Node, depth: int = 3) -> set[str]:
    """The score functions (sigmoid, softmax) within `depth` producers of `node`, `node` included: what tells
    a router's top-k from other top-ks."""
    seen, frontier = set(), [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if is_call(n, aten.sigmoid.default):
                seen.add("sigmoid")
            elif _softmax_input(n) is not None:
                seen.add("softmax")
            nxt.extend(a for a in n.all_input_nodes if a.op == "call_function")
        frontier = nxt
    return seen


def _feeds_softmax(v: torch.fx.Node, softmax_of: dict) -> bool:
    if v in softmax_of:
        return True
    return any(is_call(u, prims.convert_element_type.default) and u in softmax_of for u in v.users)


def _softmax_outputs(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    found: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        if is_call(n, aten.div.Tensor, aten.mul.Tensor, aten._softmax.default):
            x = _softmax_input(n)
            if x is not None:
                found.setdefault(x, []).append(n)
    return found


def _cast_to(tail: torch.fx.Node | None) -> torch.dtype | None:
    """The low dtype every reader of the weights casts them to (Qwen's `.to(router_logits.dtype)`), or None: the op
    then stores them in that dtype itself, one kernel less per layer (the cast rounded the same fp32 values)."""
    readers = list(tail.users) if tail is not None else []
    dtypes = {u.args[1] if is_call(u, prims.convert_element_type.default) else None for u in readers}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    return dtype if dtype in LOW_DTYPES else None


def _apply(graph: torch.fx.Graph, topk: torch.fx.Node, rw: _Rewrite) -> None:
    k = topk.args[1]
    dtype = _cast_to(rw.tail)
    with graph.inserting_before(topk):
        fused = call(graph, FUSED_TOPK, (rw.logits, k, rw.kind, rw.renormalize, rw.bias, rw.n_group,
                                         rw.topk_group, float(rw.scale), dtype))
        weights = call(graph, operator.getitem, (fused, 0))
        ids = call(graph, operator.getitem, (fused, 1))
    for node in (fused, weights, ids):
        node.meta["stack_trace"] = topk.meta.get("stack_trace")
    for old in _getitems(topk).get(1, []):
        old.replace_all_uses_with(ids)
    if rw.tail is not None:
        for old in list(rw.tail.users) if dtype is not None else [rw.tail]:
            old.replace_all_uses_with(weights)


class FuseMoeRouting(MoefxPass):
    name = "fuse_moe_routing"
    uuid_files = (_fx.__file__, _routing.__file__)

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        softmax_of = _softmax_outputs(graph)
        done = 0
        for node in list(graph.nodes):
            if not is_call(node, aten.topk.default):
                continue
            found = _classify(node, softmax_of)
            if found is None:
                continue
            if isinstance(found, str):
                ctx.skip(f"router top-k at {source_of(node)} kept: {found}")
                continue
            _apply(graph, node, found)
            done += 1
        return done
