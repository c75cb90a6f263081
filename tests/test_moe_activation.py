"""Gate activations beyond SiLU: the Triton epilogues (interpreter) and every torch path against the legacy oracle,
the derivatives against autograd, transformers' activation modules mapped by type, and a warning-issuing fallback
that compiles with fullgraph=True."""

from __future__ import annotations

import warnings

import pytest
import torch
from backends_util import kernel_device, legacy_ref, make_inputs, relerr
from torch import nn

from moefx.backends import BACKENDS, available_backends, moe_experts
from moefx.backends.activation import ACTIVATIONS

pytestmark = pytest.mark.usefixtures("isolated_moe_tables")
NON_SILU = [a for a in sorted(ACTIVATIONS) if a != "silu"]


def test_derivatives_match_autograd():
    g = torch.linspace(-8, 8, 401, dtype=torch.float64, requires_grad=True)
    for act in ACTIVATIONS.values():
        (want,) = torch.autograd.grad(act.fn(g).sum(), g)
        assert torch.allclose(act.grad(g.detach()), want, atol=1e-12), act.name


@pytest.mark.parametrize("activation", NON_SILU)
def test_kernel_epilogues_match_legacy(activation):
    """fused_moe's GEMM 1 and gemv_moe's stage 1 with the activation's ACT id (fp32 inputs: the interpreter's dot)."""
    from moefx.backends.kernels.fused_moe_kernels import fused_moe
    from moefx.backends.kernels.gemv_kernels import gemv_moe

    dev = kernel_device()
    for m, kernel in ((3, gemv_moe), (20, fused_moe)):
        inp = make_inputs(m, torch.float32, device=dev)
        inp["hidden"] = inp["hidden"] * 2  # reach both tails of the activation
        ref = BACKENDS["legacy"](*(inp[k] for k in ("hidden", "topk_ids", "topk_weights", "w13", "w2")),
                                 activation=activation)
        out = kernel(inp["hidden"], inp["topk_ids"], inp["topk_weights"], inp["w13"], inp["w2"], activation=activation)
        assert relerr(out, ref) < (5e-3 if dev == "cuda" else 1e-5), kernel.__name__
        assert relerr(out, legacy_ref(inp)) > 1e-2  # not SiLU's result


@pytest.mark.parametrize("activation", NON_SILU)
def test_every_cpu_backend_takes_the_activation_or_says_why(activation):
    inp = make_inputs(11, torch.float32)
    args = [inp[k] for k in ("hidden", "topk_ids", "topk_weights", "w13", "w2")]
    ref = BACKENDS["legacy"](*args, activation=activation)
    for name in available_backends("cpu"):
        reason = BACKENDS[name].unsupported_reason(args[0], args[3], args[4], activation=activation)
        if name == "cpu":
            assert reason == f"cpu backend computes SiLU experts only, not {activation}"
            with pytest.warns(UserWarning, match="computes SiLU experts only"):
                assert relerr(moe_experts(*args, backend=name, activation=activation), ref) < 1e-6
            continue
        assert reason is None and relerr(moe_experts(*args, backend=name, activation=activation), ref) < 1e-5, name
    up = moe_experts(*args, backend="upstream", upstream="transformers", activation=activation)
    assert relerr(up, ref) < 1e-5
    with pytest.raises(ValueError, match="activation='relu' is invalid; valid choices"):
        moe_experts(*args, activation="relu")


def test_transformers_activation_modules_map_by_type():
    from transformers.activations import ACT2FN

    from moefx.integrations.transformers import activation_name

    want = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_python": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
            "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_accurate": "gelu_tanh", "relu": None,
            "relu2": None, "quick_gelu": None, "gelu_10": None}
    assert {k: activation_name(ACT2FN[k]) for k in want} == want
    assert activation_name(nn.GELU()) == "gelu" and activation_name(nn.GELU(approximate="tanh")) == "gelu_tanh"
    x = torch.randn(64, dtype=torch.float64) * 3
    for key, name in want.items():  # the mapped names compute what transformers' modules compute
        if name:
            assert torch.allclose(ACTIVATIONS[name].fn(x), ACT2FN[key](x), atol=1e-6), key


def test_fallback_warning_does_not_break_a_fullgraph_compile():
    """An experts module the op cannot take (biases) warns once, while dynamo traces it, and compiles in one graph."""
    from test_transformers_experts import TOPK, _layout_module

    module = _layout_module(transposed=False, bias=True)
    module.config._experts_implementation = "moefx"
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, module.gate_up_proj.shape[2], generator=g)
    w, ids = torch.softmax(torch.randn(5, module.num_experts, generator=g), -1).topk(TOPK, dim=-1)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(x, ids, w)
        compiled(x, ids, w)
    assert [str(c.message) for c in caught if "moefx" in str(c.message)] == [
        "moefx experts: Experts_t0_b1 uses expert biases; running transformers' grouped_mm experts"
    ]
    module.config._experts_implementation = "eager"
    assert relerr(out, module(x, ids, w)) < 1e-5
    torch._dynamo.reset()
