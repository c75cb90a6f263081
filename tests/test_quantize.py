"""moefx.quantize: quantized linears and experts against references, skip list, config errors, and loading a
DeepSeek-V3 / Qwen3-FP8 layout checkpoint written by the test."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import moefx
from moefx.backends.registry import dequant_block
from moefx.models import build_model, tiny_qwen3_moe_config
from moefx.ops.quant import ref_quant
from moefx.quant_linear import Fp8BlockExperts, Fp8BlockLinear, Int8Experts, Int8Linear
from moefx.quantize import Fp8BlockConfig, Int8Config, load_fp8_checkpoint


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _tiny_moe(seed=0):
    cfg = tiny_qwen3_moe_config(hidden_size=128, moe_intermediate_size=128, intermediate_size=256, head_dim=32,
                                mlp_only_layers=[0])
    return build_model(cfg, seed=seed, dtype=torch.bfloat16)


def test_fp8_block_linear_matches_reference():
    torch.manual_seed(0)
    lin = nn.Linear(320, 200, bias=True).to(torch.bfloat16)
    x = torch.randn(5, 7, 320, dtype=torch.bfloat16)
    ref_fp = lin(x)
    (q_lin,) = moefx.quantize(nn.Sequential(lin), "fp8_block128")
    assert isinstance(q_lin, Fp8BlockLinear) and q_lin.weight.dtype == torch.float8_e4m3fn
    assert q_lin.weight_scale_inv.shape == (2, 3)  # ceil(200/128), ceil(320/128)
    out = q_lin(x)
    # Reference: dequantized weight, activations quantized per token and group of 128, fp32 matmul.
    q, s = ref_quant(x, "fp8_group", 128, 1e-10, 0.0, 448.0, False)
    a = q.float() * s.repeat_interleave(128, dim=-1)[..., :320]
    ref = (a @ dequant_block(q_lin.weight, q_lin.weight_scale_inv, (128, 128)).t() + lin.bias.float())
    assert out.dtype == torch.bfloat16 and _rel(out, ref) < 1e-2
    assert _rel(out, ref_fp) < 0.08  # FP8 w8a8 error against the unquantized layer


def test_int8_linear_close_to_float():
    torch.manual_seed(1)
    lin = nn.Linear(256, 96, bias=False)
    x = torch.randn(9, 256)
    ref = lin(x)
    (q_lin,) = moefx.quantize(nn.Sequential(lin), "int8")
    assert isinstance(q_lin, Int8Linear) and q_lin.weight.dtype == torch.int8 and q_lin.weight_scale.shape == (96,)
    assert _rel(q_lin(x), ref) < 0.02


def test_skip_list_and_config_errors():
    model = nn.ModuleDict({"lm_head": nn.Linear(8, 8), "mlp": nn.ModuleDict({"gate": nn.Linear(8, 4),
                                                                           "gate_proj": nn.Linear(8, 8)})})
    moefx.quantize(model, "int8")
    assert type(model["lm_head"]) is nn.Linear and type(model["mlp"]["gate"]) is nn.Linear
    assert isinstance(model["mlp"]["gate_proj"], Int8Linear)
    other = nn.ModuleDict({"lm_head": nn.Linear(8, 8)})
    moefx.quantize(other, Int8Config(skip=()))
    assert isinstance(other["lm_head"], Int8Linear)
    with pytest.raises(ValueError, match="fp8_block128"):
        moefx.quantize(nn.Linear(4, 4), "fp8_block")
    kept = model["mlp"]["gate_proj"]
    assert moefx.quantize(model, "int8")["mlp"]["gate_proj"] is kept  # the same scheme again: unchanged
    with pytest.raises(ValueError, match=r"already quantized with 'int8'; it cannot be re-quantized to "
                                         r"'fp8_block128'"):
        moefx.quantize(model, "fp8_block128")
    assert model["mlp"]["gate_proj"] is kept and model.moefx_quantization == Int8Config()  # refused: untouched
    fp8 = nn.Sequential(nn.Linear(8, 8))
    fp8[0].weight.data = fp8[0].weight.data.to(torch.float8_e4m3fn)
    with pytest.warns(UserWarning, match="already quantized"):
        moefx.quantize(fp8, "int8")
    assert type(fp8[0]) is nn.Linear


@pytest.mark.parametrize("scheme", ["fp8_block128", "int8"])
def test_experts_quantized_match_dequantized_reference(scheme):
    model = _tiny_moe()
    experts = model.model.layers[1].mlp.experts
    gate_up, down = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    moefx.quantize(model, scheme)
    q = model.model.layers[1].mlp.experts
    assert isinstance(q, Fp8BlockExperts if scheme == "fp8_block128" else Int8Experts)
    torch.manual_seed(2)
    hidden = torch.randn(6, 128, dtype=torch.bfloat16)
    ids = torch.randint(0, 8, (6, 2))
    weights = torch.rand(6, 2, dtype=torch.bfloat16)
    out = q(hidden, ids, weights)
    # Unquantized experts with transformers' own loop, on the original weights.
    experts.gate_up_proj.data, experts.down_proj.data = gate_up, down
    ref = experts(hidden, ids, weights)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert _rel(out, ref) < 0.06
    if scheme == "fp8_block128":
        assert q.gate_up_proj_scale_inv.shape == (8, 2, 1) and q.down_proj_scale_inv.shape == (8, 1, 1)


def _release_layout(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fused experts of a moefx-quantized state dict, split into per-expert linears the way the
    DeepSeek-V3 / Qwen3-FP8 releases store them (`experts.{e}.{gate,up,down}_proj.weight[_scale_inv]`)."""
    out = {}
    for key, value in sd.items():
        prefix, _, name = key.rpartition(".")
        if name not in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv") \
                or not prefix.endswith("experts"):
            out[key] = value
            continue
        suffix = "weight_scale_inv" if name.endswith("_scale_inv") else "weight"
        for e in range(value.shape[0]):
            if name.startswith("gate_up"):
                gate, up = value[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.{suffix}"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.{suffix}"] = up.contiguous()
            else:
                out[f"{prefix}.{e}.down_proj.{suffix}"] = value[e].contiguous()
    return out


