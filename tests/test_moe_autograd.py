"""Autograd of `moefx::moe_experts`: gradcheck on the reference, every forward backend's gradients against autograd
through a plain loop, the grouped_mm backward path, FP8 (activation gradients, frozen weights), and fullgraph
compiles whose backward graph holds one `moefx::moe_experts_backward` node."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moefx.backends import available_backends, moe_experts
from moefx.backends.backward import backward_grouped_mm, backward_reference
from moefx.backends.registry import MoeCall
from moefx.kernels.activation import ACTIVATIONS

pytestmark = pytest.mark.usefixtures("isolated_moe_tables")
E, H, I, TOPK = 6, 16, 8, 2


def _inputs(m: int, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu", unused: int = 0,
            shape: tuple[int, int, int] = (E, H, I)):
    """Fresh routing over the first E - `unused` experts (the others get no token) and scaled random weights."""
    e, h, i = shape
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, h, generator=g, dtype=torch.float64)
    probs = torch.softmax(torch.randn(m, e - unused, generator=g, dtype=torch.float64), -1)
    tw, ids = probs.topk(TOPK, dim=-1)
    w13 = torch.randn(e, 2 * i, h, generator=g, dtype=torch.float64) / h**0.5
    w2 = torch.randn(e, h, i, generator=g, dtype=torch.float64) / i**0.5
    return [t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in (hidden, ids, tw, w13, w2)]


def _loop_forward(hidden, ids, tw, w13, w2, activation="silu", limit=None):
    """The op's math as a plain differentiable loop over (token, slot) pairs (autograd gives its gradients)."""
    act = ACTIVATIONS[activation].fn
    rows = []
    for m in range(hidden.shape[0]):
        acc = 0
        for j in range(ids.shape[1]):
            e = int(ids[m, j])
            gate, up = (w13[e] @ hidden[m]).chunk(2)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            acc = acc + tw[m, j] * (w2[e] @ (act(gate) * up))
        rows.append(acc)
    return torch.stack(rows)


def _grads(fn, tensors):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    hidden, tw, w13, w2 = leaves
    out = fn(hidden, tw, w13, w2)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    (out * upstream.to(out.device, out.dtype)).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize(("activation", "limit"), [*((a, None) for a in sorted(ACTIVATIONS)), ("silu", 0.4)])
def test_gradcheck_fp64_reference(activation, limit):
    """Numerical vs analytical Jacobians of every differentiable input (tiny: one forward per input element); limit
    0.4 clamps part of the gate and up values (none lies within gradcheck's step of the bound)."""
    hidden, ids, tw, w13, w2 = _inputs(4, seed=1, dtype=torch.float64, unused=1, shape=(4, 4, 3))
    args = [t.requires_grad_() for t in (hidden, tw, w13, w2)]

    def fn(x, w, a, b):
        return moe_experts(x, ids, w, a, b, backend="reference", activation=activation, gate_limit=limit)

    if limit is not None:
        gu = torch.einsum("eoh,mh->meo", w13, hidden)[torch.arange(4)[:, None], ids]
        assert 0 < (gu.abs() > limit).float().mean() < 1  # the clamp is active somewhere, not everywhere
    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_every_cpu_forward_backend_has_the_loops_gradients(activation):
    """Whatever backend runs the forward (and transformers' grouped_mm as the plain path), the op's backward gives
    autograd-through-a-loop's gradients (fp32, relative 1e-5), for all four differentiable inputs."""
    hidden, ids, tw, w13, w2 = _inputs(7, seed=2, unused=2)
    ref_out, ref = _grads(lambda x, w, a, b: _loop_forward(x, ids, w, a, b, activation), (hidden, tw, w13, w2))
    calls = [dict(backend=b) for b in available_backends("cpu") if b != "cpu" or activation == "silu"]
    calls.append(dict(backend="upstream", upstream="transformers"))
    for kw in calls:
        out, grads = _grads(lambda x, w, a, b, kw=kw: moe_experts(x, ids, w, a, b, activation=activation, **kw),
                            (hidden, tw, w13, w2))
        assert _rel(out, ref_out) < 1e-5, kw
        for name, got, want in zip(("hidden", "topk_weights", "w13", "w2"), grads, ref):
            assert _rel(got, want) < 1e-5, (kw, name)
    # sanity: the weights' gradients are not trivially zero (experts E-2, E-1 get no token: theirs are)
    assert ref[2][: E - 2].abs().amax() > 1e-3 and ref[2][E - 2 :].abs().amax() == 0


def test_clamped_gate_gradients_match_the_loop():
    hidden, ids, tw, w13, w2 = _inputs(7, seed=12, unused=1)
    ref_out, ref = _grads(lambda x, w, a, b: _loop_forward(x, ids, w, a, b, "silu", 0.5), (hidden, tw, w13, w2))
    for backend in ("reference", "grouped", "gemv"):
        out, grads = _grads(lambda x, w, a, b, be=backend: moe_experts(x, ids, w, a, b, backend=be, gate_limit=0.5),
                            (hidden, tw, w13, w2))
        assert _rel(out, ref_out) < 1e-5
        assert all(_rel(g, r) < 1e-5 for g, r in zip(grads, ref)), backend


def test_only_requested_gradients_are_computed():
    """Frozen expert weights (LoRA on attention, router training): no weight gradient, the others still right."""
    hidden, ids, tw, w13, w2 = _inputs(6, seed=3)
    x = hidden.clone().requires_grad_()
    w = tw.clone().requires_grad_()
    moe_experts(x, ids, w, w13, w2, backend="grouped").pow(2).sum().backward()
    x_ref = hidden.clone().requires_grad_()
    w_ref = tw.clone().requires_grad_()
    _loop_forward(x_ref, ids, w_ref, w13, w2).pow(2).sum().backward()
    assert w13.grad is None and w2.grad is None
    assert _rel(x.grad, x_ref.grad) < 1e-5 and _rel(w.grad, w_ref.grad) < 1e-5


