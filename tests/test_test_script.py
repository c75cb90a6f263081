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
    for text in ("--vllm", "MOEFX_TEST_VLLM", "MOEFX_SKIP_VLLM", "MOEFX_TRITON", "9.4 GB", "4 bad argument"):
        assert text in out.stdout, text
    assert "set -uo" not in out.stdout  # the header only, not the script


@pytest.mark.parametrize(("args", "env", "named"), [
    (("--vlm",), {}, "'--vlm'"),
    ((), {"MOEFX_TEST_VLLM": "yes"}, "MOEFX_TEST_VLLM='yes'"),
    ((), {"MOEFX_SKIP_VLLM": "true"}, "MOEFX_SKIP_VLLM='true'"),
])
def test_bad_argument_or_knob_exits_4_naming_it_before_installing(args, env, named):
    out = _script(*args, **env)
    assert out.returncode == 4
    assert named in out.stderr and "valid:" in out.stderr
    assert "installing" not in out.stdout


def test_ci_runs_both_stages():
    run = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^exec bash scripts/test\.sh --vllm$", run, re.M)


def test_script_pins_no_triton_by_default():
    text = SCRIPT.read_text()
    assert "triton==" not in text.split("set -uo pipefail", 1)[1]  # only MOEFX_TRITON chooses a Triton


def test_docs_state_the_triton_range_pyproject_allows():
    dev = re.search(r"^dev = \[(.*)\]", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    low, high = re.search(r'"triton>=([\d.]+),<([\d.]+);', dev).groups()
    tested = f"Triton {low} through 3.{int(high.split('.')[1]) - 1}"
    for page in ("README.md", "docs/CLI.md"):
        assert tested in " ".join((ROOT / page).read_text().split()), f"{page} does not say '{tested}'"
