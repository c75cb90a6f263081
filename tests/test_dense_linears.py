"""dense_linears at the FX level: the single linears left after fuse_sibling_linears (o_proj, down_proj, the MoE
router, their FP8 forms) become one-weight dense_linear calls; LM-head-sized N and static prefill M stay in cuBLAS,
with the reason reported; numerics equal the unfused graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_fuse_sibling_linears import DENSE, LINEARS, attention_fn, dense_weights, run_pass, trace

from moefx.models.tiny import tiny_qwen3_moe_config
from moefx.passes.dense_linears import MAX_N, MAX_STATIC_M, DenseLinears
from moefx.passes.fuse_sibling_linears import FuseSiblingLinears
from moefx.testing import count_ops


@pytest.fixture(autouse=True)
def _no_dense_env(monkeypatch, isolated_moe_tables):
    monkeypatch.delenv("MOEFX_DENSE_BACKEND", raising=False)


@pytest.mark.parametrize("quant", [None, "fp8_block128"])
def test_attention_after_sibling_fusion_has_no_plain_linear_left(quant):
    fn, args = attention_fn(True, quant=quant)
    gm = trace(fn, *args)
    ref = gm(*args)
    run_pass(gm, FuseSiblingLinears)
    assert run_pass(gm, DenseLinears) == (1, [])
    assert sorted(dense_weights(gm)) == [1, 3] and count_ops(gm.graph, *LINEARS) == 0
    assert torch.equal(gm(*args), ref)


def test_router_gate_goes_to_the_op_and_forced_gemv_stays_close():
    cfg = tiny_qwen3_moe_config()
    torch.manual_seed(0)
    w, x = torch.randn(cfg.num_experts, cfg.hidden_size), torch.randn(6, cfg.hidden_size)

    def fn(w, x):
        return F.linear(x, w).softmax(-1)  # the router's logits (Qwen3-MoE: F.linear over its [E, H] weight)

    gm = trace(fn, w, x)
    ref = gm(w, x)
    assert run_pass(gm, DenseLinears, dense_backend="gemv") == (1, [])
    assert [n.args[-1] for n in gm.graph.nodes if n.target is DENSE] == ["gemv"]
    assert ((gm(w, x) - ref).norm() / ref.norm()).item() < 1e-5


def test_lm_head_and_static_prefill_stay_in_cublas():
    def fn(h, head, w):
        return F.linear(h[:, -1], head), F.linear(h, w)

    h = torch.randn(1, MAX_STATIC_M + 1, 8)
    gm = trace(fn, h, torch.randn(MAX_N, 8), torch.randn(16, 8))
    n, skipped = run_pass(gm, DenseLinears)
    assert n == 0 and count_ops(gm.graph, *LINEARS) == 2
    assert any(f"N={MAX_N} >= {MAX_N}" in s for s in skipped) and any("static M=257" in s for s in skipped), skipped
    small = trace(fn, torch.randn(1, 4, 8), torch.randn(MAX_N, 8), torch.randn(16, 8))
    assert run_pass(small, DenseLinears)[0] == 1  # M=4: the small projection is taken, the head is not