@pytest.mark.parametrize(("dtype", "limit"), [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 0.5)])
def test_grouped_mm_backward_path_equals_the_reference(dtype, limit):
    """The CUDA path's algorithm (sort by expert, five torch._grouped_mm calls) run on the CPU's grouped_mm."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    hidden, ids, tw, w13, w2 = _inputs(9, seed=4, dtype=dtype, unused=2)
    grad = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    call = MoeCall(hidden, ids, tw, w13, w2, activation="gelu", gate_limit=limit)
    want = backward_reference(grad, call, [True] * 4)
    got = backward_grouped_mm(grad, call, [True] * 4)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert _rel(a, b) < (1e-5 if dtype == torch.float32 else 2e-2)
    assert got[2][E - 2 :].abs().amax() == 0 and got[3][E - 2 :].abs().amax() == 0  # experts without tokens


def test_fp8_weights_give_activation_gradients_and_stay_frozen():
    from backends_util import quant_block

    from moefx.backends.registry import dequant_block

    hidden, ids, tw, w13, w2 = _inputs(6, seed=6, unused=1)
    bs = (8, 8)
    (q13, s13), (q2, s2) = quant_block(w13, bs), quant_block(w2, bs)
    d13, d2 = dequant_block(q13, s13, bs), dequant_block(q2, s2, bs)
    out, grads = _grads(
        lambda x, w, a, b: moe_experts(x, ids, w, q13, q2, w13_scale=s13, w2_scale=s2, block_shape=bs),
        (hidden, tw, torch.zeros(1), torch.zeros(1)),
    )
    ref_out, ref = _grads(lambda x, w, a, b: _loop_forward(x, ids, w, d13, d2), (hidden, tw, w13, w2))
    assert _rel(out, ref_out) < 1e-5
    assert _rel(grads[0], ref[0]) < 1e-5 and _rel(grads[1], ref[1]) < 1e-5
    q13.requires_grad_()
    with pytest.raises(RuntimeError, match="FP8 block-quantized expert weights are frozen"):
        moe_experts(hidden, ids, tw, q13, q2, w13_scale=s13, w2_scale=s2, block_shape=bs).sum().backward()


def _capture_backend(graphs: dict):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs.setdefault(kind, []).append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))


def test_fullgraph_compile_traces_forward_and_backward_as_one_node_each():
    hidden, ids, tw, w13, w2 = _inputs(8, seed=7)
    params = [t.clone().requires_grad_() for t in (w13, w2)]

    def fn(x, w):
        return F.relu(moe_experts(x, ids, w, *params, backend="grouped", activation="gelu_tanh")).sum()

    graphs: dict = {}
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=_capture_backend(graphs), fullgraph=True)
    x, w = hidden.clone().requires_grad_(), tw.clone().requires_grad_()
    compiled(x, w).backward()
    x_ref, w_ref = hidden.clone().requires_grad_(), tw.clone().requires_grad_()
    ref_params = [t.clone().requires_grad_() for t in (w13, w2)]
    F.relu(_loop_forward(x_ref, ids, w_ref, *ref_params, "gelu_tanh")).sum().backward()
    for got, want in zip((x.grad, w.grad, *(p.grad for p in params)), (x_ref.grad, w_ref.grad,
                                                                       *(p.grad for p in ref_params))):
        assert _rel(got, want) < 1e-5
    ops = {kind: [n.target for g in gs for n in g.graph.nodes if n.op == "call_function"]
           for kind, gs in graphs.items()}
    assert ops["forward"].count(torch.ops.moefx.moe_experts.default) == 1
    assert ops["backward"].count(torch.ops.moefx.moe_experts_backward.default) == 1
    torch._dynamo.reset()


def test_backward_schema_and_fake():
    hidden, ids, tw, w13, w2 = _inputs(4, seed=8)
    for needs in ([True] * 4, [True, False, False, True]):
        args = (torch.randn_like(hidden), hidden, ids, tw, w13, w2, None, None, None, "silu", needs)
        torch.library.opcheck(torch.ops.moefx.moe_experts_backward.default, args,
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_cuda_backward_through_the_kernels_matches_the_reference(activation):
    """On the GPU: the forward through the gemv and grouped kernels, the backward through torch._grouped_mm (bf16),
    against the fp32 reference on the CPU; experts without tokens get zero weight gradients."""
    from moefx.backends.backward import backward_path

    for m, backend in ((4, "gemv"), (300, "grouped")):
        hidden, ids, tw, w13, w2 = _inputs(m, seed=10 + m, dtype=torch.bfloat16, device="cuda", unused=3,
                                           shape=(16, 256, 128))
        assert backward_path(hidden, w2) == "grouped_mm"
        out, grads = _grads(lambda x, w, a, b, be=backend, ids=ids: moe_experts(x, ids, w, a, b, backend=be,
                                                                               activation=activation),
                            (hidden, tw, w13, w2))
        cpu = [t.cpu().float() for t in (hidden, tw, w13, w2)]
        ref_out, ref = _grads(lambda x, w, a, b, ids=ids.cpu(): moe_experts(x, ids, w, a, b, backend="reference",
                                                                           activation=activation), cpu)
        assert _rel(out.cpu(), ref_out) < 2e-2
        for name, got, want in zip(("hidden", "topk_weights", "w13", "w2"), grads, ref):
            assert got.dtype == torch.bfloat16 and _rel(got.cpu(), want) < 3e-2, (m, name)
        assert grads[2][-3:].abs().amax() == 0 and grads[3][-3:].abs().amax() == 0, m
