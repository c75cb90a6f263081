"""One KV-cache formula and one free-memory reading: the decode engine's slots, the planner's capture cap and
offload's KV reserve count the same KV bytes per token, and every reader of free memory goes through
`moefx.machine.free_memory`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import moefx.machine
from moefx.config import CompilationConfig
from moefx.engine.memory import cache_bytes
from moefx.facts.execution import ExecutionSignature
from moefx.facts.model import ModelSignature
from moefx.facts.sizes import config_kv_shape, kv_bytes_per_token
from moefx.models import tiny_qwen3_moe_config
from moefx.offload import plan as offload_plan
from moefx.offload.transform import _kv_reserve
from moefx.planner import serving


@pytest.mark.parametrize("overrides", [
    {},  # head_dim stated, grouped KV heads
    {"head_dim": None, "num_key_value_heads": 2},  # head_dim from hidden_size / heads
])
def test_the_engine_the_planner_and_offload_count_the_same_kv_bytes(overrides, monkeypatch) -> None:
    config = tiny_qwen3_moe_config(**overrides)
    layers, kv_heads, head_dim = config_kv_shape(config)
    assert (layers, kv_heads) == (config.num_hidden_layers, config.num_key_value_heads)
    assert head_dim == (config.head_dim or config.hidden_size // config.num_attention_heads)
    want = layers * 2 * kv_heads * head_dim * 2  # bfloat16: 2 bytes

    # the engine: a static cache of rows x length, less its token and mask buffers
    rows, length = 3, 256
    engine = (cache_bytes(config, rows, length, torch.bfloat16) - 2 * rows * length * 8) // (rows * length)

    # the planner: the capture cap's explain text names the bytes per token it divided by
    ms = ModelSignature.from_config(config).with_dtype("bfloat16", "test")
    monkeypatch.setattr(serving, "_free_memory", lambda ms, es: (80 * 2**30, "80 GiB free"))
    _, why = serving.capture_cap(ms, ExecutionSignature.preset("h100", mode="capture", dtype="bfloat16"))

    # offload: the plan's estimate and the transform's KV pool (for one sequence of 100 tokens)
    _, planned = offload_plan._estimate_bytes(ms)
    cfg = CompilationConfig(max_batch_size=1, prefill_token_budget=100)
    reserve = _kv_reserve(SimpleNamespace(config=config), cfg, 2)

    assert engine == planned == reserve // 100 == want and f"({want} B each)" in why


def test_unknown_geometry_gives_no_kv_bytes() -> None:
    assert kv_bytes_per_token(4, None, 64, 2) is None and kv_bytes_per_token(4, 2, 64, 0) is None
    assert _kv_reserve(SimpleNamespace(config=SimpleNamespace(num_hidden_layers=2)), CompilationConfig(), 2) == 0
    with pytest.raises(ValueError, match="num_attention_heads"):
        cache_bytes(SimpleNamespace(num_hidden_layers=2), 1, 16, torch.float32)


def test_free_memory_on_the_cpu_is_the_hosts_available_memory(monkeypatch) -> None:
    monkeypatch.setattr(moefx.machine, "host_memory_available", lambda: 123 * 2**20)
    assert moefx.machine.free_memory("cpu") == moefx.machine.free_memory(torch.device("cpu")) == 123 * 2**20
    monkeypatch.setattr(moefx.machine, "host_memory_available", lambda: None)
    assert moefx.machine.free_memory("cpu") > 0


def test_free_memory_on_cuda_counts_the_allocators_unused_cache(monkeypatch) -> None:
    """The driver's free bytes plus what torch's allocator reserved but does not use (no GPU needed: the three CUDA
    readings are stood in for)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * 2**30)
    assert moefx.machine.free_memory("cuda:0") == 12 * 2**30


def test_no_module_reads_the_driver_s_free_memory_but_machine() -> None:
    """Every reader of free memory goes through `moefx.machine.free_memory`, so all count the same thing."""
    from pathlib import Path

    root = Path(moefx.machine.__file__).parent
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if "mem_get_info" in p.read_text())
    assert readers == ["machine.py"]
