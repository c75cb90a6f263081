"""fuse_sibling_linears: linears that read the same input -> one `moefx::dense_linear` call with several weights.

q/k/v of an attention, a dense MLP's gate/up and shared experts' gate/up each read one activation; unfused they are
separate GEMMs that each launch, read the activation and, at decode M, stream their weights with too few programs
to fill the GPU (k_proj and v_proj of Qwen3-30B-A3B are 512 rows each). One dense_linear call takes all the weights
(no concatenation: the kernel walks the weights' row tiles end to end in one launch, so no copy of the weights is
made, once or per call) and returns each output, which takes the place of the matched linear's output.
Exact: the call computes the same dot products; where its policy has no calibration row (or M is above the
calibrated range) it runs the same linears one by one, bit for bit the unfused graph (dense.py `upstream`).
Forms and what counts as the same input: linear_forms.py. Both the float (`mm`/`addmm` over a weight) and the FP8
block form (`moefx::fp8_block_gemm`) are fused, each with its own kind; a float linear and an FP8 one never share
a call. The backend written into the call is the config's `dense_backend`.
"""

from __future__ import annotations

import torch.fx

from moefx.passes import linear_forms as lf
from moefx.passes.base import MoefxPass, PassContext


class FuseSiblingLinears(MoefxPass):
    name = "fuse_sibling_linears"
    uuid_files = lf.DEPENDENCY_FILES

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        backend = ctx.config.dense_backend
        order = {n: i for i, n in enumerate(graph.nodes)}
        groups: dict[tuple, list[lf.Linear]] = {}
        for node in graph.nodes:
            found = lf.parse(node)
            if isinstance(found, str):
                ctx.skip(f"linear at {lf.source_of(node)} left alone: {found}")
            elif found is not None:
                key = (*found.group_key(), found.backend or backend)
                groups.setdefault(key, []).append(found)
        done = 0
        for (*_, call_backend), members in groups.items():
            members = self._mergeable(members, order, ctx)
            if len(members) >= 2:
                lf.emit(graph, members, call_backend, order)
                done += 1
        return done

    @staticmethod
    def _mergeable(members: list[lf.Linear], order: dict, ctx: PassContext) -> list[lf.Linear]:
        """Members that can share one call: used, and with their weights defined before the first member."""
        members = [m for m in members if any(o is not None for o in m.outputs)]
        if len(members) < 2:
            return members
        first = min(members, key=lambda m: order[m.node])
        keep = []
        for m in members:
            if lf.defined_before(m, first.node, order):
                keep.append(m)
            else:
                ctx.skip(f"linear at {m.where()}: its weight is computed after its first sibling's call; not fused")
        return keep
