"""Cost model switch point moves the right way with each bandwidth; the per-machine cache; GPU memory priority."""

import dataclasses

import pytest
import torch

from moefx.offload.cost import (
    Geometry,
    MachineRates,
    cached_rates,
    cpu_cost,
    cpu_seconds,
    machine_rates,
    modelled_seconds,
    split_experts,
    store_rates,
    switch_point,
)
from moefx.offload.cpu_experts import ExpertStore
from moefx.offload.gpu_budget import PRIORITY, plan_gpu_memory
from moefx.offload.hw import host_info

QWEN3 = Geometry(num_experts=128, top_k=8, hidden=2048, inter=768, expert_bytes=9_437_184)
H200 = MachineRates(cpu_gbps=45.0, cpu_tflops=3.0, h2d_gbps=55.0, gpu_tflops=600.0)


def test_switch_point_is_where_everything_streams():
    m = switch_point(QWEN3, H200)
    assert m is not None and m > 1
    assert modelled_seconds(m, QWEN3, H200)[1] == 1.0 and modelled_seconds(m - 1, QWEN3, H200)[1] < 1.0
    # Below it the call is split, never slower than all-CPU in the model.
    for tokens in (1, 8, 512):
        secs, share = modelled_seconds(tokens, QWEN3, H200)
        assert 0 < share < 1 and secs < cpu_seconds(tokens, QWEN3, H200)


def _scaled(field, factor):
    return dataclasses.replace(H200, **{field: getattr(H200, field) * factor})


@pytest.mark.parametrize(
    "field,factor,direction",
    [
        ("h2d_gbps", 2.0, "down"),  # faster PCIe -> everything streams from fewer tokens
        ("h2d_gbps", 0.5, "up"),
        ("cpu_tflops", 2.0, "up"),  # faster CPU GEMMs -> the CPU keeps a share for longer
        ("cpu_tflops", 0.5, "down"),
    ],
)
def test_switch_point_moves_the_right_way(field, factor, direction):
    base = switch_point(QWEN3, H200)
    moved = switch_point(QWEN3, _scaled(field, factor))
    assert moved is not None and base is not None
    assert (moved < base) if direction == "down" else (moved > base)


@pytest.mark.parametrize(
    "field,factor,direction",
    [("cpu_gbps", 2.0, "down"), ("cpu_gbps", 0.5, "up"), ("h2d_gbps", 2.0, "up"), ("h2d_gbps", 0.5, "down")],
)
def test_decode_share_moves_the_right_way(field, factor, direction):
    """At decode sizes the DRAM vs PCIe balance sets how many routed experts the GPU takes."""
    for tokens in (1, 4, 64):
        base = modelled_seconds(tokens, QWEN3, H200)[1]
        moved = modelled_seconds(tokens, QWEN3, _scaled(field, factor))[1]
        assert (moved < base) if direction == "down" else (moved > base)
    # Faster host memory never makes streaming everything start earlier.
    assert switch_point(QWEN3, _scaled("cpu_gbps", 2.0)) >= switch_point(QWEN3, H200)


def test_split_prefers_streaming_the_heaviest_experts():
    rows = [1.0, 900.0, 2.0, 600.0]
    flags, secs = split_experts(rows, 128, QWEN3, H200)
    assert flags[1] and flags[3] and not (flags[0] and flags[2])
    assert secs <= sum(cpu_cost(t, QWEN3, H200) for t in rows)


def test_no_gpu_never_streams():
    assert switch_point(QWEN3, dataclasses.replace(H200, h2d_gbps=None, gpu_tflops=None)) is None


def test_rate_cache_roundtrip(tmp_path):
    path = tmp_path / "rates.json"
    store_rates("machine-a", H200, path)
    got = cached_rates("machine-a", path)
    assert dataclasses.replace(got, source=H200.source) == H200 and "cache" in got.source
    assert cached_rates("machine-b", path) is None


def test_machine_rates_measures_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    g = torch.Generator().manual_seed(0)
    store = ExpertStore(torch.randn(8, 64, 64, generator=g), torch.randn(8, 64, 32, generator=g))
    first = machine_rates(store, torch.float32, None, host_info(), 2)
    assert first.source.startswith("measured") and first.cpu_gbps > 0 and first.cpu_tflops > 0
    assert first.h2d_gbps is None and first.decode_workers >= 1
    again = machine_rates(store, torch.float32, None, host_info(), 2)
    assert again.source.startswith("cache") and again.cpu_gbps == first.cpu_gbps


def test_memory_priority_order_and_errors():
    gib = 1 << 30
    b = plan_gpu_memory(free=10 * gib, kv_pool=4 * gib, staging=2 * gib)
    assert PRIORITY == ("kv_pool", "prefill_staging", "activation_workspace")
    assert (b.kv_pool, b.prefill_staging, b.activation_workspace) == (4 * gib, 2 * gib, 4 * gib)
    assert b.explain_line().startswith("offload gpu memory (priority order) = kv_pool 4.00 GiB -> prefill_staging")
    with pytest.raises(ValueError, match="MOEFX_OFFLOAD_STAGE_TILE_E.*at most 2 experts"):
        plan_gpu_memory(free=10 * gib, kv_pool=6 * gib, staging=6 * gib, tile_e=96, expert_bytes=gib)
    with pytest.raises(ValueError, match="max_batch_size"):
        plan_gpu_memory(free=gib, kv_pool=2 * gib, staging=0)


def _gpu_plan(monkeypatch, tmp_path, **env):
    from moefx.config import CompilationConfig
    from moefx.offload.plan import offload_plan
    from moefx.signatures import ExecutionSignature, ModelSignature

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ms = ModelSignature(model_type="qwen3_moe", dtype="bfloat16", hidden_size=2048, moe_intermediate_size=768,
                        num_experts=128, top_k=8, num_layers=48)
    es = ExecutionSignature(device_type="cuda", device_name="NVIDIA H200", mode="eager")
    return offload_plan(ms, es, CompilationConfig.from_any({"offload": {"experts": "cpu"}})), ms, es


