"""scripts/test.sh's flags and knobs (only the paths that exit before installing anything), .ci/run, and the
Triton range pyproject allows against the one the docs state."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "test.sh"


def _script(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MOEFX_")}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env={**clean, **env},
                          timeout=60, check=False)


def test_help_names_the_stages_flags_and_exit_codes():
    out = _script("--help")
    assert out.returncode == 0, out.stderr
    for text in ("--vllm", "MOEFX_TEST_VLLM", "MOEFX_SKIP_VLLM", "MOEFX_TRITON", "9.4 GB", "4 bad argument",
                 "--torch211", "MOEFX_TEST_TORCH211", "MOEFX_SKIP_TORCH211", "venv-torch211", "8 is added"):
        assert text in out.stdout, text
    assert "set -uo" not in out.stdout  # the header only, not the script


@pytest.mark.parametrize(("args", "env", "named"), [
    (("--vlm",), {}, "'--vlm'"),
    ((), {"MOEFX_TEST_VLLM": "yes"}, "MOEFX_TEST_VLLM='yes'"),
    ((), {"MOEFX_SKIP_VLLM": "true"}, "MOEFX_SKIP_VLLM='true'"),
    ((), {"MOEFX_TEST_FULL": "all"}, "MOEFX_TEST_FULL='all'"),
    ((), {"MOEFX_TEST_TORCH211": "on"}, "MOEFX_TEST_TORCH211='on'"),
    ((), {"MOEFX_SKIP_TORCH211": "2"}, "MOEFX_SKIP_TORCH211='2'"),
])
def test_bad_argument_or_knob_exits_4_naming_it_before_installing(args, env, named):
    out = _script(*args, **env)
    assert out.returncode == 4
    assert named in out.stderr and "valid:" in out.stderr
    assert "installing" not in out.stdout


def test_ci_runs_every_stage_with_every_test():
    run = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^exec bash scripts/test\.sh --full --vllm --torch211$", run, re.M)


@pytest.mark.parametrize(("args", "env", "full"), [
    ((), {}, False),
    (("--full",), {}, True),
    ((), {"MOEFX_TEST_FULL": "1"}, True),
])
def test_the_default_main_stage_leaves_slow_and_compile_tests_to_full(tmp_path, args, env, full):
    log = tmp_path / "log"
    out = _script(*args, VIRTUAL_ENV="", STUB_LOG=str(log), HOME=str(tmp_path),
                  MOEFX_VENV=str(_stub_venv(tmp_path / "main")), **env)
    assert out.returncode == 0, out.stdout + out.stderr
    (pytest_call,) = [c for c in log.read_text().splitlines() if "-m pytest" in c]
    assert ("not slow and not compile" in pytest_call) != full, pytest_call
    assert ("every test" if full else "--full runs them") in out.stdout


def test_script_pins_no_triton_by_default():
    text = SCRIPT.read_text()
    assert "triton==" not in text.split("set -uo pipefail", 1)[1]  # only MOEFX_TRITON chooses a Triton


def test_docs_state_the_triton_range_pyproject_allows():
    dev = re.search(r"^dev = \[(.*)\]", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    low, high = re.search(r'"triton>=([\d.]+),<([\d.]+);', dev).groups()
    tested = f"Triton {low} through 3.{int(high.split('.')[1]) - 1}"
    for page in ("README.md", "docs/CLI.md"):
        assert tested in " ".join((ROOT / page).read_text().split()), f"{page} does not say '{tested}'"


def _stub_venv(path: Path) -> Path:
    """A venv whose python logs its arguments and succeeds (pytest exits with STUB_PYTEST_RC): runs the script's
    whole flow without installing or testing anything."""
    py = path / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text('#!/usr/bin/env bash\necho "$*" >> "$STUB_LOG"\n'
                  'case "$*" in *"-m pytest"*) exit "${STUB_PYTEST_RC:-0}" ;; esac\n')
    py.chmod(0o755)
    return path


def _stubbed_run(tmp_path: Path, stage_venv: str, *args: str, **env: str) -> tuple[subprocess.CompletedProcess,
                                                                                   list[str]]:
    """scripts/test.sh over stub venvs (the main one and the optional stage's, named by `stage_venv`): its result
    and the commands the stubs were run with."""
    log = tmp_path / "log"
    venvs = {"MOEFX_VENV": str(_stub_venv(tmp_path / "main")), stage_venv: str(_stub_venv(tmp_path / "stage"))}
    out = _script(*args, VIRTUAL_ENV="", STUB_LOG=str(log), HOME=str(tmp_path), **venvs, **env)
    return out, log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize(("args", "env", "vllm_runs"), [
    ((), {}, False),
    (("--vllm",), {}, True),
    ((), {"MOEFX_TEST_VLLM": "1"}, True),
    (("--vllm",), {"MOEFX_SKIP_VLLM": "1"}, False),
])
def test_vllm_stage_runs_only_when_asked(tmp_path, args, env, vllm_runs):
    out, calls = _stubbed_run(tmp_path, "MOEFX_VLLM_VENV", *args, **env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sum("-m pytest" in c for c in calls) == 1 + vllm_runs
    assert not any("triton==" in c for c in calls)  # no pin unless MOEFX_TRITON names one
    summary = out.stdout.splitlines()[-1]
    assert summary.startswith("== vLLM stage: ") and ("passed" in summary) == vllm_runs
    if not args and not env:
        assert "--vllm" in summary and "NOT tested" in summary


def test_triton_knob_and_failed_stages_set_the_exit_code(tmp_path):
    log = tmp_path / "log"
    venvs = {"MOEFX_VENV": str(_stub_venv(tmp_path / "main")), "MOEFX_VLLM_VENV": str(_stub_venv(tmp_path / "vllm"))}
    common = dict(VIRTUAL_ENV="", STUB_LOG=str(log), HOME=str(tmp_path), **venvs)
    out = _script(MOEFX_TRITON="triton==3.6.0", STUB_PYTEST_RC="5", **common)
    assert out.returncode == 1 and "collected no tests" in out.stderr  # pytest exit 5 is a failure
    assert any("-e .[dev] triton==3.6.0" in c for c in log.read_text().splitlines())
    assert _script("--vllm", STUB_PYTEST_RC="1", **common).returncode == 3  # both stages failed


@pytest.mark.parametrize(("args", "env", "runs"), [
    ((), {}, False),
    (("--torch211",), {}, True),
    ((), {"MOEFX_TEST_TORCH211": "1"}, True),
    (("--torch211",), {"MOEFX_SKIP_TORCH211": "1"}, False),
])
def test_torch211_stage_runs_only_when_asked_with_the_saved_trace_tests(tmp_path, args, env, runs):
    out, calls = _stubbed_run(tmp_path, "MOEFX_TORCH211_VENV", *args, **env)
    assert out.returncode == 0, out.stdout + out.stderr
    pytest_calls = [c for c in calls if "-m pytest" in c]
    assert len(pytest_calls) == 1 + runs
    if runs:
        for test in ("tests/test_aot_steps.py", "tests/test_compile_cache.py", "tests/test_saved_traces_gpu.py"):
            assert test in pytest_calls[-1]
    line = [t for t in out.stdout.splitlines() if t.startswith("== torch 2.11 stage: ")]
    assert len(line) == 1 and ("passed" in line[0]) == runs, line
    if not args and not env:
        assert "--torch211" in line[0] and "NOT tested" in line[0]


def test_a_failed_torch211_stage_adds_8_to_the_exit_code(tmp_path):
    venvs = {"MOEFX_VENV": str(_stub_venv(tmp_path / "main")),
             "MOEFX_TORCH211_VENV": str(_stub_venv(tmp_path / "torch211"))}
    out = _script("--torch211", VIRTUAL_ENV="", STUB_LOG=str(tmp_path / "log"), HOME=str(tmp_path), STUB_PYTEST_RC="1",
                  **venvs)
    assert out.returncode == 9, out.stdout  # main (1) and torch 2.11 (8)
