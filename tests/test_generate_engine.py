"""`generate()` on moefx's decode engine gives transformers' tokens (fp32, CPU), and says when it cannot run.

The engine's steps run eagerly here (mode eager) except in the one compiled test; CUDA graphs are checked in
tests/test_generate_gpu.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import moefx
from moefx.engine.engine import DecodeLoop
from moefx.models import build_model, tiny_qwen3_moe_config
from moefx.sampling.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def models():
    stock = build_model(tiny_qwen3_moe_config(), seed=5)
    optimized = moefx.optimize(copy.deepcopy(stock), config={"mode": "eager"})
    return stock, optimized


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_greedy_tokens_equal_transformers(models):
    stock, model = models
    before = len(model.moefx_generate.fallbacks)
    for batch, length in ((1, 5), (3, 9)):
        ids = _ids(batch, length, batch)
        want = stock.generate(ids, max_new_tokens=9, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=9, do_sample=False), want)
        assert torch.equal(model.generate(input_ids=ids, max_length=length + 4, do_sample=False), want[:, :-5])
    assert len(model.moefx_generate.fallbacks) == before
    assert model.moefx_generate.engine.stats.requests >= 4


def test_eos_and_stopping_criteria_equal_transformers(models):
    stock, model = models
    before = len(model.moefx_generate.fallbacks)
    ids = _ids(2, 6, 11)
    free = stock.generate(ids, max_new_tokens=8, do_sample=False)
    for step in (0, 3, 7):  # EOS as the first, a middle and the last new token of row 0
        eos = int(free[0, 6 + step])
        kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0)
        got = model.generate(ids, **kwargs)
        assert torch.equal(got, stock.generate(ids, **kwargs)), step

    class LastTokenIs(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == int(free[1, 9])

    criteria = StoppingCriteriaList([LastTokenIs()])
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, stopping_criteria=criteria)
    assert torch.equal(model.generate(ids, **kwargs), stock.generate(ids, **kwargs))
    assert len(model.moefx_generate.fallbacks) == before


def test_left_padding_equals_transformers(models):
    stock, model = models
    ids = _ids(3, 8, 2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kwargs = dict(max_new_tokens=7, do_sample=False, pad_token_id=0)
    want = stock.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(model.generate(ids, attention_mask=mask, **kwargs), want)
    assert torch.equal(model.generate(ids, **kwargs), want)  # the mask inferred from the pad tokens
    right = mask.flip(-1)
    model.generate(ids, attention_mask=right, **kwargs)
    assert "right-padded" in model.moefx_generate.fallbacks[-1]
    fallbacks = len(model.moefx_generate.fallbacks)
    model.generate(ids.flip(-1), **kwargs)  # pad tokens at the end: the mask inferred from them is right-padded
    assert len(model.moefx_generate.fallbacks) == fallbacks + 1 and "right-padded" in model.moefx_generate.fallbacks[-1]


def test_batches_padded_to_the_bucket_give_the_same_tokens(models):
    stock, _ = models
    loop = DecodeLoop(stock, capture_sizes=[1, 2, 4, 8])
    for batch in (3, 5, 9):
        ids = _ids(batch, 6, batch)
        want = stock.generate(ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(loop.generate(ids, 6, GREEDY), want), batch
    assert loop.bucket(3) == (4, True) and loop.bucket(9) == (9, False)  # 9: above the capture sizes
    assert sorted(rows for rows, _ in loop.slots.keys()) == [4, 8, 9]


def test_sampling_runs_on_the_engine_and_follows_the_seed(models):
    _, model = models
    before = len(model.moefx_generate.fallbacks)
    ids = _ids(2, 5, 3)
    kwargs = dict(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20, top_p=0.9)
    torch.manual_seed(1)
    first = model.generate(ids, **kwargs)
    torch.manual_seed(1)
    assert torch.equal(model.generate(ids, **kwargs), first)
    torch.manual_seed(2)
    assert not torch.equal(model.generate(ids, **kwargs), first)
    assert first.shape == (2, 17) and len(model.moefx_generate.fallbacks) == before


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"num_beams": 2}, "num_beams=2"),
        ({"repetition_penalty": 1.3}, "RepetitionPenaltyLogitsProcessor"),
        ({"return_dict_in_generate": True, "output_scores": True}, "return_dict_in_generate"),
        ({"min_new_tokens": 3, "eos_token_id": 7}, "MinNewTokensLengthLogitsProcessor"),
    ],
)
def test_what_the_engine_does_not_do_runs_transformers_loop(models, kwargs, reason):
    stock, model = models
    ids = _ids(2, 5, 4)
    got = model.generate(ids, max_new_tokens=5, do_sample=False, **kwargs)
    want = stock.generate(ids, max_new_tokens=5, do_sample=False, **kwargs)
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    else:
        assert torch.equal(got.sequences, want.sequences)
    assert reason in model.moefx_generate.fallbacks[-1]


def test_plan_says_where_generate_runs(models):
    _, model = models
    line = next(p for p in model.moefx_plan.provenance if "engine" in p)
    assert "static KV cache" in line and "mode eager" in line


@pytest.mark.compile
def test_compiled_engine_tokens_equal_eager_with_bounded_compiles():
    """Default mode on the CPU: prefill, decode step and sampler compiled with the moefx backend. Batch rows and
    cache length are dynamic from the first compile, so new prompt lengths, batch sizes >= 2 and a longer cache
    reuse every compiled function; a new temperature, top-p or top-k of the same form (`SamplingParams.form`)
    reuses the sampler and only a new form compiles it once more. One layer: each compile is a cold inductor C++
    build, and a second layer adds code, not cases."""
    torch._dynamo.reset()
    stock = build_model(tiny_qwen3_moe_config(num_hidden_layers=1), seed=1)
    model = moefx.optimize(copy.deepcopy(stock), config={"pass_config": {"eliminate_noops": True}})
    assert model.moefx_plan.pass_enabled("eliminate_noops")
    for batch, length in ((2, 7), (2, 11), (3, 9), (2, 300)):  # 300 + 5 positions: the next cache length, 384
        ids = _ids(batch, length, length)
        want = stock.generate(ids, max_new_tokens=5, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), want), (batch, length)
    stats = model.moefx_generate.engine.stats
    assert sorted(length for _, length in model.moefx_generate.engine.slots.keys()) == [256, 256, 384]
    assert stats.compiles == {"prefill": 1, "decode": 1, "sampler": 1}, stats.compiles
    for batch, kwargs in ((3, {"temperature": 0.7, "top_k": 20}), (2, {"temperature": 1.3, "top_k": 30}),
                          (4, {"temperature": 0.9, "top_k": 25, "top_p": 0.8})):
        torch.manual_seed(batch)
        out = model.generate(_ids(batch, 6, 6), max_new_tokens=4, do_sample=True, **kwargs)
        assert out.shape == (batch, 10) and int(out.max()) < stock.config.vocab_size
    # top_k 20/30/25 share the form top_k 32; top_p on is a second form; the model's steps compile no more
    assert stats.compiles == {"prefill": 1, "decode": 1, "sampler": 3}, stats.compiles
    assert set(stats.compile_s) == set(stats.compiles)
    assert model.moefx_generate.fallbacks == []
