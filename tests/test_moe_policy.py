"""MoE policy: exact calibration keys, thresholds at T and T±1, capture safety, overrides, pins, tables."""

from __future__ import annotations

import sys

import pytest
import torch
import yaml

from moefx.backends import BACKENDS
from moefx.backends.calibration import (
    CalibrationRow,
    MRange,
    crossover_ranges,
    device_identity,
    find_row,
    key_for_tensors,
    load_table,
    parse_ranges,
    user_table_dir,
    write_row,
)
from moefx.backends.op import select_backend
from moefx.backends.policy import env_override, moe_plan, parse_policy_spec
from moefx.backends.reference import ReferenceBackend
from moefx.config import CompilationConfig
from moefx.signatures import ExecutionSignature, ModelSignature

E, H, I, TOPK = 8, 64, 32, 2
T = 16  # threshold used by the test tables


pytestmark = pytest.mark.usefixtures("isolated_moe_tables")


def _tensors(m: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(m)
    hidden = torch.randn(m, H, generator=g, dtype=dtype)
    ids = torch.randint(0, E, (m, TOPK), generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g, dtype=dtype)
    w2 = torch.randn(E, H, I, generator=g, dtype=dtype)
    return hidden, ids, w13, w2


def _row(mode: str, ranges: str, **key_changes) -> CalibrationRow:
    hidden, ids, w13, _ = _tensors(1)
    key = key_for_tensors(hidden, ids, w13, None, mode)
    key = type(key)(**{**key.__dict__, **key_changes})
    return CalibrationRow(key, parse_ranges(ranges, "test"), {"date": "2026-11-29", "command": "test"}, "")


def _user_table(tmp_path, *rows: CalibrationRow):
    path = tmp_path / "xdg" / "moefx" / "calibration" / "cpu.yaml"
    for row in rows:
        write_row(path, row)
    return path


def _choose(m: int, backend: str = "auto", capturing: bool = False, upstream: str = "transformers") -> str:
    hidden, ids, w13, w2 = _tensors(m)
    return select_backend(hidden, ids, w13, w2, backend=backend, upstream=upstream, capturing=capturing)


def _tiny_signatures(mode: str = "compile"):
    ms = ModelSignature(num_experts=E, hidden_size=H, moe_intermediate_size=I, top_k=TOPK, dtype="float32")
    es = ExecutionSignature.detect(device="cpu", mode=mode, dtype=torch.float32)
    return ms, es


def test_no_row_runs_upstream_and_plan_says_why():
    assert _choose(1) == "transformers"
    assert _choose(1, upstream="reference") == "reference"
    plan = moe_plan(*_tiny_signatures(), CompilationConfig())
    assert not plan.applies
    text = "\n".join(plan.explain_lines())
    assert "moe eager M 1..inf = upstream  [no calibration row for eager]" in text
    assert f"E={E} N={2 * I} K={H} top_k={TOPK} float32 quant=none" in text


def test_threshold_and_neighbours(tmp_path):
    _user_table(tmp_path, _row("eager", f"reference@1-{T},upstream@{T + 1}-"))
    assert [_choose(m) for m in (T - 1, T, T + 1)] == ["reference", "reference", "transformers"]
    assert _choose(4096) == "transformers"


def test_only_exact_key_matches(tmp_path):
    _user_table(
        tmp_path,
        _row("eager", "reference@1-"),
        _row("capture", "reference@1-", E=E + 1),
        _row("capture", "reference@1-", dtype="bfloat16"),
        _row("capture", "reference@1-", top_k=TOPK + 1),
        _row("capture", "reference@1-", multiprocessor_count=999),
    )
    assert _choose(3) == "reference"
    hidden, ids, w13, _ = _tensors(3)
    assert find_row(key_for_tensors(hidden, ids, w13, None, "capture")) is None
    assert find_row(key_for_tensors(hidden, ids, w13, (128, 128), "eager")) is None


def test_plan_uses_row_and_names_it(tmp_path):
    path = _user_table(tmp_path, _row("eager", f"reference@1-{T},upstream@{T + 1}-"))
    plan = moe_plan(*_tiny_signatures(), CompilationConfig())
    assert plan.applies
    lines = plan.explain_lines()
    assert f"moe eager M 1..{T} = reference  [{path.name}#1]" in lines
    assert f"moe eager M {T + 1}..inf = upstream  [{path.name}#1]" in lines
    # reference syncs the host: the capture policy never runs it.
    assert plan.policy("capture").backend_for(1) == "upstream"
    spec = parse_policy_spec(plan.spec())
    assert spec["eager"].backend_for(T) == "reference" and spec["eager"].backend_for(T + 1) == "upstream"


def test_plan_tensor_parallel_key_divides_intermediate(tmp_path):
    _user_table(tmp_path, _row("eager", "reference@1-", N=I))  # 2I / tp=2
    ms, _ = _tiny_signatures()
    es = ExecutionSignature(device_type="cpu", dtype="float32", tp_size=2)
    assert moe_plan(ms, es, CompilationConfig()).policy("eager").backend_for(1) == "reference"
    es1 = ExecutionSignature(device_type="cpu", dtype="float32", tp_size=1)
    assert not moe_plan(ms, es1, CompilationConfig()).applies


def test_capture_uses_capture_row_only(tmp_path):
    _user_table(tmp_path, _row("eager", "upstream@1-"), _row("capture", f"upstream@1-{T},reference@{T + 1}-"))
    assert _choose(T + 1, capturing=False) == "transformers"
    with pytest.raises(RuntimeError, match="cannot run inside CUDA-graph capture"):
        _choose(T + 1, capturing=True)
    assert _choose(T, capturing=True) == "transformers"


def test_capture_never_runs_host_syncing_forced_backend():
    plan = moe_plan(*_tiny_signatures(), CompilationConfig(moe_backend="reference"))
    assert plan.policy("eager").backend_for(1) == "reference"
    assert plan.policy("capture").backend_for(1) == "upstream"
    assert "reference waits on the host" in plan.policy("capture").source
    with pytest.raises(RuntimeError, match="syncs the host"):
        _choose(1, backend="reference", capturing=True)


def test_legacy_is_the_reference_backend_under_its_former_name(tmp_path, monkeypatch):
    """`legacy` (the public contract's name for the reference loop) is accepted wherever a MoE backend is named and
    read as `reference`: config (dict, dotted override, direct), env, the op's arguments, table ranges and timings,
    rule pins and rule files. The config's hash is that of `reference`; only `reference` is listed as a valid
    choice."""
    from moefx.backends import moe_experts
    from moefx.config import MOE_BACKENDS
    from moefx.planner.rules import parse_rule

    assert "legacy" not in MOE_BACKENDS and "reference" in BACKENDS and "legacy" not in BACKENDS
    ref = CompilationConfig(moe_backend="reference")
    for cfg in (CompilationConfig.from_any({"moe_backend": "legacy"}), CompilationConfig(moe_backend="legacy"),
                CompilationConfig().with_overrides(["moe_backend=legacy"])):
        assert cfg.moe_backend == "reference" and cfg.compute_hash() == ref.compute_hash()
    with pytest.raises(ValueError, match=r"valid choices: \['auto', 'reference'"):
        CompilationConfig.from_any({"moe_backend": "legacyy"})
    assert moe_plan(*_tiny_signatures(), CompilationConfig(moe_backend="legacy")).backend == "reference"
    monkeypatch.setenv("MOEFX_MOE_BACKEND", "legacy")
    assert _choose(1) == "reference" and env_override().forced == "reference"
    monkeypatch.delenv("MOEFX_MOE_BACKEND")
    assert _choose(1, backend="legacy") == _choose(1, upstream="legacy") == "reference"
    hidden, ids, w13, w2 = _tensors(3)
    weights = torch.rand(3, TOPK)
    want = BACKENDS["reference"](hidden, ids, weights, w13, w2)
    assert torch.equal(moe_experts(hidden, ids, weights, w13, w2, backend="legacy"), want)
    assert torch.equal(moe_experts(hidden, ids, weights, w13, w2, backend="upstream", upstream="legacy"), want)
    row = _row("eager", f"legacy@1-{T},upstream@{T + 1}-").to_yaml()
    row["timings_us"] = {"legacy": {1: 5.0}}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"rows": [row]}))
    (loaded,) = load_table(path)
    assert loaded.ranges[0].backend == "reference" and set(loaded.timings_us) == {"reference"}
    plan = moe_plan(*_tiny_signatures(), CompilationConfig(), pins={"ranges": f"legacy@1-{T},upstream@{T + 1}-"})
    assert plan.policy("eager").backend_for(1) == "reference"
    plan = moe_plan(*_tiny_signatures(), CompilationConfig(), pins={"backend": "legacy"})
    assert plan.policy("eager").backend_for(100) == "reference"
    rule = parse_rule({"match": {"family": "qwen3_moe"}, "moe": {"backend": "legacy"}}, "rules.yaml", 0)
    assert rule.moe == {"backend": "reference"}


