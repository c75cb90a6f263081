"""CUDA-only checks (skipped without a GPU): no host sync per decode step, deferred stop == stock outputs."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import moefx
from moefx.engine.engine import DecodeLoop
from moefx.engine.hf_generate import deferred_stop_instances, enable_deferred_stop
from moefx.models import build_model, tiny_qwen3_moe_config
from moefx.sampling.sampler import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.compile,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _syncs(fn) -> list[str]:
    """Where `fn` synchronized with the host (file:line of each sync debug warning)."""
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().synchronize()
    return [f"{w.filename}:{w.lineno}" for w in log if "synchroniz" in str(w.message)]


def test_decode_loop_has_no_host_sync_per_step():
    """The syncs of a whole generate() do not grow with the number of steps (12 and 22 new tokens), with the
    compiled step replayed from CUDA graphs. One-off syncs come and go between calls (H200, torch 2.11: one in
    torch/cuda/__init__.py in the first call after the warm-up only), so each length counts the fewer of two calls;
    the prompt forward syncs in transformers' masking."""
    model = build_model(tiny_qwen3_moe_config(), seed=0, dtype=torch.bfloat16, device="cuda")
    cfg = {"mode": "capture", "pass_config": {"rewrite_sampler_syncs": True}}
    backend = moefx.backend(cfg, cudagraphs=False)
    loop = DecodeLoop(model, max_len=64, compile_kwargs={"backend": backend}, cuda_graphs=True)
    ids = torch.randint(1, 256, (4, 8), device="cuda")
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    for n in (2, 12, 22):
        loop.generate(ids, n, params)  # compile and capture
    assert loop.stats.captures == 1 and not loop.stats.uncaptured
    short, long = (min((_syncs(lambda n=n: loop.generate(ids, n, params)) for _ in range(2)), key=len)
                   for n in (12, 22))
    assert len(long) == len(short), f"12 steps: {short}; 22 steps: {long}"


def test_deferred_stop_on_cuda_matches_stock():
    stock = build_model(tiny_qwen3_moe_config(), seed=1, device="cuda")
    deferred = copy.deepcopy(stock)
    assert enable_deferred_stop(deferred) is None
    ids = torch.randint(1, 256, (3, 6), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    free = stock.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    eos = int(free[0, 9])
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=eos)
    before = deferred_stop_instances()
    assert torch.equal(deferred.generate(ids, **kwargs), stock.generate(ids, **kwargs))
    assert deferred_stop_instances() == before + 1


def _hf_like_sampler(logits, unfinished):
    probs = torch.softmax(logits, -1)
    tok = torch.multinomial(probs, 1)
    if unfinished.max() == 0:
        return tok, None
    return tok, unfinished


def test_audit_sees_runtime_syncs_on_cuda():
    """Every runtime sync of the eager sampler is reported at a line of the sampler (a sync raised inside torch's
    Python code is named at the sampler line that called it), the stop check's among them."""
    import inspect

    report = moefx.audit_syncs(_hf_like_sampler, torch.randn(4, 512, device="cuda"), torch.ones(4, device="cuda"))
    runtime = [f for f in report.findings if f.kind == "runtime sync"]
    lines, start = inspect.getsourcelines(_hf_like_sampler)
    sampler_lines = {f'"{__file__}", line {start + i}' for i in range(len(lines))}
    assert runtime and all(f.where in sampler_lines for f in runtime), [f.where for f in runtime]
    stop_check = start + next(i for i, ln in enumerate(lines) if "unfinished.max()" in ln)
    assert any(f.where.endswith(f"line {stop_check}") for f in runtime), [f.where for f in runtime]
    assert any(n.startswith("runtime:") for n in report.notes), report.notes
