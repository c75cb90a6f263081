"""A stream of 200 mixed requests through `optimize(tiny)` + `generate()` (CPU, fp32, eager steps), in a seeded random
order: batch sizes 1..6, prompts 3..40, 1..10 new tokens, greedy and sampling (temperature, top-k, top-p), EOS ids,
left-padded masks and stopping criteria. The engine runs with a small memory budget and 16-position length buckets,
so slots are allocated, reused, evicted and re-allocated all along. Greedy requests give transformers' own tokens
(the unoptimized model's generate()); sampled ones, from a fixed seed, the plain engine's (one DecodeLoop without
budget pressure). Each request costs a few tiny eager forwards, so the whole stream stays well within two minutes
on a loaded 2-core CPU.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import moefx
from moefx.engine.engine import DecodeLoop
from moefx.engine.hf_generate import read_request
from moefx.engine.memory import cache_bytes
from moefx.models import build_model, tiny_qwen3_moe_config

ROOT = Path(__file__).resolve().parents[1]
REQUESTS = 200
SAMPLING = ({"temperature": 0.8}, {"temperature": 1.0, "top_k": 20}, {"temperature": 0.7, "top_p": 0.9},
            {"temperature": 1.2, "top_k": 50, "top_p": 0.8})


class _LastTokenIn(StoppingCriteria):
    def __init__(self, ids: set[int]) -> None:
        self.ids = ids

    def __call__(self, input_ids, scores, **kwargs):
        return torch.tensor([int(t) in self.ids for t in input_ids[:, -1]])


def _request(rng: random.Random, index: int) -> dict:
    batch, prompt = rng.randint(1, 6), rng.randint(3, 40)
    ids = torch.randint(1, 256, (batch, prompt), generator=torch.Generator().manual_seed(index))
    kwargs: dict = {"max_new_tokens": rng.randint(1, 10), "pad_token_id": 0}
    if batch > 1 and rng.random() < 0.4:  # left padding on some rows
        mask = torch.ones_like(ids)
        for row in range(1, batch):
            mask[row, : rng.randint(0, prompt - 1)] = 0
        kwargs["attention_mask"] = mask
        ids = ids.masked_fill(mask == 0, 0)
    if rng.random() < 0.5:
        kwargs["eos_token_id"] = rng.sample(range(1, 256), rng.randint(1, 3))
    if rng.random() < 0.25:
        kwargs["stopping_criteria"] = StoppingCriteriaList([_LastTokenIn(set(rng.sample(range(1, 256), 40)))])
    greedy = rng.random() < 0.5
    kwargs.update({"do_sample": False} if greedy else {"do_sample": True, **rng.choice(SAMPLING)})
    return {"ids": ids, "kwargs": kwargs, "greedy": greedy, "seed": index}


def test_a_stream_of_mixed_requests_gives_the_reference_tokens():
    stock = build_model(tiny_qwen3_moe_config(), seed=11)
    budget = 3 * cache_bytes(stock.config, 6, 64, torch.float32)  # about three of the largest slots
    model = moefx.optimize(copy.deepcopy(stock), config={"mode": "eager", "memory_budget": budget})
    engine = model.moefx_generate.engine
    engine.slots.min_len = 16  # length buckets 16, 24, 32, 48, 64 for these short requests
    plain = DecodeLoop(copy.deepcopy(stock), memory_budget=1e9)
    rng = random.Random(30)
    requests = [_request(rng, i) for i in range(REQUESTS)]
    kinds = {"greedy": 0, "sampled": 0, "eos": 0, "masked": 0, "criteria": 0}
    for i, r in enumerate(requests):
        ids, kwargs = r["ids"], r["kwargs"]
        torch.manual_seed(r["seed"])
        got = model.generate(ids, **kwargs)
        if r["greedy"]:
            want = stock.generate(ids, **kwargs)
        else:
            request, why = read_request(plain.model, (ids,), kwargs)
            assert request is not None, why
            torch.manual_seed(r["seed"])
            want = plain.generate(request.input_ids, request.max_new_tokens, request.params,
                                  eos_token_id=request.eos, pad_token_id=request.pad,
                                  attention_mask=request.attention_mask, stopping_criteria=request.criteria)
        assert torch.equal(got, want), (i, ids.shape, kwargs)
        kinds["greedy" if r["greedy"] else "sampled"] += 1
        kinds["eos"] += "eos_token_id" in kwargs
        kinds["masked"] += "attention_mask" in kwargs
        kinds["criteria"] += "stopping_criteria" in kwargs
    assert min(kinds.values()) >= 20, kinds  # every kind of request is in the stream
    stats = engine.stats
    assert model.moefx_generate.fallbacks == [] and stats.requests == REQUESTS
    assert stats.evictions >= 10 and stats.slot_allocations == stats.slots + stats.evictions
    assert stats.cache_bytes <= budget and engine.slots.used() <= engine.slots.limit == budget
    lengths = {length for _, length in engine.slots.keys()}
    assert lengths <= {16, 24, 32, 48, 64}
    assert "evicted" in model.moefx_generate.describe()


@pytest.mark.slow
def test_stream_bench_smoke_run_on_the_cpu(tmp_path):
    """bench/stream.py end to end on the tiny model (eager steps, a budget its slots overflow): JSON and PASS lines."""
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "bench" / "stream.py"), "--tiny", "--device", "cpu", "--mode", "eager",
           "--layers", "2", "--requests", "60", "--max-batch", "8", "--max-prompt", "300", "--max-new", "8",
           "--memory-budget", "3MiB", "--check-every", "3"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "stream_2l.json").read_text())
    assert data["requests"] == 60 and not data["errors"] and not data["mismatches"] and all(data["checks"].values())
    assert data["evictions"] > 0 and data["slot_allocations"] == data["slots"] + data["evictions"]
    assert sum(c["requests"] for c in data["classes"].values()) == 60 and data["checked"]["greedy"] > 0
    assert proc.stdout.count("PASS: ") == 5 and data["ran"] == 60
    assert [m["request"] for m in data["memory"]] == [0, 50, 59] and data["check_every"] == 3
    split = data["time_split"]  # eager mode compiles and captures nothing
    assert split["first_use_requests"] == 0 and split["steady_requests"] == 60 and split["graphs_off_reruns_s"] > 0
