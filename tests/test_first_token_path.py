"""The first token's host path of `generate(ids, max_new_tokens=1)` on the engine (fp32, CPU, the prefill padded to its
bucket as on CUDA): a repeated call reads no generation config, nothing before the prefill reads the device but the
documented checks, and the tokens stay transformers'. Counted, not timed (docs/FINDINGS.md has the host times)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode

from moefx.engine.engine import DecodeLoop
from moefx.engine.hf_generate import install_generate
from moefx.engine.prefill import BucketedPrefill
from moefx.models import build_model, tiny_qwen3_moe_config

# bench/e2e.py's call (greedy_kwargs(1))
KWARGS = dict(max_new_tokens=1, min_new_tokens=None, do_sample=False, pad_token_id=0, eos_token_id=None)
# Tensor methods that read device data on the host (a sync on CUDA)
READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero"}


@pytest.fixture()
def models():
    stock = build_model(tiny_qwen3_moe_config(), seed=5).eval()
    model = copy.deepcopy(stock)
    install_generate(model, DecodeLoop(model, prefill_capture_tokens=4096))
    return stock, model


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


class _Reads(TorchFunctionMode):
    """The host reads made outside the model's forward, each with whether the padded prefill had started
    (`BucketedPrefill._call`: on CUDA, the graph's launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.launched = self.in_forward = False
        self.reads: list[tuple[str, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS and not self.in_forward:
            self.reads.append((name, self.launched))
        return func(*args, **(kwargs or {}))


_CALL = BucketedPrefill._call


def _reads(model, monkeypatch, *args, **kwargs) -> tuple[list[str], list[str]]:
    """The host reads of one generate() call: (before the prefill, after it)."""
    mode = _Reads()
    bucketed = model.moefx_generate.engine._bucketed
    forward = bucketed.steps.forward  # what the eager engine's compiled prefill is

    def launch(self, *a, **k):
        mode.launched = True
        return _CALL(self, *a, **k)

    def model_call(*a, **k):
        mode.in_forward = True
        try:
            return forward(*a, **k)
        finally:
            mode.in_forward = False

    monkeypatch.setattr(BucketedPrefill, "_call", launch)
    monkeypatch.setitem(bucketed._fns, False, model_call)
    with mode:
        model.generate(*args, **kwargs)
    return [name for name, after in mode.reads if not after], [name for name, after in mode.reads if after]


def test_a_repeated_call_reads_no_generation_config_and_a_change_reads_it_again(models):
    stock, model = models
    memo = model.moefx_generate.memo
    ids = _ids(1, 20, 0)
    assert torch.equal(model.generate(ids, **KWARGS), stock.generate(ids, **KWARGS))
    reads = memo.reads
    for length in (20, 33):  # another prompt length is the same call form
        ids = _ids(1, length, length)
        assert torch.equal(model.generate(ids, **KWARGS), stock.generate(ids, **KWARGS))
    assert memo.reads == reads
    kwargs = dict(KWARGS, max_new_tokens=6)  # another call form: read once
    assert torch.equal(model.generate(ids, **kwargs), stock.generate(ids, **kwargs))
    assert memo.reads == reads + 1
    free = stock.generate(ids, **kwargs)
    for m in (stock, model):  # the model's generation config changed in place: read again, and followed
        m.generation_config.eos_token_id = int(free[0, 35])
        m.generation_config.pad_token_id = 0
    kwargs = dict(max_new_tokens=6, do_sample=False)
    got, want = model.generate(ids, **kwargs), stock.generate(ids, **kwargs)
    assert torch.equal(got, want) and got.shape[1] < free.shape[1]
    assert memo.reads == reads + 2
    assert not model.moefx_generate.fallbacks


def test_before_the_prefill_one_host_read_checks_the_ids_and_the_padding(models, monkeypatch):
    _, model = models
    ids = _ids(2, 24, 1)
    model.generate(ids, **KWARGS)  # the slot and the call form's settings
    before, after = _reads(model, monkeypatch, ids, **KWARGS)
    # the ids' min and max, and pad tokens in the prompt (the mask transformers would infer): one read
    assert before == ["tolist"], before
    assert after == [], after  # one token, no EOS: nothing waits for the prefill before generate() returns
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    model.generate(ids, attention_mask=mask, **KWARGS)  # a new call form: read by transformers' helpers once
    before, _ = _reads(model, monkeypatch, ids, attention_mask=mask, **KWARGS)
    assert before == ["tolist"], before  # a mask given: the ids and the mask's two facts in one read
    padded = ids.clone()
    padded[0, :3] = 0  # pad tokens on the left: the mask inferred from them, in the same one read
    before, _ = _reads(model, monkeypatch, padded, **KWARGS)
    assert before == ["tolist"], before
    model.generate(ids, **dict(KWARGS, pad_token_id=None))
    before, _ = _reads(model, monkeypatch, ids, **dict(KWARGS, pad_token_id=None))
    assert before == ["tolist"], before


def test_bad_ids_are_refused_once_the_call_form_is_kept(models):
    _, model = models
    model.generate(_ids(1, 4, 0), **KWARGS)
    for bad, words in ((torch.full((1, 4), 256), "token id 256"), (torch.tensor([[3, -1]]), "token id -1")):
        with pytest.raises(ValueError, match=words):
            model.generate(bad, **KWARGS)
    with pytest.raises(ValueError, match="empty prompt"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), **KWARGS)
