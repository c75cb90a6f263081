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


# ------------------------------------------------------------------ in place, a module at a time, bounded memory


def _one_shot_fp8(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole-tensor block quantization (every block at once, in fp32): what the sliced one must equal."""
    *lead, n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    wp = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    blocks = wp.reshape(*lead, nb, bn, kb, bk)
    scale = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=1e-12) / 448.0
    q = (blocks / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(*lead, nb * bn, kb * bk)[..., :n, :k].contiguous(), scale.reshape(*lead, nb, kb)


def _one_shot_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(w.float() / scale).clamp(-127, 127).to(torch.int8), scale.squeeze(-1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (float8 has no CPU comparison kernels: compare the bytes)."""
    as_bytes = (lambda t: t.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (lambda t: t)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((3, 260, 130), (128, 128)),
                                         ((2, 2, 96, 64), (32, 32)), ((5, 64, 48), (32, 16))])
@pytest.mark.parametrize("chunk_bytes", [1, 4096, 40_000, 1 << 40])
def test_sliced_weight_quant_equals_one_shot(shape, block, chunk_bytes):
    from moefx.ops.quant import quant_weight_fp8_block, quant_weight_int8_channel

    w = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 1, shape[-1])
         ).to(torch.bfloat16)
    q, s = quant_weight_fp8_block(w, *block, chunk_bytes=chunk_bytes)
    rq, rs = _one_shot_fp8(w, *block)
    assert _same(q, rq) and _same(s, rs)
    q8, s8 = quant_weight_int8_channel(w, chunk_bytes=chunk_bytes)
    rq8, rs8 = _one_shot_int8(w)
    assert _same(q8, rq8) and _same(s8, rs8)


def test_sliced_weight_quant_writes_into_out_and_checks_it():
    from moefx.ops.quant import quant_weight_fp8_block

    w = torch.randn(2, 256, 128, dtype=torch.bfloat16)
    out = (torch.empty(2, 256, 128, dtype=torch.float8_e4m3fn), torch.empty(2, 2, 1))
    q, s = quant_weight_fp8_block(w, out=out, chunk_bytes=1)
    assert q is out[0] and s is out[1] and _same(q, _one_shot_fp8(w, 128, 128)[0])
    with pytest.raises(ValueError, match=r"out scale is \(2, 1, 1\).*expected a contiguous \(2, 2, 1\)"):
        quant_weight_fp8_block(w, out=(out[0], torch.empty(2, 1, 1)))


@pytest.mark.parametrize("scheme", ["fp8_block128", "int8"])
def test_quantize_equals_the_one_shot_quantization(scheme, monkeypatch):
    import moefx.ops.quant as quant

    monkeypatch.setattr(quant.quant_weight_fp8_block, "__defaults__", (128, 128, None, 4096))
    monkeypatch.setattr(quant.quant_weight_int8_channel, "__defaults__", (None, 4096))
    model = _tiny_moe()
    originals = {name: p.detach().clone() for name, p in model.named_parameters()}
    moefx.quantize(model, scheme)
    sd = model.state_dict()
    checked = 0
    for name, w in originals.items():
        prefix, _, leaf = name.rpartition(".")
        if scheme == "fp8_block128" and sd[name].dtype == torch.float8_e4m3fn:
            scale = sd[f"{name}_scale_inv" if leaf != "weight" else f"{prefix}.weight_scale_inv"]
            rq, rs = _one_shot_fp8(w, 128, 128)
        elif scheme == "int8" and sd[name].dtype == torch.int8:
            scale = sd[f"{name}_scale" if leaf != "weight" else f"{prefix}.weight_scale"]
            rq, rs = _one_shot_int8(w)
        else:
            assert _same(sd[name], w), name  # left alone (norms, embedding, router, lm_head)
            continue
        assert _same(sd[name], rq) and _same(scale, rs), name
        checked += 1
    assert checked == 2 * 4 + 3 + 2  # q/k/v/o of both layers, layer 0's dense MLP, layer 1's two expert tensors