def test_env_override_and_validation(tmp_path, monkeypatch):
    _user_table(tmp_path, _row("eager", "upstream@1-"))
    monkeypatch.setenv("MOEFX_MOE_BACKEND", "reference")
    assert _choose(1) == "reference"
    plan = moe_plan(*_tiny_signatures(), CompilationConfig())
    assert plan.backend == "reference" and plan.source == "env MOEFX_MOE_BACKEND"
    # the user's config wins over the environment
    assert moe_plan(*_tiny_signatures(), CompilationConfig(moe_backend="upstream")).backend == "upstream"
    monkeypatch.setenv("MOEFX_MOE_BACKEND", "fastest")
    with pytest.raises(ValueError, match="MOEFX_MOE_BACKEND='fastest'.*valid choices"):
        _choose(1)


@pytest.mark.parametrize(
    ("switch", "enum", "error"),
    [("1", "grouped", True), ("0", "gemv", True), ("1", "gemv", False), ("0", "grouped", False), ("maybe", None, True)],
)
def test_backend_switch_conflicts(monkeypatch, switch, enum, error):
    monkeypatch.setenv("MOEFX_USE_GEMV", switch)
    if enum:
        monkeypatch.setenv("MOEFX_MOE_BACKEND", enum)
    if error:
        with pytest.raises(ValueError, match="MOEFX_USE_GEMV"):
            env_override()
    else:
        assert env_override().forced == enum


