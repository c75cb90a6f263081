"""fuse_norm_linear on a transformers Qwen3-MoE decoder layer's attention entry (input norm, then q/k/v through one
moefx::dense_linear call) in its post-grad graph: the norm goes into one moefx::rms_norm_dense_linear call, bit for
bit the unfused graph on fresh inputs (the CPU runs the reference path), in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from moefx.backends.dense import dense_linear
from moefx.models import build_model, tiny_qwen3_moe_config
from moefx.passes.fuse_norm_linear import ADD_NORM_DENSE, NORM_DENSE, FuseNormLinear
from moefx.passes.linear_forms import DENSE
from moefx.testing import PassRun, count_ops, functional_graph, run_passes

aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("isolated_moe_tables")


class _AttentionEntry(torch.nn.Module):
    """A decoder layer's input norm and its q/k/v projections in one dense_linear call (what fuse_sibling_linears
    leaves); `flat`: the call reads the normed tensor flattened to rows, as after fuse_sibling_linears; `twice`: the
    normed tensor is also returned, a second reader."""

    def __init__(self, layer: torch.nn.Module, flat: bool = False, twice: bool = False,
                 backend: str = "gemv") -> None:
        super().__init__()
        self.layer, self.flat, self.twice, self.backend = layer, flat, twice, backend

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        attn = self.layer.self_attn
        normed = self.layer.input_layernorm(hidden)
        rows = normed.reshape(-1, normed.shape[-1]) if self.flat else normed
        qkv = dense_linear(rows, [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], backend=self.backend)
        return (*qkv, normed) if self.twice else tuple(qkv)


def _block(dtype: torch.dtype, flat: bool = False, twice: bool = False, backend: str = "gemv") -> _AttentionEntry:
    """backend "gemv": the call the policy gives the gemv kernel at decode M (the CPU has no calibration rows, so
    "auto" runs upstream here)."""
    model = build_model(tiny_qwen3_moe_config(num_hidden_layers=1), seed=0).eval().to(dtype)
    return _AttentionEntry(model.model.layers[0], flat, twice, backend)


def _hidden(block: _AttentionEntry, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(1, 3, block.layer.input_layernorm.weight.shape[0], dtype=dtype)


def _run_pass(gm: torch.fx.GraphModule) -> tuple[int, PassRun]:
    run = run_passes(gm, FuseNormLinear)
    return run.rewrites, run


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_input_norm_goes_into_the_qkv_call(dtype, flat):
    block = _block(dtype, flat)
    hidden = torch.randn(1, 3, block.layer.input_layernorm.weight.shape[0], dtype=dtype)
    gm, state = functional_graph(block, hidden)
    unfused = functional_graph(block, hidden)[0]
    rsqrts = count_ops(gm.graph, aten.rsqrt.default)
    assert count_ops(gm.graph, DENSE) == 1 and count_ops(gm.graph, NORM_DENSE) == 0
    n, run = _run_pass(gm)
    assert n == 1 and len(run.notes) == 1, run.skipped
    assert count_ops(gm.graph, DENSE) == 0 and count_ops(gm.graph, NORM_DENSE) == 1
    assert count_ops(gm.graph, aten.rsqrt.default) == rsqrts - 1
    with torch.no_grad():
        for seed in (1, 2):
            x = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
            outs, refs = gm(state, x), unfused(state, x)
            assert len(outs) == len(refs) == 3
            assert all(o.dtype == dtype and torch.equal(o, r) for o, r in zip(outs, refs)), seed


class _MoeEntry(torch.nn.Module):
    """A decoder layer's post-attention residual add and norm, then the router as one dense_linear call over the
    rows; the experts' stand-in reads the normed rows, the layer's last residual add reads the sum."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, residual: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = residual + attn
        normed = self.layer.post_attention_layernorm(hidden)
        rows = normed.reshape(-1, normed.shape[-1])
        (logits,) = dense_linear(rows, [self.layer.mlp.gate.weight], backend="gemv")
        experts = rows * 2
        return logits, hidden + experts.reshape(hidden.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_post_attention_add_and_norm_go_into_the_router_call(dtype):
    """The sum and the normed rows become the fused call's outputs for their other readers: bit for bit the unfused
    graph on fresh inputs (the CPU runs the torch ops)."""
    block = _MoeEntry(_block(dtype).layer)
    shape = (1, 3, block.layer.post_attention_layernorm.weight.shape[0])
    gm, state = functional_graph(block, torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype))
    unfused = functional_graph(block, torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype))[0]
    rsqrts, adds = count_ops(gm.graph, aten.rsqrt.default), count_ops(gm.graph, aten.add.Tensor)
    n, run = _run_pass(gm)
    assert n == 1 and "moefx::add_rms_norm_dense_linear" in run.notes[0], run.skipped
    assert count_ops(gm.graph, DENSE) == 0 and count_ops(gm.graph, ADD_NORM_DENSE) == 1
    assert count_ops(gm.graph, aten.rsqrt.default) == rsqrts - 1
    assert count_ops(gm.graph, aten.add.Tensor) < adds  # the residual add is the op's now
    gm.graph.lint()
    with torch.no_grad():
        for seed in (1, 2):
            g = torch.Generator().manual_seed(seed)
            r, a = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
            outs, refs = gm(state, r, a), unfused(state, r, a)
            assert len(outs) == len(refs) == 2
            assert all(o.dtype == dtype and torch.equal(o, ref) for o, ref in zip(outs, refs)), seed