def test_plan_reads_switch_point_from_cache(monkeypatch, tmp_path):
    from moefx.offload.cost import key_for

    plan, ms, es = _gpu_plan(monkeypatch, tmp_path)
    assert not plan.switch_known and "decided at optimize()" in "\n".join(plan.explain_lines())
    store_rates(key_for("NVIDIA H200", "bfloat16", (1536, 2048), (2048, 768), False, host_info()), H200,
                tmp_path / "moefx" / "offload_rates.json")
    plan, _, _ = _gpu_plan(monkeypatch, tmp_path)
    lines = "\n".join(plan.explain_lines())
    assert plan.switch_tokens == switch_point(QWEN3, H200)
    assert f"offload prefill streaming to GPU = M >= {plan.switch_tokens}  [cost model: cache" in lines
    assert "split per call by the cost model" in lines


def test_plan_env_pins_switch_point(monkeypatch, tmp_path):
    plan, _, _ = _gpu_plan(monkeypatch, tmp_path, VLLM_XIAOTU_GPU_PREFILL_MIN_TOKENS="512")
    assert plan.switch_pinned and plan.switch_tokens == 512
    assert "= M >= 512  [env VLLM_XIAOTU_GPU_PREFILL_MIN_TOKENS]" in "\n".join(plan.explain_lines())
    monkeypatch.delenv("VLLM_XIAOTU_GPU_PREFILL_MIN_TOKENS")
    plan, _, _ = _gpu_plan(monkeypatch, tmp_path, MOEFX_OFFLOAD_GPU_PREFILL_MIN_TOKENS="0")
    assert plan.switch_tokens is None and "never (CPU for every M)" in "\n".join(plan.explain_lines())


def test_shared_dram_keeps_decode_on_the_cpu_when_splitting_gains_nothing():
    """H2D copies and the CPU path read the same DRAM: when both at once read no faster than the CPU alone,
    splitting a decode call cannot help and the model keeps it on the CPU; with independent bandwidth it splits."""
    rows = [1.0] * 8
    host = dataclasses.replace(H200, cpu_gbps=65.0)  # the host kernel outruns PCIe (measured: 63 vs 55 GB/s)
    saturated = dataclasses.replace(host, shared_gbps=host.cpu_gbps)
    flags, secs = split_experts(rows, 1, QWEN3, saturated)
    assert not any(flags)
    assert secs == pytest.approx(cpu_seconds(1, QWEN3, host), rel=1e-3)
    independent = dataclasses.replace(host, shared_gbps=host.cpu_gbps + host.h2d_gbps)
    flags, split_secs = split_experts(rows, 1, QWEN3, independent)
    assert 0 < sum(flags) < len(flags) and split_secs < secs
    # In between, the split is no faster than what both sides can read together.
    partial = dataclasses.replace(host, shared_gbps=1.3 * host.cpu_gbps)
    flags, secs_partial = split_experts(rows, 1, QWEN3, partial)
    assert secs_partial >= 8 * QWEN3.expert_bytes / (partial.shared_gbps * 1e9) - 1e-12


def test_fixed_streaming_cost_keeps_small_calls_on_the_cpu():
    """A call that streams anything pays the ring's fixed cost once: worth it for many experts, not for decode."""
    rows = [1.0] * 8
    free = dataclasses.replace(H200, shared_gbps=H200.cpu_gbps + H200.h2d_gbps)
    assert any(split_experts(rows, 1, QWEN3, free)[0])
    costly = dataclasses.replace(free, stream_overhead_s=2e-3)
    flags, secs = split_experts(rows, 1, QWEN3, costly)
    assert not any(flags) and secs == pytest.approx(cpu_seconds(1, QWEN3, costly), rel=1e-3)
    # Once routing hits every expert, streaming all of them needs no routing sync and pays no fixed cost, while
    # a split still does: with a fixed cost, prefill streams everything instead of splitting.
    assert modelled_seconds(8192, QWEN3, costly)[1] == 1.0


def test_no_sliver_splits_where_every_expert_streams_without_a_sync():
    """Where routing hits every expert, a split must leave the CPU at least SPLIT_MIN_CPU_SHARE of the experts
    (it waits for the router, streaming everything does not); below that M any worthwhile split is taken."""
    from moefx.offload.cost import SPLIT_MIN_CPU_SHARE, hits_every_expert

    rates = dataclasses.replace(H200, cpu_tflops=0.43, shared_gbps=81.0)
    shares = {m: modelled_seconds(m, QWEN3, rates)[1] for m in (64, 512, 1024, 2048, 8192)}
    assert 0 < shares[64] < 1 and not hits_every_expert(64, 8, 128)
    for m, share in shares.items():
        assert share == 1.0 or 1 - share >= SPLIT_MIN_CPU_SHARE or not hits_every_expert(m, 8, 128), (m, share)
    assert shares[512] < 1.0 == shares[8192]


def test_plan_line_shows_the_measured_split_start():
    from types import SimpleNamespace

    from moefx.offload.transform import _record_cost_model

    op = SimpleNamespace()
    _record_cost_model(op, QWEN3, H200, split_start=32)
    assert op.decode_path.startswith("CPU alone below M=32 (measured)") and "M=1:" not in op.decode_path
    assert "M=64:" in op.decode_path and op.switch_tokens == switch_point(QWEN3, H200)
    _record_cost_model(op, QWEN3, H200)
    assert "M=1:" in op.decode_path and "modelled" in op.decode_path
