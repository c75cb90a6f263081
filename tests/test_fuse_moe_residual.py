"""fuse_moe_residual on a transformers Qwen3-MoE decoder layer's post-grad graph: the residual add after the MoE
block becomes one moefx::moe_experts_residual call, bit for bit the unfused layer on fresh inputs."""

from __future__ import annotations

import pytest
import torch

import moefx.integrations.transformers  # noqa: F401  (registers experts_implementation="moefx")
from moefx.models import build_model, tiny_qwen3_moe_config
from moefx.passes.fuse_moe_residual import MOE, MOE_RESIDUAL, FuseMoeResidual
from moefx.testing import PassRun, count_ops, functional_graph, run_passes

aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("isolated_moe_tables")


class _MoeHalf(torch.nn.Module):
    """A decoder layer's MoE half: post-attention norm, the sparse MoE block, the residual add (`twice`: the
    block's output is also returned, a second reader)."""

    def __init__(self, layer: torch.nn.Module, twice: bool = False) -> None:
        super().__init__()
        self.layer, self.twice = layer, twice

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out = self.layer.mlp(self.layer.post_attention_layernorm(hidden))
        out = out[0] if isinstance(out, tuple) else out
        return (hidden + out, out * 2) if self.twice else hidden + out


def _block(twice: bool = False) -> _MoeHalf:
    model = build_model(tiny_qwen3_moe_config(num_hidden_layers=1), seed=0).eval()
    model.set_experts_implementation("moefx")
    return _MoeHalf(model.model.layers[0], twice)


def _run_pass(gm: torch.fx.GraphModule) -> tuple[int, PassRun]:
    run = run_passes(gm, FuseMoeResidual)
    return run.rewrites, run


def test_the_layer_residual_add_goes_into_the_experts_call():
    block = _block()
    hidden = torch.randn(1, 3, block.layer.post_attention_layernorm.weight.shape[0])
    gm, state = functional_graph(block, hidden)
    adds_before = count_ops(gm.graph, aten.add.Tensor)
    assert count_ops(gm.graph, MOE) == 1 and count_ops(gm.graph, MOE_RESIDUAL) == 0
    n, run = _run_pass(gm)
    assert n == 1, run.skipped
    assert count_ops(gm.graph, MOE) == 0 and count_ops(gm.graph, MOE_RESIDUAL) == 1
    assert count_ops(gm.graph, aten.add.Tensor) == adds_before - 1
    with torch.no_grad():
        for seed in (1, 2):
            x = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(gm(state, x), block(x)), seed


def test_an_experts_output_read_twice_is_left_alone():
    """The op's output has another reader: the add stays, nothing is rewritten."""
    block = _block(twice=True)
    gm, _ = functional_graph(block, torch.randn(1, 3, block.layer.post_attention_layernorm.weight.shape[0]))
    n, _ = _run_pass(gm)
    assert n == 0 and count_ops(gm.graph, MOE) == 1


def test_the_plan_prefers_it_on_cuda_only():
    from moefx.models.catalog import catalog_config
    from moefx.signatures import ExecutionSignature, ModelSignature, resolve

    ms = ModelSignature.from_config(catalog_config("qwen3-30b-a3b"))
    assert resolve(ms, ExecutionSignature.preset("h200", dtype="bfloat16")).pass_enabled("fuse_moe_residual")
    assert not resolve(ms, ExecutionSignature(device_type="cpu", dtype="bfloat16")).pass_enabled("fuse_moe_residual")


def test_symbolic_sizes_stay_nodes():
    """Under dynamic shapes the reshapes take the residual's sizes as sym_size nodes, never a SymInt written into
    their arguments (inductor re-traces a nested region's body and fails on a symbol it does not bind): the graph
    runs at other row counts than the one it was traced at, bit for bit the unfused graph traced alike."""
    block = _block()
    h = block.layer.post_attention_layernorm.weight.shape[0]
    gm, state = functional_graph(block, torch.randn(2, 3, h), tracing_mode="symbolic")
    unfused = functional_graph(block, torch.randn(2, 3, h), tracing_mode="symbolic")[0]
    n, run = _run_pass(gm)
    assert n == 1, run.skipped
    flat = [v for node in gm.graph.nodes for v in _flatten(node.args)]
    assert not any(isinstance(v, torch.SymInt) for v in flat), [node.format_node() for node in gm.graph.nodes]
    with torch.no_grad():
        for shape in ((2, 3, h), (4, 5, h)):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0]))
            assert torch.equal(gm(state, x), unfused(state, x)), shape


def _flatten(args: object) -> list:
    if isinstance(args, (list, tuple)):
        return [v for a in args for v in _flatten(a)]
    return [args]
