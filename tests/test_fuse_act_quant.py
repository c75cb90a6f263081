"""fuse_act_quant at the FX level: capture the post-grad graph of real SiLU-mul + quant code, run the pass,
count ops, and compare the rewritten graph with eager on fresh random inputs (FP8 bit-identical but for
< 0.1% last-bit division differences, INT8 identical, scales within 1e-6 relative)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moefx.ops.quant import QuantScheme
from moefx.passes.fuse_act_quant import FuseActQuant
from moefx.passes.quant_patterns import post_grad_graph
from moefx.testing import count_ops, run_passes

aten, ops = torch.ops.aten, torch.ops.moefx
FP8 = torch.float8_e4m3fn
M = 64


# ------------------------------------------------------------------------------------------ user code forms
def vllm_silu_and_mul(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def hf_mlp_act(x, wg, wu):
    return F.silu(x @ wg) * (x @ wu)


def vllm_group_quant(y, g=128, ue8m0=False):
    xg = y.view(-1, y.shape[-1] // g, g)
    absmax = xg.abs().max(dim=-1, keepdim=True)[0].float()
    scale = absmax / 448.0
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = scale.clamp(min=1.0 / (448.0 * 512.0))
    q = (xg / scale).clamp(-448.0, 448.0).to(FP8)
    return q.view(y.shape), scale.squeeze(-1).reshape(*y.shape[:-1], -1)


def deepseek_act_quant(y, g=128, clamps=True):
    xg = y.reshape(-1, g).float()
    if clamps:
        scale = xg.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4) / 448.0
        q = (xg / scale).clamp(-448.0, 448.0).to(FP8)
    else:
        scale = xg.abs().amax(dim=-1, keepdim=True) / 448.0
        q = (xg / scale).to(FP8)
    return q.reshape(y.shape), scale.reshape(*y.shape[:-1], -1)


def fp8_token_quant(y):
    yf = y.float()
    scale = yf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 448.0
    return (yf / scale).clamp(-448.0, 448.0).to(FP8), scale


def vllm_token_quant(y):
    x_max = y.abs().max(dim=-1)[0].unsqueeze(-1).to(torch.float32)
    scale = (x_max / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    return (y.to(torch.float32) * scale.reciprocal()).clamp(-448.0, 448.0).to(FP8), scale


def int8_token_quant(y):
    yf = y.float()
    scale = yf.abs().amax(dim=-1, keepdim=True) / 127.0
    return (yf / scale).round().clamp(-128, 127).to(torch.int8), scale


def int8_group_quant(y, g=128):
    yf = y.reshape(-1, g).float()
    scale = yf.abs().amax(dim=-1, keepdim=True) / 127.0
    q = (yf / scale).round().clamp(-128, 127).to(torch.int8)
    return q.reshape(y.shape), scale.reshape(*y.shape[:-1], -1)


def moefx_quant(y):
    return ops.quant(y, *QuantScheme("fp8_group", 128).args())


# ------------------------------------------------------------------------------------------------ helpers
def _inputs(kind, dtype, n=256, rows=M):
    if kind == "cat":
        return [torch.randn(rows, 2 * n, dtype=dtype) * 3]
    w = [torch.randn(96, n, dtype=dtype) * 0.3 for _ in range(2)]
    return [torch.randn(rows, 96, dtype=dtype), *w]


def _run_pass(fn, args, dynamic=False):
    graph = post_grad_graph(fn, args, dynamic_rows=dynamic)
    run = run_passes(graph, FuseActQuant)
    return graph, run.rewrites, run


def _assert_close_quant(out, ref):
    """FP8: < 0.1% of elements differ (last-bit division); INT8: identical; scales within 1e-6 relative."""
    q, s = out[0], out[1]
    rq, rs = ref[0], ref[1]
    assert q.dtype == rq.dtype and q.shape == rq.shape and s.shape == rs.shape
    diff = (q.float() != rq.float()) & ~(q.float().isnan() & rq.float().isnan())
    limit = 1e-3 if q.dtype == FP8 else 0.0
    assert diff.float().mean().item() <= limit, f"{diff.sum().item()} of {diff.numel()} quantized values differ"
    assert ((s - rs).abs() <= 1e-6 * rs.abs()).all()


def _check(fn, kind, dtype, fused_op, dynamic=False):
    args = _inputs(kind, dtype)
    graph, n, run = _run_pass(fn, args, dynamic)
    assert n == 1, run.skipped
    assert count_ops(graph, fused_op) == 1
    assert count_ops(graph, aten.exp.default, aten.neg.default, aten.amax.default, aten.max.dim,
                         ops.quant.default, ops.silu_mul.default) == 0
    assert _casts_to_quant(graph) == 0
    fresh = _inputs(kind, dtype, rows=M - 24 if dynamic else M)
    _assert_close_quant(run_graph(graph, fresh), fn(*fresh))


def run_graph(graph, args):
    """Run a captured graph on `args`; symbolic-size placeholders get the row count of the first input."""
    values, tensors = [], iter(args)
    for p in graph.find_nodes(op="placeholder"):
        values.append(args[0].shape[0] if isinstance(p.meta.get("val"), torch.SymInt) else next(tensors))
    return torch.fx.GraphModule(graph.owning_module, graph)(*values)


def _casts_to_quant(graph):
    return sum(
        1 for n in graph.nodes
        if n.target is torch.ops.prims.convert_element_type.default and n.args[1] in (FP8, torch.int8)
    )


# ---------------------------------------------------------------------------------------------------- tests
CASES = [
    ("vllm_siluandmul+vllm_group128", lambda x: vllm_group_quant(vllm_silu_and_mul(x)), "cat", torch.bfloat16),
    ("vllm_siluandmul+vllm_group64_ue8m0", lambda x: vllm_group_quant(vllm_silu_and_mul(x), 64, True), "cat",
     torch.float16),
    ("hf_mlp+deepseek_group128", lambda x, a, b: deepseek_act_quant(hf_mlp_act(x, a, b)), "split", torch.float16),
    ("hf_mlp+deepseek_v3_noclamp_group64", lambda x, a, b: deepseek_act_quant(hf_mlp_act(x, a, b), 64, False),
     "split", torch.bfloat16),
    ("vllm_siluandmul+fp8_token", lambda x: fp8_token_quant(vllm_silu_and_mul(x)), "cat", torch.float32),
    ("hf_mlp+int8_token", lambda x, a, b: int8_token_quant(hf_mlp_act(x, a, b)), "split", torch.bfloat16),
    ("vllm_siluandmul+int8_group128", lambda x: int8_group_quant(vllm_silu_and_mul(x)), "cat", torch.bfloat16),
    ("hf_mlp+moefx_quant", lambda x, a, b: moefx_quant(hf_mlp_act(x, a, b)), "split", torch.bfloat16),
    ("moefx_silu_mul+moefx_quant", lambda x: moefx_quant(ops.silu_mul(x)), "cat", torch.bfloat16),
    ("moefx_silu_mul+vllm_group128", lambda x: vllm_group_quant(ops.silu_mul(x)), "cat", torch.float32),
]


@pytest.mark.parametrize("name,fn,kind,dtype", CASES, ids=[c[0] for c in CASES])
def test_fuses_and_matches_eager(name, fn, kind, dtype):
    fused = ops.silu_mul_quant_split.default if kind == "split" else ops.silu_mul_quant.default
    _check(fn, kind, dtype, fused)


def test_dynamic_batch_still_fuses():
    _check(lambda x: vllm_group_quant(vllm_silu_and_mul(x)), "cat", torch.bfloat16, ops.silu_mul_quant.default,
           dynamic=True)


def test_constants_come_from_the_match():
    def fn(x):
        y = vllm_silu_and_mul(x)
        scale = y.float().abs().amax(dim=-1, keepdim=True).clamp(min=0.25) / 240.0
        return (y.float() / scale).clamp(-240.0, 240.0).to(FP8), scale

    args = _inputs("cat", torch.bfloat16)
    graph, n, _ = _run_pass(fn, args)
    assert n == 1
    (node,) = [nd for nd in graph.nodes if nd.target is ops.silu_mul_quant.default]
    assert node.args[1:6] == ("fp8_token", 0, 0.25, 0.0, 240.0)
    _assert_close_quant(run_graph(graph, args), fn(*args))


def test_reciprocal_form_fuses_with_the_reciprocal_rounding():
    """vLLM's per-token path multiplies by scale.reciprocal(): the op reproduces that rounding, not a division."""
    fn = lambda x: vllm_token_quant(vllm_silu_and_mul(x))  # noqa: E731
    _check(fn, "cat", torch.bfloat16, ops.silu_mul_quant.default)
    graph, _, _ = _run_pass(fn, _inputs("cat", torch.bfloat16))
    (node,) = graph.find_nodes(op="call_function", target=ops.silu_mul_quant.default)
    assert node.args[-2:] == ("reciprocal", False)


