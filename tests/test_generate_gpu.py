"""`optimize` + `generate()` on CUDA: the decode step compiled and replayed from CUDA graphs per bucket."""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch

import moefx
from moefx.models import build_model, tiny_qwen3_moe_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.compile,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(seed)).cuda()


def test_captured_greedy_equals_transformers_fp32():
    """fp32 (no TF32): the compiled, graph-replayed engine gives transformers' eager tokens; batch 3 runs in its own
    bucket, batch 6 above max_batch_size 4 runs without a graph. The experts run moefx's gemv (capturable in fp32;
    the tiny shapes have no calibration row, and transformers' fp32 grouped_mm fallback reads offsets on the host)."""
    stock = build_model(tiny_qwen3_moe_config(), seed=2, device="cuda")
    model = moefx.optimize(copy.deepcopy(stock), config={"max_batch_size": 4, "moe_backend": "gemv"})
    for batch in (1, 3, 6):
        ids = _ids(batch, 7, batch)
        want = stock.generate(ids, max_new_tokens=10, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), want), batch
    stats = model.moefx_generate.engine.stats
    above = ("batches above the largest capture size 4 decode without a CUDA graph (first: batch 6); config key "
             "'max_batch_size' sets the largest")
    assert stats.captures == 2 and stats.uncaptured == [above] and stats.above_cap == 1, stats
    assert model.moefx_generate.fallbacks == [f"engine: {above}"]
    assert stats.graph_bytes > 0 and stats.slots == 3  # the graph pools count against the memory budget


def test_default_plan_captures_lazily_and_a_request_over_the_budget_fails_before_allocating():
    """No max_batch_size: capture sizes up to a cap from this GPU's free memory, each captured on first use. A
    request whose cache cannot fit in the memory budget raises MemoryBudgetError with nothing allocated (no CUDA
    out-of-memory half-way)."""
    from moefx.engine.memory import MemoryBudgetError, cache_bytes

    stock = build_model(tiny_qwen3_moe_config(), seed=2, device="cuda")
    budget = 4 * cache_bytes(stock.config, 16, 256, torch.float32)
    model = moefx.optimize(copy.deepcopy(stock), config={"moe_backend": "gemv", "memory_budget": budget})
    sizes = model.moefx_plan.serving["capture_sizes"]
    assert sizes[:10] == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96], sizes
    assert "from memory" in model.moefx_plan.serving_sources["capture_sizes"]
    ids = _ids(12, 7, 12)
    want = stock.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), want)
    stats = model.moefx_generate.engine.stats
    assert stats.captures == 1 and stats.slots == 1  # bucket 16 only: nothing captured ahead of use
    decode = [c for c in stats.capture_seconds if c["what"] == "decode"]  # its parts timed (moefx/engine/graphs.py)
    assert len(decode) == 1 and decode[0]["batch"] == 16 and decode[0]["captured"], decode
    assert all(decode[0][part] >= 0 for part in ("first_run", "check_run", "capture")), decode
    big = _ids(96, 7, 1)  # bucket 96: six times the 16-row cache, above the whole budget
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with pytest.raises(MemoryBudgetError, match="MOEFX_MEMORY_BUDGET"):
        model.generate(big, max_new_tokens=6, do_sample=False)
    assert torch.cuda.max_memory_allocated() - before < cache_bytes(stock.config, 96, 256, torch.float32) // 4
    assert stats.slot_allocations == 1 and stats.slots == 1


def test_evicted_slots_give_their_memory_back():
    """Under a budget that holds one of these caches, the 4096-long slot evicts the 3072-long one (which then
    serves nobody: the longer slot takes the shorter requests), and the evicted memory is free at once: nothing
    waits for Python's cyclic collector (a 500-request stream's peak doubled while evicted caches did). The
    evicted slot held the only graphs: the next capture still works."""
    from moefx.engine.memory import cache_bytes

    stock = build_model(tiny_qwen3_moe_config(max_position_embeddings=8192), seed=2, device="cuda")
    smaller = cache_bytes(stock.config, 64, 3072, torch.float32)
    budget = cache_bytes(stock.config, 64, 4096, torch.float32) + 32 * 2**20
    model = moefx.optimize(stock, config={"moe_backend": "gemv", "memory_budget": budget})
    gc.disable()
    try:
        for prompt in (2900, 4000, 2900, 4000):  # cache lengths 3072, 4096, 3072, 4096
            model.generate(_ids(64, prompt, prompt), max_new_tokens=3, do_sample=False)
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
            gc.collect()
            torch.cuda.synchronize()
            waiting = held - torch.cuda.memory_allocated()
            assert waiting < smaller // 2, (prompt, waiting / 2**20)
    finally:
        gc.enable()
    stats = model.moefx_generate.engine.stats
    assert (stats.evictions, stats.slot_allocations, stats.slots) == (1, 2, 1), stats.describe_slots()
    # the new slot's step was captured into the pool the evicted one's graphs had left (GraphPool), and the
    # random numbers still work: a capture into a dead pool fails and leaves the CUDA generator in capture mode
    assert stats.captures == 2 and not stats.uncaptured, stats.uncaptured
    torch.randn(4, device="cuda").normal_()


