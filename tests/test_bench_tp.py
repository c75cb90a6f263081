"""bench/tp.py's single-process parts on the CPU: the floors, the targets, the table, and the TP=1 decode step
(the multi-GPU run itself needs 2-4 GPUs; `python bench/tp.py --quick` runs TP 1 and 2 over gloo)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from moefx.models import build_model, qwen3_moe_config, tiny_qwen3_moe_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tp():
    spec = importlib.util.spec_from_file_location("bench_tp", ROOT / "bench" / "tp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_sets_no_multicast(tp):
    import os

    assert {k: os.environ[k] for k in tp.NO_MULTICAST} == tp.NO_MULTICAST


def test_floors_and_gather_bytes(tp):
    cfg = qwen3_moe_config(48)
    one = tp.step_bytes(cfg, 1, 1, context=0)
    assert 5.8e9 < one < 6.4e9  # ~3 B active parameters (attention, 8 experts, router, LM head) in bf16
    two = tp.step_bytes(cfg, 2, 1, context=0)
    router = 2 * 48 * cfg.hidden_size * cfg.num_experts  # replicated on every rank
    assert two == pytest.approx((one - router) / 2 + router)
    assert tp.all_reduces_per_step(cfg) == 97
    assert tp.head_gather_bytes(cfg, 4, 16, greedy=True) == 16 * 8
    assert tp.head_gather_bytes(cfg, 4, 16, greedy=False) == 16 * 37984 * 2


def test_targets_and_table(tp):
    rows = [dict(tp=1, arm="full", batch=1, tok_s=100.0), dict(tp=2, arm="full", batch=1, tok_s=170.0),
            dict(tp=2, arm="full", batch=16, tok_s=1000.0, peak_mib=50.0),
            dict(tp=2, arm="greedy", batch=16, tok_s=1040.0, peak_mib=40.0),
            dict(tp=2, arm="transformers", batch=16, note="failed: RuntimeError: x")]
    targets = tp.speedups(rows)
    assert targets["tp2_over_tp1_b1"] == pytest.approx(1.7)
    assert targets["greedy_gain_tp2_b16"] == pytest.approx(0.04)
    assert targets["greedy_mem_saved_mib_tp2_b16"] == pytest.approx(10.0)
    text = tp.table(rows)
    assert text.count("\n") == len(rows) + 1 and "failed: RuntimeError" in text
    args = tp.parse(["--quick"])
    assert (args.device, args.sizes, args.batches) == ("cpu", [1, 2], (1, 2))
    with pytest.raises(SystemExit, match="needs 8 devices"):
        tp.parse(["--quick", "--tp", "8"])


def test_tp1_decode_step_matches_transformers_greedy(tp):
    cfg = tiny_qwen3_moe_config()
    ids = torch.randint(1, cfg.vocab_size, (2, tp.PROMPT), generator=torch.Generator().manual_seed(0))
    model = tp.moefx_model(cfg, 1, torch.device("cpu"), torch.float32, {"mode": "eager"})
    state = tp.DecodeState(model, ids, tp.PROMPT + 8, greedy=False, max_steps=4)
    seconds, note = tp.step_seconds(state, steps=2, runs=1)  # one warm-up step, then two timed
    assert seconds > 0 and note == "eager steps (no CUDA)"
    ref = build_model(cfg, seed=0, routing="balanced").generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(state.tokens(4), ref[:, tp.PROMPT:])
    assert tp.decode_steps(32, 3) >= 1 + 32 * 3  # the token buffer holds the eager fallback's steps too
