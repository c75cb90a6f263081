"""routing="balanced" at full Qwen3-30B-A3B widths and depth (48 layers, bf16, the benchmarks' model): every layer
hits >= 90% of the uniform expectation of distinct experts (per layer, the mean over fresh prompts), at 16 and 256
tokens and for a decode step of B=16 sequences. Skipped without a GPU (the model is ~61 GB)."""

from __future__ import annotations

import pytest
import torch

from moefx.models import build_model, qwen3_moe_config
from moefx.models.routing_stats import decode_distinct_experts, distinct_experts, uniform_expected

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def model():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: 48 layers in fp32 would not fit one GPU
    try:
        m = build_model(qwen3_moe_config(48), seed=0, dtype=torch.bfloat16, device="cuda", routing="balanced")
    finally:
        torch.set_default_dtype(default)
    yield m
    del m
    torch.cuda.empty_cache()


@pytest.mark.parametrize("tokens,prompts", [(16, 8), (256, 2)])
def test_balanced_30b_widths_48_layers(model, tokens, prompts):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(1, model.config.vocab_size, (prompts, tokens), generator=gen).cuda()
    counts = torch.tensor([distinct_experts(model, ids[i:i + 1]) for i in range(prompts)], dtype=torch.float64)
    got = counts.mean(0).tolist()
    want = 0.9 * uniform_expected(model, tokens)
    assert min(got) >= want, f"distinct experts per layer {[round(x, 1) for x in got]}, 90% of uniform {want:.1f}"


def test_balanced_decode_step_b16(model):
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(1, model.config.vocab_size, (16, 64), generator=gen).cuda()
    got = list(decode_distinct_experts(model, ids, steps=4).values())
    want = 0.9 * uniform_expected(model, 16)
    assert min(got) >= want, f"distinct experts per layer {[round(x, 1) for x in got]}, 90% of uniform {want:.1f}"