def test_a_step_that_syncs_the_host_is_not_captured_and_leaves_the_process_healthy():
    """fp32 experts on transformers' path read their offsets on the host: the engine finds that before capturing,
    says so, runs the steps without a graph (same tokens), and random numbers still work afterwards."""
    stock = build_model(tiny_qwen3_moe_config(), seed=2, device="cuda")
    model = moefx.optimize(copy.deepcopy(stock), config={"moe_backend": "upstream"})
    ids = _ids(1, 7, 0)
    want = stock.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), want)
    stats = model.moefx_generate.engine.stats
    assert stats.captures == 0 and "syncs the host" in stats.uncaptured[0], stats
    torch.randn(4, device="cuda").normal_()


def test_capture_mode_with_a_static_cache_request_does_not_crash():
    """The crash this replaces: optimize(mode="capture") + generate(cache_implementation="static") ended in SIGSEGV
    after inductor skipped its CUDA graphs over StaticLayer's in-place write position. Now the request runs on the
    engine, and a request the engine does not take (beam search) runs transformers' loop on the compiled forward."""
    stock = build_model(tiny_qwen3_moe_config(), seed=3, dtype=torch.bfloat16, device="cuda")
    model = moefx.optimize(copy.deepcopy(stock), config={"mode": "capture"})
    ids = _ids(1, 6, 0)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
    assert out.shape == (1, 14) and model.moefx_generate.engine.stats.captures == 1
    beams = model.generate(ids, max_new_tokens=4, num_beams=2, cache_implementation="static")
    assert beams.shape == (1, 10) and "num_beams=2" in model.moefx_generate.fallbacks[-1]
    torch.cuda.synchronize()


def test_sampling_inside_the_graph_draws_fresh_numbers_each_step():
    stock = build_model(tiny_qwen3_moe_config(), seed=4, dtype=torch.bfloat16, device="cuda")
    model = moefx.optimize(copy.deepcopy(stock), config={"max_batch_size": 2})
    ids = _ids(2, 5, 1)
    kwargs = dict(max_new_tokens=24, do_sample=True, temperature=1.0, top_k=0)
    torch.manual_seed(0)
    first = model.generate(ids, **kwargs)
    torch.manual_seed(0)
    again = model.generate(ids, **kwargs)
    torch.manual_seed(1)
    other = model.generate(ids, **kwargs)
    assert torch.equal(first, again) and not torch.equal(first, other)
    new = first[:, 5:]
    assert len(set(new[0].tolist())) > 4  # a replayed graph that reused its random numbers would repeat a pattern
    assert model.moefx_generate.engine.stats.captures == 1


