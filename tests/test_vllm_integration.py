"""Runs only where vLLM is installed (scripts/test.sh --vllm runs it in its own vLLM venv); CPU-only checks."""

import importlib.metadata
import os
import pickle

import pytest
import torch

# In the vLLM venv stage of scripts/test.sh a missing vLLM is a failure, not a skip.
vllm = __import__("vllm") if os.environ.get("MOEFX_REQUIRE_VLLM") == "1" else pytest.importorskip("vllm")

from moefx.integrations import vllm as moefx_vllm  # noqa: E402
from moefx.testing import count_ops  # noqa: E402

pytestmark = pytest.mark.vllm


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.name == "moefx" and ep.value == "moefx.integrations.vllm:register" for ep in eps)


def test_pass_manager_is_a_vllm_inductor_pass_with_stable_uuid():
    from vllm.config import CompilationConfig as VllmCompilationConfig

    base = moefx_vllm._inductor_pass_base()
    cfg = {"pass_config": {"fuse_act_quant": True, "eliminate_noops": True}}
    pm = moefx_vllm.pass_manager(cfg)
    assert isinstance(pm, base)
    assert pm.enabled == ["eliminate_noops", "fuse_act_quant"]
    assert pm.uuid() == moefx_vllm.pass_manager(cfg).uuid()
    assert pm.uuid() != moefx_vllm.pass_manager({"pass_config": {"eliminate_noops": True}}).uuid()
    vc = VllmCompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": pm})
    assert vc.inductor_compile_config["post_grad_custom_post_pass"] is pm
    assert isinstance(vc.compute_hash(), str)
    assert type(pickle.loads(pickle.dumps(pm))).__name__ == "MoefxVllmPassManager"


def test_config_comes_from_env_and_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("MOEFX_CONFIG", '{"pass_config": {"fuse_norm_quant": true}}')
    assert moefx_vllm.load_config().pass_config.fuse_norm_quant is True
    assert "fuse_norm_quant" in moefx_vllm.pass_manager().enabled
    monkeypatch.setenv("MOEFX_CONFIG", '{"moe_backend": "fastest"}')
    with pytest.raises(ValueError, match="MOEFX_CONFIG.*'moe_backend'.*valid choices"):
        moefx_vllm.load_config()


def test_register_installs_the_fused_moe_method_out_of_tree(monkeypatch):
    from vllm.model_executor.custom_op import op_registry_oot

    monkeypatch.delenv("MOEFX_CONFIG", raising=False)
    moefx_vllm.register()
    moefx_vllm.register()  # idempotent, as every vLLM process may call it more than once
    cls = op_registry_oot["UnquantizedFusedMoEMethod"]
    assert cls.__name__ == "MoefxFusedMoEMethod"

    class Layer:  # what the method reads of vLLM's layer
        expert_map = None
        apply_router_weight_on_input = False
        activation = "silu"
        w13_weight = torch.randn(4, 16, 8)
        w2_weight = torch.randn(4, 8, 8)

    method = object.__new__(cls)
    x, ids = torch.randn(3, 8), torch.randint(0, 4, (3, 2))
    # No calibration row for this shape on this device: vLLM's own method runs (fail closed).
    assert method._moefx_backend(Layer(), x, ids, shared=None) is None
    assert method._moefx_backend(Layer(), x, ids, shared=object()) is None