def test_quantize_releases_each_original_even_where_a_hook_holds_it():
    import gc
    import weakref

    model = _tiny_moe()
    experts = model.model.layers[1].mlp.experts
    held = [experts, model.model.layers[0].self_attn.q_proj]  # a user's variable
    model.model.layers[1].register_forward_hook(lambda mod, args, out, held=held: out)  # a hook's closure
    originals = [(name, p) for name, p in model.named_parameters()
                 if name.endswith(("proj.weight", "gate_up_proj", "down_proj")) and "mlp.gate." not in name]
    kept = {name: p.detach().clone() for name, p in model.named_parameters()}
    moefx.quantize(model, "fp8_block128")
    for name, p in originals:  # the replaced float tensors: emptied, whoever still holds them
        assert p.numel() == 0 and p.dtype == torch.bfloat16, name
    assert held[0].gate_up_proj.numel() == 0 and held[1].weight.numel() == 0
    for name, p in model.named_parameters():  # what the model keeps is intact
        if name in kept and p.dtype == torch.bfloat16:
            assert torch.equal(p, kept[name]), name

    plain = _tiny_moe()  # with no outside reference, the replaced modules themselves are freed
    refs = [weakref.ref(m) for name, m in plain.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"]
    refs.append(weakref.ref(plain.model.layers[1].mlp.experts))
    moefx.quantize(plain, "int8")
    gc.collect()
    assert refs and all(r() is None for r in refs)


def test_quantize_keeps_tied_weights_and_replaces_a_shared_module_everywhere():
    torch.manual_seed(0)
    embed = nn.Embedding(16, 256)
    head = nn.Linear(256, 16, bias=False)
    head.weight = embed.weight  # tied, as transformers ties the LM head to the embedding
    shared = nn.Linear(256, 256)
    model = nn.ModuleDict({"embed": embed, "lm_head": head, "a": nn.ModuleDict({"proj": shared}),
                           "b": nn.ModuleDict({"proj": shared})})
    tied = embed.weight.detach().clone()
    shared_w = shared.weight
    moefx.quantize(model, Int8Config(skip=()))
    assert isinstance(model["lm_head"], Int8Linear) and torch.equal(model["embed"].weight, tied)  # still in use
    assert model["a"]["proj"] is model["b"]["proj"] and isinstance(model["a"]["proj"], Int8Linear)
    assert shared_w.numel() == 0  # the shared original was replaced at both places: released


@pytest.mark.gpu
def test_quantize_peak_memory_on_cuda_is_the_float_model_plus_2gib():
    """8 layers at Qwen3-30B-A3B widths (about 10 GiB in bf16): keeping the originals while the FP8 copies are made
    would peak at about 1.5x the model; in place, one module at a time, the peak stays within the model + 2 GiB."""
    import gc

    from moefx.models import qwen3_moe_config

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = build_model(qwen3_moe_config(8), dtype=torch.bfloat16, device="cuda").eval()
    float_bytes = torch.cuda.memory_allocated() - base
    ref = {name: _one_shot_fp8(p.detach(), 128, 128)
           for name, p in model.model.layers[3].named_parameters() if name.endswith(("gate_up_proj", "q_proj.weight"))}
    ref_bytes = sum(q.numel() + s.numel() * 4 for q, s in ref.values())
    torch.cuda.reset_peak_memory_stats()
    moefx.quantize(model, "fp8_block128")
    peak = torch.cuda.max_memory_allocated() - base - ref_bytes
    assert float_bytes > 8 * 2**30
    assert peak <= float_bytes + 2 * 2**30, f"peak {peak / 2**30:.2f} GiB over a {float_bytes / 2**30:.2f} GiB model"
    layer = model.model.layers[3]
    q, s = ref["mlp.experts.gate_up_proj"]
    assert _same(layer.mlp.experts.gate_up_proj, q) and _same(layer.mlp.experts.gate_up_proj_scale_inv, s)
    q, s = ref["self_attn.q_proj.weight"]
    assert _same(layer.self_attn.q_proj.weight, q) and _same(layer.self_attn.q_proj.weight_scale_inv, s)
    del model, ref
    gc.collect()
    torch.cuda.empty_cache()
