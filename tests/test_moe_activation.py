"""Gate activations beyond SiLU: the Triton epilogues (interpreter) and every torch path against the reference oracle,
the derivatives against autograd, transformers' activation modules mapped by type, and a warning-issuing fallback
that compiles with fullgraph=True."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from backends_util import kernel_device, make_inputs, moe_call, reference_ref, relerr, unsupported
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.integrations.moe import use_experts_implementation

from moefx.backends import BACKENDS, available_backends, moe_experts
from moefx.kernels.activation import ACTIVATIONS

pytestmark = pytest.mark.usefixtures("isolated_moe_tables")
NON_SILU = [a for a in sorted(ACTIVATIONS) if a != "silu"]


def test_derivatives_match_autograd():
    g = torch.linspace(-8, 8, 401, dtype=torch.float64, requires_grad=True)
    for act in ACTIVATIONS.values():
        (want,) = torch.autograd.grad(act.fn(g).sum(), g)
        assert torch.allclose(act.grad(g.detach()), want, atol=1e-12), act.name


@pytest.mark.parametrize(("activation", "limit"), [("gelu", None), ("gelu_tanh", None), ("silu", 1.0)])
def test_kernel_epilogues_match_reference(activation, limit):
    """fused_moe's GEMM 1 and gemv_moe's stage 1 with the activation's ACT id and the clamp (fp32 inputs: the
    interpreter's dot); limit 1.0 clamps about half the gate and up values of these inputs."""
    from moefx.kernels.moe_gemv import gemv_moe
    from moefx.kernels.moe_grouped import fused_moe

    dev = kernel_device()
    for m, kernel in ((3, gemv_moe), (20, fused_moe)):
        inp = make_inputs(m, torch.float32, device=dev)
        inp["hidden"] = inp["hidden"] * 2  # reach both tails of the activation
        ref = BACKENDS["reference"].apply(moe_call(inp, activation=activation, gate_limit=limit))
        out = kernel(moe_call(inp, activation=activation, gate_limit=limit))
        assert relerr(out, ref) < (5e-3 if dev == "cuda" else 1e-5), kernel.__name__
        assert relerr(out, reference_ref(inp)) > 1e-2  # not unclamped SiLU's result


@pytest.mark.parametrize(("activation", "limit"), [("gelu", None), ("gelu_tanh", None), ("silu", 1.0)])
def test_every_cpu_backend_takes_the_gate_or_says_why(activation, limit):
    inp = make_inputs(11, torch.float32)
    args = [inp[k] for k in ("hidden", "topk_ids", "topk_weights", "w13", "w2")]
    gate = dict(activation=activation, gate_limit=limit)
    ref = BACKENDS["reference"](*args, **gate)
    for name in available_backends("cpu"):
        reason = unsupported(BACKENDS[name], args[0], args[3], args[4], **gate)
        if name == "cpu":
            assert reason == f"cpu backend computes unclamped SiLU experts only, not {activation} (limit {limit})"
            with pytest.warns(UserWarning, match="computes unclamped SiLU experts only"):
                assert relerr(moe_experts(*args, backend=name, **gate), ref) < 1e-6
            continue
        assert reason is None and relerr(moe_experts(*args, backend=name, **gate), ref) < 1e-5, name
    up = moe_experts(*args, backend="upstream", upstream="transformers", **gate)
    assert relerr(up, ref) < 1e-5
    with pytest.raises(ValueError, match="activation='relu' is invalid; valid choices"):
        moe_experts(*args, activation="relu")
    with pytest.raises(ValueError, match="gate_limit=0.0 is invalid"):
        moe_experts(*args, gate_limit=0.0)


def test_transformers_activation_modules_map_by_type():
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


def test_custom_gates_run_the_op_when_they_compute_a_clamped_swiglu():
    """A custom `_apply_gate` is recognised by running it against the op's formula: a clamped SwiGLU (DeepSeek-V4's
    form, or one with no act_fn) runs the op with its limit; one the op cannot compute (an alpha gate) falls back."""
    from test_transformers_experts import _Layout

    from moefx.integrations.transformers import gate_of, unsupported_reason

    def clamped(self, gu):
        gate, up = gu.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)

    def clamped_silu(self, gu):
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=self.swiglu_limit)) * up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)

    def alpha(self, gu):
        gate, up = gu.chunk(2, dim=-1)
        return (up + 1) * gate * torch.sigmoid(self.alpha * gate)

    want = {clamped: ("gelu", 2.5), clamped_silu: ("silu", 2.5), alpha: None}
    for fn, expected in want.items():
        cls = use_experts_implementation(type(f"E_{fn.__name__}", (_Layout,), {"_apply_gate": fn}))
        torch.manual_seed(4)
        module = cls(PretrainedConfig(), transposed=False, bias=False)
        module.act_fn = ACT2FN["gelu"]
        module.limit = module.swiglu_limit = 2.5
        module.alpha = 1.7
        assert gate_of(module) == expected, fn.__name__
        if expected is None:
            assert unsupported_reason(module) == f"a custom gate (E_{fn.__name__}._apply_gate)"
            continue
        g = torch.Generator().manual_seed(8)
        x = torch.randn(7, module.gate_up_proj.shape[2], generator=g) * 3
        w, ids = torch.softmax(torch.randn(7, module.num_experts, generator=g), -1).topk(2, dim=-1)
        module.config._experts_implementation = "grouped_mm"  # calls the module's gate (its eager loop does not)
        ref = module(x, ids, w)
        module.config._experts_implementation = "moefx"
        for backend in ("reference", "grouped", "gemv"):
            module.moefx_backend = backend
            assert relerr(module(x, ids, w), ref) < 1e-5, (fn.__name__, backend)


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
