"""moefx's own sampler: same filtering as transformers' warpers, the right distribution, no sync ops."""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from moefx.sampling.sampler import SamplingParams, candidate_probs, sample

PARAMS = [
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=0, top_p=0.7),
    SamplingParams(temperature=0.6, top_k=20, top_p=1.0, min_p=0.05),
    SamplingParams(temperature=1.0),
]


def hf_scores(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    procs = LogitsProcessorList([TemperatureLogitsWarper(p.temperature)])
    if p.top_k:
        procs.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        procs.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        procs.append(MinPLogitsWarper(p.min_p))
    return procs(None, logits.clone())


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_kept_tokens_and_probabilities_match_transformers(params):
    logits = torch.randn(6, 500) * 3
    probs, ids = candidate_probs(logits, params)
    ours = torch.zeros_like(logits).scatter(-1, ids, probs)
    ref = torch.softmax(hf_scores(logits, params), -1)
    assert torch.equal(ours > 0, ref > 0)
    ours = ours / ours.sum(-1, keepdim=True)
    assert (ours - ref).abs().max() < 1e-5


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_values_through_the_form_give_the_same_probabilities(params):
    """The engine's path: the params' form fixes the compiled shape, the values come as a tensor; the kept
    tokens and their probabilities are those of the params themselves (top_k 50 in the form 64, 20 in 32)."""
    logits = torch.randn(6, 500) * 3
    want_probs, want_ids = candidate_probs(logits, params)
    probs, ids = candidate_probs(logits, params.form(), torch.tensor(params.values()))
    want = torch.zeros_like(logits).scatter(-1, want_ids, want_probs)
    got = torch.zeros_like(logits).scatter(-1, ids, probs)
    assert torch.equal(got > 0, want > 0)
    assert (got - want).abs().max() < 1e-6


def test_one_form_for_values_that_only_scale():
    forms = {SamplingParams(temperature=t, top_k=k, top_p=p).form()
             for t in (0.5, 1.0, 1.7) for k in (17, 20, 32) for p in (0.8, 0.95)}
    assert forms == {SamplingParams(top_k=32, top_p=0.5)}
    assert SamplingParams(top_k=3).form().top_k == 16 and SamplingParams(top_k=33).form().top_k == 64
    assert SamplingParams(temperature=0.0, top_k=7).form() == SamplingParams(temperature=0.0)
    assert SamplingParams(min_p=0.1).form().min_p > 0 and SamplingParams().form().top_k == 0


def test_draws_follow_the_filtered_distribution():
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.9)
    row = torch.randn(1, 64) * 2
    draws = 40000
    got = sample(row.expand(draws, 64), params)
    ref = torch.softmax(hf_scores(row, params), -1)[0].double()
    counts = torch.bincount(got, minlength=64).double()
    assert counts[ref == 0].sum() == 0  # never a filtered token
    live = ref > 0
    expected = ref[live] * draws
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    k = int(live.sum()) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    assert 0.5 * math.erfc(z / math.sqrt(2)) > 1e-3  # chi-square p-value
    assert 0.5 * (counts / draws - ref).abs().sum() < 0.02  # total variation


def test_greedy_and_seeded_generator():
    logits = torch.randn(4, 100)
    assert torch.equal(sample(logits, SamplingParams(temperature=0)), logits.argmax(-1))
    params = SamplingParams(temperature=0.9, top_k=10)
    a = sample(logits, params, torch.Generator().manual_seed(3))
    b = sample(logits, params, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.dtype == torch.int64 and a.shape == (4,)


def test_the_sampler_has_no_sync_ops():
    gm = make_fx(lambda x: sample(x, PARAMS[0]), tracing_mode="symbolic")(torch.randn(3, 300))
    syncs = {"_local_scalar_dense", "nonzero", "multinomial", "index_put_", "masked_select", "item"}
    names = {str(n.target).split(".")[1] for n in gm.graph.nodes if n.op == "call_function" and "aten" in str(n.target)}
    assert not names & syncs, names & syncs


@pytest.mark.parametrize(
    "kwargs,key",
    [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0}, "top_p"), ({"min_p": 1}, "min_p")],
)
def test_bad_params_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        SamplingParams(**kwargs)
