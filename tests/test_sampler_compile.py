"""One end-to-end compile through moefx.backend: the sampler passes run inside inductor and report sources."""

from __future__ import annotations

import torch

import moefx


def sampler(logits, temperature, top_p):
    t = temperature.item()
    scaled = logits / t
    kth = torch.topk(scaled, 5)[0][..., -1, None]
    scaled[scaled < kth] = -float("inf")
    cum = torch.softmax(scaled, -1).sort(-1, descending=True)[0].cumsum(-1)
    probs = torch.softmax(scaled.clamp(min=-t * 1e4), -1)
    return torch.multinomial(probs, 1), (cum < top_p.item()).sum(-1), torch.nonzero(probs > 0.5)


def test_compiled_sampler_is_rewritten_and_reports_what_it_keeps():
    cfg = {"pass_config": {"rewrite_sampler_syncs": True, "sampler_exponential_race": True}}
    be = moefx.backend(cfg)
    moefx.clear_compile_reports()
    torch._dynamo.reset()
    dyn = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True}
    # A cache hit would skip the post-grad passes and their reports.
    with torch._dynamo.config.patch(dyn), torch._inductor.config.patch(fx_graph_cache=False):
        fn = torch.compile(sampler, backend=be, fullgraph=True)
        logits = torch.randn(4, 64)
        tok, kept, big = fn(logits.clone(), torch.tensor(0.8), torch.tensor(0.9))
    torch._dynamo.reset()
    assert tok.shape == (4, 1)
    # Every token drawn is among the top-5 of its row (filtering happened before sampling).
    top5 = torch.topk(logits, 5).indices
    assert all(int(tok[i, 0]) in top5[i].tolist() for i in range(4))
    _, ref_kept, ref_big = sampler(logits.clone(), torch.tensor(0.8), torch.tensor(0.9))
    assert torch.equal(kept, ref_kept) and torch.equal(big, ref_big)
    reports = moefx.compile_reports()
    assert sum(r.matches.get("rewrite_sampler_syncs", 0) for r in reports) >= 2
    skipped = "\n".join(s for r in reports for s in r.skipped.get("rewrite_sampler_syncs", []))
    assert "nonzero" in skipped and "test_sampler_compile.py" in skipped
    assert not any(line.startswith("multinomial") for line in skipped.splitlines())  # raced, not kept
