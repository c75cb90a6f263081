"""The decode engine's slots (CPU, fp32, eager steps): geometric cache lengths, one memory budget with
least-recently-used eviction, a request that cannot fit raising before it allocates, the counts in stats and
describe(), the above-the-cap line, and the budget's config key and env knob."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch

from moefx.config import CompilationConfig, parse_memory_budget
from moefx.engine.engine import DecodeLoop
from moefx.engine.hf_generate import install_generate
from moefx.engine.memory import MemoryBudgetError, cache_bytes
from moefx.engine.slots import SlotPool, cache_len
from moefx.env import get_setting
from moefx.models import build_model, tiny_qwen3_moe_config
from moefx.sampling.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def stock():
    return build_model(tiny_qwen3_moe_config(), seed=7)


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_cache_lengths_grow_geometrically():
    """A context growing one token at a time to L allocates O(log L) lengths (256-token steps took L/256)."""
    lengths = [cache_len(n) for n in range(1, 65537)]
    buckets = sorted(set(lengths))
    assert buckets[:6] == [256, 384, 512, 768, 1024, 1536] and buckets[-1] == 65536
    assert len(buckets) <= 2 * 8 + 1  # 256 * 2**8 = 65536: two buckets per doubling
    assert all(n <= length for n, length in zip(range(1, 65537), lengths))
    assert all(b / a <= 1.5 for a, b in zip(buckets, buckets[1:]))  # at most 50% of a cache is never used
    assert cache_len(300, limit=320) == 320 and cache_len(17, min_len=16) == 24


def test_cache_bytes_are_what_the_engine_allocates(stock):
    loop = DecodeLoop(stock, memory_budget=1e9)
    loop.generate(_ids(3, 5, 0), 4, GREEDY)
    slot = next(iter(loop.slots._slots.values()))
    held = sum(t.nbytes for layer in slot.cache.layers for t in (layer.keys, layer.values))
    held += slot.state["seq"].nbytes + slot.mask.nbytes
    assert cache_bytes(stock.config, 3, 256, torch.float32) == held == loop.stats.cache_bytes
    # layers x 2 x B x kv_heads x max_len x head_dim x 4 bytes, plus two [B, max_len] long buffers
    assert held == 2 * 2 * 3 * 2 * 256 * 16 * 4 + 2 * 3 * 256 * 8


def test_least_recently_used_slots_are_freed_at_the_budget(stock):
    per_row = cache_bytes(stock.config, 1, 256, torch.float32)
    loop = DecodeLoop(stock, memory_budget=6 * per_row)
    for batch in (1, 2, 3):  # 6 rows: fills the budget exactly
        loop.generate(_ids(batch, 4, batch), 3, GREEDY)
    assert loop.slots.keys() == [(1, 256), (2, 256), (3, 256)] and loop.stats.evictions == 0
    loop.generate(_ids(1, 4, 9), 3, GREEDY)  # a hit makes batch 1 the most recent
    loop.generate(_ids(2, 4, 8), 3, GREEDY)
    want = stock.generate(_ids(4, 4, 4), max_new_tokens=3, do_sample=False)
    assert torch.equal(loop.generate(_ids(4, 4, 4), 3, GREEDY), want)  # frees 3 (least recent), then 1
    assert loop.slots.keys() == [(2, 256), (4, 256)]
    s = loop.stats
    assert (s.slots, s.slot_allocations, s.evictions, s.cache_bytes) == (2, 4, 2, 6 * per_row)
    assert loop.slots.used() <= loop.slots.limit == 6 * per_row


def test_an_evicted_slot_frees_its_cache_at_once(stock, monkeypatch):
    """A compiled engine's slots are held by reference cycles (each layer's `get_mask_sizes` is bound to it, and
    dynamo's tracing state holds the caches a compile ran on) that only Python's cyclic collector breaks: eviction
    frees them at once, collecting only where a cycle is left (never for the plain engine's slots)."""
    collections, collect = [], gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(1) or collect(*a))
    per_row = cache_bytes(stock.config, 1, 256, torch.float32)
    gc.disable()
    try:
        for compile_kwargs in ({"backend": "eager"}, None):
            loop = DecodeLoop(stock, compile_kwargs=compile_kwargs, memory_budget=3 * per_row)
            alive = []
            for batch, length in ((1, 5), (2, 5), (1, 300), (3, 5)):  # the last two evict every older slot
                loop.generate(_ids(batch, length, batch), 3, GREEDY)
                slot = loop.slots.latest(batch)
                alive.append(weakref.ref(slot.cache.layers[0].keys))
                del slot
            assert loop.stats.evictions == 3 and [ref() is not None for ref in alive] == [False] * 3 + [True]
            if compile_kwargs is None:
                assert not collections  # nothing but the pool held them
            collections.clear()
    finally:
        gc.enable()


def test_a_request_that_cannot_fit_raises_before_it_allocates(stock):
    per_row = cache_bytes(stock.config, 1, 256, torch.float32)
    loop = DecodeLoop(stock, memory_budget=4 * per_row)
    loop.generate(_ids(2, 4, 0), 3, GREEDY)
    before = (loop.stats.slot_allocations, loop.stats.evictions, loop.slots.keys())
    with pytest.raises(MemoryBudgetError) as err:
        loop.generate(_ids(5, 4, 1), 3, GREEDY)
    message = str(err.value)
    assert f"{5 * per_row / 2**20:.1f} MiB" in message and f"{4 * per_row / 2**20:.1f} MiB" in message
    assert "memory_budget" in message and "MOEFX_MEMORY_BUDGET" in message and isinstance(err.value, ValueError)
    assert (loop.stats.slot_allocations, loop.stats.evictions, loop.slots.keys()) == before  # nothing freed or made
    assert loop.stats.requests == 1


