"""`attn_implementation="moefx"`'s mask function: a plain causal mask over a fresh prompt is left out, so SDPA runs
`is_causal=True` under torch.compile whatever the versions (transformers 5.17 with torch 2.11, the H200's, passes the
dense mask there), and the logits stay those of transformers' SDPA path (fp32, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from moefx.integrations.attention import NAME, is_fresh_causal, register
from moefx.models import build_model, tiny_qwen3_moe_config


def _sdpa_calls(model: torch.nn.Module, **inputs) -> tuple[list[tuple[bool, bool]], torch.Tensor]:
    """(is_causal, has a mask) of every SDPA call in the graph dynamo traces for `model(**inputs)`, and its logits."""
    calls: list[tuple[bool, bool]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and "scaled_dot_product_attention" in str(node.target):
                mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                calls.append((bool(node.kwargs.get("is_causal", False)), mask is not None))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        logits = torch.compile(model, backend=backend, fullgraph=False)(**inputs).logits
    torch._dynamo.reset()
    return calls, logits


@pytest.fixture(scope="module")
def models():
    stock = build_model(tiny_qwen3_moe_config(num_hidden_layers=2), seed=3)
    stock.set_attn_implementation("sdpa")
    ours = copy.deepcopy(stock)
    register()
    ours.set_attn_implementation(NAME)
    return stock, ours


def test_a_fresh_prompt_runs_sdpa_causal_without_a_mask_under_compile(models):
    stock, ours = models
    ids = torch.randint(1, 256, (2, 13), generator=torch.Generator().manual_seed(0))
    calls, logits = _sdpa_calls(ours, input_ids=ids)
    _, want = _sdpa_calls(stock, input_ids=ids)  # a dense mask or none, by transformers and torch version
    assert calls == [(True, False)] * 2, calls
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)


def test_a_padded_prompt_keeps_its_mask(models):
    stock, ours = models
    ids = torch.randint(1, 256, (2, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    calls, logits = _sdpa_calls(ours, input_ids=ids, attention_mask=mask)
    _, want = _sdpa_calls(stock, input_ids=ids, attention_mask=mask)
    assert calls == [(False, True)] * 2, calls
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)


def test_only_the_square_causal_mask_from_position_zero_is_left_out():
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    fresh = dict(batch_size=1, q_length=8, kv_length=8, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                 attention_mask=None, allow_is_causal_skip=True)
    assert is_fresh_causal(fresh)
    for change in ({"kv_length": 256}, {"q_length": 1, "kv_length": 1}, {"kv_offset": 4}, {"q_offset": 3},
                   {"q_offset": torch.tensor(0)}, {"attention_mask": torch.ones(1, 8, dtype=torch.bool)},
                   {"mask_function": sliding_window_causal_mask_function(4)}, {"local_size": 4},
                   {"allow_is_causal_skip": False}):
        assert not is_fresh_causal({**fresh, **change}), change
