"""fp8_weight_only: at decode M, an FP8 block linear reads its float input instead of an FP8 copy of it.

`Fp8BlockLinear` (moefx.quantize) is `moefx::quant(x)` (per-token-group e4m3 activations) then
`moefx::fp8_block_gemm`. At M <= 4 rows the GEMV's time is its weight bytes, and the activation quant is a kernel of
its own in front of it (or a norm + quant kernel, where fuse_norm_quant fuses them), 3.4 us a layer of the FP8 decode
step on the H100 (docs/FINDINGS.md). This pass rewrites such a linear into the weight-only form of
`moefx::dense_linear` (float x, FP8 weights with their block scales, no x_scale): the gemv kernel dequantizes each
weight block as it streams it and multiplies the float x, so no activation quant runs, and fuse_norm_linear can then
put the layer's input norm (and a residual add) into the GEMV's prologue as it does for bf16.

Not exact: Y = x @ dequant(W)^T in fp32, rounded once, where the W8A8 form rounds x to e4m3 per group before the
product. The weight-only result is the closer one to the float linear (the activation rounding is gone); the change
is a change of rounding that the fp32 scorer judges, and `pass_config.fp8_weight_only = False` keeps the W8A8 form.

Matched: a `moefx::fp8_block_gemm` whose activation and scale are outputs 0 and 1 of one `moefx::quant` of a float
x with an FP8 scheme (what Fp8BlockLinear writes), at a static M of at most the rows the dense kernel's CUDA-core
product serves (`default_config(m, False)` not a tensor-core tile: M <= 4, the limit fuse_norm_linear uses for the
prologue forms), where the dense policy runs the gemv kernel for the call in a captured step. With
fuse_sibling_linears on, the policy is asked about the call the linear becomes with its siblings (q/k/v as one
call): the calibration rows are per fused shape, and q_proj alone has none (docs/FINDINGS.md). Left alone, with
the reason in the compile report: a dynamic or larger M (prefill: W8A8 on the tensor cores), a call the policy runs
upstream, an input that is not such a quant. Runs before the quant fusions, so the quant it makes dead is not fused
into its producer first.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from moefx.backends.dense import select_backend
from moefx.backends.dense_policy import GEMV
from moefx.kernels.availability import module_file, triton_missing
from moefx.passes import linear_forms as lf
from moefx.passes.base import MoefxPass, PassContext
from moefx.passes.fx import call, is_call, meta_val, source_of


def _quant_input(a: object, a_scale: object) -> torch.fx.Node | None:
    """x when `a` and `a_scale` are outputs 0 and 1 of one moefx::quant(x, <an FP8 scheme>), else None."""
    if not (is_call(a, operator.getitem) and is_call(a_scale, operator.getitem)):
        return None
    quant = a.args[0]
    if quant is not a_scale.args[0] or (a.args[1], a_scale.args[1]) != (0, 1) or not is_call(quant, lf.QUANT):
        return None
    kind = quant.args[1] if len(quant.args) > 1 else quant.kwargs.get("kind")
    return quant.args[0] if isinstance(kind, str) and kind.startswith("fp8") else None


def _siblings(graph: torch.fx.Graph) -> dict[torch.fx.Node, tuple[list[torch.fx.Node], list[torch.fx.Node]]]:
    """Each FP8 linear's weights and scales together with those of its siblings (the linears fuse_sibling_linears
    will put into one call with it: same input, K, dtypes and block), in graph order."""
    groups: dict[tuple, list[lf.Linear]] = {}
    for node in graph.nodes:
        found = lf.parse(node) if is_call(node, lf.FP8_GEMM) else None
        if isinstance(found, lf.Linear):
            groups.setdefault(found.group_key(), []).append(found)
    return {m.node: ([w for s in members for w in s.weights], [w for s in members for w in s.weight_scales])
            for members in groups.values() for m in members}


def _problem(x: torch.fx.Node, weights: list[torch.fx.Node], scales: list[torch.fx.Node], block: list[int],
             out_dtype: torch.dtype | None, backend: str) -> str | None:
    """Why the weight-only form is not taken for this call, whose weights run in one dense call with `weights`
    (None: it is)."""
    xv, wv, sv = meta_val(x), [meta_val(w) for w in weights], [meta_val(s) for s in scales]
    if not all(isinstance(v, torch.Tensor) for v in (xv, *wv, *sv)):
        return "the call's inputs have no fake values"
    if xv.dtype not in lf.FLOAT_DTYPES:
        return f"the quant's input is {xv.dtype}, not a float tensor"
    if any(not isinstance(d, int) for d in xv.shape):
        return "its row count is not static (prefill and decode share the graph: W8A8 serves both)"
    m = xv.numel() // max(xv.shape[-1], 1)
    from moefx.kernels.dense_gemm import default_config

    if default_config(m, False).dot:
        return f"M={m} runs the tensor-core tiles, where W8A8 reads half the activation bytes"
    missing = triton_missing()
    if missing:
        return missing
    name = select_backend(xv, wv, sv, block, out_dtype, backend, capturing=True)
    rows = [int(w.shape[0]) for w in wv]
    return None if name == GEMV else f"the dense policy runs M={m} N={rows} {name}, not the gemv kernel"


class Fp8WeightOnly(MoefxPass):
    name = "fp8_weight_only"
    uuid_files = (*lf.DEPENDENCY_FILES, module_file("moefx.kernels.dense_gemm"))

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        backend = ctx.config.dense_backend
        # q/k/v are asked about as the one call they become: the policy's rows are per fused shape
        siblings = _siblings(graph) if "fuse_sibling_linears" in ctx.enabled else {}
        done = 0
        for node in list(graph.nodes):
            if not is_call(node, lf.FP8_GEMM):
                continue
            a, a_s, w, ws, bn, bk = node.args[:6]
            bias = node.args[6] if len(node.args) > 6 else node.kwargs.get("bias")
            out_dtype = node.args[7] if len(node.args) > 7 else node.kwargs.get("out_dtype")
            x = _quant_input(a, a_s)
            where = source_of(node)
            if x is None:
                ctx.skip(f"FP8 linear at {where} keeps the W8A8 form: its activation is not one moefx::quant of a "
                         f"float tensor with an FP8 scheme")
                continue
            block = [int(bn), int(bk)]
            weights, scales = siblings.get(node, ([w], [ws]))
            why = _problem(x, weights, scales, block, out_dtype, backend)
            if why:
                ctx.skip(f"FP8 linear at {where} keeps the W8A8 form: {why}")
                continue
            with graph.inserting_before(node):
                fused = call(graph, lf.DENSE, (x, [w], [bias], None, [ws], block, out_dtype, backend))
                fused.meta["stack_trace"] = node.meta.get("stack_trace")
                item = call(graph, operator.getitem, (fused, 0))
            node.replace_all_uses_with(item)
            graph.erase_node(node)  # the quant, read by no other linear, is dead: the manager's DCE drops it
            m = meta_val(x).numel() // meta_val(x).shape[-1]
            ctx.note(f"FP8 linear at {where}: weight-only form at M={m} (float input, no activation quant; "
                     f"moefx::dense_linear)")
            done += 1
        return done
