"""The prefill padded to its prompt-length bucket (moefx/engine/prefill.py) gives the unpadded prefill's logits and
cache (fp32, CPU: the same padding logic as under CUDA graphs, without the graph), and transformers' tokens."""

from __future__ import annotations

import pytest
import torch

from moefx.config import PREFILL_BUCKETS, CompilationConfig, prefill_buckets
from moefx.engine.engine import DecodeLoop
from moefx.engine.prefill import pick_bucket
from moefx.models import build_model, tiny_qwen3_moe_config
from moefx.sampling.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_qwen3_moe_config(), seed=5)


def _request(length: int, masked: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    ids = torch.randint(1, 256, (2, length), generator=torch.Generator().manual_seed(seed))
    if not masked:
        return ids, None
    mask = torch.ones_like(ids)
    mask[1, : length // 2] = 0  # row 1 left-padded (nothing to pad at length 1)
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("masked", [False, True], ids=["unpadded", "left-padded"])
def test_padded_prefill_gives_the_unpadded_logits_and_cache(model, masked):
    padded, plain = DecodeLoop(model, prefill_capture_tokens=4096), DecodeLoop(model, prefill_capture_tokens=0)
    for length in (1, 7, 16, 17, 100):
        ids, mask = _request(length, masked, length)
        got, want = [], []
        padded.generate(ids, 1, GREEDY, attention_mask=mask, logits_out=got)
        plain.generate(ids, 1, GREEDY, attention_mask=mask, logits_out=want)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        slot, ref = padded.slots.latest(2), plain.slots.latest(2)
        assert (pick_bucket(2, length, PREFILL_BUCKETS, 4096), masked, False) in slot.prefill, length
        for layer, other in zip(slot.cache.layers, ref.cache.layers):
            for name in ("keys", "values"):
                mine, theirs = getattr(layer, name), getattr(other, name)
                torch.testing.assert_close(mine[:, :, :length], theirs[:, :, :length], atol=1e-5, rtol=1e-5)
                assert not mine[:, :, length:].any(), (length, name)  # padded positions never written
            assert int(layer.cumulative_length) == length
    assert not plain.slots.latest(2).prefill and padded.stats.prefill_buckets == PREFILL_BUCKETS


def test_the_padded_prefill_zeroes_its_tail_and_resets_the_cache_only_when_written_past_it(model):
    """Not zeros by luck: in a cache filled with a sentinel, the padded prefill writes the prompt and zeros up to
    its bucket, leaves what lies past the bucket when no request wrote there (no reset launches), and zeroes it when
    one may have (`Slot.prepare_write`)."""
    loop = DecodeLoop(model, prefill_capture_tokens=4096)
    ids, _ = _request(9, False, 0)
    loop.generate(ids, 1, GREEDY)
    slot = loop.slots.latest(2)
    n = min(16, slot.max_len)  # the bucket of 9 tokens, within the cache
    assert slot.written == n < slot.max_len  # the prefill wrote [0, n), the one token decoded nothing
    for written, past in ((slot.written, 7), (slot.max_len, 0)):
        for layer in slot.cache.layers:
            layer.keys.fill_(7.0)
            layer.values.fill_(7.0)
        slot.written = written
        loop._prompt(slot, 9, None, masked=False, by_head=False, form=GREEDY, graphs=False)
        assert slot.written == n
        for layer in slot.cache.layers:
            for t in (layer.keys, layer.values):
                assert bool((t[:, :, n:] == past).all()) and bool((t[:, :, 9:n] == 0).all())
                assert not bool((t[:, :, :9] == 7).any())


@pytest.mark.parametrize("masked", [False, True], ids=["unpadded", "left-padded"])
def test_greedy_after_the_padded_prefill_equals_transformers(model, masked):
    loop = DecodeLoop(model, prefill_capture_tokens=64)  # buckets 16, 32, 64 at two rows: 17 and 40 padded
    for length in (5, 17, 40):
        ids, mask = _request(length, masked, 100 + length)
        want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = loop.generate(ids, 8, GREEDY, attention_mask=mask, pad_token_id=0)
        assert torch.equal(got, want), length
    assert len(loop.slots.latest(2).prefill) == 2  # 5 -> 16, 17 -> 32; 40 at two rows exceeds the cap: unpadded


def test_the_decode_writes_the_positions_the_slot_counts_and_no_further(model):
    """A prompt that fills its bucket (bench/e2e.py's shapes do) asking one token leaves nothing past the bucket, so
    the next request resets nothing; n tokens write n - 1 positions past the prompt, and no more (a sentinel past
    them stays)."""
    loop = DecodeLoop(model, prefill_capture_tokens=4096)
    ids, _ = _request(16, False, 3)
    loop.generate(ids, 1, GREEDY)
    slot = loop.slots.latest(2)
    assert slot.written == 16
    for layer in slot.cache.layers:
        layer.keys.fill_(7.0)
        layer.values.fill_(7.0)
    loop.generate(ids, 3, GREEDY)
    assert slot.written == 18
    for layer in slot.cache.layers:
        for t in (layer.keys, layer.values):
            assert bool((t[:, :, 18:] == 7).all()) and not bool((t[:, :, :18] == 7).any())


@pytest.mark.parametrize("masked", [False, True], ids=["unpadded", "left-padded"])
def test_a_bucket_longer_than_the_cache_and_shorter_requests_after_longer_ones(model, masked):
    """A bucket past the cache's length (the prompt copied into it from the host, not read from the slot in the
    graph), and requests that follow a longer one in the same slot (what it wrote past their bucket zeroed
    first): transformers' tokens each time."""
    loop = DecodeLoop(model, prefill_capture_tokens=64, max_len=30)  # 17 tokens: bucket 32 > 30 positions
    for length, new in ((17, 8), (5, 20), (6, 3), (17, 13), (4, 2)):
        ids, mask = _request(length, masked, 200 + length)
        want = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
        got = loop.generate(ids, new, GREEDY, attention_mask=mask, pad_token_id=0)
        assert torch.equal(got, want), (length, new)
    assert {key[0] for key in loop.slots.latest(2).prefill} == {16, 32}


def test_prefill_buckets_and_the_config_key_are_validated():
    assert prefill_buckets(0) == () and prefill_buckets(64) == (16, 32, 64)
    assert pick_bucket(1, 17, PREFILL_BUCKETS, 4096) == 32 and pick_bucket(1, 16, PREFILL_BUCKETS, 4096) == 16
    assert pick_bucket(8, 512, PREFILL_BUCKETS, 4096) == 512 and pick_bucket(8, 513, PREFILL_BUCKETS, 4096) is None
    assert pick_bucket(1, 4097, PREFILL_BUCKETS, 4096) is None
    assert CompilationConfig.from_any({"prefill_capture_tokens": 0}).prefill_capture_tokens == 0
    with pytest.raises(ValueError, match="prefill_capture_tokens.*16, 32"):
        CompilationConfig.from_any({"prefill_capture_tokens": 100})
    with pytest.raises(ValueError, match="prefill_capture_tokens"):
        DecodeLoop(build_model(tiny_qwen3_moe_config(num_hidden_layers=1), seed=0), prefill_capture_tokens=8)


def test_no_padded_prefill_where_nothing_is_captured(model):
    """Without CUDA graphs (the CPU, modes compile and eager) the default prefill runs at the prompt's length."""
    assert DecodeLoop(model).stats.prefill_buckets == ()


@pytest.mark.compile
def test_compiles_are_bounded_by_the_buckets_used(model):
    """dynamo only (backend "eager"): the padded prefill compiles once for every bucket and prompt length (its
    prompt dimension is dynamic), plus once when a second batch size makes the batch dimension dynamic; a prompt
    above the cap takes the dynamic prefill."""
    loop = DecodeLoop(model, compile_kwargs={"backend": "eager"}, prefill_capture_tokens=32)
    for batch, length in ((1, 3), (1, 9), (1, 16), (1, 20), (1, 31), (2, 5), (2, 12), (1, 40)):
        ids = torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(length))
        want = model.generate(ids, max_new_tokens=3, do_sample=False)
        assert torch.equal(loop.generate(ids, 3, GREEDY), want), (batch, length)
    compiles = loop.stats.compiles
    assert compiles["prefill[padded]"] <= 2 and compiles["prefill"] == 1, compiles


def test_greedy_through_a_vocab_parallel_head_reads_the_last_real_position(model, monkeypatch):
    """Greedy over the tensor-parallel head (tokens without full logits) takes the padded prefill's token at the
    last real position: one rank, its gather replaced by the local argmax, gives transformers' tokens."""
    import copy

    from moefx.parallel.lm_head import VocabParallelLMHead

    monkeypatch.setattr(VocabParallelLMHead, "greedy", lambda self, hidden: self.local_logits(hidden).argmax(-1))
    monkeypatch.setattr(VocabParallelLMHead, "forward", lambda self, hidden: self.local_logits(hidden))
    sharded = copy.deepcopy(model)
    weight = sharded.lm_head.weight.detach().clone()
    sharded.lm_head = VocabParallelLMHead(weight, weight.shape[0], rank=0, world=1, group="unused")
    loop = DecodeLoop(sharded, prefill_capture_tokens=4096)
    assert loop._head is sharded.lm_head
    for length in (5, 17):
        ids, mask = _request(length, True, 200 + length)
        want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(loop.generate(ids, 6, GREEDY, attention_mask=mask, pad_token_id=0), want), length
    assert {key[2] for key in loop.slots.latest(2).prefill} == {True}  # the by-head prefill ran


def _prefill_ops(layers: int, monkeypatch) -> tuple[list[str], list[str], list[str]]:
    """The aten ops a repeated one-token request runs outside the padded prefill (`BucketedPrefill._call`; on CUDA:
    its graph), those `_call` runs around the model's forward (the writes into the static cache), and the first
    token's pick it runs after them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moefx.engine.prefill import BucketedPrefill

    where = ["outside"]

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: dict[str, list[str]] = {"outside": [], "around": [], "forward": [], "pick": []}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[where[0]].append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    def flagged(fn, name):
        def run(*args, **kwargs):
            before, where[0] = where[0], name
            try:
                return fn(*args, **kwargs)
            finally:
                where[0] = before
        return run

    call = BucketedPrefill._call
    monkeypatch.setattr(BucketedPrefill, "_call", flagged(call, "around"))
    loop = DecodeLoop(build_model(tiny_qwen3_moe_config(num_hidden_layers=layers), seed=5), prefill_capture_tokens=64)
    loop._bucketed._fns[False] = flagged(loop._bucketed._fns[False], "forward")
    monkeypatch.setattr(BucketedPrefill, "_pick_first", flagged(BucketedPrefill._pick_first, "pick"))
    ids, _ = _request(9, False, 0)
    loop.generate(ids, 1, GREEDY)  # allocates the slot
    with Count() as count:
        loop.generate(ids, 1, GREEDY)
    return count.ops["outside"], count.ops["around"], count.ops["pick"]


VIEWS = {"aten.slice", "aten.view", "aten.alias", "aten.expand", "aten.unsqueeze"}


def test_the_host_work_around_the_prefill_does_not_grow_with_depth(monkeypatch):
    """What a request runs outside its captured prefill is paid on the host at every request (on CUDA each op a
    launch with Python between): the same ops at 8 layers as at 2, and for a repeated request only the id check,
    the prompt into the slot, the finished flags, the prompt length, and the output's copy. The cache is not
    reset (the prefill writes zeros past the prompt; `Slot.prepare_write`), the bucket's other inputs are derived
    in the graph from the length."""
    (two, _, _), (eight, _, _) = _prefill_ops(2, monkeypatch), _prefill_ops(8, monkeypatch)
    assert two == eight, (two, eight)
    launches = [op for op in two if op not in VIEWS]
    assert launches == ["aten.aminmax", "aten.stack", "aten.copy_", "aten.ge", "aten.fill_", "aten.clone"], launches


def test_the_first_tokens_pick_runs_inside_the_padded_prefill(monkeypatch):
    """The first token's sampler and position moves are part of what the prefill's graph replays on CUDA: none of
    them runs after it from Python."""
    outside, _, pick = _prefill_ops(2, monkeypatch)
    assert "aten.argmax" in pick and "aten.isin" in pick, pick
    assert not {"aten.argmax", "aten.isin", "aten.index_copy_"} & set(outside), outside


def test_the_prompt_goes_into_the_static_cache_in_one_kernel_per_tensor(monkeypatch):
    """Each captured op is a graph node (~1 us each, and the graph launch's host time grows with them): the keys
    and values go into the cache by one masked write each (and the tokens into the bucket by one), the write
    positions by one foreach copy."""
    for layers in (2, 8):
        _, around, _ = _prefill_ops(layers, monkeypatch)
        assert around.count("aten.where") == 2 * layers + 1, around
        assert around.count("aten._foreach_copy_") == 1 and "aten.copy_" not in around, around
