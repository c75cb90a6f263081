"""bench/report.py and its parts without a GPU: no torch import, the stage table's links to the sections, the
command check, and the README's sync claim read from the counted syncs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the bench package

from bench import report, stages  # noqa: E402
from bench.sections import sampler  # noqa: E402


def test_report_renders_the_page_without_importing_torch():
    code = ("import runpy, sys; sys.argv = ['report.py', '--check']\n"
            "try:\n    runpy.run_path('bench/report.py', run_name='__main__')\nexcept SystemExit as e:\n"
            "    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules and 'moefx' not in sys.modules, 'report.py imported torch'\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_every_stage_section_has_a_renderer_and_a_place_on_the_page():
    placed = {s for _, group in report.WORKLOADS for s in group}
    for s in stages.STAGES:
        assert s.section is None or (s.section in report.SECTIONS and s.section in placed), s.name
        assert not s.keeps or s.section, f"{s.name}: keeps files for no section"
    with pytest.raises(ValueError, match="valid: demo moe"):
        stages.stage("no-such-stage")


def test_a_result_whose_command_runs_another_sections_stage_is_refused():
    r = {"stage": "moe", "command": "bash bench/run_h200.sh fusions", "_file": "x.json"}
    with pytest.raises(ValueError, match="feeds section 'fusions', not 'moe'"):
        report.check_commands({"moe": r})
    with pytest.raises(ValueError, match="unknown stage 'moe-old'"):
        report.check_commands({"moe": {**r, "command": "bash bench/run_h200.sh moe-old"}})
    report.check_commands({"moe": {**r, "command": "bash bench/run_h200.sh moe"}})


def test_the_runner_gets_each_stage_from_the_table():
    out = subprocess.run([sys.executable, "bench/stages.py", "--shell", "dense"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith("limit=180; command='python3 bench/dense.py --ms 1,2,4,8,16,32,64'; after=")
    assert "case $s in" not in (ROOT / "bench" / "run_h200.sh").read_text()


@pytest.mark.parametrize(("counts", "line"), [
    ([0.0, 0.0], "Sampling: zero host syncs per decode step"),
    ([0.0, 1.5], "Sampling: up to 1.50 host syncs per decode step"),
    ([None, None], None),
])
def test_the_sync_claim_is_the_counted_syncs(counts, line):
    row = {"mode": "greedy", "batch": 1, "tokens_per_s": 1.0, "step_ms": 1.0, "floor_step_ms": 1.0}
    decode = [{**row, "arm": "moefx", "syncs_per_step": c} for c in counts]
    decode.append({**row, "arm": "hf", "syncs_per_step": 1.0})  # the peer's syncs are not moefx's claim
    got = sampler.headline({"sampler": {"decode": decode}})
    assert got == ([] if line is None else [f"{line} (counted with CUDA's sync debug mode)."])
