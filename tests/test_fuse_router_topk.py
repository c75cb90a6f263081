"""fuse_router_topk on a Qwen3-MoE decoder layer's MoE entry as the earlier passes leave it (post-attention add +
norm + router in one moefx::add_rms_norm_dense_linear call, then moefx::fused_topk): one moefx::add_rms_norm_route
call, bit for bit the unfused graph on fresh inputs (the CPU runs the two ops in turn), in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from moefx.backends.dense import dense_linear
from moefx.models import build_model, tiny_qwen3_moe_config
from moefx.ops.quant import PRESETS
from moefx.passes.fuse_moe_routing import FUSED_TOPK
from moefx.passes.fuse_norm_linear import ADD_NORM_DENSE, FuseNormLinear
from moefx.passes.fuse_router_topk import ROUTE, FuseRouterTopk
from moefx.quant_linear import Fp8BlockLinear
from moefx.testing import count_ops, functional_graph, run_passes

pytestmark = pytest.mark.usefixtures("isolated_moe_tables")


class _MoeEntry(torch.nn.Module):
    """The post-attention add and norm, the router as a dense_linear call over the rows and fused_topk as
    fuse_moe_routing writes it; the experts' stand-in reads the normed rows, the last residual add the sum."""

    def __init__(self, layer: torch.nn.Module, experts: int | None = None) -> None:
        super().__init__()
        self.layer = layer
        weight = layer.mlp.gate.weight
        self.gate = weight if experts is None else torch.nn.Parameter(torch.randn(experts, weight.shape[1]).to(
            weight.dtype), requires_grad=False)

    def forward(self, residual: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = residual + attn
        normed = self.layer.post_attention_layernorm(hidden)
        rows = normed.reshape(-1, normed.shape[-1])
        (logits,) = dense_linear(rows, [self.gate], backend="gemv")
        weights, ids = torch.ops.moefx.fused_topk(logits, 2, "softmax", True, None, 1, 1, 1.0, rows.dtype)
        return weights, ids, hidden + (rows * 2).reshape(hidden.shape)


def _graph(dtype: torch.dtype, experts: int | None = None):
    model = build_model(tiny_qwen3_moe_config(num_hidden_layers=1), seed=0).eval().to(dtype)
    block = _MoeEntry(model.model.layers[0], experts)
    shape = (1, 3, block.layer.post_attention_layernorm.weight.shape[0])
    gm, state = functional_graph(block, torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype))
    unfused = functional_graph(block, torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype))[0]
    run = run_passes(gm, FuseNormLinear)
    assert run.rewrites == 1, run.skipped
    return gm, state, unfused, shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_routing_goes_into_the_router_call(dtype):
    gm, state, unfused, shape = _graph(dtype)
    assert count_ops(gm.graph, ADD_NORM_DENSE) == 1 and count_ops(gm.graph, FUSED_TOPK) == 1
    run = run_passes(gm, FuseRouterTopk)
    assert run.rewrites == 1 and "moefx::add_rms_norm_route" in run.notes[-1], run.skipped
    assert count_ops(gm.graph, ROUTE) == 1
    assert count_ops(gm.graph, ADD_NORM_DENSE) == 0 and count_ops(gm.graph, FUSED_TOPK) == 0
    with torch.no_grad():
        for seed in (1, 2):
            g = torch.Generator().manual_seed(seed)
            r, a = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
            outs, refs = gm(state, r, a), unfused(state, r, a)
            assert len(outs) == len(refs) == 3
            assert all(o.dtype == ref.dtype and torch.equal(o, ref) for o, ref in zip(outs, refs)), seed


def test_a_router_the_epilogue_does_not_take_keeps_its_routing_kernel():
    """More experts than one program holds: two calls, and the report says why."""
    gm, _, _, _ = _graph(torch.float32, experts=2048)
    run = run_passes(gm, FuseRouterTopk)
    assert run.rewrites == 0
    assert count_ops(gm.graph, FUSED_TOPK) == 1 and count_ops(gm.graph, ROUTE) == 0
    assert any("does not take this router" in s for s in run.skipped), run.skipped


class _Fp8OProj(_MoeEntry):
    """The same entry behind an FP8 o_proj as moefx.quantize writes it (Fp8BlockLinear: activation quant + FP8
    GEMM), which fp8_weight_only turns into a weight-only dense_linear call at decode M."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__(layer)
        h = layer.post_attention_layernorm.weight.shape[0]
        linear = torch.nn.Linear(h, h, bias=False, dtype=layer.post_attention_layernorm.weight.dtype)
        self.o_proj = Fp8BlockLinear.from_linear(linear, (128, 128), PRESETS["fp8_group128"])

    def forward(self, residual: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return super().forward(residual, self.o_proj(attn))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_after_an_fp8_weight_only_o_proj_the_add_norm_and_routing_go_into_the_router(dtype):
    """The add reads the weight-only call's output: that output must carry its fake value for the add to be seen as
    the residual sum (without it the norm was taken for a plain one with two readers, and an FP8 decode step ran
    the add + norm and the top-k as two kernels of their own, docs/FINDINGS.md)."""
    torch.manual_seed(0)
    model = build_model(tiny_qwen3_moe_config(num_hidden_layers=1, hidden_size=128), seed=0).eval().to(dtype)
    block = _Fp8OProj(model.model.layers[0])
    shape = (1, 1, 128)
    graphs = [functional_graph(block, torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype))
              for _ in range(2)]
    (gm, state), (ref, _) = graphs
    config = {"dense_backend": "gemv"}
    run = run_passes(gm, "fp8_weight_only", "fuse_norm_linear", "fuse_router_topk", config=config)
    assert run.matches == {"fp8_weight_only": 1, "fuse_norm_linear": 1, "fuse_router_topk": 1}, run.skipped
    assert count_ops(gm.graph, ROUTE) == 1 and count_ops(gm.graph, FUSED_TOPK) == 0
    assert count_ops(gm.graph, torch.ops.aten.rsqrt.default) == 0  # the norm runs in the router's prologue
    assert run_passes(ref, "fp8_weight_only", config=config).matches["fp8_weight_only"] == 1
    with torch.no_grad():
        for seed in (1, 2):
            g = torch.Generator().manual_seed(seed)
            r, a = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
            outs, refs = gm(state, r, a), ref(state, r, a)
            assert all(o.dtype == ref.dtype and torch.equal(o, ref) for o, ref in zip(outs, refs)), seed
