"""dense_linears: every remaining single linear -> a one-weight `moefx::dense_linear` call, so the dense policy picks
its backend per call by M (the small-M GEMV where a calibration row says it wins, the unfused linear elsewhere).

Runs after fuse_sibling_linears, on the linears it left single: attention's o_proj, an MLP's down_proj, the MoE
router gate, and their FP8 block forms (linear_forms.py). Exact in the same sense: no row or an M above the row's
range runs the linear as the graph did. Left in cuBLAS, by rule:
- N >= MAX_N output features (32768): LM heads (vocabularies of 32k-256k rows). cuBLAS already spreads such an N
  over every SM and reads the head at its bytes floor at decode M (Qwen3-30B-A3B's 151936 x 2048 head: 148 us
  for 622 MB on the H200, docs/FINDINGS.md), and `last_token_logits` / the sampler passes own that matmul.
- a static M above MAX_STATIC_M (256) rows: a prefill-only graph, far above every calibrated small-M range.
Linears that are left alone are reported with the reason.
"""

from __future__ import annotations

import torch.fx

from moefx.passes import linear_forms as lf
from moefx.passes.base import MoefxPass, PassContext
from moefx.passes.fx import meta_val

MAX_N = 32768
MAX_STATIC_M = 256


class DenseLinears(MoefxPass):
    name = "dense_linears"
    uuid_files = lf.DEPENDENCY_FILES

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        backend = ctx.config.dense_backend
        order = {n: i for i, n in enumerate(graph.nodes)}
        done = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is lf.DENSE:
                continue
            found = lf.parse(node)
            if found is None:
                continue
            why = found if isinstance(found, str) else _rule(found)
            if why:
                ctx.skip(f"linear at {lf.source_of(node)} left alone: {why}")
                continue
            lf.emit(graph, [found], backend, order)
            done += 1
        return done


def _rule(lin: lf.Linear) -> str | None:
    n = lin.ns[0]
    if n >= MAX_N:
        return f"N={n} >= {MAX_N} output features (an LM head) stays in cuBLAS"
    rows = meta_val(lin.x).numel() // max(lin.k, 1)
    if isinstance(rows, int) and rows > MAX_STATIC_M:
        return f"static M={rows} > {MAX_STATIC_M} rows (a prefill-only graph) stays in cuBLAS"
    return None