def test_load_fp8_checkpoint_written_with_safetensors(tmp_path):
    from safetensors.torch import save_file

    source = moefx.quantize(_tiny_moe(seed=0), "fp8_block128")
    sd = _release_layout(source.state_dict())
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert sd["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (1, 1)
    assert "model.layers.1.mlp.experts.7.up_proj.weight_scale_inv" in sd
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))

    target = load_fp8_checkpoint(_tiny_moe(seed=1), path)
    assert isinstance(target.moefx_quantization, Fp8BlockConfig)
    from moefx.signatures import ModelSignature

    ms = ModelSignature.from_module(target)
    assert (ms.quant_act_dtype, ms.quant_act_scheme, ms.quant_block_shape) == ("float8_e4m3fn", "dynamic", (128, 128))
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        assert torch.equal(target(ids).logits, source(ids).logits)

    bad = dict(sd)
    bad["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(2, 2)
    with pytest.raises(ValueError, match="q_proj.weight_scale_inv"):
        load_fp8_checkpoint(_tiny_moe(seed=1), bad)


def test_a_second_scheme_is_refused_and_the_model_stays_consistent():
    model = _tiny_moe()
    moefx.quantize(model, "fp8_block128")
    with pytest.raises(ValueError, match="already quantized with 'fp8_block128'.*'int8'"):
        moefx.quantize(model, "int8")
    assert isinstance(model.model.layers[1].mlp.experts, Fp8BlockExperts)
    assert isinstance(model.moefx_quantization, Fp8BlockConfig)  # what the attribute says is what the modules are
    assert model.config.quantization_config["quant_method"] == "fp8"
