"""Runs only where vLLM is installed (scripts/test.sh runs it in its own vLLM venv); CPU-only checks."""

import importlib.metadata
import os
import pickle

import pytest
import torch

# In the vLLM venv stage of scripts/test.sh a missing vLLM is a failure, not a skip.
vllm = __import__("vllm") if os.environ.get("MOEFX_REQUIRE_VLLM") == "1" else pytest.importorskip("vllm")

from moefx.integrations import vllm as moefx_vllm  # noqa: E402
from moefx.testing import count_ops, post_grad_graphs  # noqa: E402

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


def test_fuse_act_quant_matches_vllm_native_silu_and_mul_with_quant_fp8():
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    from moefx.config import CompilationConfig
    from moefx.passes import PASS_REGISTRY, PassContext

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        act = SiluAndMul()
        quant = QuantFP8(static=False, group_shape=GroupShape(1, 128))

    def f(x):
        return quant.forward_native(act.forward_native(x))

    x = torch.randn(8, 512, dtype=torch.bfloat16)
    (gm,) = post_grad_graphs(f, x)
    n = PASS_REGISTRY["fuse_act_quant"]().run(gm.graph, PassContext(CompilationConfig()))
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert n == 1
    assert count_ops(gm, torch.ops.aten.exp.default, torch.ops.aten.sigmoid.default) == 0
    assert any(str(node.target).startswith("moefx.") for node in gm.graph.nodes if node.op == "call_function")
    for _ in range(3):
        x = torch.randn(8, 512, dtype=torch.bfloat16) * 3
        q, s = gm(x)
        q_ref, s_ref = f(x)
        assert torch.allclose(s, s_ref, rtol=1e-6, atol=0)
        mismatched = (q.float() != q_ref.float()).float().mean().item()
        assert mismatched < 1e-3