def test_under_pressure_a_longer_slot_of_the_bucket_serves_a_shorter_request(stock):
    small = cache_bytes(stock.config, 2, 256, torch.float32)
    loop = DecodeLoop(stock, memory_budget=cache_bytes(stock.config, 2, 384, torch.float32) + small // 2)
    long_ids = _ids(2, 300, 3)
    loop.generate(long_ids, 4, GREEDY)
    assert loop.slots.keys() == [(2, 384)]
    ids = _ids(2, 6, 4)
    want = stock.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(loop.generate(ids, 5, GREEDY), want)  # its own 256 slot would not fit next to the 384 one
    assert loop.slots.keys() == [(2, 384)] and loop.stats.slot_allocations == 1
    roomy = DecodeLoop(stock, memory_budget=1e9)
    roomy.generate(long_ids, 4, GREEDY)
    roomy.generate(ids, 5, GREEDY)
    assert roomy.slots.keys() == [(2, 384), (2, 256)]  # with room, each request gets its own length


def test_graph_memory_counts_against_the_budget_and_frees_other_slots(stock):
    per_row = cache_bytes(stock.config, 1, 256, torch.float32)
    loop = DecodeLoop(stock, memory_budget=4 * per_row)
    loop.generate(_ids(1, 4, 0), 2, GREEDY)
    loop.generate(_ids(2, 4, 1), 2, GREEDY)
    keep = loop.slots.find(2, 256, torch.device("cpu"), 0)
    loop.slots.record_graph_bytes("prefill", 2 * per_row, torch.device("cpu"), keep=keep)
    assert loop.slots.keys() == [(2, 256)] and loop.stats.graph_bytes == 2 * per_row
    with pytest.raises(MemoryBudgetError, match="held by captured graph pools"):
        loop.generate(_ids(3, 4, 2), 2, GREEDY)  # 3 rows + 2 rows of graph memory > 4
    with loop.slots.graph_memory("decode", torch.device("cpu")):  # measures nothing off CUDA
        pass
    assert loop.slots.graph_bytes == {"prefill": 2 * per_row}


def test_a_fraction_budget_is_taken_of_the_free_memory(stock):
    loop = DecodeLoop(stock, memory_budget=0.25)
    loop.generate(_ids(1, 4, 0), 2, GREEDY)
    assert 0 < loop.slots.limit and "0.25 of" in loop.stats.memory_budget and "config key" in loop.stats.memory_budget


def test_batches_above_the_largest_capture_size_say_so_once(stock):
    """On the CPU nothing is captured, but an engine that would capture (cuda_graphs) reports a batch above the
    largest capture size: one warning, one line in stats, fallbacks and describe(), a count per request."""
    model = copy.deepcopy(stock)
    loop = DecodeLoop(model, cuda_graphs=True, capture_sizes=[1, 2], memory_budget=1e9)
    front = install_generate(model, loop)
    ids = _ids(3, 5, 1)
    want = stock.generate(ids, max_new_tokens=4, do_sample=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), want)
        model.generate(_ids(2, 5, 2), max_new_tokens=4, do_sample=False)
    above = [w for w in caught if "above the largest capture size 2" in str(w.message)]
    assert len(above) == 1
    assert loop.stats.above_cap == 2
    assert front.fallbacks == ["engine: batches above the largest capture size 2 decode without a CUDA graph "
                               "(first: batch 3); config key 'max_batch_size' sets the largest"]
    text = front.describe()
    assert "3 requests on the engine (2 above the largest capture size" in text and "0 in transformers' loop" in text
    assert "2 slots alive (2 allocated, 0 evicted)" in text and "budget 953.7 MiB (config key memory_budget)" in text


@pytest.mark.parametrize("value", [0, -1, True, "8GiB", float("inf")])
def test_memory_budget_config_key_is_validated(value):
    with pytest.raises(ValueError, match="memory_budget"):
        CompilationConfig.from_any({"memory_budget": value})


def test_max_batch_size_may_be_unset_but_not_invalid():
    assert CompilationConfig.from_any({}).max_batch_size is None
    assert CompilationConfig.from_any({"max_batch_size": None, "memory_budget": 0.5}).memory_budget == 0.5
    for bad in (0, "8", 2.5):
        with pytest.raises(ValueError, match="max_batch_size"):
            CompilationConfig.from_any({"max_batch_size": bad})


def test_memory_budget_env_knob(monkeypatch):
    assert parse_memory_budget("40GiB") == 40 * 2**30 and parse_memory_budget("0.6") == 0.6
    assert parse_memory_budget("512 MiB") == 512 * 2**20 and parse_memory_budget("8e9") == 8e9
    monkeypatch.setenv("MOEFX_MEMORY_BUDGET", "2GiB")
    assert get_setting("MOEFX_MEMORY_BUDGET") == 2 * 2**30
    pool = SlotPool(stats=type("S", (), {})())
    assert (pool.setting, pool.source) == (2 * 2**30, "env MOEFX_MEMORY_BUDGET")
    assert SlotPool(stats=None, memory_budget=0.3).source == "config key memory_budget"  # config wins over env
    for bad in ("lots", "0", "-2GiB", "3XB"):
        monkeypatch.setenv("MOEFX_MEMORY_BUDGET", bad)
        with pytest.raises(ValueError, match="MOEFX_MEMORY_BUDGET"):
            get_setting("MOEFX_MEMORY_BUDGET")
