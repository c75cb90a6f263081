"""fuse_sibling_linears at the FX level: trace real transformers Qwen3-MoE attention and a dense MLP (tiny configs),
their FP8 block forms (moefx.quantize) and moefx's own op form, run the pass, count ops before/after, and compare
the rewritten graph with the unfused one on random inputs (bit for bit where the call runs upstream, within the
fp32 summation-order bound where it runs the gemv path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.post_grad import view_to_reshape
from torch.func import functional_call, functionalize
from torch.fx.experimental.proxy_tensor import make_fx
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention, Qwen3MoeMLP, Qwen3MoeRotaryEmbedding

import moefx
from moefx.backends import dense_linear
from moefx.models.tiny import tiny_qwen3_moe_config
from moefx.passes.fuse_sibling_linears import FuseSiblingLinears
from moefx.testing import count_ops, run_passes

aten, ops = torch.ops.aten, torch.ops.moefx
DENSE = ops.dense_linear.default
LINEARS = (aten.mm.default, aten.addmm.default, ops.fp8_block_gemm.default)


@pytest.fixture(autouse=True)
def _no_dense_env(monkeypatch, isolated_moe_tables):
    monkeypatch.delenv("MOEFX_DENSE_BACKEND", raising=False)


def trace(fn, *args):
    """The decomposed, functional graph of `fn(*args)` (mm/addmm over permuted weights, reshapes around them)."""
    gm = make_fx(functionalize(fn, remove="mutations"), tracing_mode="fake", decomposition_table=select_decomp_table())(
        *args
    )
    view_to_reshape(gm)
    return gm


def run_pass(gm, pass_cls=FuseSiblingLinears, **cfg):
    run = run_passes(gm, pass_cls, config=cfg)
    return run.rewrites, run.skipped


def dense_weights(gm) -> list[int]:
    return [len(n.args[1]) for n in gm.graph.nodes if n.target is DENSE]


def attention_fn(bias: bool, dtype=torch.float32, quant: str | None = None):
    cfg = tiny_qwen3_moe_config(attention_bias=bias)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attn = Qwen3MoeAttention(cfg, 0).eval().to(dtype)
    if bias:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            torch.nn.init.normal_(getattr(attn, name).bias)
    if quant:
        attn = moefx.quantize(attn, quant)
    rope = Qwen3MoeRotaryEmbedding(cfg)
    x = torch.randn(2, 5, cfg.hidden_size, dtype=dtype)
    cos, sin = rope(x, torch.arange(5)[None].expand(2, 5))
    params = {k: v.detach() for k, v in attn.named_parameters()}

    def fn(p, x, cos, sin):
        return functional_call(attn, p, (x, (cos, sin), None))[0]

    return fn, (params, x, cos, sin)


@pytest.mark.parametrize("bias", [False, True])
def test_qwen3_attention_qkv_become_one_call(bias):
    fn, args = attention_fn(bias)
    gm = trace(fn, *args)
    ref = gm(*args)
    assert count_ops(gm.graph, aten.addmm.default if bias else aten.mm.default) == 4
    assert run_pass(gm) == (1, [])
    assert dense_weights(gm) == [3]  # q, k, v; o_proj reads the attention output, it has no sibling
    assert count_ops(gm.graph, *LINEARS) == 1
    assert torch.equal(gm(*args), ref)  # no CPU calibration row: upstream, the unfused linears bit for bit


def test_forced_gemv_matches_within_the_fp32_bound():
    fn, args = attention_fn(True)
    gm = trace(fn, *args)
    ref = gm(*args)
    run_pass(gm, dense_backend="gemv")
    assert [n.args[-1] for n in gm.graph.nodes if n.target is DENSE] == ["gemv"]
    out = gm(*args)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_dense_mlp_gate_up_become_one_call():
    cfg = tiny_qwen3_moe_config()
    torch.manual_seed(0)
    mlp = Qwen3MoeMLP(cfg).eval().to(torch.bfloat16)
    params = {k: v.detach() for k, v in mlp.named_parameters()}
    x = torch.randn(3, 4, cfg.hidden_size, dtype=torch.bfloat16)

    def fn(p, x):
        return functional_call(mlp, p, (x,))

    gm = trace(fn, params, x)
    ref = gm(params, x)
    assert run_pass(gm)[0] == 1 and dense_weights(gm) == [2] and count_ops(gm.graph, aten.mm.default) == 1
    assert torch.equal(gm(params, x), ref)


def test_fp8_attention_fuses_with_its_activation_quant_read_once():
    fn, args = attention_fn(False, quant="fp8_block128")
    gm = trace(fn, *args)
    ref = gm(*args)
    assert count_ops(gm.graph, ops.fp8_block_gemm.default) == 4 and count_ops(gm.graph, ops.quant.default) == 4
    assert run_pass(gm) == (1, [])
    (node,) = [n for n in gm.graph.nodes if n.target is DENSE]
    assert len(node.args[1]) == 3 and node.args[5] == [128, 128] and node.args[6] == torch.float32
    # q/k/v each quantized the same input with the same scheme: one quant feeds the call, the others are dead
    assert count_ops(gm.graph, ops.quant.default) == 2 and count_ops(gm.graph, ops.fp8_block_gemm.default) == 1
    assert torch.equal(gm(*args), ref)


def _graph_module(fn, args, dynamic_x=False):
    """Inductor's own post-grad graph of fn(*args) (dynamo + AOT), and the values of its placeholders."""
    from moefx.passes.quant_patterns import post_grad_graph

    if dynamic_x:
        torch._dynamo.mark_dynamic(args[0], 0)
    graph = post_grad_graph(fn, args)
    values, tensors = [], iter(args)
    for p in graph.find_nodes(op="placeholder"):  # a symbolic size gets its example value
        val = p.meta["val"]
        values.append(int(val.node.hint) if isinstance(val, torch.SymInt) else next(tensors))
    return torch.fx.GraphModule(graph.owning_module, graph), values


