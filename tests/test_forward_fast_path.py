"""The forward of an optimized causal LM on the engine's padded prefill (moefx/engine/forward.py): its logits, loss
and cache equal the plain forward's (fp32, CPU), its compiles are bounded by the bucket key's discrete parts, and
the calls it cannot take run the plain forward, the reason said once.

Most tests run the fast path on dynamo alone (backend "eager": the routing and padding without inductor's minutes
on a small CPU); the `compile` tests go through `moefx.optimize` itself, training step included."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import warnings

import pytest
import torch

import moefx
from moefx.config import PREFILL_BUCKETS
from moefx.engine.engine import DecodeLoop
from moefx.engine.forward import ForwardFront
from moefx.models import build_model, tiny_qwen3_moe_config

LENGTHS = (3, 7, 16, 17, 31, 64, 65, 100, 130)


def _cache(out):
    """The output's cache: `cache` from transformers 5.2x, `past_key_values` before (5.17 names it so)."""
    fields = {f.name for f in dataclasses.fields(type(out))}
    return out.cache if "cache" in fields else out.past_key_values


def _cache_arg(model) -> str:
    """The forward's cache argument under this transformers (`cache` or `past_key_values`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@pytest.fixture(scope="module")
def stock():
    return build_model(tiny_qwen3_moe_config(), seed=5)


@pytest.fixture(scope="module")
def fast(stock):
    """(the routed forward, its front) over a copy of `stock`, compiled by dynamo only."""
    model = copy.deepcopy(stock)
    loop = DecodeLoop(model, compile_kwargs={"backend": "eager"})
    front = ForwardFront(model, loop.steps, loop.graphs, loop.bucket, PREFILL_BUCKETS, 4096, capture=False)
    return front.route(model.forward), front


def _ids(batch: int, length: int, seed: int, padded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    ids = torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(seed))
    if not padded:
        return ids, None
    mask = torch.ones_like(ids)
    mask[-1, : length // 3 + 1] = 0  # the last row left-padded
    return ids.masked_fill(mask == 0, 0), mask


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_logits_and_cache_equal_the_plain_forward_with_bounded_compiles(stock, fast):
    forward, front = fast
    for batch in (1, 2):
        for padded in (False, True):
            for length in LENGTHS:
                ids, mask = _ids(batch, length, length * batch, padded)
                with torch.no_grad():
                    got = forward(input_ids=ids, attention_mask=mask)
                    want = stock(input_ids=ids, attention_mask=mask)
                    last = forward(input_ids=ids, attention_mask=mask, logits_to_keep=1)
                assert got.logits.shape == want.logits.shape == (batch, length, 256)
                _close(got.logits, want.logits)
                _close(last.logits, want.logits[:, -1:])
                for mine, theirs in zip(_cache(got).layers, _cache(want).layers):
                    assert mine.keys.shape == theirs.keys.shape, (batch, padded, length)
                    _close(mine.keys, theirs.keys)
                    _close(mine.values, theirs.values)
    assert front.calls == 2 * 2 * 2 * len(LENGTHS) and not front.fallbacks
    # bounded by the key's discrete parts (batch 1 or more, masked or not, last or all), not by 9 lengths in 6 buckets
    assert front.compiles() <= 8, front.steps.stats.compiles


def test_logits_to_keep_forms_and_position_ids(stock, fast):
    forward, _ = fast
    ids, mask = _ids(2, 20, 3, True)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = stock(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        for keep, rows in ((3, want[:, -3:]), (25, want), (torch.tensor([0, 5, 19]), want[:, [0, 5, 19]]),
                           (torch.tensor([-1]), want[:, -1:])):
            got = forward(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep).logits
            _close(got, rows)
        shared = forward(input_ids=ids, position_ids=torch.arange(20)[None] + 4, logits_to_keep=1).logits
        _close(shared, stock(input_ids=ids, position_ids=torch.arange(20)[None] + 4, logits_to_keep=1).logits)


def test_inference_mode_then_no_grad_share_a_bucket_key(stock, fast):
    forward, front = fast
    ids, _ = _ids(2, 11, 10, False)
    calls = front.calls
    with torch.inference_mode():
        first = forward(input_ids=ids, logits_to_keep=1).logits
    with torch.no_grad():
        second = forward(input_ids=ids, logits_to_keep=1).logits
        want = stock(input_ids=ids, logits_to_keep=1).logits
    assert front.calls == calls + 2
    _close(first, want)
    _close(second, want)


def test_labels_give_transformers_loss(stock, fast):
    forward, _ = fast
    ids, mask = _ids(2, 33, 4, True)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        got = forward(input_ids=ids, attention_mask=mask, labels=labels)
        want = stock(input_ids=ids, attention_mask=mask, labels=labels)
    assert got.loss is not None and got.loss.dim() == 0
    _close(got.loss, want.loss)


def test_inputs_embeds_and_use_cache_off(stock, fast):
    forward, front = fast
    ids, _ = _ids(2, 12, 5, False)
    embeds = stock.get_input_embeddings()(ids).detach()
    with torch.no_grad():
        got = forward(inputs_embeds=embeds, use_cache=False)
        want = stock(inputs_embeds=embeds, use_cache=False)
    _close(got.logits, want.logits)
    assert _cache(got) is None and _cache(want) is None
    assert any(key[3] == 3 for key in front._runs)  # an embeddings bucket key ran


def test_the_returned_cache_continues_a_request(stock, fast):
    """The cache handed back is the real positions' only: the stock model decodes on from it as from its own."""
    forward, _ = fast
    ids, _ = _ids(1, 10, 6, False)
    with torch.no_grad():
        prefix = forward(input_ids=ids[:, :9])
        step = stock(input_ids=ids[:, 9:], **{_cache_arg(stock): _cache(prefix)}, logits_to_keep=1).logits
        whole = stock(input_ids=ids, logits_to_keep=1).logits
    _close(step, whole)