def _compile_through_vllm_pass_manager(fn, example, vllm_config):
    """`fn` compiled by inductor with vLLM's own pass manager as its post-grad hook and moefx's pass manager
    installed the way vLLM installs it (inductor_compile_config["post_grad_custom_post_pass"] ->
    PostGradPassManager.add), with vLLM's pre-grad IR functionalization; returns (compiled fn, graph copies)."""
    import copy

    from torch._inductor.compile_fx import compile_fx
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.compilation.passes.ir.inplace_functionalization import VllmIRInplaceFunctionalizationPass
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config.utils import Range

    graphs = []
    with pass_context(Range(start=1, end=1 << 16)):
        pm = PostGradPassManager()
        pm.configure(vllm_config)
        if not hasattr(torch.ops._C, "rotary_embedding"):
            # fix_functionalization (after every other pass) looks up vLLM's compiled CUDA ops, absent on a CPU host
            pm.fix_functionalization = lambda graph: None
        pm.add(moefx_vllm.pass_manager({"pass_config": {"fuse_act_quant": True, "fuse_norm_quant": True}}))

        def post(graph):
            pm(graph)
            graphs.append(copy.deepcopy(graph))

        def backend(gm, example_inputs):
            with pass_context(Range(start=1, end=1 << 16)):
                return compile_fx(gm, example_inputs, config_patches={
                    "pre_grad_custom_pass": VllmIRInplaceFunctionalizationPass(vllm_config),
                    "post_grad_custom_post_pass": post, "fx_graph_cache": False})

        torch._dynamo.reset()
        for a in example:
            torch._dynamo.mark_dynamic(a, 0)
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        compiled(*[a.clone() for a in example])
    return compiled, graphs


@pytest.mark.compile
def test_vllm_layers_fuse_exactly_through_vllms_pass_manager():
    """vLLM's own SiluAndMul, RMSNorm (vLLM IR op, with and without residual) and QuantFP8 (dynamic, group 128:
    vLLM's own fusions do not cover it on Hopper) fuse into moefx's ops inside vLLM's pass manager and reproduce
    the layers' `forward_native` run eagerly (FP8 codes < 0.1% off, scales 1e-6, the new residual bit for bit).
    (Calling `act(x)` outside a compile runs a torch.compile'd forward_native, which keeps fp32 intermediates.)"""
    from torch._functorch import config as functorch_config
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    import moefx

    ops = torch.ops.moefx
    vc = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vc):
        act = SiluAndMul()
        norm = RMSNorm(256, eps=1e-6, dtype=torch.bfloat16)
        quant = QuantFP8(static=False, group_shape=GroupShape(1, 128))
    norm.weight.data = (torch.rand(256) + 0.5).to(torch.bfloat16)

    def f(x, residual, h, native=False):
        n, q, a = (norm.forward_native, quant.forward_native, act.forward_native) if native else (norm, quant, act)
        y, new_residual = n(x, residual)
        q1, s1 = q(y)
        q2, s2 = q(n(new_residual))
        q3, s3 = q(a(h))
        return q1, s1, new_residual, q2, s2, q3, s3

    def inputs(rows, seed):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(rows, n, generator=g) * 2).to(torch.bfloat16) for n in (256, 256, 512)]

    moefx.clear_compile_reports()
    with set_current_vllm_config(vc), functorch_config.patch(enable_autograd_cache=False):
        compiled, graphs = _compile_through_vllm_pass_manager(f, inputs(16, 0), vc)
        assert len(graphs) == 1  # the token dimension is dynamic: one graph for every row count
        (graph,) = graphs
        (report,) = moefx.compile_reports()
        assert report.matches == {"fuse_norm_quant": 2, "fuse_act_quant": 1}, report.skipped
        assert count_ops(graph, ops.add_rms_norm_quant.default, ops.rms_norm_quant.default,
                         ops.silu_mul_quant.default) == 3
        assert count_ops(graph, torch.ops.aten.max.dim, torch.ops.aten.amax.default) == 0
        for seed in (1, 2):
            fresh = inputs(24 + seed, seed)
            out = compiled(*[a.clone() for a in fresh])
            ref = f(*[a.clone() for a in fresh], native=True)
            for o, r in zip(out, ref):
                assert o.dtype == r.dtype and o.shape == r.shape
                if o.dtype == torch.float8_e4m3fn:
                    assert (o.float() != r.float()).float().mean().item() < 1e-3
                elif o.dtype == torch.float32:
                    assert ((o - r).abs() <= 1e-6 * r.abs()).all()
                else:
                    assert torch.equal(o, r)