def test_fp8_siblings_after_fuse_norm_quant():
    """Norm -> quant -> q/k/v FP8 gemms (Fp8BlockLinear.forward): fuse_norm_quant folds the quant into the norm, then
    the three gemms reading its output become one call."""
    from moefx.ops.quant import PRESETS, quant_weight_fp8_block
    from moefx.passes.fuse_norm_quant import FuseNormQuant

    scheme = PRESETS["fp8_group128"].args()

    def fn(x, w, *qw):
        h = x.float()
        h = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        outs = []
        for i in range(0, len(qw), 2):
            q, s = ops.quant(h, *scheme)
            outs.append(ops.fp8_block_gemm(q, s, qw[i], qw[i + 1], 128, 128, None, x.dtype))
        return tuple(outs)

    torch.manual_seed(0)
    qw = [t for n in (256, 128, 128) for t in quant_weight_fp8_block(torch.randn(n, 256) * 0.05, 128, 128)]
    args = [torch.randn(4, 256, dtype=torch.bfloat16), torch.randn(256, dtype=torch.bfloat16), *qw]
    gm, values = _graph_module(fn, args)
    ref = gm(*values)
    assert run_pass(gm, FuseNormQuant, pass_config={"fuse_norm_quant": True})[0] == 1
    assert run_pass(gm)[0] == 1
    assert count_ops(gm.graph, ops.rms_norm_quant.default) == 1 and dense_weights(gm) == [3]
    assert all(torch.equal(a, b) for a, b in zip(gm(*values), ref))


def test_real_post_grad_graph_with_dynamic_rows():
    """Inductor's own post-grad graph (token rows symbolic): one reshape per linear, not merged, same fusion."""

    def fn(x, wq, wk, bk, wv):  # dynamo numbers the inputs in the order of first use
        return F.linear(x, wq), F.linear(x, wk, bk), F.linear(x, wv)

    args = [torch.randn(2, 3, 64), torch.randn(96, 64), torch.randn(32, 64), torch.randn(32), torch.randn(32, 64)]
    gm, values = _graph_module(fn, args, dynamic_x=True)
    ref = gm(*values)
    assert run_pass(gm) == (1, []) and dense_weights(gm) == [3]
    assert all(torch.equal(a, b) for a, b in zip(gm(*values), ref))


def test_own_form_calls_on_one_input_merge():
    x, w1, w2, w3 = torch.randn(4, 32), torch.randn(8, 32), torch.randn(16, 32), torch.randn(8, 32)

    def fn(x, w1, w2, w3):
        a = dense_linear(x, [w1])[0]
        b, c = dense_linear(x, [w2, w3], [None, None])
        return a + c, b

    gm = trace(fn, x, w1, w2, w3)
    ref = gm(x, w1, w2, w3)
    assert run_pass(gm)[0] == 1 and dense_weights(gm) == [3]
    assert all(torch.equal(a, b) for a, b in zip(gm(x, w1, w2, w3), ref))


def test_left_alone_linears_are_reported():
    def fn(x, w_t, w, u):
        return F.linear(x, w_t), F.linear(x, w), F.linear(x, u), x @ u.t().t().t()

    x, w = torch.randn(4, 32), torch.randn(16, 32)
    w_t = torch.randn(32, 16).t()  # strides (1, 16): not contiguous in K
    gm = trace(fn, x, w_t, w, torch.randn(8, 32))
    n, skipped = run_pass(gm)
    assert n == 1 and dense_weights(gm) == [2]
    assert any("not contiguous in K" in s for s in skipped), skipped


@pytest.mark.compile
def test_compiled_projections_with_both_passes():
    """A real inductor compile through moefx.backend (q/k/v, then o over q: no pointwise code to build): the
    list-returning op lowers and runs, the report counts the rewrites."""

    def fn(x, wq, wk, wv, wo):
        q, k, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
        return F.linear(q, wo), k, v

    args = [torch.randn(2, 3, 64), torch.randn(64, 64), torch.randn(32, 64), torch.randn(32, 64), torch.randn(64, 64)]
    cfg = {"pass_config": {"fuse_sibling_linears": True, "dense_linears": True}, "dense_backend": "gemv"}
    moefx.clear_compile_reports()
    refs = fn(*args)
    outs = torch.compile(fn, backend=moefx.backend(cfg))(*args)
    assert all(((o - r).norm() / r.norm()).item() < 1e-5 for o, r in zip(outs, refs))
    assert moefx.compile_reports()[-1].matches == {"fuse_sibling_linears": 1, "dense_linears": 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quant", [None, "fp8_block128"])
def test_gpu_attention_step_replays_from_cuda_graphs(quant):
    """bf16 attention (and its FP8 form) compiled with both passes and the gemv backend forced, under inductor's CUDA
    graphs (reduce-overhead): the calls are captured (capture-mode choice, no host sync) and replay correctly."""
    with torch.device("cuda"):
        fn, (params, x, cos, sin) = attention_fn(False, dtype=torch.bfloat16, quant=quant)
    cfg = {"pass_config": {"fuse_sibling_linears": True, "dense_linears": True}, "dense_backend": "gemv"}
    step = torch.compile(fn, backend=moefx.backend({**cfg, "mode": "capture"}))
    with torch.no_grad():
        for _ in range(3):  # warm-up, record, replay
            x = torch.randn_like(x)
            ref = fn(params, x, cos, sin)
            out = step(params, x, cos, sin)
            assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2