def test_what_does_not_fit_runs_the_plain_forward_and_says_why_once(stock, fast):
    forward, front = fast
    ids, _ = _ids(1, 8, 7, False)
    calls = front.calls
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out = forward(input_ids=ids)  # gradients enabled, the parameters require grad: a training call
        assert out.logits.requires_grad
        with torch.no_grad():
            cache = _cache(forward(input_ids=ids[:, :4]))
            forward(input_ids=ids[:, 4:], **{_cache_arg(stock): cache})  # a continuation
            forward(input_ids=ids, output_hidden_states=True)
            forward(input_ids=torch.randint(1, 256, (3, 1400)))  # 3 x bucket 2048 > 4096
    said = [str(w.message) for w in caught if "moefx forward" in str(w.message)]
    assert len(said) == 4 and sum("gradients enabled" in line for line in said) == 1, said
    assert front.fallbacks["argument 'output_hidden_states'"] == 1
    assert any("a cache passed in" in why for why in front.fallbacks)
    assert any("above the prompt buckets" in why for why in front.fallbacks)
    assert front.calls == calls + 1  # only the prefix ran on the fast path
    assert front.fallbacks[next(w for w in front.fallbacks if "gradients" in w)] == 2


def test_grad_enabled_without_trainable_parameters_takes_the_fast_path(stock, fast):
    forward, front = fast
    ids, _ = _ids(1, 6, 8, False)
    params = list(front.model.parameters())
    try:
        for p in params:
            p.requires_grad_(False)
        calls = front.calls
        got = forward(ids, logits_to_keep=1)  # positional input_ids too
        assert front.calls == calls + 1 and not got.logits.requires_grad
    finally:
        for p in params:
            p.requires_grad_(True)
    with torch.no_grad():
        _close(got.logits, stock(ids, logits_to_keep=1).logits)


# -- through moefx.optimize (inductor) ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def optimized(stock):
    return moefx.optimize(copy.deepcopy(stock), config={"mode": "compile"})


