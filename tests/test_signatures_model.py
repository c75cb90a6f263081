"""ModelSignature: normalization from every input form, published geometries, fail-closed matching."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch
import yaml

from moefx.models import build_model, tiny_qwen3_moe_config
from moefx.models.catalog import catalog_config, catalog_hf_config, catalog_names
from moefx.planner.registry import PROVIDERS, match
from moefx.signatures import ExecutionSignature, ModelSignature, resolve

H200 = ExecutionSignature.preset("h200", mode="capture", max_batch_size=64, dtype="bfloat16")

# name -> (profile, family, routing, E, top_k, expert width, hidden, shared experts, dense-first layers, quant)
PUBLISHED = {
    "deepseek-v3": ("deepseek_v3", "deepseek", "sigmoid_bias_group_topk", 256, 8, 2048, 7168, 1, 3, "fp8"),
    "deepseek-v2": ("deepseek_v2", "deepseek", "softmax_group_topk", 160, 6, 1536, 5120, 2, 1, None),
    "qwen3-30b-a3b": ("qwen3_moe", "qwen3_moe", "softmax", 128, 8, 768, 2048, 0, 0, None),
    "qwen3-235b-a22b": ("qwen3_moe", "qwen3_moe", "softmax", 128, 8, 1536, 4096, 0, 0, None),
    "mixtral-8x7b": ("mixtral", "mixtral", "softmax", 8, 2, 14336, 4096, 0, 0, None),
    "olmoe-1b-7b": ("olmoe", "olmoe", "softmax", 64, 8, 1024, 2048, 0, 0, None),
    "qwen1.5-moe-a2.7b": ("qwen2_moe", "qwen2_moe", "softmax", 60, 4, 1408, 2048, 1, 0, None),
    "qwen2-57b-a14b": ("qwen2_moe", "qwen2_moe", "softmax", 64, 8, 2560, 3584, 1, 0, None),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_geometry_resolves_to_family_and_features(name: str) -> None:
    profile, family, routing, e, k, inter, hidden, shared, dense, quant = PUBLISHED[name]
    ms = ModelSignature.from_config(catalog_config(name))
    assert (ms.family, ms.routing, ms.num_experts, ms.top_k) == (family, routing, e, k)
    assert (ms.moe_intermediate_size, ms.hidden_size, ms.num_shared_experts) == (inter, hidden, shared)
    assert (ms.first_dense_layers, ms.quant_method, ms.dtype, ms.hidden_act) == (dense, quant, "bfloat16", "silu")
    assert ms.is_causal_lm
    plan = resolve(ms, H200)
    assert plan.profile == profile
    assert plan.serving["prefill_token_budget"] == 4096
    # The transformers config object of the same geometry gives the same signature.
    assert ModelSignature.from_config(catalog_hf_config(name)) == ms


def test_published_details() -> None:
    ds = ModelSignature.from_config(catalog_config("deepseek-v3"))
    assert (ds.n_group, ds.topk_group, ds.norm_topk_prob, ds.routed_scaling_factor) == (8, 4, True, 2.5)
    assert (ds.attention, ds.kv_lora_rank, ds.shared_expert_intermediate_size) == ("mla", 512, 2048)
    assert (ds.quant_weight_dtype, ds.quant_act_dtype, ds.quant_act_scheme) == ("float8_e4m3fn",) * 2 + ("dynamic",)
    assert (ds.quant_block_shape, ds.quant_act_group_size) == ((128, 128), 128)
    mixtral = ModelSignature.from_config(catalog_config("mixtral-8x7b"))
    assert mixtral.norm_topk_prob is True  # fixed by the architecture, not stated in config.json
    olmoe = ModelSignature.from_config(catalog_config("olmoe-1b-7b"))
    assert olmoe.norm_topk_prob is False and olmoe.attention == "mha"
    qwen2 = ModelSignature.from_config(catalog_config("qwen2-57b-a14b"))
    assert (qwen2.shared_expert_intermediate_size, qwen2.head_dim, qwen2.attention) == (20480, 128, "gqa")
    q235 = ModelSignature.from_config(catalog_config("Qwen/Qwen3-235B-A22B"))
    assert (q235.num_layers, q235.num_heads, q235.num_kv_heads) == (94, 64, 4)


def test_catalog_rejects_unknown_name_and_returns_copies() -> None:
    with pytest.raises(ValueError, match="valid names"):
        catalog_config("qwen9-moe")
    a = catalog_config("deepseek-v3")
    a["quantization_config"]["weight_block_size"][0] = 64
    assert catalog_config("deepseek-v3")["quantization_config"]["weight_block_size"] == [128, 128]
    assert "tiny-qwen3-moe" in catalog_names()


# Each field a provider or the MoE policy keys on, with a changed value.
KEY_CHANGES = {
    "model_type": "qwen3_next",
    "dtype": "float16",
    "hidden_size": 4096,
    "num_layers": 24,
    "num_experts": 64,
    "top_k": 4,
    "moe_intermediate_size": 1536,
    "routing": "sigmoid_bias",
    "norm_topk_prob": False,
    "quant_method": "fp8",
    "quant_block_shape": (64, 64),
    "num_shared_experts": 1,
    "vocab_size": 32000,
    "hidden_act": "gelu",
}


@pytest.mark.parametrize("field", sorted(KEY_CHANGES))
def test_each_key_field_changes_the_signature_and_plan(field: str) -> None:
    base = ModelSignature.from_config(catalog_config("qwen3-30b-a3b"))
    changed = dataclasses.replace(base, **{field: KEY_CHANGES[field]})
    assert changed != base and hash(changed) != hash(base) and changed.key() != base.key()
    plan_base, plan_changed = resolve(base, H200), resolve(changed, H200)
    assert plan_changed.model == changed and plan_base.model == base
    assert plan_changed.fingerprint() != plan_base.fingerprint()
    # Fields the provider cannot plan for make the profile fall back; the rest keep it but change the key.
    if field in ("model_type", "routing", "hidden_act", "quant_method"):
        assert plan_changed.profile == "unknown", field
        assert plan_changed.enabled_passes() == []
    else:
        assert plan_changed.profile == "qwen3_moe"


@pytest.mark.parametrize("missing", ["num_experts_per_tok", "num_experts", "moe_intermediate_size", "hidden_act",
                                     "norm_topk_prob", "hidden_size"])
def test_partial_metadata_fails_closed(missing: str) -> None:
    data = catalog_config("qwen3-30b-a3b")
    del data[missing]
    ms = ModelSignature.from_config(data)
    fragment, why = match(ms, H200)
    assert fragment is None and "declined" in why
    plan = resolve(ms, H200)
    assert plan.profile == "unknown" and plan.enabled_passes() == []
    assert all(p.backend_for(m) == "upstream" for p in plan.moe.policies.values() for m in (1, 64, 4096))


def test_dtype_comes_from_the_config_or_the_execution_and_says_where() -> None:
    from transformers import AutoConfig

    data = catalog_config("qwen3-30b-a3b")
    assert ModelSignature.from_config(data).dtype_source == "config 'torch_dtype'"
    hf = AutoConfig.for_model("qwen3_moe", dtype="bfloat16")
    assert (ModelSignature.from_config(hf).dtype, ModelSignature.from_config(hf).dtype_source) == (
        "bfloat16", "config 'dtype'")
    del data["torch_dtype"]
    ms = ModelSignature.from_config(data)
    assert ms.dtype is None and "dtype=unknown" in ms.describe()
    # The execution signature's compute dtype fills it in, and the plan says so.
    plan = resolve(ms, H200)
    assert plan.profile == "qwen3_moe" and plan.model.dtype == "bfloat16"
    assert "dtype=bfloat16 [execution signature]" in plan.explain()
    # Neither states one: fail closed, saying how to fix it.
    plan = resolve(ms, ExecutionSignature.preset("h200"))
    assert plan.profile == "unknown" and "the config states no dtype" in plan.profile_reason
    assert plan.enabled_passes() == []
    # The source is not a fact: equal signatures, equal keys.
    stated, filled = ModelSignature.from_config({**data, "dtype": "bfloat16"}), ms.with_dtype("bfloat16", "elsewhere")
    assert stated == filled and stated.key() == filled.key() and stated.dtype_source != filled.dtype_source


def test_deepseek_v3_without_group_fields_fails_closed() -> None:
    data = catalog_config("deepseek-v3")
    del data["topk_group"]
    assert resolve(ModelSignature.from_config(data), H200).profile == "unknown"


def test_new_model_type_of_a_known_family_does_not_match_until_declared() -> None:
    for model_type, source in (("deepseek_v32", "deepseek-v3"), ("qwen3_5_moe", "qwen3-30b-a3b")):
        data = {**catalog_config(source), "model_type": model_type}
        ms = ModelSignature.from_config(data)
        assert ms.family is None
        plan = resolve(ms, H200)
        assert plan.profile == "unknown" and f"no provider declares model_type {model_type!r}" in plan.profile_reason
    assert not any("deepseek_v32" in p.model_types for p in PROVIDERS.values())


def test_unknown_quantization_and_activation_fail_closed() -> None:
    data = {**catalog_config("qwen3-30b-a3b"), "quantization_config": {"quant_method": "hqq", "nbits": 4}}
    ms = ModelSignature.from_config(data)
    assert ms.quant_method == "hqq" and ms.quant_weight_dtype is None
    assert "not a format moefx understands" in resolve(ms, H200).profile_reason
    gelu = ModelSignature.from_config({**catalog_config("mixtral-8x7b"), "hidden_act": "gelu"})
    assert "activation 'gelu'" in resolve(gelu, H200).profile_reason


def test_quantization_formats_are_normalized() -> None:
    base = catalog_config("qwen3-30b-a3b")
    ct = {
        "quant_method": "compressed-tensors",
        "config_groups": {"g0": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                                 "input_activations": {"num_bits": 8, "type": "int", "dynamic": True,
                                                       "strategy": "token"}}},
    }
    ms = ModelSignature.from_config({**base, "quantization_config": ct})
    assert (ms.quant_weight_dtype, ms.quant_act_dtype, ms.quant_act_scheme) == ("int8", "int8", "dynamic")
    gptq = ModelSignature.from_config({**base, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    assert (gptq.quant_weight_dtype, gptq.quant_act_dtype) == ("int4", None)
    static = ModelSignature.from_config(
        {**base, "quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}
    )
    assert static.quant_act_scheme == "static" and static.quant_block_shape is None


def test_nested_text_config_and_vllm_wrappers() -> None:
    text = catalog_config("qwen3-30b-a3b")
    outer = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "some_vl_wrapper", "text_config": text}
    direct = ModelSignature.from_config(text)
    assert ModelSignature.from_config(outer) == direct
    hf = catalog_hf_config("qwen3-30b-a3b")
    model_config = types.SimpleNamespace(hf_config=hf, dtype=torch.bfloat16, quantization=None)
    assert ModelSignature.from_config(model_config) == ModelSignature.from_config(hf)
    vllm_config = types.SimpleNamespace(model_config=model_config)
    assert ModelSignature.from_config(vllm_config) == ModelSignature.from_config(hf)
    # vLLM online quantization (no quantization_config in the checkpoint) is still recorded.
    online = types.SimpleNamespace(hf_config=hf, dtype=torch.bfloat16, quantization="fp8")
    assert ModelSignature.from_config(online).quant_method == "fp8"


def test_files_folders_and_yaml(tmp_path) -> None:
    data = catalog_config("olmoe-1b-7b")
    (tmp_path / "config.json").write_text(json.dumps(data))
    expected = ModelSignature.from_config(data)
    assert ModelSignature.from_config(tmp_path) == expected
    assert ModelSignature.from_config(str(tmp_path / "config.json")) == expected
    sig_yaml = tmp_path / "sig.yaml"
    sig_yaml.write_text(yaml.safe_dump({**expected.to_dict(), "architectures": ["OlmoeForCausalLM"],
                                        "quant_block_shape": None}))
    assert ModelSignature.from_config(sig_yaml) == expected
    with pytest.raises(ValueError, match="does not exist"):
        ModelSignature.from_config(tmp_path / "nope.json")


def test_bad_field_types_raise() -> None:
    with pytest.raises(ValueError, match="num_experts"):
        ModelSignature.from_config({**catalog_config("qwen3-30b-a3b"), "num_experts": "128"})
    with pytest.raises(ValueError, match="top_k"):
        ModelSignature(top_k=True)


def test_from_module_reads_config_and_weight_dtype() -> None:
    model = build_model(tiny_qwen3_moe_config(), dtype=torch.bfloat16)
    ms = ModelSignature.from_module(model)
    assert (ms.family, ms.dtype, ms.architectures) == ("qwen3_moe", "bfloat16", ("Qwen3MoeForCausalLM",))
    assert resolve(ms, H200).profile == "qwen3_moe"


def test_from_module_without_config_infers_geometry_but_stays_unknown() -> None:
    model = build_model(tiny_qwen3_moe_config())
    bare = torch.nn.Module()
    bare.layers = model.model.layers
    ms = ModelSignature.from_module(bare)
    assert (ms.num_experts, ms.hidden_size, ms.moe_intermediate_size, ms.dtype) == (8, 64, 32, "float32")
    assert ms.top_k is None and ms.model_type is None
    assert resolve(ms, H200).profile == "unknown"


def test_from_module_reads_per_expert_module_lists() -> None:
    class Expert(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = torch.nn.Linear(16, 24, bias=False)

    block = torch.nn.Module()
    block.experts = torch.nn.ModuleList(Expert() for _ in range(4))
    ms = ModelSignature.from_module(block)
    assert (ms.num_experts, ms.hidden_size, ms.moe_intermediate_size) == (4, 16, 24)


def test_glm4_moe_provider_matches_transformers_config_and_fails_closed() -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("glm4_moe", dtype="bfloat16", architectures=["Glm4MoeForCausalLM"])
    ms = ModelSignature.from_config(cfg)
    assert (ms.family, ms.routing, ms.num_shared_experts, ms.first_dense_layers) == ("glm4_moe", "sigmoid_bias", 1, 1)
    assert resolve(ms, H200).profile == "glm4_moe"
    data = cfg.to_dict()
    del data["topk_group"]
    assert resolve(ModelSignature.from_config(data), H200).profile == "unknown"


def test_from_module_prefers_weights_over_a_contradicting_config(monkeypatch: pytest.MonkeyPatch) -> None:
    import moefx.log

    monkeypatch.setattr(moefx.log, "_warned", set())
    model = build_model(tiny_qwen3_moe_config())
    model.config.num_experts = 16  # config edited after the weights were built
    with pytest.warns(UserWarning, match="num_experts=16 but the weights say 8"):
        ms = ModelSignature.from_module(model)
    assert ms.num_experts == 8
