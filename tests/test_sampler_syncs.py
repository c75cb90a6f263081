"""FX-level tests of rewrite_sampler_syncs on the decomposed, functional (post-grad style) graph."""

from __future__ import annotations

import math

import pytest
import torch

from moefx.passes.rewrite_sampler_syncs import RewriteSamplerSyncs
from moefx.testing import count_ops, decomposed_graph, run_passes

aten = torch.ops.aten


def post_grad(fn, *args):
    """The functional, inductor-decomposed aten graph of `fn` (what a post-grad pass sees)."""
    return decomposed_graph(fn, *args, tracing_mode="symbolic", remove="mutations_and_views")


def run_pass(gm, race: bool = False):
    cfg = {"pass_config": {"rewrite_sampler_syncs": True, "sampler_exponential_race": race}}
    run = run_passes(gm, RewriteSamplerSyncs, config=cfg)
    return run.rewrites, run.skipped


def scalar_math(logits, t, p):
    s = t.item()
    a = torch.full_like(logits, s) + logits.clamp(min=s) * s
    b = (logits / s).masked_fill(logits < s, p.item())
    return a, b, logits > s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_item_feeding_tensor_math_becomes_0d_tensor(dtype):
    args = (torch.randn(3, 33).to(dtype), torch.tensor(0.37), torch.tensor(-2.5))
    gm = post_grad(scalar_math, *args)
    assert count_ops(gm.graph, aten._local_scalar_dense.default) == 2
    n, skipped = run_pass(gm)
    assert count_ops(gm.graph, aten._local_scalar_dense.default) == 0, (gm.graph, skipped)
    assert n == 2
    for _ in range(3):
        fresh = (torch.randn(3, 33).to(dtype), torch.rand(()) + 0.1, torch.randn(()))
        for got, ref in zip(gm(*fresh), scalar_math(*fresh)):
            assert torch.equal(got, ref)  # bit-identical


def item_feeds_topk(logits, k):
    return torch.topk(logits, k.item()).values


def item_in_control_flow(logits, t):
    s = t.item()
    return logits * (s * 2.0 + 1.0)


def test_item_feeding_a_shape_or_python_math_is_reported_and_kept():
    for fn, args in [
        (item_feeds_topk, (torch.randn(2, 16), torch.tensor(5))),
        (item_in_control_flow, (torch.randn(2, 16), torch.tensor(0.5))),
    ]:
        gm = post_grad(fn, *args)
        before = str(gm.graph)
        n, skipped = run_pass(gm)
        assert n == 0 and str(gm.graph) == before
        assert skipped and ".item()" in skipped[0] and "kept" in skipped[0]


def mask_fill(logits):
    kth = torch.topk(logits, 5)[0][..., -1, None]
    logits = logits.clone()
    logits[logits < kth] = -float("inf")
    rows = torch.ones(logits.shape[0], dtype=torch.bool)
    rows[torch.tensor([0])] = False  # integer index: no sync, left alone
    logits[rows] = 7.0  # a mask over the leading dim only
    return logits


def test_bool_index_put_becomes_where():
    gm = post_grad(mask_fill, torch.randn(4, 40))
    assert count_ops(gm.graph, aten.index_put.default) == 3  # two bool masks, one int index
    n, skipped = run_pass(gm)
    assert n == 2 and not skipped
    assert count_ops(gm.graph, aten.index_put.default) == 1  # the integer-index put is left alone
    x = torch.randn(4, 40)
    assert torch.equal(gm(x), mask_fill(x))


def gather_by_mask(logits):
    keep = logits > 0
    values = logits.clone()
    values[keep] = logits[keep] * 2  # values depend on the mask count
    return values, torch.nonzero(keep), logits[keep].sum()


def test_shape_changing_forms_are_reported_and_left_unchanged():
    gm = post_grad(gather_by_mask, torch.randn(3, 8))
    before = str(gm.graph)
    n, skipped = run_pass(gm)
    assert n == 0 and str(gm.graph) == before
    text = "\n".join(skipped)
    assert "nonzero" in text and "boolean-mask indexing" in text and "boolean index_put" in text


def sample(logits):
    return torch.multinomial(torch.softmax(logits, -1), 1)


def sample_many(probs):
    return torch.multinomial(probs, 3, replacement=False)


