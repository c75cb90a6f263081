"""transformers' experts interface: "moefx" gives eager's logits on five MoE families and odd layouts."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
)
from transformers.activations import ACT2FN
from transformers.integrations.moe import use_experts_implementation

import moefx
import moefx.log
from moefx.backends import available_backends
from moefx.integrations.transformers import is_experts_module, unsupported_reason
from moefx.models import tiny_qwen3_moe_config

SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
CONFIGS = {
    "qwen3_moe": lambda: tiny_qwen3_moe_config(),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **SMALL, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
    ),
    "mixtral": lambda: MixtralConfig(
        **SMALL, intermediate_size=32, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
    ),
    "olmoe": lambda: OlmoeConfig(**SMALL, intermediate_size=32, num_key_value_heads=4, num_experts=8,
                                 num_experts_per_tok=2),
    "deepseek_v3": lambda: DeepseekV3Config(
        **SMALL, intermediate_size=128, moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    ),
}


pytestmark = pytest.mark.usefixtures("isolated_moe_tables")


def _model(family: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](), dtype=torch.float32).eval()
    with torch.no_grad():  # expert weights large enough that a wrong experts path moves the logits
        for module in model.modules():
            if is_experts_module(module):
                module.gate_up_proj.normal_(std=0.2)
                module.down_proj.normal_(std=0.2)
    return model


def _logits(model: nn.Module, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_moefx_experts_equal_eager(family):
    model = _model(family)
    model.set_experts_implementation("eager")
    ref = _logits(model)
    experts = [m for m in model.modules() if is_experts_module(m)]
    assert experts and all(unsupported_reason(m) is None for m in experts)
    model.set_experts_implementation("moefx")
    assert model.config._experts_implementation == "moefx"
    assert _rel(_logits(model), ref) <= 1e-5  # no calibration row: upstream (transformers grouped_mm) via the op
    for backend in available_backends("cpu"):
        for m in experts:
            m.moefx_backend = backend
        assert _rel(_logits(model), ref) <= 1e-5, backend
    for m in experts:  # sanity: the experts really matter for these logits
        m.moefx_backend = "auto"
        m.down_proj.data.zero_()
    assert _rel(_logits(model), ref) > 1e-2


def test_from_pretrained_with_moefx(tmp_path):
    model = _model("qwen3_moe")
    model.set_experts_implementation("eager")
    ref = _logits(model)
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", experts_implementation="moefx", dtype=torch.float32)
    assert loaded.config._experts_implementation == "moefx"
    assert _rel(_logits(loaded.eval()), ref) <= 1e-5


def test_optimize_sets_moefx_only_where_the_plan_says_so():
    model = _model("olmoe")
    model.set_experts_implementation("eager")
    ref = _logits(model)
    upstream = moefx.optimize(_model("olmoe"), config={"mode": "eager"})  # no calibration row on this CPU
    assert upstream.config._experts_implementation != "moefx"
    assert not any(line.startswith("moe_experts:") for line in upstream.moefx_plan.provenance)
    forced = moefx.optimize(_model("olmoe"), config={"mode": "eager", "moe_backend": "reference"})
    assert forced.config._experts_implementation == "moefx"
    assert any("experts_implementation = moefx" in line for line in forced.moefx_plan.provenance)
    experts = [m for m in forced.modules() if is_experts_module(m)]
    assert all(m.moefx_backend.startswith("eager=reference@1-") for m in experts)
    assert _rel(_logits(forced), ref) <= 1e-5


E, H, I, TOPK = 4, 16, 8, 2


class _Layout(nn.Module):
    """Experts in transformers' decorated form with a chosen layout, with a plain-loop eager forward."""

    def __init__(self, config, transposed: bool, bias: bool):
        super().__init__()
        self.num_experts = E
        gu, dn = ((E, H, 2 * I), (E, I, H)) if transposed else ((E, 2 * I, H), (E, H, I))
        self.gate_up_proj = nn.Parameter(torch.randn(*gu) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(*dn) * 0.3)
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * I) * 0.3)
            self.down_proj_bias = nn.Parameter(torch.randn(E, H) * 0.3)
        self.act_fn = ACT2FN["silu"]
        self._t, self._b = transposed, bias

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[0]):
            for j in range(top_k_index.shape[1]):
                e = int(top_k_index[t, j])
                wg, wd = self.gate_up_proj[e], self.down_proj[e]
                wg, wd = (wg.T, wd.T) if self._t else (wg, wd)
                gu = wg @ hidden_states[t] + (self.gate_up_proj_bias[e] if self._b else 0)
                g, u = gu.chunk(2)
                y = wd @ (self.act_fn(g) * u) + (self.down_proj_bias[e] if self._b else 0)
                out[t] += top_k_weights[t, j] * y
        return out


def _layout_module(transposed: bool, bias: bool) -> nn.Module:
    cls = type(f"Experts_t{int(transposed)}_b{int(bias)}", (_Layout,), {})
    cls = use_experts_implementation(cls, is_transposed=transposed, has_bias=bias)
    torch.manual_seed(3)
    return cls(PretrainedConfig(), transposed=transposed, bias=bias)


