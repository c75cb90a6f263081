"""Qwen3-MoE models built from a transformers config with seeded random weights (no download)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


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


def build_model(
    config: Any, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """Instantiate `Qwen3MoeForCausalLM(config)` with weights drawn from a seeded generator."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config)
    return model.to(dtype=dtype).eval()