def sample_repl(probs):
    return torch.multinomial(probs, 3, replacement=True)


def test_multinomial_needs_the_sub_toggle():
    gm = post_grad(sample, torch.randn(2, 10))
    n, skipped = run_pass(gm, race=False)
    assert n == 0 and count_ops(gm.graph, aten.multinomial.default) == 1
    assert any("sampler_exponential_race is off" in s for s in skipped)
    gm = post_grad(sample_repl, torch.rand(2, 10))
    n, skipped = run_pass(gm, race=True)
    assert n == 0 and any("replacement" in s for s in skipped)


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper-tail p-value of Pearson's chi-square (Wilson-Hilferty normal approximation)."""
    n = counts.sum()
    expected = probs * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    k = probs.numel() - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_exponential_race_samples_the_same_distribution():
    gm = post_grad(sample, torch.randn(2, 10))
    n, _ = run_pass(gm, race=True)
    assert n == 1
    assert count_ops(gm.graph, aten.multinomial.default) == 0
    assert count_ops(gm.graph, aten.exponential.default) == 1
    torch.manual_seed(0)
    vocab, draws = 12, 40000
    logits = torch.randn(1, vocab) * 1.5
    logits[0, 3] = -float("inf")  # a filtered token is never drawn
    probs = torch.softmax(logits, -1)[0]
    got = gm(logits.expand(draws, vocab).contiguous())
    assert got.shape == (draws, 1) and got.dtype == torch.int64
    counts = torch.bincount(got[:, 0], minlength=vocab).double()
    assert counts[3] == 0
    live = probs > 0
    assert _chi_square_p(counts[live], probs[live].double()) > 1e-3
    tv = 0.5 * (counts / draws - probs.double()).abs().sum()
    assert tv < 0.02
    # Same check for the eager op, so the bound is known to be achievable and not loose by accident.
    ref = torch.bincount(sample(logits.expand(draws, vocab).contiguous())[:, 0], minlength=vocab).double()
    assert 0.5 * (ref / draws - probs.double()).abs().sum() < 0.02


def test_exponential_race_without_replacement_draws_distinct_tokens():
    probs = torch.rand(64, 9) + 0.01
    gm = post_grad(sample_many, probs)
    n, _ = run_pass(gm, race=True)
    assert n == 1 and count_ops(gm.graph, aten.topk.default) == 1
    out = gm(probs)
    assert out.shape == (64, 3)
    assert all(len(set(row.tolist())) == 3 for row in out)
    # First pick follows probs: compare the first-column histogram with the categorical on many draws.
    torch.manual_seed(1)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    first = gm(p.expand(30000, 4).contiguous())[:, 0]
    freq = torch.bincount(first, minlength=4).double() / 30000
    assert (freq - p.double()).abs().max() < 0.015


def nonzero_fill(probs):
    probs = probs.clone()
    probs[torch.nonzero(probs < 0.1, as_tuple=True)] = 0.0
    idx = (probs > 0.9).nonzero()
    probs[idx[:, 0], idx[:, 1]] = 1.0
    return probs


def nonzero_fill_and_count(probs):
    probs = probs.clone()
    idx = (probs > 0.9).nonzero()
    probs[idx[:, 0], idx[:, 1]] = 1.0
    return probs, idx.shape[0]


def test_nonzero_coordinates_fill_becomes_where():
    gm = post_grad(nonzero_fill, torch.rand(3, 8))
    assert count_ops(gm.graph, aten.nonzero.default) == 2
    n, skipped = run_pass(gm)
    assert n == 2 and not skipped
    assert count_ops(gm.graph, aten.nonzero.default) == 0
    assert count_ops(gm.graph, aten.index_put.default) == 0
    x = torch.rand(5, 8)  # a fresh shape too: the graph is symbolic
    assert torch.equal(gm(x), nonzero_fill(x))


def test_nonzero_used_elsewhere_is_reported():
    gm = post_grad(nonzero_fill_and_count, torch.rand(3, 8))
    n, skipped = run_pass(gm)
    assert n == 1  # the fill is rewritten; the count still needs the nonzero
    assert any("nonzero" in s and "kept" in s for s in skipped)
    x = torch.rand(4, 8)
    got, ref = gm(x), nonzero_fill_and_count(x)
    assert torch.equal(got[0], ref[0]) and int(got[1]) == ref[1]