def test_a_norm_with_another_reader_is_left_alone():
    """The normed tensor is also an output: the norm stays a kernel of its own, nothing is rewritten."""
    block = _block(torch.bfloat16, flat=True, twice=True)
    gm, _ = functional_graph(block, _hidden(block, torch.bfloat16))
    n, run = _run_pass(gm)
    assert n == 0 and count_ops(gm.graph, DENSE) == 1 and count_ops(gm.graph, NORM_DENSE) == 0
    assert any("readers, not only this call" in s for s in run.skipped), run.skipped


def test_a_call_the_policy_runs_upstream_keeps_its_norm():
    """Off the gemv kernel the fused op would run the norm as separate torch ops (a prefill's M, no calibration
    row): the norm stays inductor's one kernel and the report says why."""
    block = _block(torch.bfloat16, backend="auto")
    gm, _ = functional_graph(block, _hidden(block, torch.bfloat16))
    n, run = _run_pass(gm)
    assert n == 0 and count_ops(gm.graph, NORM_DENSE) == 0
    assert any("M=3 upstream" in s for s in run.skipped), run.skipped


def test_the_plan_prefers_it_where_it_prefers_dense_linears():
    from moefx.models.catalog import catalog_config
    from moefx.signatures import ExecutionSignature, ModelSignature, resolve

    ms = ModelSignature.from_config(catalog_config("qwen3-30b-a3b"))
    for es in (ExecutionSignature.preset("h200", dtype="bfloat16"),
               ExecutionSignature(device_type="cpu", dtype="bfloat16")):
        plan = resolve(ms, es)
        assert plan.pass_enabled("fuse_norm_linear") == plan.pass_enabled("dense_linears")
    assert resolve(ms, ExecutionSignature.preset("h200", dtype="bfloat16")).pass_enabled("fuse_norm_linear")


def test_without_triton_the_norm_stays_and_the_report_says_why(monkeypatch):
    """No Triton (PyTorch's CPU wheels): the pass, whose fused call runs a Triton kernel, leaves the norm alone
    with "triton is not installed", and the process says once what is off."""
    import moefx.log
    from moefx.kernels import availability as triton_support

    said: list[str] = []

    class Progress:  # the progress logger's lines, counted where they are written
        def info(self, message: str, *args: object) -> None:
            said.append(message % args)

    monkeypatch.setattr(moefx.log, "progress_logger", lambda: Progress())
    monkeypatch.setattr(triton_support, "triton_available", lambda: False)
    triton_support._say_once.cache_clear()
    block = _block(torch.bfloat16)
    for _ in range(2):
        gm, _ = functional_graph(block, _hidden(block, torch.bfloat16))
        n, ctx = _run_pass(gm)
        assert n == 0 and count_ops(gm.graph, NORM_DENSE) == 0
        assert any(s.endswith(f": {triton_support.TRITON_MISSING}") for s in ctx.skipped), ctx.skipped
    said = [line for line in said if triton_support.TRITON_MISSING in line]
    assert len(said) == 1 and "every other path runs" in said[0]
    triton_support._say_once.cache_clear()