def test_sigmoid_form_left_alone_with_reason():
    def fn(x):
        g, u = x.chunk(2, -1)
        return fp8_token_quant(g * torch.sigmoid(g) * u)

    graph, n, run = _run_pass(fn, _inputs("cat", torch.bfloat16))
    assert n == 0 and _casts_to_quant(graph) == 1
    assert any("sigmoid" in r and "test_fuse_act_quant.py:" in r for r in run.skipped), run.skipped


def test_fp8_max_out_of_range_left_alone_with_reason():
    def fn(x):
        y = vllm_silu_and_mul(x)
        scale = y.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 500.0
        return (y.float() / scale).clamp(-500.0, 500.0).to(FP8), scale

    graph, n, run = _run_pass(fn, _inputs("cat", torch.bfloat16))
    assert n == 0 and _casts_to_quant(graph) == 1
    assert any("500.0" in r for r in run.skipped), run.skipped


def test_producer_with_other_users_left_alone():
    def fn(x):
        y = vllm_silu_and_mul(x)
        q, s = vllm_group_quant(y)
        return q, s, y.sum()

    graph, n, run = _run_pass(fn, _inputs("cat", torch.bfloat16))
    assert n == 0 and count_ops(graph, ops.quant.default) == 0
    assert any("also feeds" in r for r in run.skipped), run.skipped


def test_uuid_covers_the_ops_files():
    files = " ".join(FuseActQuant.uuid_files)
    assert "fused_quant.py" in files and "quant.py" in files and "quant_patterns.py" in files


def test_skip_reason_reaches_the_compile_report():
    import moefx
    from moefx.config import CompilationConfig
    from moefx.passes import PassManager

    def fn(x):
        y = vllm_silu_and_mul(x)
        scale = y.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 500.0
        return (y.float() / scale).clamp(-500.0, 500.0).to(FP8), scale

    graph = post_grad_graph(fn, _inputs("cat", torch.bfloat16))
    moefx.clear_compile_reports()
    PassManager(CompilationConfig(), ["fuse_act_quant"])(graph)
    (report,) = moefx.compile_reports()
    assert report.matches == {"fuse_act_quant": 0}
    assert any("500.0" in r for r in report.skipped["fuse_act_quant"])
