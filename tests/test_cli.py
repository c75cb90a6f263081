"""The `moefx` command line: fast start-up, clean errors, models built at a depth that fits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import moefx
from moefx.cli import COMMANDS
from moefx.cli import main as cli_main
from moefx.models.catalog import catalog_config

ROOT = Path(__file__).resolve().parents[1]


def _moefx(*args: str, **env: str) -> subprocess.CompletedProcess:
    code = ("import sys; from moefx.cli import main; rc = main(sys.argv[1:]); print('torch' in sys.modules); "
            "sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=120)


def test_help_and_version_start_without_torch() -> None:
    start = time.perf_counter()
    version = _moefx("--version")  # argparse exits from inside main: nothing after it prints
    elapsed = time.perf_counter() - start
    assert version.returncode == 0 and version.stdout.startswith(f"moefx {moefx.__version__}")
    # About 0.1 s on an idle core (torch alone takes 2-5 s); the bound leaves room for a loaded machine.
    assert elapsed < 5.0, f"moefx --version took {elapsed:.1f} s"
    shown = _moefx()
    assert shown.returncode == 0 and shown.stdout.strip().endswith("False"), shown.stdout  # torch not imported
    assert all(name in shown.stdout for name in COMMANDS)


HELP_SCRIPT = r"""
import json, sys, time
from moefx.cli import main
out = {}
for name in sys.argv[1:]:
    start = time.perf_counter()
    try:
        main([name, "--help"])
    except SystemExit as exc:
        code = exc.code
    out[name] = {"code": code, "s": time.perf_counter() - start, "torch": "torch" in sys.modules}
