"""fuse_qk_norm_rope: a decode step's q/k RMSNorm + RoPE + KV-cache write -> one `moefx::qk_norm_rope_cache` call.

Between a Qwen3-style attention's projections and `moefx::decode_attention`, the compiled step holds three
inductor kernels per layer (q norm + RoPE; k norm + RoPE + key write; value write); the op does it in one
(moefx/ops/rope_cache.py, same rounding as the eager code). Matched, from the attention call back:
`moefx::decode_attention(q, K, V, ...)` with
- K = `index_put(keys, [None, None, positions], rope(permute(rms_norm(k))))`, V = `index_put(values, [None, None,
  positions], permute(v))` on two graph inputs (the cache layer, written back by `copy_` at the graph's end) and
  one positions tensor, read by nothing but the attention and the write-back;
- q = `rope(permute(rms_norm(q)))`, with the same cos and sin as k's, where rope(x) = `x * cos + cat(-x[..., h:],
  x[..., :h]) * sin` (transformers' `rotate_half`, cos/sin unsqueezed at dim 1), `permute` is [0, 2, 1, 3] and the
  norms are plain RMSNorms (fuse_norm_quant's recognizer) with their weight applied after the downcast and one eps.
The op mutates the cache layer, so it is inserted as an `auto_functionalized` call: inductor's own passes then
write in place and drop the write-back copies, as for any mutating custom op.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from moefx.ops import decode_attention as _attention  # noqa: F401  (registers moefx::decode_attention)
from moefx.ops import rope_cache as _rope_cache
from moefx.passes import quant_fusion, quant_patterns
from moefx.passes.base import MoefxPass, PassContext
from moefx.passes.fx import call, is_call, meta_val, source_of
from moefx.passes.quant_patterns import NotMine, Reject

aten = torch.ops.aten
ATTENTION = torch.ops.moefx.decode_attention.default
QK_NORM_ROPE_CACHE = torch.ops.moefx.qk_norm_rope_cache.default
AUTO_FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized
_END = 2**63 - 1  # the slice end `x[..., h:]` traces to
_KERNEL_ARGS = ("q", "k", "v", "q_weight", "k_weight", "cos", "sin", "keys", "values", "positions")


class _Miss(Exception):
    """The candidate is not this pattern; the message says why (for the compile report)."""


def _last_dim(dim: object, ndim: int) -> bool:
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _half_slice(node: object, x: torch.fx.Node, start: int, end: int) -> bool:
    """node = x[..., start:end] (an end at the last element may be traced as a huge end)."""
    if not is_call(node, aten.slice.Tensor) or node.args[0] is not x:
        return False
    dim = node.args[1] if len(node.args) > 1 else 0
    lo = node.args[2] if len(node.args) > 2 else 0
    hi = node.args[3] if len(node.args) > 3 else _END
    d = meta_val(x).shape[-1]
    return _last_dim(dim, meta_val(x).dim()) and lo == start and (hi == end or (end == d and hi >= d))


def _rope(node: object) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]:
    """(x, cos4, sin4) when node = x * cos4 + rotate_half(x) * sin4."""
    if not is_call(node, aten.add.Tensor) or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        raise _Miss("not an add")
    for direct, rotated in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        if not (is_call(direct, aten.mul.Tensor) and is_call(rotated, aten.mul.Tensor)):
            continue
        for cat, sin in ((rotated.args[0], rotated.args[1]), (rotated.args[1], rotated.args[0])):
            if not is_call(cat, aten.cat.default) or len(cat.args[0]) != 2:
                continue
            neg, lo = cat.args[0]
            if not is_call(neg, aten.neg.default):
                continue
            x = lo.args[0] if isinstance(lo, torch.fx.Node) and lo.args else None
            if not isinstance(x, torch.fx.Node) or meta_val(x) is None:
                continue
            d = meta_val(x).shape[-1]
            if not (_last_dim(cat.args[1] if len(cat.args) > 1 else 0, meta_val(x).dim()) and isinstance(d, int)
                    and _half_slice(lo, x, 0, d // 2) and _half_slice(neg.args[0], x, d // 2, d)):
                continue
            a, b = direct.args[:2]
            if x is a or x is b:
                return x, (b if x is a else a), sin
    raise _Miss("not x * cos + rotate_half(x) * sin")


def _unsqueezed(node: object) -> torch.fx.Node:
    """cos from cos.unsqueeze(1) (apply_rotary_pos_emb's unsqueeze_dim)."""
    if not is_call(node, aten.unsqueeze.default) or node.args[1] != 1:
        raise _Miss("cos/sin are not unsqueezed at dim 1")
    return node.args[0]


def _heads_first(node: object) -> torch.fx.Node:
    """y when node = y.transpose(1, 2) of a [B, S, H, D] tensor (a permute, maybe made contiguous)."""
    if is_call(node, aten.clone.default):
        node = node.args[0]
    if not is_call(node, aten.permute.default) or list(node.args[1]) != [0, 2, 1, 3]:
        raise _Miss("not a [0, 2, 1, 3] permute of the heads")
    return node.args[0]


def _head_norm(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node | None, float]:
    """(x, weight, eps) of a plain per-head RMSNorm with its weight applied after the downcast."""
    try:
        match = quant_fusion.RMS_NORM_PRODUCER.recognize(node)
    except (NotMine, Reject) as e:
        raise _Miss(f"the head norm is not a plain RMSNorm ({e})") from None
    why = quant_fusion.plain_norm_problem(match)
    if why:
        raise _Miss(f"the head norm is {why}")
    x, weight, eps, _ = match.args
    return x, weight, eps


def _cache_write(node: object) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]:
    """(cache input, positions, rows) of index_put(cache, [None, None, positions], rows) on a graph input."""
    if not is_call(node, aten.index_put.default) or len(node.args) > 3 and node.args[3]:
        raise _Miss("the cache is not written by index_put")
    cache, index, rows = node.args[:3]
    if not (isinstance(cache, torch.fx.Node) and cache.op == "placeholder"):
        raise _Miss("the cache is not a graph input")
    if len(index) != 3 or index[0] is not None or index[1] is not None or not isinstance(index[2], torch.fx.Node):
        raise _Miss("the cache write is not at [:, :, positions]")
    others = [u for u in node.users if not (is_call(u, aten.copy_.default) and u.args[0] is cache)]
    if len(others) != 1 or len(node.users) != 2:
        raise _Miss("the written cache is read by more than the attention and its write-back")
    return cache, index[2], rows


