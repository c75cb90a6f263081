"""fuse_rope_attention: `moefx::qk_norm_rope_cache` -> `moefx::decode_attention` -> one `moefx::decode_attention_rope`.

After fuse_qk_norm_rope a decode step's attention is two kernels per layer: the q/k norm, RoPE and cache write, then
the attention over the cache. The fused op runs both in the attention kernel's one launch (moefx/ops/
decode_attention.py): each program normalizes and rotates its query rows itself, and the program whose slice holds
the step's position writes the new key and value before it reads the cache, so a layer saves one kernel and its
boundary (~1-1.5 µs on the H100 even in a CUDA graph) and q's round trip through memory. Rounding is the two ops'.
Matched: a decode_attention call whose query is output 0 of an auto_functionalized qk_norm_rope_cache call (as
fuse_qk_norm_rope writes it) read by nothing else, and whose keys and values are that call's outputs 1 and 2. The
other readers of the cache outputs (the write-back copies) read the fused call's.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from moefx.ops import decode_attention as _attention
from moefx.ops import rope_cache as _rope_cache  # registers moefx::qk_norm_rope_cache
from moefx.passes.base import MoefxPass, PassContext
from moefx.passes.fx import call, is_call, meta_val, source_of

ATTENTION = torch.ops.moefx.decode_attention.default
ATTENTION_ROPE = torch.ops.moefx.decode_attention_rope.default
QK_NORM_ROPE_CACHE = torch.ops.moefx.qk_norm_rope_cache.default
AUTO_FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized
_ARGS = ("q", "k", "v", "q_weight", "k_weight", "cos", "sin", "keys", "values", "positions")


def _item(node: object, index: int) -> torch.fx.Node | None:
    """The auto_functionalized qk_norm_rope_cache call whose output `index` `node` is, or None."""
    if not is_call(node, operator.getitem) or node.args[1] != index:
        return None
    fused = node.args[0]
    if not is_call(fused, AUTO_FUNCTIONALIZED) or fused.args[0] is not QK_NORM_ROPE_CACHE:
        return None
    return fused


def _problem(attn: torch.fx.Node, rope: torch.fx.Node) -> str | None:
    q_out, keys, values = attn.args[:3]
    if _item(keys, 1) is not rope or _item(values, 2) is not rope:
        return "its keys and values are not the q/k norm + RoPE call's cache outputs"
    if len(q_out.users) != 1:
        return "the rotated query is read by more than the attention"
    mask = attn.args[3] if len(attn.args) > 3 else attn.kwargs.get("mask")
    vals = [meta_val(rope.kwargs[n]) if rope.kwargs.get(n) is not None else None for n in _ARGS]
    if any(v is None for n, v in zip(_ARGS, vals) if rope.kwargs.get(n) is not None):
        return "an input has no fake value"
    why = _attention.rope_unsupported_reason(*vals, meta_val(mask) if mask is not None else None)
    if why is not None and vals[0].device.type == "cuda":  # elsewhere the op's reference is the two ops' code
        return f"the kernel does not take it: {why}"
    return None


class FuseRopeAttention(MoefxPass):
    name = "fuse_rope_attention"
    uuid_files = (_attention.__file__, _rope_cache.__file__)

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        done = 0
        for attn in list(graph.nodes):
            if not is_call(attn, ATTENTION) or attn.kwargs:
                continue
            rope = _item(attn.args[0], 0)
            if rope is None:
                continue
            why = _problem(attn, rope)
            if why:
                ctx.skip(f"attention at {source_of(attn)}: q/k norm + RoPE left a kernel of its own: {why}")
                continue
            q_out, keys, values, mask, scale = attn.args
            with graph.inserting_before(attn):
                fused = call(graph, AUTO_FUNCTIONALIZED, (ATTENTION_ROPE,),
                             {**rope.kwargs, "mask": mask, "scale": scale})
                got = [call(graph, operator.getitem, (fused, i)) for i in range(3)]
            attn.replace_all_uses_with(got[0])
            keys.replace_all_uses_with(got[1])
            values.replace_all_uses_with(got[2])
            for node in (attn, q_out, keys, values, rope):
                graph.erase_node(node)
            ctx.note(f"q/k norm + RoPE + cache write into the attention at {source_of(attn)} "
                     "(moefx::decode_attention_rope)")
            done += 1
        return done
