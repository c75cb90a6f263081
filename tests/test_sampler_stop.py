"""The deferred stop check gives exactly the stock generate() outputs, with EOS at different steps per row."""

from __future__ import annotations

import copy

import pytest
import torch

from moefx.engine.hf_generate import deferred_stop_instances, enable_deferred_stop
from moefx.models import build_model, tiny_qwen3_moe_config


@pytest.fixture(scope="module")
def models():
    stock = build_model(tiny_qwen3_moe_config(), seed=3)
    deferred = copy.deepcopy(stock)
    assert enable_deferred_stop(deferred, devices=("cpu",)) is None
    return stock, deferred


def _eos_at_different_steps(stock, ids, sampling):
    """An EOS id that row 0 emits early and row 1 emits later or never (from a stock run, same seed)."""
    torch.manual_seed(11)
    out = stock.generate(ids, max_new_tokens=12, do_sample=sampling, pad_token_id=0, top_k=20)[:, ids.shape[1] :]
    for step in range(1, 6):
        tok = int(out[0, step])
        if tok not in out[0, :step].tolist() and tok not in out[1, : step + 1].tolist():
            return tok
    pytest.skip("no token separates the rows for this seed")


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_outputs_identical_to_stock_loop(models, sampling):
    stock, deferred = models
    ids = torch.randint(1, 256, (3, 5), generator=torch.Generator().manual_seed(7))
    eos = _eos_at_different_steps(stock, ids, sampling)
    kwargs = dict(max_new_tokens=12, do_sample=sampling, eos_token_id=eos, pad_token_id=0, top_k=20)
    before = deferred_stop_instances()
    for extra in ({}, {"return_dict_in_generate": True, "output_scores": True}):
        torch.manual_seed(11)
        ref = stock.generate(ids, **kwargs, **extra)
        torch.manual_seed(11)
        got = deferred.generate(ids, **kwargs, **extra)
        if extra:
            assert torch.equal(got.sequences, ref.sequences)
            assert len(got.scores) == len(ref.scores)
            assert all(torch.equal(a, b) for a, b in zip(got.scores, ref.scores))
        else:
            assert torch.equal(got, ref)
            assert (got == eos).any()  # the EOS path was exercised
    assert deferred_stop_instances() == before + 2  # the deferred check really ran


def test_max_length_without_eos_and_stock_model_untouched(models):
    stock, deferred = models
    ids = torch.randint(1, 256, (2, 4), generator=torch.Generator().manual_seed(1))
    ref = stock.generate(ids, max_new_tokens=7, do_sample=False, pad_token_id=0)
    before = deferred_stop_instances()
    assert torch.equal(stock.generate(ids, max_new_tokens=7, do_sample=False, pad_token_id=0), ref)
    assert deferred_stop_instances() == before  # a model without moefx keeps the stock check
    assert torch.equal(deferred.generate(ids, max_new_tokens=7, do_sample=False, pad_token_id=0), ref)
    assert deferred_stop_instances() == before + 1


def test_transform_turns_it_on_for_cuda_only(models):
    from types import SimpleNamespace

    from moefx.config import CompilationConfig
    from moefx.engine.install import install_engine

    stock, _ = models
    model = copy.deepcopy(stock)
    eager = CompilationConfig.from_any({"mode": "eager"})
    cpu_plan = SimpleNamespace(execution=SimpleNamespace(device_type="cpu"), serving={})
    assert "off" in install_engine(model, cpu_plan, eager)[-1]
    assert getattr(model, "_moefx_deferred_stop", None) is None
    cuda_plan = SimpleNamespace(execution=SimpleNamespace(device_type="cuda"), serving={})
    assert "on" in install_engine(model, cuda_plan, eager)[-1]
    assert model._moefx_deferred_stop == ("cuda",)
    assert "no transformers generate" in install_engine(torch.nn.Linear(2, 2), cuda_plan, eager)[-1]


def test_decode_loop_stops_one_step_late_with_stock_outputs(models):
    from moefx.engine.engine import DecodeLoop
    from moefx.sampling.sampler import SamplingParams

    stock, _ = models
    loop = DecodeLoop(stock, max_len=32)
    greedy = SamplingParams(temperature=0)
    for batch in (1, 3):
        ids = torch.randint(1, 256, (batch, 5), generator=torch.Generator().manual_seed(batch))
        free = stock.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(loop.generate(ids, 10, greedy), free)
        eos = int(free[0, 8])  # row 0 finishes at its 4th new token (or earlier)
        ref = stock.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=eos)
        got = loop.generate(ids, 10, greedy, eos_token_id=eos)
        assert torch.equal(got, ref), (got, ref)
        if batch == 1:
            assert got.shape[1] < free.shape[1]  # stopped early; the extra step's token was dropped


def test_decode_loop_cuda_graphs_option(models):
    """cuda_graphs over a backend that adds inductor's own CUDA graphs is refused; on CPU inputs it runs the
    steps without graphs (same tokens)."""
    import moefx
    from moefx.engine.engine import DecodeLoop
    from moefx.sampling.sampler import SamplingParams

    stock, _ = models
    with pytest.raises(ValueError, match="cuda_graphs"):
        DecodeLoop(stock, max_len=32, compile_kwargs={"backend": moefx.backend(cudagraphs=True)}, cuda_graphs=True)
    ids = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(7))
    greedy = SamplingParams(temperature=0)
    assert torch.equal(DecodeLoop(stock, 32, cuda_graphs=True).generate(ids, 6, greedy),
                       DecodeLoop(stock, 32).generate(ids, 6, greedy))


def test_only_static_layers_are_captured(models):
    from transformers import DynamicCache, StaticCache

    from moefx.engine.slots import _uncapturable_cache

    stock, _ = models
    assert _uncapturable_cache(StaticCache(config=stock.config, max_cache_len=16)) is None
    assert "DynamicLayer" in _uncapturable_cache(DynamicCache(config=stock.config))
    assert "unknown" in _uncapturable_cache(object())


def test_optimize_records_the_engine_decisions(models):
    import moefx

    stock, _ = models
    model = moefx.optimize(copy.deepcopy(stock), config={"mode": "eager"})
    lines = [p for p in model.moefx_plan.provenance if p.startswith("engine:")]
    assert "generate() on moefx's engine" in lines[0] and len(lines) == 4
    assert lines[1].startswith("engine: decode engine memory: cache lengths 256, 384, 512"), lines[1]
    assert lines[2] == "engine: forward: the plain forward (mode eager)"
    assert lines[3] == "engine: deferred stop check off: device cpu (on for cuda only)"