def test_backend_switch_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFX_USE_GEMV", "1")
    with pytest.warns(UserWarning, match="older spelling of MOEFX_MOE_BACKEND"):
        override = env_override()
    assert (override.forced, override.source) == ("gemv", "env MOEFX_USE_GEMV")
    monkeypatch.setenv("MOEFX_USE_GEMV", "0")
    _user_table(tmp_path, _row("eager", f"gemv@1-{T},reference@{T + 1}-"))
    plan = moe_plan(*_tiny_signatures(), CompilationConfig())
    assert plan.policy("eager").backend_for(1) == "upstream"
    assert plan.policy("eager").backend_for(T + 1) == "reference"


@pytest.fixture
def cuda_only_backend():
    class CudaOnly(ReferenceBackend):
        name = "test_cuda_only"
        devices = ("cuda",)

    BACKENDS[CudaOnly.name] = CudaOnly()
    yield CudaOnly.name
    del BACKENDS[CudaOnly.name]


def test_forced_backend_obeys_unsupported_reason(cuda_only_backend):
    with pytest.warns(UserWarning, match="test_cuda_only.*does not run on cpu; running reference"):
        assert _choose(2, backend=cuda_only_backend, upstream="reference") == "reference"
    with pytest.warns(UserWarning, match="'nope'.*not registered"):
        assert _choose(2, backend="eager=nope@1-;capture=nope@1-", upstream="reference") == "reference"


