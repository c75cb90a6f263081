"""`moefx::moe_experts`: dispatch targets vs the reference oracle, FP8 plumbing, schema/fake, one node under compile."""

from __future__ import annotations

import pytest
import torch

from moefx.backends import BACKENDS, available_backends, moe_experts
from moefx.backends.registry import dequant_block

E, H, I, TOPK = 8, 64, 32, 2


pytestmark = pytest.mark.usefixtures("isolated_moe_tables")


def _inputs(m: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, H, generator=g).to(dtype)
    logits = torch.randn(m, E, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(TOPK, dim=-1)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    return hidden, ids, weights.to(dtype), w13, w2


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def test_available_backends_lists_reference_and_only_registered_names():
    names = available_backends("cpu")
    assert "reference" in names and set(names) <= set(BACKENDS)


@pytest.mark.parametrize("m", [1, 5, 33])
def test_auto_without_row_is_the_oracle(m):
    hidden, ids, w, w13, w2 = _inputs(m, seed=100 + m)
    ref = BACKENDS["reference"](hidden, ids, w, w13, w2)
    assert torch.equal(moe_experts(hidden, ids, w, w13, w2), ref)


@pytest.mark.parametrize("m", [1, 7, 40])
def test_every_cpu_backend_and_transformers_upstream_match_reference(m):
    hidden, ids, w, w13, w2 = _inputs(m, seed=200 + m)
    ref = BACKENDS["reference"](hidden, ids, w, w13, w2)
    for name in available_backends("cpu"):
        assert _rel(moe_experts(hidden, ids, w, w13, w2, backend=name), ref) < 1e-5, name
    up = moe_experts(hidden, ids, w, w13, w2, backend="upstream", upstream="transformers")
    assert _rel(up, ref) < 1e-5


def test_bf16_through_op_stays_bf16():
    hidden, ids, w, w13, w2 = _inputs(9, seed=3, dtype=torch.bfloat16)
    out = moe_experts(hidden, ids, w, w13, w2, upstream="transformers")
    ref = BACKENDS["reference"](hidden.float(), ids, w.float(), w13.float(), w2.float())
    assert out.dtype == torch.bfloat16 and _rel(out, ref) < 2e-2


def test_fp8_block_weights_reach_the_backend():
    hidden, ids, w, w13, w2 = _inputs(6, seed=4)
    bs = (16, 16)

    def quant(wt):
        e, n, k = wt.shape
        blocks = wt.reshape(e, n // bs[0], bs[0], k // bs[1], bs[1])
        scale = blocks.abs().amax(dim=(2, 4)) / 448.0
        q = (blocks / scale[:, :, None, :, None]).reshape(e, n, k).to(torch.float8_e4m3fn)
        return q, scale

    q13, s13 = quant(w13)
    q2, s2 = quant(w2)
    out = moe_experts(hidden, ids, w, q13, q2, w13_scale=s13, w2_scale=s2, block_shape=bs)
    ref = BACKENDS["reference"](hidden, ids, w, dequant_block(q13, s13, bs), dequant_block(q2, s2, bs))
    assert _rel(out, ref) < 1e-5
    assert _rel(out, BACKENDS["reference"](hidden, ids, w, w13, w2)) < 0.1  # fp8 rounding of the weights
    with pytest.raises(ValueError, match="together"):
        moe_experts(hidden, ids, w, q13, q2, w13_scale=s13, block_shape=bs)


def test_empty_call_and_bad_arguments():
    hidden, ids, w, w13, w2 = _inputs(0, seed=5)
    assert moe_experts(hidden, ids, w, w13, w2).shape == (0, H)
    hidden, ids, w, w13, w2 = _inputs(2, seed=5)
    with pytest.raises(ValueError, match="backend='fastest' is invalid; valid choices"):
        moe_experts(hidden, ids, w, w13, w2, backend="fastest")
    with pytest.raises(ValueError, match="upstream='hf' is invalid"):
        moe_experts(hidden, ids, w, w13, w2, upstream="hf")
    with pytest.raises(ValueError, match="mode 'graph'"):
        moe_experts(hidden, ids, w, w13, w2, backend="graph=reference@1-")
    with pytest.raises(ValueError, match="shapes"):
        moe_experts(hidden[0], ids, w, w13, w2)


def test_opcheck_schema_and_fake():
    hidden, ids, w, w13, w2 = _inputs(4, seed=6)
    args = (hidden, ids, w, w13, w2, None, None, None, "reference", "reference")
    torch.library.opcheck(torch.ops.moefx.moe_experts.default, args, test_utils=("test_schema", "test_faketensor"))


def test_compiled_graph_keeps_one_node_for_every_m():
    """Dispatch happens inside the op: a dynamic-M graph has one moefx::moe_experts node and no recompile."""
    graphs = []

    def count_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(hidden, ids, w, w13, w2):
        return moe_experts(hidden, ids, w, w13, w2, backend="eager=reference@1-4,upstream@5-;capture=upstream@1-")

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=count_backend, dynamic=True, fullgraph=True)
    for m in (3, 9, 17):
        args = _inputs(m, seed=300 + m)
        assert _rel(compiled(*args), BACKENDS["reference"](*args)) < 1e-5
    assert len(graphs) == 1
    op = torch.ops.moefx.moe_experts
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum(t in (op, op.default) for t in targets) == 1
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_capture_uses_capture_policy_and_replays_correctly():
    spec = "eager=reference@1-;capture=grouped@1-"
    args = [t.cuda() for t in _inputs(6, seed=400, dtype=torch.bfloat16)]
    moe_experts(*args, backend=spec)  # warm-up (Triton JIT) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(*args, backend=spec)
    for seed in (401, 402):
        for dst, src in zip(args, _inputs(6, seed=seed, dtype=torch.bfloat16)):
            dst.copy_(src)
        graph.replay()
        ref = BACKENDS["reference"](*[a.float() if a.is_floating_point() else a for a in args])
        assert _rel(out, ref) < 3e-2
    with pytest.raises(RuntimeError, match="cannot run inside CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            moe_experts(*args, backend="reference")