@pytest.mark.compile
@pytest.mark.slow
def test_optimized_forward_routes_and_trains_as_eager(stock, optimized):
    """One optimized model: no-grad calls run the padded prefill with eager's logits; a training step (grad on) runs
    the compiled forward, its loss and every gradient equal eager's."""
    assert any("forward: calls without gradients" in line for line in optimized.moefx_plan.provenance)
    front = optimized.moefx_forward
    for length in (5, 40):
        ids, mask = _ids(2, length, length, True)
        with torch.no_grad():
            _close(optimized(input_ids=ids, attention_mask=mask).logits,
                   stock(input_ids=ids, attention_mask=mask).logits)
    assert front.calls == 2
    ids, mask = _ids(2, 24, 9, True)
    labels = ids.masked_fill(mask == 0, -100)
    eager = copy.deepcopy(stock)
    eager.train()
    optimized.train()
    try:
        want = eager(input_ids=ids, attention_mask=mask, labels=labels).loss
        got = optimized(input_ids=ids, attention_mask=mask, labels=labels).loss
        want.backward()
        got.backward()
    finally:
        optimized.eval()
    _close(got.detach(), want.detach())
    grads = dict(eager.named_parameters())
    compared = 0
    for name, p in optimized.named_parameters():
        ref = grads.get(name)
        if ref is None or ref.grad is None:
            continue
        assert p.grad is not None, name
        _close(p.grad, ref.grad)
        compared += 1
    assert compared >= len(grads) // 2 and front.calls == 2  # the training step took the compiled forward
    assert any("training mode" in why or "gradients" in why for why in front.fallbacks)


@pytest.mark.gpu
@pytest.mark.compile
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_forward_equals_eager_on_cuda_fp32():
    """fp32 on CUDA, mode capture: each bucket key captured once and replayed (two lengths in one bucket refill its
    buffers; batch 3 runs as 4 rows), logits, loss and cache equal eager's; a batch above the capture sizes runs the
    compiled forward. The experts run moefx's gemv (capturable in fp32, as in tests/test_generate_gpu.py)."""
    stock = build_model(tiny_qwen3_moe_config(), seed=2, device="cuda")
    model = moefx.optimize(copy.deepcopy(stock), config={"max_batch_size": 4, "moe_backend": "gemv"})
    front = model.moefx_forward
    assert front.capture
    with torch.no_grad():
        for batch, length, padded in ((1, 9, False), (1, 14, False), (3, 20, True), (2, 100, True), (6, 10, False)):
            ids, mask = _ids(batch, length, batch * length, padded)
            ids, mask = ids.cuda(), (mask.cuda() if mask is not None else None)
            for keep in (1, 0):
                got = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep, labels=None if keep else ids)
                want = stock(input_ids=ids, attention_mask=mask, logits_to_keep=keep, labels=None if keep else ids)
                torch.testing.assert_close(got.logits, want.logits, rtol=1e-3, atol=1e-3)
                if not keep:
                    torch.testing.assert_close(got.loss, want.loss, rtol=1e-3, atol=1e-3)
                    for mine, theirs in zip(_cache(got).layers, _cache(want).layers):
                        torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-3, atol=1e-3)
    assert front.captures == 6, front.describe()  # (1, 16) and (4, 32) and (2, 128), each last and all
    assert any("above the largest capture size" in why for why in front.fallbacks), front.fallbacks


def test_fallbacks_the_caller_said_already_are_counted_not_said_again(stock, monkeypatch):
    """Inside `said_by_caller()` (transformers' own generate() loop for a request the engine does not take, whose
    reason hf_generate.py says) a call on the plain path is counted and not warned about; outside, it is, once."""
    import moefx.engine.forward as forward_mod

    said: list[str] = []
    monkeypatch.setattr(forward_mod, "warn_once", said.append)
    model = copy.deepcopy(stock)
    loop = DecodeLoop(model, compile_kwargs={"backend": "eager"})
    front = ForwardFront(model, loop.steps, loop.graphs, loop.bucket, PREFILL_BUCKETS, 4096, capture=False)
    forward = front.route(model.forward)
    ids, _ = _ids(1, 8, 11, False)
    with torch.no_grad():
        prefix = _cache(stock(input_ids=ids[:, :4]))
        with front.said_by_caller():
            forward(input_ids=ids[:, 4:6], **{_cache_arg(stock): prefix})
        assert not said and sum(front.fallbacks.values()) == 1
        for _ in range(2):
            forward(input_ids=ids[:, 6:], **{_cache_arg(stock): prefix})
    assert len(said) == 1 and "a cache passed in" in said[0], said
    assert sum(front.fallbacks.values()) == 3 and front.calls == 0