def test_pins():
    ms, es = _tiny_signatures()
    plan = moe_plan(ms, es, CompilationConfig(), pins={"backend": "reference", "source": "rules.yaml#2"})
    assert plan.policy("eager").backend_for(100) == "reference" and plan.source == "rules.yaml#2"
    plan = moe_plan(ms, es, CompilationConfig(), pins={"ranges": f"reference@1-{T},upstream@{T + 1}-", "mode": "eager"})
    assert [plan.policy("eager").backend_for(m) for m in (T, T + 1)] == ["reference", "upstream"]
    assert plan.policy("capture").backend_for(1) == "upstream"
    pinned = moe_plan(ms, es, CompilationConfig(moe_backend="upstream"), pins={"backend": "reference"})
    assert pinned.backend == "upstream"
    with pytest.raises(ValueError, match="exactly one of"):
        moe_plan(ms, es, CompilationConfig(), pins={"backend": "reference", "ranges": "reference@1-"})
    with pytest.raises(ValueError, match=r"unknown MoE backend \['gemvv'\]; valid choices"):
        moe_plan(ms, es, CompilationConfig(), pins={"backend": "gemvv", "source": "r.yaml#1"})
    with pytest.raises(ValueError, match="starts at M=4, expected M=3"):
        moe_plan(ms, es, CompilationConfig(), pins={"ranges": "reference@1-2,upstream@4-"})


def test_table_validation_names_file_and_row(tmp_path):
    good = _row("eager", "reference@1-").to_yaml()
    bad_ranges = dict(good, ranges=[{"backend": "reference", "min_m": 1, "max_m": 4}])
    bad_mode = dict(good, key=dict(good["key"], mode="graph"))
    no_prov = {k: v for k, v in good.items() if k != "provenance"}
    for i, rows in enumerate(([good, bad_ranges], [bad_mode], [no_prov], [good, good])):
        path = tmp_path / f"t{i}.yaml"
        path.write_text(yaml.safe_dump({"rows": rows}))
        with pytest.raises(ValueError, match=rf"t{i}\.yaml"):
            load_table(path)


def test_crossovers_interpolate_in_log_m():
    timings = {"gemv": {1: 10.0, 2: 12.0, 4: 16.0, 8: 40.0}, "grouped": {1: 30.0, 2: 30.0, 4: 30.0, 8: 30.0}}
    ranges = crossover_ranges(timings)
    assert ranges[0].backend == "gemv" and ranges[1] == MRange("grouped", ranges[0].max_m + 1, None)
    assert 4 <= ranges[0].max_m <= 7
    assert crossover_ranges({"a": {1: 1.0, 64: 1.0}, "b": {1: 2.0, 64: 2.0}}) == (MRange("a", 1, None),)
    noisy = {"a": {1: 10.0, 2: 10.1, 4: 10.0, 8: 10.2}, "b": {1: 12.0, 2: 10.0, 4: 10.2, 8: 9.95}}
    assert crossover_ranges(noisy) == (MRange("a", 1, None),)  # within 3%: no slivers
    assert crossover_ranges(noisy, tolerance=0.0)[1].backend == "b"
    lone = {"a": {1: 10.0, 2: 13.0, 4: 10.0, 8: 30.0}, "b": {1: 20.0, 2: 10.0, 4: 20.0, 8: 20.0}}
    assert crossover_ranges(lone)[0].backend == "a" and crossover_ranges(lone)[0].max_m >= 4  # b's lone win at M=2
    edge = {"a": {1: 13.0, 2: 10.0, 4: 10.0}, "b": {1: 10.0, 2: 20.0, 4: 20.0}}
    assert crossover_ranges(edge)[0] == MRange("b", 1, 1)  # a win at the first grid point has one neighbour: kept


def test_cpu_identity_is_stable():
    assert device_identity("cpu") == device_identity(torch.device("cpu"))
    assert device_identity("cpu")[0].startswith("cpu: ")