def _start_of(positions: torch.fx.Node) -> torch.fx.Node:
    """The write position's own tensor when positions = arange(1) + start (the decode step's one position, as
    `_StaticLayerView` writes it): the op reads it directly, and no kernel computes the sum."""
    if not is_call(positions, aten.add.Tensor) or len(positions.args) != 2:
        return positions
    for iota, start in (positions.args, positions.args[::-1]):
        if is_call(iota, torch.ops.prims.iota.default) and iota.args[0] == 1 and \
                iota.kwargs.get("start", 0) == 0 and isinstance(meta_val(start), torch.Tensor) and \
                meta_val(start).numel() == 1 and meta_val(start).dtype == meta_val(positions).dtype:
            return start
    return positions


class FuseQkNormRope(MoefxPass):
    name = "fuse_qk_norm_rope"
    uuid_files = (quant_fusion.__file__, quant_patterns.__file__, _rope_cache.__file__)

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        done = 0
        for attn in list(graph.nodes):
            if not is_call(attn, ATTENTION):
                continue
            try:
                kwargs, q_rope, k_write, v_write = self._match(attn)
            except _Miss as e:
                ctx.skip(f"attention at {source_of(attn)}: q/k norm + RoPE + cache write left unfused: {e}")
                continue
            with graph.inserting_before(attn):
                fused = call(graph, AUTO_FUNCTIONALIZED, (QK_NORM_ROPE_CACHE,), kwargs)
                outs = [call(graph, operator.getitem, (fused, i)) for i in range(3)]
            for old, new in zip((q_rope, k_write, v_write), outs):
                old.replace_all_uses_with(new)
            ctx.note(f"q/k norm + RoPE + cache write before {source_of(attn)} into moefx::qk_norm_rope_cache")
            done += 1
        return done

    @staticmethod
    def _match(attn: torch.fx.Node) -> tuple[dict, torch.fx.Node, torch.fx.Node, torch.fx.Node]:
        q_rope, k_write, v_write = attn.args[:3]
        keys, positions, k_rope = _cache_write(k_write)
        values, v_positions, v_rows = _cache_write(v_write)
        if v_positions is not positions or values is keys:
            raise _Miss("the key and value writes are not at one positions tensor into two caches")
        qn, cos4, sin4 = _rope(q_rope)
        kn, k_cos4, k_sin4 = _rope(k_rope)
        if (k_cos4, k_sin4) != (cos4, sin4):
            raise _Miss("q and k are rotated by different cos/sin")
        q, q_weight, eps = _head_norm(_heads_first(qn))
        k, k_weight, k_eps = _head_norm(_heads_first(kn))
        if k_eps != eps:
            raise _Miss(f"q and k norms use different eps ({eps}, {k_eps})")
        v = _heads_first(v_rows)
        kwargs = dict(q=q, k=k, v=v, q_weight=q_weight, k_weight=k_weight, eps=eps, cos=_unsqueezed(cos4),
                      sin=_unsqueezed(sin4), keys=keys, values=values, positions=_start_of(positions))
        vals = [meta_val(kwargs[n]) for n in _KERNEL_ARGS]
        if any(v is None for n, v in zip(_KERNEL_ARGS, vals) if kwargs[n] is not None):
            raise _Miss("an input has no fake value")
        why = _rope_cache.unsupported_reason(*vals)
        if why is not None and vals[0].device.type == "cuda":  # elsewhere the op's reference is the unfused code
            raise _Miss(f"the kernel does not take it: {why}")
        return kwargs, q_rope, k_write, v_write
