"""fuse_rope_attention on a transformers Qwen3-MoE attention's decode-step graph after fuse_qk_norm_rope: the
q/k norm + RoPE + cache write call and the attention become one moefx::decode_attention_rope call, bit for bit the
graph before (output and caches) on fresh inputs; through inductor it writes the cache in place; off by default."""

from __future__ import annotations

import pytest
import torch

import moefx
from moefx.passes.fuse_qk_norm_rope import ATTENTION, AUTO_FUNCTIONALIZED, QK_NORM_ROPE_CACHE, FuseQkNormRope
from moefx.passes.fuse_rope_attention import ATTENTION_ROPE, FuseRopeAttention
from moefx.testing import count_ops, functional_graph, run_passes
from tests.test_fuse_qk_norm_rope import _half, _inputs, assert_same_on_fresh_inputs, compiled_like_eager


def _fused_calls(gm: torch.fx.GraphModule, op) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is AUTO_FUNCTIONALIZED and n.args[0] is op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_rope_call_and_the_attention_become_one_op(dtype, monkeypatch):
    half = _half(dtype, monkeypatch)
    gm, state = functional_graph(half, *_inputs(half, dtype, 0))
    before, _ = functional_graph(half, *_inputs(half, dtype, 0))
    assert run_passes(before, FuseQkNormRope).rewrites == 1
    assert run_passes(gm, FuseQkNormRope).rewrites == 1
    run = run_passes(gm, FuseRopeAttention)
    assert run.rewrites == 1, run.skipped
    assert _fused_calls(gm, ATTENTION_ROPE) == 1 and _fused_calls(gm, QK_NORM_ROPE_CACHE) == 0
    assert count_ops(gm.graph, ATTENTION) == 0
    assert run.notes and "decode_attention_rope" in run.notes[0]
    assert_same_on_fresh_inputs(gm, before, state, half, dtype)


def test_without_the_norm_rope_call_nothing_is_rewritten(monkeypatch):
    """The attention alone (fuse_qk_norm_rope did not run): no candidate, nothing changed."""
    half = _half(torch.float32, monkeypatch)
    gm, _ = functional_graph(half, *_inputs(half, torch.float32, 0))
    run = run_passes(gm, FuseRopeAttention)
    assert run.rewrites == 0 and count_ops(gm.graph, ATTENTION) == 1


def test_a_rotated_query_read_elsewhere_keeps_two_ops_with_a_reason(monkeypatch):
    half = _half(torch.float32, monkeypatch)
    gm, _ = functional_graph(half, *_inputs(half, torch.float32, 0))
    run_passes(gm, FuseQkNormRope)
    q_out = next(n for n in gm.graph.nodes if n.target is ATTENTION).args[0]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        extra = gm.graph.call_function(torch.ops.aten.clone.default, (q_out,))
    output.args = ((*output.args[0], extra),)
    run = run_passes(gm, FuseRopeAttention)
    assert run.rewrites == 0 and any("read by more than the attention" in s for s in run.skipped), run.skipped


@pytest.mark.compile
def test_inductor_writes_the_cache_in_place(monkeypatch):
    """Through inductor with both passes on: the compiled call equals eager (output and written cache) and runs the
    fused op, re-inplaced (a copy would leave the cache unwritten)."""
    passes = {"fuse_qk_norm_rope": True, "fuse_rope_attention": True}
    code, matches = compiled_like_eager(_half(torch.float32, monkeypatch), passes)
    assert matches.get("fuse_qk_norm_rope") == 1 and matches.get("fuse_rope_attention") == 1, matches
    assert "decode_attention_rope" in code and "qk_norm_rope_cache" not in code


def test_the_plan_leaves_it_off_until_timed():
    from moefx.models.catalog import catalog_config
    from moefx.signatures import ExecutionSignature, ModelSignature, resolve

    ms = ModelSignature.from_config(catalog_config("qwen3-30b-a3b"))
    plan = resolve(ms, ExecutionSignature.preset("h200", dtype="bfloat16"))
    assert plan.pass_enabled("fuse_qk_norm_rope") and not plan.pass_enabled("fuse_rope_attention")
    assert "not yet timed on a GPU" in plan.passes["fuse_rope_attention"].reason


@pytest.mark.gpu
@pytest.mark.compile
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_engine_with_it_on_gives_transformers_tokens_on_cuda():
    """fp32 on CUDA (head_dim 32, which both kernels take), the decode step compiled and replayed from CUDA graphs
    with the toggle on: the pass folds every layer's call and the greedy tokens are transformers' eager ones."""
    import copy

    from moefx.models import build_model, tiny_qwen3_moe_config

    stock = build_model(tiny_qwen3_moe_config(head_dim=32), seed=2, device="cuda")
    moefx.clear_compile_reports()
    cfg = {"max_batch_size": 4, "moe_backend": "gemv", "pass_config": {"fuse_rope_attention": True}}
    model = moefx.optimize(copy.deepcopy(stock), config=cfg)
    for batch in (1, 3):
        ids = torch.randint(1, 256, (batch, 7), generator=torch.Generator().manual_seed(batch)).cuda()
        want = stock.generate(ids, max_new_tokens=10, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), want), batch
    assert any(r.matches.get("fuse_rope_attention") for r in moefx.compile_reports())