def test_calibrate_quick_writes_a_row_the_op_then_follows(tmp_path, capsys):
    from moefx.cli import main

    out = user_table_dir() / "cpu.yaml"
    argv = ["calibrate", "--experts", str(E), "--hidden", str(H), "--intermediate", str(I), "--topk", str(TOPK),
            "--quick", "--backends", "reference,upstream", "--output", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "eager row cpu.yaml#1" in printed and "chosen" in printed
    assert f"wrote {out}: from now on moefx.optimize and `moefx plan` on this device read it" in printed
    (row,) = load_table(out)
    hidden, ids, w13, w2 = _tensors(1)
    assert row.key == key_for_tensors(hidden, ids, w13, None, "eager")
    assert set(row.timings_us) == {"reference", "upstream"}
    assert all({1, 2} <= set(ts) for ts in row.timings_us.values())  # pruning needs two slow M in a row
    assert set().union(*row.timings_us.values()) == {1, 2, 4, 8, 16}
    assert row.provenance["torch"] == str(torch.__version__) and row.provenance["date"]
    assert row.provenance["command"].startswith(f"moefx calibrate --tp 1 --experts {E} --hidden {H}")
    assert "--max-m 16 --reps 3" in row.provenance["command"] and "M 1, 2, 4, 8, 16 (5 points)" in row.provenance[
        "grid"]  # the grid actually run, not the --max-m default
    assert list(out.parent.glob("cpu-*.png"))
    plan = moe_plan(*_tiny_signatures(), CompilationConfig())
    assert plan.applies == any(r.backend != "upstream" for r in row.ranges)
    assert f"[{row.source}]" in "\n".join(plan.explain_lines())
    for m in (1, 3, 16, 17, 1000):
        (want,) = [r.backend for r in row.ranges if r.contains(m)]
        assert _choose(m) == {"upstream": "transformers"}.get(want, want)


def test_calibrate_without_matplotlib_writes_the_row_and_skips_the_plot(tmp_path, capsys, monkeypatch):
    from moefx.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "t.yaml"
    argv = ["calibrate", "--experts", str(E), "--hidden", str(H), "--intermediate", str(I), "--topk", str(TOPK),
            "--quick", "--max-m", "2", "--backends", "reference,upstream", "--output", str(out)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "plot skipped: matplotlib is not installed (pip install 'moefx[plot]')" in captured.err
    assert f"wrote {out}: plans read it only when a config lists it, e.g. config={{'calibration': ['{out}']}}" in (
        captured.out)
    assert len(load_table(out)) == 1 and not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--modes", "capture"], "needs a CUDA device"),
        (["--model", "qwen3-30b-a3b"], "either --model or"),
        (["--backends", "warp"], "not available"),
    ],
)
def test_calibrate_bad_arguments(extra, message, capsys):
    from moefx.cli import main

    argv = ["calibrate", "--experts", "4", "--hidden", "16", "--intermediate", "8", "--topk", "2", "--quick", *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_calibrate_model_shapes_per_gpu(tmp_path):
    import argparse
    import json

    from moefx.cli.calibrate_run import _shape
    from moefx.models.catalog import catalog_config

    ns = argparse.Namespace(model="deepseek-v3", tp=8, experts=None, hidden=None, intermediate=None, topk=None)
    assert _shape(ns) == ("deepseek-v3-tp8", 256, 7168, 256, 8)
    ns.model, ns.tp = "mixtral-8x7b", 1
    assert _shape(ns) == ("mixtral-8x7b", 8, 4096, 14336, 2)
    (tmp_path / "config.json").write_text(json.dumps(catalog_config("olmoe-1b-7b")))
    ns.model = str(tmp_path)
    assert _shape(ns)[1:] == (64, 2048, 1024, 8)
    ns.model, ns.tp = "qwen3-30b-a3b", 5
    with pytest.raises(ValueError, match="not divisible by --tp 5"):
        _shape(ns)


def test_sweep_stops_timing_a_contender_slow_at_two_m_in_a_row(monkeypatch):
    from moefx.calibrate import moe, sweep

    cost = {"fast": lambda m: float(m), "spiky": lambda m: 50.0 if m == 2 else float(m), "slow": lambda m: 10.0 * m}
    problem = moe.MoeProblem(4, 16, 8, 2, torch.float32, "none", torch.device("cpu"), seed=0)
    monkeypatch.setattr(problem, "call", lambda name: cost[name])
    monkeypatch.setattr(sweep, "_cpu_timer", lambda fn, sets: lambda r: fn(sets[0][0].shape[0]))
    result = sweep.sweep(problem, ["fast", "spiky", "slow"], "eager", (1, 2, 4, 8), reps=1)
    timings, skipped = result.timings, result.skipped
    assert set(timings["fast"]) == set(timings["spiky"]) == {1, 2, 4, 8}  # one spike is not enough
    assert set(timings["slow"]) == {1, 2} and "above M=2" in skipped["slow"]


def test_close_calls_are_retimed_then_reported_uncertain():
    from moefx.calibrate.sweep import RETIME_ROUNDS, Sweep, resolve_close_calls

    result = Sweep()
    noisy = [100.0, 80.0, 120.0, 90.0, 110.0]  # 20% interquartile spread
    for m in (1, 2, 4):
        result.add("a", m, [t * m for t in noisy])
        result.add("b", m, [t * m * (1.02 if m < 4 else 3.0) for t in noisy])  # a near-tie at M 1, 2 only
    calls = []

    def retime(names: list[str], m: int) -> dict[str, list[float]]:
        calls.append((tuple(names), m))
        return {name: [t * m * (1.02 if name == "b" else 1.0) for t in noisy] for name in names}

    resolve_close_calls(result, retime, default=None)
    assert sorted(result.uncertain) == [1, 2] and "within the" in result.uncertain[1]
    assert calls == [(("a", "b"), m) for m in (1, 2) for _ in range(RETIME_ROUNDS)]  # together; M=4 decided
    assert len(result.samples["a"][1]) == len(noisy) * (1 + RETIME_ROUNDS)
    assert result.pinned == {1: "a", 2: "a"}  # no default among them: the fastest, then the previous M's choice
    assert 0.03 <= result.tolerance <= 0.25  # the measured noise widens the crossover hysteresis
    # Quiet samples: a 2% gap is decided at once, nothing re-timed.
    quiet = Sweep()
    quiet.add("a", 1, [100.0] * 5)
    quiet.add("b", 1, [102.0] * 5)
    resolve_close_calls(quiet, lambda names, m: pytest.fail("re-timed a decided point"))
    assert quiet.uncertain == {} and quiet.pinned == {} and quiet.tolerance == 0.03


def _noisy_run(cpu_bias: float, seed: int):
    """A synthetic --quick sweep on a loaded machine: cpu and gemv about as fast as upstream at M<=4 (one run sees
    cpu 5% ahead, the other 5% behind), a spike or two per contender, and gemv clearly ahead (3x) at M=8, 16."""
    import random

    from moefx.calibrate.sweep import Sweep, resolve_close_calls

    rng = random.Random(seed)

    def samples(base: float) -> list[float]:
        return [base * rng.uniform(0.7, 1.3) * (rng.choice([1.0, 1.0, 40.0])) for _ in range(3)]

    base = {"upstream": lambda m: 100.0 * m, "cpu": lambda m: 100.0 * m * cpu_bias,
            "gemv": lambda m: 100.0 * m if m <= 4 else 33.0 * m}
    result = Sweep()
    for m in (1, 2, 4, 8, 16):
        for name, cost in base.items():
            result.add(name, m, [cost(m) * rng.uniform(0.98, 1.02) for _ in range(3)] if m > 4 else samples(cost(m)))

    def retime(names: list[str], m: int) -> dict[str, list[float]]:
        return {n: samples(base[n](m)) if m <= 4 else [base[n](m)] * 3 for n in names}

    resolve_close_calls(result, retime)
    return result


def test_calibrate_on_a_noisy_machine_keeps_the_default_where_the_noise_decides_and_is_repeatable():
    """Two runs whose noisy medians disagree about M<=4 write the same row: upstream (the default) kept there and
    marked uncertain, gemv only where it wins beyond the noise."""
    from moefx.backends.calibration import crossover_ranges

    rows = []
    for bias, seed in ((0.95, 1), (1.05, 2)):
        result = _noisy_run(bias, seed)
        assert result.pinned == {1: "upstream", 2: "upstream", 4: "upstream"}, result.uncertain
        assert all("kept the default, upstream" in result.uncertain[m] for m in (1, 2, 4))
        rows.append(crossover_ranges(result.timings, tolerance=result.tolerance, pinned=result.pinned))
    assert rows[0] == rows[1] and rows[0][0].backend == "upstream" and rows[0][-1].backend == "gemv"


def test_crossover_ranges_follow_pinned_points():
    from moefx.backends.calibration import crossover_ranges

    timings = {"a": {1: 1.0, 2: 1.0, 4: 1.0}, "upstream": {1: 1.1, 2: 1.1, 4: 1.1}}
    assert crossover_ranges(timings) == (MRange("a", 1, None),)
    pinned = crossover_ranges(timings, pinned={1: "upstream", 2: "upstream"})
    assert pinned[0].backend == "upstream" and pinned[0].contains(2) and pinned[-1] == MRange("a", pinned[0].max_m + 1,
                                                                                               None)
    lone = crossover_ranges(timings, pinned={2: "upstream"})  # a pinned point is not smoothed away as a lone win
    assert any(r.backend == "upstream" and r.contains(2) for r in lone)


def test_interleaved_rounds_share_the_load_of_the_machine():
    """Each round times every contender once, order rotated: a round the machine is loaded slows all of them,
    so the medians keep their ratio; a contender that raises is dropped with the reason."""
    from moefx.calibrate.sweep import interleave

    load = [1.0, 30.0, 1.0, 1.0, 25.0]  # two rounds with a heavy spike
    order = []

    def timer(name: str, cost: float):
        def one(r: int) -> float:
            order.append((r, name))
            return cost * load[r]
        return one

    def broken(r: int) -> float:
        raise RuntimeError("no graph for you")

    failed: dict[str, str] = {}
    out = interleave({"a": timer("a", 10.0), "b": timer("b", 20.0), "c": broken}, len(load), failed)
    assert sorted(out) == ["a", "b"] and failed == {"c": "RuntimeError: no graph for you"}
    assert [n for r, n in order if r == 0] == ["a", "b"] and [n for r, n in order if r == 1] == ["b", "a"]  # rotated
    import statistics

    assert statistics.median(out["b"]) / statistics.median(out["a"]) == 2.0
    assert all(len(v) == len(load) for v in out.values())


FP8_H, FP8_I = 128, 128  # smallest shape a 128x128 weight block fits


def _fp8_call(m: int) -> tuple:
    """An FP8 block-128 call: bf16 activations, float8_e4m3fn weights with (128, 128) block scales."""
    from backends_util import quant_block

    g = torch.Generator().manual_seed(m)
    hidden = torch.randn(m, FP8_H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (m, TOPK), generator=g)
    w13, s13 = quant_block(torch.randn(E, 2 * FP8_I, FP8_H, generator=g) / FP8_H**0.5, (128, 128))
    w2, s2 = quant_block(torch.randn(E, FP8_H, FP8_I, generator=g) / FP8_I**0.5, (128, 128))
    return hidden, ids, w13, w2, s13, s2


def _choose_fp8(m: int, capturing: bool = False) -> str:
    hidden, ids, w13, w2, s13, _ = _fp8_call(m)
    return select_backend(hidden, ids, w13, w2, s13, (128, 128), upstream="transformers", capturing=capturing)


def _fp8_row(mode: str, ranges: str, quant_block=(128, 128)) -> CalibrationRow:
    hidden, ids, w13, *_ = _fp8_call(1)
    key = key_for_tensors(hidden, ids, w13, quant_block, mode)
    return CalibrationRow(key, parse_ranges(ranges, "test"), {"date": "2026-11-29", "command": "test"}, "")


def test_fp8_row_written_loaded_and_picked_only_for_its_quant_block(tmp_path):
    # an unquantized row for the same shape does not serve FP8 calls: upstream (the reference loop for FP8)
    path = _user_table(tmp_path, _fp8_row("eager", "gemv@1-", quant_block=None))
    assert _choose_fp8(3) == "reference"
    write_row(path, _fp8_row("eager", "reference@1-", quant_block=(128, 64)))
    assert _choose_fp8(3) == "reference"  # (128, 64) rows do not serve (128, 128) calls either
    write_row(path, _fp8_row("eager", f"gemv@1-{T},grouped@{T + 1}-"))
    write_row(path, _fp8_row("eager", f"grouped@1-{T},gemv@{T + 1}-"))  # same key: replaces, not duplicates
    rows = load_table(path)
    assert len(rows) == 3 and [r.key.quant_block for r in rows] == [None, (128, 64), (128, 128)]
    assert "quant_block: [128, 128]" in path.read_text()
    assert [_choose_fp8(m) for m in (T, T + 1)] == ["grouped", "gemv"]
    hidden, ids, w13, *_ = _fp8_call(1)
    assert find_row(key_for_tensors(hidden, ids, w13, (128, 128), "capture")) is None
    with pytest.raises(RuntimeError, match="cannot run inside CUDA-graph capture"):
        _choose_fp8(1, capturing=True)  # no capture row: upstream = reference, which capture refuses


def test_plan_fp8_signature_uses_the_fp8_row(tmp_path):
    _user_table(tmp_path, _fp8_row("eager", "gemv@1-"))
    quant = dict(quant_method="fp8", quant_weight_dtype="float8_e4m3fn", quant_block_shape=(128, 128))
    ms = ModelSignature(num_experts=E, hidden_size=FP8_H, moe_intermediate_size=FP8_I, top_k=TOPK,
                        dtype="bfloat16", **quant)
    es = ExecutionSignature.detect(device="cpu", mode="compile", dtype=torch.bfloat16)
    plan = moe_plan(ms, es, CompilationConfig())
    assert plan.policy("eager").backend_for(1) == "gemv" and "quant=128x128" in plan.key
    unquantized = ModelSignature(num_experts=E, hidden_size=FP8_H, moe_intermediate_size=FP8_I, top_k=TOPK,
                                 dtype="bfloat16")
    assert not moe_plan(unquantized, es, CompilationConfig()).applies
    other_block = ModelSignature(**{**unquantized.__dict__, **quant, "quant_block_shape": (64, 64)})
    assert not moe_plan(other_block, es, CompilationConfig()).applies


def test_calibrate_fp8_quick_writes_an_fp8_row_auto_follows(tmp_path, capsys):
    from moefx.cli import main

    out = user_table_dir() / "cpu.yaml"
    argv = ["calibrate", "--experts", str(E), "--hidden", str(FP8_H), "--intermediate", str(FP8_I),
            "--topk", str(TOPK), "--dtype", "bfloat16", "--quant", "fp8-block128", "--quick",
            "--backends", "reference,gemv,upstream", "--output", str(out), "--plot", "none"]
    assert main(argv) == 0
    assert "upstream runs the reference loop" in capsys.readouterr().err
    (row,) = load_table(out)
    hidden, ids, w13, *_ = _fp8_call(1)
    assert row.key == key_for_tensors(hidden, ids, w13, (128, 128), "eager")
    assert row.key.quant_block == (128, 128) and row.key.dtype == "bfloat16"
    assert set(row.timings_us) == {"reference", "gemv"}
    assert "--quant fp8-block128" in row.provenance["command"]
    for m in (1, 5, 16, 100):
        (want,) = [r.backend for r in row.ranges if r.contains(m)]
        assert _choose_fp8(m) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["eager", "capture"])
def test_calibrate_sweep_times_cuda_contenders_interleaved(mode):
    """The CUDA timers (events; graph replay in capture) give every contender its reps at every M, interleaved,
    and the sweep decides or pins every point (no contender dropped for a timer error)."""
    from moefx.backends import available_backends
    from moefx.backends.calibration import crossover_ranges
    from moefx.calibrate import moe, sweep

    problem = moe.MoeProblem(8, 128, 64, 2, torch.bfloat16, "none", torch.device("cuda"), seed=0)
    names, _ = moe.check(problem, [*available_backends(torch.device("cuda")), "upstream"])
    result = sweep.sweep(problem, names, mode, (1, 2, 8), reps=4)
    assert not [why for why in result.skipped.values() if "Error" in why], result.skipped
    assert result.timings and set(result.timings) <= set(names)
    for name, ts in result.timings.items():
        assert all(len(result.samples[name][m]) >= 4 and t > 0 for m, t in ts.items())
    assert set(result.pinned) == set(result.uncertain)
    ranges = crossover_ranges(result.timings, tolerance=result.tolerance, pinned=result.pinned)
    assert ranges[0].min_m == 1 and ranges[-1].max_m is None