print(json.dumps(out))
"""


def test_subcommand_help_imports_no_torch_and_answers_at_once() -> None:
    """Each `moefx <cmd> --help` in one interpreter, in turn: none loads torch (sys.modules), each answers in well
    under a second (torch alone takes 2-5 s to import)."""
    names = list(COMMANDS)
    proc = subprocess.run([sys.executable, "-c", HELP_SCRIPT, *names], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [n for n, r in seen.items() if r["torch"]] == [] and all(r["code"] == 0 for r in seen.values()), seen
    assert max(r["s"] for r in seen.values()) < 1.0, seen


def test_invalid_moefx_log_is_one_clean_line() -> None:
    proc = _moefx("plan", "tiny-qwen3-moe", MOEFX_LOG="verbose")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("moefx: error: environment variable MOEFX_LOG='verbose' is invalid; valid values: "
                                   "['debug', 'info', 'warning', 'error']")


def test_missing_paths_are_named_as_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["plan"], ["audit-syncs"], ["calibrate", "--model"]):
        assert cli_main([*command, str(tmp_path / "nonexistent" / "model")]) == 2
        assert "no such file or folder" in capsys.readouterr().err
    assert cli_main(["plan", str(tmp_path)]) == 2
    assert "holds no config.json" in capsys.readouterr().err


def test_plan_for_a_config_without_dtype_says_how_to_fix(tmp_path: Path, capsys) -> None:
    data = catalog_config("qwen3-30b-a3b")
    del data["torch_dtype"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert cli_main(["plan", str(tmp_path), "--device", "h200"]) == 0
    assert "the config states no dtype" in capsys.readouterr().out
    assert cli_main(["plan", str(tmp_path), "--device", "h200", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "profile = qwen3_moe" in out and "dtype=bfloat16 [execution signature]" in out


def test_models_are_built_at_a_reduced_depth_and_refused_when_too_big(tmp_path: Path, monkeypatch, capsys) -> None:
    from moefx.models import spec

    small = {**catalog_config("tiny-qwen3-moe"), "num_hidden_layers": 4, "layer_types": ["full_attention"] * 4}
    (tmp_path / "config.json").write_text(json.dumps(small))
    model, what = spec.build_model_from_spec(str(tmp_path), None, torch.device("cpu"), torch.float32)
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2 and "2 of 4 layers" in what
    assert model.lm_head.weight.dtype == torch.float32
    model, _ = spec.build_model_from_spec(str(tmp_path), 3, torch.device("cpu"), torch.bfloat16)
    assert len(model.model.layers) == 3 and model.lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="between 1 and 4"):
        spec.build_model_from_spec(str(tmp_path), 5, torch.device("cpu"), torch.float32)
    # A catalog model whose reduced depth would not fit is refused before anything is allocated.
    monkeypatch.setattr(spec, "free_memory", lambda device: 2 * 2**30)
    assert spec.default_layers(catalog_config("deepseek-v3")) == 4  # three dense layers, then one MoE layer
    assert cli_main(["audit-syncs", "deepseek-v3", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "needs about 56.3 GiB of float32 weights" in err and "not even one layer fits" in err
    assert cli_main(["audit-syncs", "qwen3-30b-a3b", "--device", "cpu", "--layers", "1"]) == 2
    assert "needs about" in capsys.readouterr().err


def test_every_option_with_a_default_shows_it_in_help() -> None:
    """docs/CLI.md gave defaults that `--help` did not show: every option whose default is a value says it."""
    import argparse

    from moefx.cli import build_parser

    for name in COMMANDS:
        parser = build_parser([name])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        blocks: dict[str, str] = {}  # each option's entry: its line and the help lines indented under it
        for line in sub.format_help().splitlines():
            if line.startswith("  -"):
                flag = line.split()[0].rstrip(",")
                blocks[flag] = line
            elif line.startswith("   ") and blocks:
                blocks[flag] += " " + line.strip()
        for action in sub._actions:
            if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                entry = next(text for flag, text in blocks.items() if flag in action.option_strings)
                assert "default" in entry, (name, entry)
    calibrate = build_parser(["calibrate"]).format_help()
    assert "MoE and dense-linear backend crossovers" in calibrate


def test_calibrate_prints_the_backend_its_row_writes_and_the_smoothing_rule() -> None:
    """`calibrate --quick` printed "chosen: gemv" at an M and wrote `upstream@1-`: the chosen column is the written
    row's backend, and where smoothing kept it over a faster one the cell and a line say so."""
    from moefx.backends.calibration import crossover_ranges
    from moefx.calibrate.sweep import Sweep
    from moefx.cli.calibrate_run import _table, written_backend

    result = Sweep(timings={"upstream": {1: 10.0, 2: 10.0, 4: 10.0}, "gemv": {1: 10.5, 2: 10.6, 4: 9.8}},
                   tolerance=0.05)
    ranges = crossover_ranges(result.timings, tolerance=result.tolerance)
    assert [r.text() for r in ranges] == ["upstream@1-"]
    text = _table("shape", result, (1, 2, 4), 3, ranges)
    row4 = next(line for line in text.splitlines() if line.startswith("4 "))
    assert row4.rstrip().endswith("upstream (smoothed: gemv 2% faster)"), text
    assert "within 5% of the fastest" in text and written_backend(ranges, 4) == "upstream"
    plain = _table("shape", Sweep(timings={"upstream": {1: 10.0}, "gemv": {1: 5.0}}), (1,), 3,
                   crossover_ranges({"upstream": {1: 10.0}, "gemv": {1: 5.0}}))
    assert "smoothing" not in plain and plain.splitlines()[-1].rstrip().endswith("gemv")


def test_audit_syncs_step_raises_no_transformers_future_warning() -> None:
    """The audited step passed `past_key_values`, which transformers 5.2x renamed `cache` with a FutureWarning that
    reached the user; the step and its prefill pass the cache under this version's name."""
    import warnings

    from transformers import StaticCache
    from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper

    from moefx.cli.audit_syncs import make_decode_step
    from moefx.engine.steps import cache_kwarg
    from moefx.models import build_model, tiny_qwen3_moe_config

    model = build_model(tiny_qwen3_moe_config(), dtype=torch.float32)
    cache = StaticCache(config=model.config, max_cache_len=8)
    ids = torch.randint(1, model.config.vocab_size, (1, 4))
    step = make_decode_step(model, LogitsProcessorList([TemperatureLogitsWarper(0.8)]))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        model(input_ids=ids, position_ids=torch.arange(4)[None], use_cache=True, **{cache_kwarg(model.forward): cache})
        tokens, _ = step(ids[:, -1:], torch.full((1, 1), 4), cache, torch.ones(1, dtype=torch.long))
    assert tokens.shape == (1,)


def test_demo_batch_bound_is_the_plans_own_capture_limit() -> None:
    """`moefx demo --batch` stops where a plan without max_batch_size stops capturing (its help says so)."""
    from moefx.cli.demo import MAX_DEMO_BATCH
    from moefx.planner.serving import CAPTURE_SIZE_LIMIT

    assert MAX_DEMO_BATCH == CAPTURE_SIZE_LIMIT