@pytest.mark.parametrize(("transposed", "bias"), [(True, False), (False, True), (True, True)])
def test_layouts_equal_eager(transposed, bias):
    module = _layout_module(transposed, bias)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(11, H, generator=g)
    w, ids = torch.softmax(torch.randn(11, E, generator=g), -1).topk(TOPK, dim=-1)
    module.config._experts_implementation = "eager"
    ref = module(x, ids, w)
    module.config._experts_implementation = "moefx"
    for backend in ("auto", "reference", *available_backends("cpu")):
        module.moefx_backend = backend
        assert _rel(module(x, ids, w), ref) <= 1e-5, backend
    if bias:
        assert unsupported_reason(module) == "expert biases"
    else:
        assert unsupported_reason(module) is None  # transposed weights go to the op as views


def test_fp8_experts_module_runs_the_op_with_block_scales():
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts

    from moefx.backends import BACKENDS
    from moefx.backends.registry import dequant_block

    config = PretrainedConfig(hidden_size=64, num_experts=4, moe_intermediate_size=32, hidden_act="silu")
    cls = use_experts_implementation(type("FP8E", (FP8Experts,), {}), experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    module = cls(config=config, block_size=(32, 32))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        pairs = ((module.gate_up_proj, module.gate_up_proj_scale_inv), (module.down_proj, module.down_proj_scale_inv))
        for w, s in pairs:
            w.copy_((torch.randn(w.shape, generator=g) * 100).clamp(-440, 440).to(torch.float8_e4m3fn))
            s.copy_(torch.rand(s.shape, generator=g) * 1e-3 + 1e-3)
    assert unsupported_reason(module) is None
    x = torch.randn(9, 64, generator=g)
    w, ids = torch.softmax(torch.randn(9, 4, generator=g), -1).topk(2, dim=-1)
    w13 = dequant_block(module.gate_up_proj, module.gate_up_proj_scale_inv, (32, 32))
    w2 = dequant_block(module.down_proj, module.down_proj_scale_inv, (32, 32))
    ref = BACKENDS["reference"](x, ids, w, w13, w2)
    module.config._experts_implementation = "moefx"
    assert _rel(module(x, ids, w), ref) <= 1e-5  # no row: the reference oracle on the block scales
    for backend in available_backends("cpu"):
        module.moefx_backend = backend
        assert _rel(module(x, ids, w), ref) <= 6e-2, backend  # w8a8 backends also round the activations
    module.limit = 0.5  # the clamped SwiGLU (DeepSeek-V4's FP8 experts): the op takes it as its gate limit
    assert unsupported_reason(module) is None
    module.moefx_backend = "reference"
    clamped = BACKENDS["reference"](x, ids, w, w13, w2, gate_limit=0.5)
    assert _rel(module(x, ids, w), clamped) <= 1e-5 and _rel(clamped, ref) > 1e-2
    module.swiglu_alpha = 1.7
    assert unsupported_reason(module) == "an alpha SwiGLU gate (gpt-oss style)"


def test_optimize_leaves_unsupported_layouts_and_strict_raises():
    from moefx.config import CompilationConfig
    from moefx.integrations.transformers import use_moefx_experts
    from moefx.signatures import ExecutionSignature, ModelSignature, resolve

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = PretrainedConfig()
            self.experts = _layout_module(transposed=False, bias=True)

        def set_experts_implementation(self, name):  # what a PreTrainedModel offers
            self.experts.config._experts_implementation = name

    cfg = CompilationConfig(moe_backend="reference", mode="eager")
    plan = resolve(ModelSignature(), ExecutionSignature(device_type="cpu"), cfg)
    holder = Holder()
    with pytest.warns(UserWarning, match="expert biases"):
        assert use_moefx_experts(holder, plan, cfg) == [
            "experts left to transformers: the moefx op does not take ['expert biases']"
        ]
    assert not hasattr(holder.experts, "moefx_backend")
    strict = CompilationConfig(moe_backend="reference", mode="eager", strict=True)
    with pytest.raises(ValueError, match="strict=true.*expert biases"):
        use_moefx_experts(holder, plan, strict)


def test_training_with_gradient_checkpointing_matches_grouped_mm():
    """What transformers' own training tests do (the issue's 14 failures): loss from labels, gradient checkpointing in
    train mode, `retain_grad` on an intermediate; moefx (grouped algorithm forced) gives grouped_mm's gradients."""
    from moefx.integrations.transformers_compat import one_thread

    grads = {}
    for impl in ("grouped_mm", "moefx"):
        with one_thread():
            grads[impl] = _checkpointed_grads(impl)
    assert grads["moefx"].keys() == grads["grouped_mm"].keys()
    experts = [n for n in grads["moefx"] if "experts" in n]
    assert experts and all(grads["moefx"][n].abs().amax() > 0 for n in experts)
    for name, g in grads["moefx"].items():
        assert _rel(g, grads["grouped_mm"][name]) <= 1e-4, name


def _checkpointed_grads(impl: str) -> dict[str, torch.Tensor]:
    model = _model("qwen3_moe")
    model.set_experts_implementation(impl)
    for m in model.modules():
        m.moefx_backend = "grouped"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    embeds = model.get_input_embeddings()(ids)
    embeds.retain_grad()
    model(inputs_embeds=embeds, labels=ids).loss.backward()
    return {"embeds": embeds.grad, **{n: p.grad for n, p in model.named_parameters() if p.grad is not None}}
