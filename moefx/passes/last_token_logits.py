"""last_token_logits: when only some rows of a linear's output are used, select them before the linear.

`lm_head(h)[:, -1]` (or `index_select(logits, 0, last_idx)` for packed prefill) computes logits for
every prompt position and keeps one per sequence: at a 4096-token prompt and a 152k vocabulary that is
gigabytes written and thrown away. Row i of `A @ W` only reads row i of `A`, so applying the same
select / slice / index / gather to the hidden states first gives the same dot products on far fewer rows.

Post-grad, `linear` is `mm` (or `addmm` with a bias) on the input flattened to 2-D, followed by a view
back to the leading dims. Matched: `[view ->] mm|addmm [-> view] [-> convert_element_type] -> selector`
where the selector works on a leading (token) dim and is the only consumer. Partly consumed outputs
are reported and left alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from moefx.passes import fx as _fx
from moefx.passes.base import MoefxPass, PassContext
from moefx.passes.fx import RESHAPES, call, meta_val, sizes_of, source_of

aten = torch.ops.aten
prims = torch.ops.prims

_SELECTORS = {aten.select.int, aten.slice.Tensor, aten.index.Tensor, aten.gather.default}


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _same_dims(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _selector_dim_ok(sel: torch.fx.Node, ndim: int) -> str | None:
    """None when `sel` only picks along leading (row) dims of a rank-`ndim` tensor, else why not."""
    if sel.target in (aten.select.int, aten.slice.Tensor, aten.gather.default):
        dim = sel.args[1] if len(sel.args) > 1 else sel.kwargs.get("dim", 0)
        if not isinstance(dim, int) or dim % ndim == ndim - 1:
            return "it selects along the output-feature dim"
        if sel.target is aten.gather.default:
            index = sel.args[2]
            if not (isinstance(index, torch.fx.Node) and index.target is aten.expand.default):
                return "gather index is not a row index expanded over the features"
            base = meta_val(index.args[0])
            if base is None or base.dim() != ndim or not statically_known_true(base.shape[-1] == 1):
                return "gather index is not a row index expanded over the features"
        return None
    indices = sel.args[1]
    if len(indices) > ndim - 1:
        return "it indexes the output-feature dim"
    for idx in indices:
        val = meta_val(idx)
        if val is not None and val.dtype in (torch.bool, torch.uint8):
            return "boolean-mask indexing (a data-dependent number of rows)"
    return None


def _numel(shape: tuple) -> Any:
    n: Any = 1
    for size in shape:
        n = n * size
    return n


class _Candidate:
    """One `[view ->] mm [-> view] [-> cast] -> selector` chain."""

    def __init__(self, mm: torch.fx.Node) -> None:
        self.mm = mm
        self.lhs_pos = 1 if mm.target is aten.addmm.default else 0
        lhs = mm.args[self.lhs_pos]
        self.flat_in = lhs if lhs.target in RESHAPES else None
        self.hidden = self.flat_in.args[0] if self.flat_in is not None else lhs
        tail = _only_user(mm)
        self.unflat = tail if tail is not None and tail.target in RESHAPES else None
        if self.unflat is None:
            self.hidden, self.flat_in = lhs, None
        tail = _only_user(self.unflat) if self.unflat is not None else tail
        self.cast = tail if tail is not None and tail.target is prims.convert_element_type.default else None
        self.selector = _only_user(self.cast) if self.cast is not None else tail

    @property
    def out(self) -> torch.fx.Node:
        return self.unflat if self.unflat is not None else self.mm

    def problem(self) -> str | None:
        if self.selector is None or self.selector.target not in _SELECTORS:
            return "not-selected"
        if self.selector.args[0] is not (self.cast or self.out):
            return "the selector does not read the linear's output"
        out_val, hid_val = meta_val(self.out), meta_val(self.hidden)
        if out_val is None or hid_val is None:
            return "untyped nodes"
        if self.unflat is not None:
            # The leading dims of the input and of the unflattened output must be the same rows.
            if self.flat_in is None or not _same_dims(tuple(hid_val.shape[:-1]), tuple(out_val.shape[:-1])):
                return "the output view does not restore the input's leading dims"
        if self.mm.target is aten.addmm.default:
            bias = meta_val(self.mm.args[0])
            if bias is None or (bias.dim() == 2 and not statically_known_true(bias.shape[0] == 1)):
                return "the bias has one row per input row"
        why = _selector_dim_ok(self.selector, out_val.dim())
        if why is None and self.selector.target in (aten.index.Tensor, aten.gather.default):
            picked, rows = _numel(meta_val(self.selector).shape[:-1]), _numel(out_val.shape[:-1])
            if not statically_known_true(picked < rows):
                why = "the index does not provably pick fewer rows than the linear computes"
        return why

    def rewrite(self, graph: torch.fx.Graph) -> torch.fx.Node:
        sel, hidden = self.selector, self.hidden
        with graph.inserting_before(sel):
            k = sizes_of(graph, hidden)[-1]
            args = list(sel.args)
            args[0] = hidden
            if sel.target is aten.gather.default:
                index = sel.args[2]
                size = list(index.args[1])
                size[-1] = k
                args[2] = call(graph, aten.expand.default, (index.args[0], size))
            picked = call(graph, sel.target, tuple(args), dict(sel.kwargs))
            lead = sizes_of(graph, picked)[:-1]
            flat = picked if len(lead) == 1 else call(graph, aten.reshape.default, (picked, [-1, k]))
            mm_args = list(self.mm.args)
            mm_args[self.lhs_pos] = flat
            rows = call(graph, self.mm.target, tuple(mm_args), dict(self.mm.kwargs))
            n = sizes_of(graph, mm_args[-1])[-1]
            new = rows if len(lead) == 1 else call(graph, aten.reshape.default, (rows, [*lead, n]))
            if self.cast is not None:
                new = call(graph, self.cast.target, (new, *self.cast.args[1:]), dict(self.cast.kwargs))
        sel.replace_all_uses_with(new)
        for node in (sel, self.cast, self.unflat, self.mm):
            if node is not None and not node.users:
                graph.erase_node(node)
        return rows


class LastTokenLogits(MoefxPass):
    name = "last_token_logits"
    uuid_files = (_fx.__file__,)

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        done = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
                continue
            cand = _Candidate(node)
            why = cand.problem()
            if why is None:
                # Keep moving selectors up: a no-op slice may sit in front of the real selection.
                while why is None:
                    cand = _Candidate(cand.rewrite(graph))
                    why = cand.problem()
                done += 1
            elif why == "not-selected":
                if _partly_selected(cand):
                    ctx.skip(f"linear at {source_of(node)} kept: other consumers read all its rows")
            else:
                ctx.skip(f"linear at {source_of(node)} kept: {why}")
        return done


def _partly_selected(cand: _Candidate) -> bool:
    out = cand.cast or cand.out
    return len(out.users) > 1 and any(u.target in _SELECTORS for u in out.users)