def test_captured_prefill_gives_the_uncaptured_tokens():
    """fp32: greedy tokens after the prefill replayed from a CUDA graph (mode capture, prompt right-padded to its
    bucket) equal those after mode compile's prefill (unpadded, no graph) and transformers'. Prompt lengths: 16
    (a bucket), 37 (padded to 64), 200 (above the largest bucket at prefill_capture_tokens 128: the dynamic
    prefill); two rows left-padded or not. Mode compile captures no prefill."""
    stock = build_model(tiny_qwen3_moe_config(), seed=6, device="cuda")
    config = {"max_batch_size": 2, "moe_backend": "gemv", "prefill_capture_tokens": 128}
    captured = moefx.optimize(copy.deepcopy(stock), config=config)
    compiled = moefx.optimize(copy.deepcopy(stock), config={**config, "mode": "compile"})
    for batch, length, padded in ((1, 16, False), (1, 37, False), (1, 200, False), (2, 37, False), (2, 37, True)):
        ids = _ids(batch, length, length)
        mask = torch.ones_like(ids)
        if padded:
            mask[1, :11] = 0
            ids = ids.masked_fill(mask == 0, 0)
        kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        want = compiled.generate(ids, **kwargs)
        assert torch.equal(captured.generate(ids, **kwargs), want), (batch, length, padded)
        assert torch.equal(stock.generate(ids, **kwargs), want), (batch, length, padded)
        assert torch.equal(captured.generate(ids, **kwargs), want), (batch, length, padded)  # replayed again
    stats = captured.moefx_generate.engine.stats
    assert stats.prefill_buckets == (16, 32, 64, 128) and stats.prefill_captures == 4, stats
    assert not stats.uncaptured and stats.prefill_graph_bytes >= 0, stats
    assert stats.compiles.get("prefill[padded]", 0) <= 3 and "prefill" in stats.compiles, stats.compiles  # B 1, 2, mask
    plain = compiled.moefx_generate.engine.stats
    assert plain.prefill_buckets == () and plain.prefill_captures == 0, plain
    assert captured.moefx_generate.fallbacks == [] and compiled.moefx_generate.fallbacks == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sampled_steps_replayed_or_called_directly_give_the_same_logits_and_tokens(dtype, isolated_moe_tables,
                                                                                   monkeypatch):
    """Same seed, same engine: the prefill and steps replayed from graphs captured in this request (with its
    compiles), from graphs captured earlier, and called directly with the graphs off give the same logits and
    tokens, bit for bit; batch 3 runs in bucket 4. The dense rows written here run the q/k/v gemv when captured and
    cuBLAS eager, so a direct call that decided as an eager one would run other kernels, and so would a capture
    whose warm-ups did not create the gemv's split-K counters (capture_mode.py)."""
    from moefx.backends import dense_policy
    from moefx.backends.calibration import parse_ranges
    from moefx.backends.capture_mode import as_captured
    from moefx.backends.dense import select_backend
    from moefx.kernels import dense_gemm as dense_kernels
    from moefx.sampling.sampler import SamplingParams

    monkeypatch.setattr(dense_kernels, "_COUNTERS", {})  # as in a fresh process: no gemv has run yet

    cfg = tiny_qwen3_moe_config(hidden_size=1024)  # K 1024: the q/k/v gemv splits K (4 rows: 2 ways, 64 rows: 4)
    ns, k = [cfg.num_attention_heads * cfg.head_dim, *[cfg.num_key_value_heads * cfg.head_dim] * 2], cfg.hidden_size
    table = os.path.join(os.environ["XDG_CONFIG_HOME"], "moefx", "calibration", "dense.yaml")  # the fixture's
    timings = {"gemv": {1: 1.0, 512: 1.0}, "upstream": {1: 2.0, 512: 2.0}}  # the grid: M 1..512
    for mode, ranges in (("capture", "gemv@1-"), ("eager", "upstream@1-")):
        key = dense_policy.dense_key("cuda", ns, k, dtype, None, mode)
        row = dense_policy.DenseRow(key, parse_ranges(ranges, "test"), {"date": "2026-12-01"}, "", timings)
        dense_policy.write_dense_row(table, row)
    x, ws = torch.zeros(4, k, dtype=dtype, device="cuda"), [torch.zeros(n, k, dtype=dtype, device="cuda") for n in ns]
    assert [select_backend(x, ws, [], None, None, capturing=c) for c in (True, False, None)] == [
        "gemv", "upstream", "upstream"]
    with as_captured():
        assert select_backend(x, ws, [], None, None) == "gemv"

    stock = build_model(cfg, seed=8, dtype=dtype, device="cuda")
    model = moefx.optimize(copy.deepcopy(stock), config={"max_batch_size": 4, "moe_backend": "gemv"})
    engine = model.moefx_generate.engine
    ids = _ids(3, 9, 2)
    runs = []
    for graphs in (True, True, False):
        engine.cuda_graphs = graphs
        torch.manual_seed(3)
        logits: list[torch.Tensor] = []
        tokens = engine.generate(ids, 16, SamplingParams(temperature=0.9, top_p=0.9), logits_out=logits)
        runs.append((tokens, torch.stack(logits)))
    engine.cuda_graphs = True
    (tokens, logits), *others = runs
    for name, (other_tokens, other_logits) in zip(("replayed", "direct"), others):
        assert torch.equal(other_logits, logits), (name, (other_logits - logits).abs().max())
        assert torch.equal(other_tokens, tokens), (name, (other_tokens == tokens).float().mean())
    assert engine.stats.captures == 1 and engine.stats.prefill_captures == 1 and not engine.stats.uncaptured
