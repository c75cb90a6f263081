"""build_model(..., routing="balanced"): top-k over each layer's own hidden states spreads like uniform routing.

Uniform expectation of distinct experts for T tokens that each pick k of E experts: E * (1 - (1 - k/E)^T)
(moefx.models.routing_stats.expected_distinct). One 16-token prompt's count under exactly uniform routing has a
standard deviation of ~2.5 experts (E=64, k=4), so a single prompt lands under 90% of the expectation ~7% of the
time; the tests take each layer's mean over several fresh prompts (none is the build's calibration prompt).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen3MoeForCausalLM

from moefx.models import build_model, qwen3_moe_config, tiny_deepseek_v3_config, tiny_qwen3_moe_config
from moefx.models.routing_stats import distinct_experts, expected_distinct, uniform_expected

TINY_64 = dict(num_experts=64, num_experts_per_tok=4, num_hidden_layers=6)
# Qwen3-30B-A3B expert counts (128, top-8) at a small hidden size and depth
WIDE_128 = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=32,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def mean_distinct(model: torch.nn.Module, tokens: int, prompts: int, seed: int = 123) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, model.config.vocab_size, (prompts, tokens), generator=gen)
    counts = torch.tensor([distinct_experts(model, ids[i:i + 1]) for i in range(prompts)], dtype=torch.float64)
    return counts.mean(0).tolist()


def test_expected_distinct_is_the_without_replacement_form():
    assert expected_distinct(64, 4, 1) == pytest.approx(4.0)
    assert expected_distinct(64, 4, 16) == pytest.approx(64 * (1 - (60 / 64) ** 16))
    assert expected_distinct(128, 8, 256) == pytest.approx(128.0, abs=1e-3)


@pytest.mark.parametrize("cfg", [tiny_qwen3_moe_config(**TINY_64), qwen3_moe_config(4, **WIDE_128)],
                         ids=["tiny-64e-top4-6l", "128e-top8-4l"])
@pytest.mark.parametrize("tokens,prompts", [(16, 8), (256, 2)])
def test_balanced_hits_90pct_of_uniform_in_every_layer(cfg, tokens, prompts):
    model = build_model(cfg, seed=0, routing="balanced")
    want = 0.9 * uniform_expected(model, tokens)
    got = mean_distinct(model, tokens, prompts)
    assert len(got) == cfg.num_hidden_layers
    assert min(got) >= want, f"distinct experts per layer {got}, 90% of uniform {want:.1f}"


def test_as_built_routing_is_concentrated():
    """The reason for the balanced build: the default weights fail the same bar (the test above can fail)."""
    model = build_model(tiny_qwen3_moe_config(**TINY_64), seed=0)
    assert min(mean_distinct(model, 16, 8)) < 0.9 * uniform_expected(model, 16)


def test_default_build_is_unchanged():
    cfg = tiny_qwen3_moe_config()
    torch.manual_seed(3)
    ref = Qwen3MoeForCausalLM(cfg).eval()  # what build_model did before routing= existed
    for model in (build_model(cfg, seed=3), build_model(cfg, seed=3, routing="as_built")):
        got = dict(model.named_parameters())
        for name, p in ref.named_parameters():
            assert torch.equal(got[name], p), name


def test_balanced_is_deterministic_and_keeps_shapes():
    cfg = tiny_qwen3_moe_config(**TINY_64)
    a, b = build_model(cfg, seed=4, routing="balanced"), build_model(cfg, seed=4, routing="balanced")
    plain = dict(build_model(cfg, seed=4).named_parameters())
    changed = 0
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
        assert p.shape == plain[name].shape and p.dtype == plain[name].dtype, name
        changed += not torch.equal(p, plain[name])
    assert changed > 0
    assert not torch.equal(dict(a.named_parameters())["model.layers.0.mlp.gate.weight"],
                           dict(build_model(cfg, seed=5, routing="balanced").named_parameters())[
                               "model.layers.0.mlp.gate.weight"])


def test_balanced_deepseek_v3_layout_builds_and_routes():
    model = build_model(tiny_deepseek_v3_config(), seed=0, routing="balanced")
    assert len(mean_distinct(model, 16, 2)) == 1  # one MoE layer (the first is dense)


def test_bad_routing_and_unbalanceable_model():
    with pytest.raises(ValueError, match="routing='uniform'.*as_built, balanced"):
        build_model(tiny_qwen3_moe_config(), routing="uniform")
    dense = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(ValueError, match="cannot balance LlamaForCausalLM: it has no transformers experts"):
        build_model(dense, routing="balanced")
