"""Qwen3-MoE (and DeepSeek-V3-layout) models built from a transformers config with seeded random weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen3MoeConfig, Qwen3MoeForCausalLM


def tiny_qwen3_moe_config(**overrides: Any) -> Qwen3MoeConfig:
    """A 2-layer, 8-expert Qwen3-MoE small enough for CPU tests (about 0.16 M parameters)."""
    params: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    params.update(overrides)
    return Qwen3MoeConfig(**params)


def tiny_deepseek_v3_config(**overrides: Any) -> DeepseekV3Config:
    """A 2-layer DeepSeek-V3 layout (MLA attention, one dense layer then 8 routed + 1 shared expert, grouped
    sigmoid routing) small enough for CPU tests."""
    params: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    params.update(overrides)
    return DeepseekV3Config(**params)


def qwen3_moe_config(num_layers: int = 8, **overrides: Any) -> Qwen3MoeConfig:
    """Qwen3-30B-A3B widths (E=128, H=2048, I=768, top-8) with `num_layers` layers."""
    params: dict[str, Any] = dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    )
    params.update(overrides)
    return Qwen3MoeConfig(**params)


ROUTINGS = ("as_built", "balanced")


def build_model(
    config: Any, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    routing: str = "as_built",
) -> torch.nn.Module:
    """Instantiate the causal LM of `config` (Qwen3MoeForCausalLM for a Qwen3MoeConfig) with weights drawn from a
    seeded generator. `routing="as_built"` keeps transformers' initialisation (a deep model then routes most tokens
    to a few experts); `"balanced"` draws the scales that make top-k routing spread like a trained model's
    (moefx/models/balance.py; benchmarks use it)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r}: valid choices are {', '.join(ROUTINGS)}")
    torch.manual_seed(seed)
    # parameters are created in `dtype` on `device`: a 48-layer Qwen3-30B-A3B-width model is ~61 GB in bf16 and
    # would need twice that if it were drawn in float32 first (it then no longer fits an 80 GB card)
    with torch.device(device), _default_dtype(dtype):
        if isinstance(config, Qwen3MoeConfig):
            model = Qwen3MoeForCausalLM(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
    model = model.to(dtype=dtype).eval()
    if routing == "balanced":
        from moefx.models.balance import balance_routing

        balance_routing(model, seed)
    return model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default floating dtype set to `dtype` inside the block (integer dtypes leave it as it is)."""
    previous = torch.get_default_dtype()
    if dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
