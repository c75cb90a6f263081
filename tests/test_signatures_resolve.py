"""resolve(): precedence user > env > rule > provider > off, fail-closed unknowns, env warnings, serving hints."""

from __future__ import annotations

import re
import warnings

import pytest

import moefx.log
import moefx.passes
from moefx.models.catalog import catalog_config
from moefx.passes.base import MoefxPass
from moefx.planner.pass_overrides import pass_overrides
from moefx.planner.rules import parse_rule
from moefx.planner.serving import CAPTURE_SIZE_LIMIT, capture_sizes
from moefx.signatures import ExecutionSignature, ModelSignature, resolve


class _Plain(MoefxPass):
    name = "eliminate_noops"


class _CudaOnly(MoefxPass):
    name = "fuse_act_quant"

    @classmethod
    def unsupported_reason(cls, ms: object, es: object) -> str | None:
        return None if getattr(es, "device_type", None) == "cuda" else "needs CUDA"


class _Logits(MoefxPass):
    name = "last_token_logits"


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stub passes with known support, no env leaking in, and fresh warn-once memory."""
    monkeypatch.setattr(moefx.passes, "PASS_REGISTRY", {p.name: p for p in (_Plain, _CudaOnly, _Logits)})
    monkeypatch.setattr(moefx.log, "_warned", set())
    for var in ("MOEFX_PASSES", "MOEFX_MOE_BACKEND", "MOEFX_USE_GEMV"):
        monkeypatch.delenv(var, raising=False)


DS = ModelSignature.from_config(catalog_config("deepseek-v3"))  # fp8 dynamic activations
QWEN = ModelSignature.from_config(catalog_config("qwen3-30b-a3b"))  # unquantized
H200 = ExecutionSignature.preset("h200", dtype="bfloat16")
CPU = ExecutionSignature(device_type="cpu", dtype="bfloat16")


def _recorded(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught]


def test_provider_preferences_follow_model_and_device() -> None:
    plan = resolve(DS, H200)
    assert plan.profile == "deepseek_v3"
    assert plan.enabled_passes() == ["eliminate_noops", "fuse_act_quant", "last_token_logits"]
    assert plan.passes["fuse_act_quant"].source == "provider deepseek_v3"
    qwen = resolve(QWEN, H200)
    assert not qwen.pass_enabled("fuse_act_quant") and "not quantized" in qwen.passes["fuse_act_quant"].reason
    cpu = resolve(DS, CPU)
    assert cpu.enabled_passes() == ["eliminate_noops"]
    assert cpu.passes["last_token_logits"].preferred is False


def test_unknown_profile_runs_upstream_with_nothing_enabled() -> None:
    ms = ModelSignature(model_type="llama", dtype="bfloat16", hidden_size=4096)
    plan = resolve(ms, H200)
    assert plan.profile == "unknown" and plan.enabled_passes() == []
    assert all(d.source == "default off" for d in plan.passes.values())
    for policy in plan.moe.policies.values():
        assert {r.backend for r in policy.ranges} == {"upstream"} and "profile unknown" in policy.source
    assert plan.serving["prefill_token_budget"] is None and plan.serving["vocab_parallel_lm_head"] is False


def test_user_config_beats_everything_and_user_backend_beats_unknown() -> None:
    plan = resolve(DS, H200, {"pass_config": {"fuse_act_quant": False}, "moe_backend": "reference"})
    assert not plan.pass_enabled("fuse_act_quant") and plan.passes["fuse_act_quant"].source == "user config"
    unknown = resolve(ModelSignature(model_type="llama"), H200, {"moe_backend": "gemv"})
    assert unknown.moe.policies["eager"].backend_for(4) == "gemv"


def test_explicit_request_for_unsupported_warns_once_and_stays_off() -> None:
    cfg = {"pass_config": {"fuse_act_quant": True}}
    plan, messages = _recorded(lambda: resolve(DS, CPU, cfg))
    decision = plan.passes["fuse_act_quant"]
    assert (decision.enabled, decision.supported, decision.source) == (False, False, "user config")
    assert "needs CUDA" in decision.reason
    assert len([m for m in messages if "fuse_act_quant" in m and "unsupported" in m]) == 1
    _, again = _recorded(lambda: resolve(DS, CPU, cfg))
    assert not [m for m in again if "fuse_act_quant" in m]
    with pytest.raises(ValueError, match="fuse_act_quant.*strict"):
        resolve(DS, CPU, {**cfg, "strict": True})


def test_supported_but_not_preferred_runs_when_asked() -> None:
    plan = resolve(QWEN, H200, {"pass_config": {"fuse_act_quant": True}})
    assert plan.pass_enabled("fuse_act_quant") and plan.passes["fuse_act_quant"].preferred is False


def test_env_sits_between_config_and_plan_and_always_warns_on_change(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEFX_PASSES", "last_token_logits=off, eliminate_noops=on")
    plan, messages = _recorded(lambda: resolve(DS, H200))
    assert not plan.pass_enabled("last_token_logits")
    assert plan.passes["last_token_logits"].source == "env MOEFX_PASSES"
    assert any(re.search(r"MOEFX_PASSES turns pass last_token_logits off", m) for m in messages)
    # eliminate_noops=on agrees with the plan: recorded as the source, but no warning (nothing changed).
    assert plan.passes["eliminate_noops"].source == "env MOEFX_PASSES"
    assert not any("eliminate_noops" in m for m in messages)
    # The user config still wins, and the conflict is reported.
    plan, messages = _recorded(lambda: resolve(DS, H200, {"pass_config": {"last_token_logits": True}}))
    assert plan.pass_enabled("last_token_logits") and plan.passes["last_token_logits"].source == "user config"
    assert any("config wins" in m for m in messages)


def test_env_turning_on_an_unmatched_model_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEFX_PASSES", "last_token_logits=on")
    plan, messages = _recorded(lambda: resolve(ModelSignature(model_type="llama"), H200))
    assert plan.pass_enabled("last_token_logits")
    assert any("turns pass last_token_logits on" in m for m in messages)


@pytest.mark.parametrize(
    "value, match",
    [("nosuch=on", "NAME=on"), ("fuse_act_quant=maybe", "invalid"), ("fuse_act_quant", "NAME=on"),
     ("last_token_logits=on,last_token_logits=off", "twice")],
)
def test_env_values_are_validated(value: str, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=match):
        pass_overrides({"MOEFX_PASSES": value})
    monkeypatch.setenv("MOEFX_PASSES", value)
    with pytest.raises(ValueError, match="MOEFX_PASSES"):
        resolve(QWEN, H200)


def test_rule_overrides_provider_but_not_env_or_config(monkeypatch: pytest.MonkeyPatch) -> None:
    rule = parse_rule({"match": {"family": "deepseek"}, "passes": {"fuse_act_quant": False}}, "r.yaml", 0)
    plan = resolve(DS, H200, rules=[rule])
    assert not plan.pass_enabled("fuse_act_quant") and plan.passes["fuse_act_quant"].source == "rule r.yaml#0"
    assert plan.rule == "rule r.yaml#0"
    monkeypatch.setenv("MOEFX_PASSES", "fuse_act_quant=on")
    with pytest.warns(UserWarning, match="plan says off \\[rule r.yaml#0\\]"):
        plan = resolve(DS, H200, rules=[rule])
    assert plan.passes["fuse_act_quant"].source == "env MOEFX_PASSES"


def test_rule_requesting_unsupported_pass_warns() -> None:
    rule = parse_rule({"match": {"family": "deepseek"}, "passes": {"fuse_act_quant": True}}, "r.yaml", 3)
    plan, messages = _recorded(lambda: resolve(DS, CPU, rules=[rule]))
    assert not plan.pass_enabled("fuse_act_quant")
    assert any("requested by rule r.yaml#3" in m for m in messages)


def test_explain_names_the_source_of_every_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEFX_PASSES", "last_token_logits=off")
    rule = parse_rule({"match": {"family": "deepseek"}, "moe": {"backend": "gemv"}}, "r.yaml", 0)
    with pytest.warns(UserWarning, match="turns pass last_token_logits off"):
        plan = resolve(DS, H200.replace(mode="capture", max_batch_size=40, tp_size=2),
                       {"pass_config": {"eliminate_noops": True}}, rules=[rule])
    lines = plan.decisions()
    assert all(re.search(r"\[[^\]]+\]", line) for line in lines), lines
    text = plan.explain()
    for source in ("user config", "env MOEFX_PASSES", "provider deepseek_v3", "rule r.yaml#0",
                   "mode capture, max_batch_size 40", "MoE family at max_batch_size 40", "tp_size 2"):
        assert source in text, source


def test_no_stale_plan_after_execution_changes() -> None:
    a = resolve(DS, H200)
    b = resolve(DS, H200.replace(device_type="cpu", device_name=None, capability=None, multiprocessor_count=None))
    assert a.execution != b.execution and a.execution.key() != b.execution.key()
    assert a.pass_enabled("fuse_act_quant") and not b.pass_enabled("fuse_act_quant")
    assert a.fingerprint() == resolve(DS, H200).fingerprint() != b.fingerprint()
    assert resolve(DS, H200.replace(tp_size=2)).fingerprint() != a.fingerprint()


@pytest.mark.parametrize(
    "mbs, expected",
    [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (16, [1, 2, 4, 8, 16]), (17, [1, 2, 4, 8, 16, 17]),
     (24, [1, 2, 4, 8, 16, 24]), (31, [1, 2, 4, 8, 16, 24, 31]), (64, [1, 2, 4, 8, 16, 24, 32, 48, 64]),
     (100, [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100])],
)
def test_capture_sizes_are_geometric_up_to_max_batch_size(mbs: int, expected: list[int]) -> None:
    sizes = capture_sizes(mbs)
    assert sizes == expected
    assert max(sizes) == mbs and sizes == sorted(set(sizes))
    plan = resolve(QWEN, H200.replace(mode="capture", max_batch_size=mbs))
    assert plan.serving["capture_sizes"] == sizes
    assert f"max_batch_size {mbs}" in plan.serving_sources["capture_sizes"]


def test_default_plan_on_an_h200_captures_up_to_a_cap_from_memory() -> None:
    """No max_batch_size: the H200 preset's published memory, less the weights, sizes the cap (Qwen3-30B-A3B:
    96 sequences of 4096 KV tokens fit in half of it); explain() lists the sizes and says where the cap came from."""
    es = ExecutionSignature.preset("h200", mode="capture", dtype="bfloat16")
    assert es.max_batch_size is None and "max_batch=from memory" in es.describe()
    plan = resolve(QWEN, es)
    sizes = plan.serving["capture_sizes"]
    assert sizes[:9] == [1, 2, 4, 8, 16, 24, 32, 48, 64] and max(sizes) >= 64
    assert max(sizes) <= CAPTURE_SIZE_LIMIT and sizes == sorted(set(sizes))
    line = next(x for x in plan.explain().splitlines() if "serving capture_sizes" in x)
    assert str(sizes) in line and "max_batch_size unset" in line and "from memory" in line and "H200" in line
    assert plan.serving["prefill_token_budget"] == 4096  # the cap stands for max_batch_size (>= 32)
    # A model with more KV per token gets a lower cap; one with unknown geometry the largest.
    deep = ModelSignature.from_config({**catalog_config("qwen3-30b-a3b"), "num_hidden_layers": 480})
    assert max(resolve(deep, es).serving["capture_sizes"]) < max(sizes)
    bare = resolve(ModelSignature(model_type="llama"), es)
    assert max(bare.serving["capture_sizes"]) == CAPTURE_SIZE_LIMIT
    assert "KV bytes per token unknown" in bare.serving_sources["capture_sizes"]


def test_unset_max_batch_size_off_cuda_has_no_cap_and_no_prefill_budget() -> None:
    plan = resolve(QWEN, CPU.replace(mode="capture"))
    assert plan.serving["capture_sizes"] == [] and plan.serving["prefill_token_budget"] is None
    assert "max_batch_size unset on cpu" in plan.serving_sources["prefill_token_budget"]


def test_capture_sizes_only_in_capture_mode_on_cuda() -> None:
    assert resolve(QWEN, H200.replace(mode="compile", max_batch_size=64)).serving["capture_sizes"] == []
    assert resolve(QWEN, CPU.replace(mode="capture", max_batch_size=64)).serving["capture_sizes"] == []
    with pytest.raises(ValueError):
        capture_sizes(0)


@pytest.mark.parametrize("mbs, budget", [(31, None), (32, 4096), (256, 4096)])
def test_prefill_budget_boundary(mbs: int, budget: int | None) -> None:
    plan = resolve(QWEN, H200.replace(max_batch_size=mbs))
    assert plan.serving["prefill_token_budget"] == budget


def test_prefill_budget_user_override_and_unknown_model() -> None:
    plan = resolve(QWEN, H200.replace(max_batch_size=8), {"prefill_token_budget": 2048})
    assert plan.serving["prefill_token_budget"] == 2048
    assert plan.serving_sources["prefill_token_budget"] == "user config"
    unknown = resolve(ModelSignature(model_type="llama"), H200.replace(max_batch_size=64))
    assert unknown.serving["prefill_token_budget"] is None


def test_vocab_parallel_lm_head_needs_tp_and_a_known_causal_lm() -> None:
    assert resolve(QWEN, H200.replace(tp_size=2)).serving["vocab_parallel_lm_head"] is True
    assert resolve(QWEN, H200).serving["vocab_parallel_lm_head"] is False
    # Functional collectives run over gloo too: the CPU is eligible (tests/test_parallel.py runs it).
    assert resolve(QWEN, CPU.replace(tp_size=2)).serving["vocab_parallel_lm_head"] is True
    unknown = resolve(ModelSignature(model_type="llama"), CPU.replace(tp_size=2))
    assert unknown.serving["vocab_parallel_lm_head"] is False


def test_registered_passes_are_handled_generically(monkeypatch: pytest.MonkeyPatch) -> None:
    class _Later(MoefxPass):
        name = "fuse_norm_quant"

    monkeypatch.setattr(moefx.passes, "PASS_REGISTRY", {p.name: p for p in (_Plain, _Later, _CudaOnly, _Logits)})
    plan = resolve(DS, H200)
    assert list(plan.passes) == ["eliminate_noops", "fuse_norm_quant", "fuse_act_quant", "last_token_logits"]
    assert plan.pass_enabled("fuse_norm_quant")


def test_the_free_memory_a_process_reads_when_it_plans_changes_no_compile_key(monkeypatch, tmp_path) -> None:
    """README path (no max_batch_size): the capture cap comes from the free memory the planning process reads, which
    is lower where transformers' static-cache compile ran first. The plan says so in its explain text, but the
    cache keys (the plan's fingerprint, the pass manager's uuid that inductor's FX cache keys on, the compile-cache
    file's name and stamp) must not change while the decisions stay the same; a cap read across a bucket edge
    changes the capture sizes, which no pass reads: the uuid and the file stay the same."""
    import moefx.planner.serving as serving
    from moefx.config import CompilationConfig
    from moefx.engine.compile_cache.file import CompileCache
    from moefx.passes import PassManager

    es = ExecutionSignature.preset("h100", mode="capture", dtype="bfloat16")
    plans = []
    for gib in (20.31, 20.18, 9.0):  # two readings under one cap, then a lower cap
        monkeypatch.setattr(serving, "_free_memory", lambda ms, es, g=gib: (int(g * 2**30), f"{g:.1f} GiB free"))
        plans.append(resolve(QWEN, es))
    a, b, low = plans
    assert "20.3 GiB free" in a.explain() and "20.2 GiB free" in b.explain()
    assert a.serving == b.serving and a.fingerprint() == b.fingerprint()
    assert low.serving["capture_sizes"] != a.serving["capture_sizes"] and low.fingerprint() != a.fingerprint()
    cfg = CompilationConfig()
    uuids = {PassManager(cfg, p.enabled_passes(), p).uuid() for p in plans}
    assert len(uuids) == 1
    files = [CompileCache.for_plan(tmp_path, p, cfg, next(iter(uuids))) for p in plans]
    assert len({f.path for f in files}) == 1 and all(f.stamp == files[0].stamp for f in files)
