"""bench/sampler.py --quick runs end to end on the CPU (tiny model) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.compile
def test_sampler_bench_quick(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sampler.py"), "--quick"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "sampler.json").read_text())
    arms = {(r["arm"], r["mode"]) for r in data["decode"]}
    assert arms == {(a, m) for a in ("hf", "hf+stop", "moefx") for m in ("sample", "greedy")}
    assert all(r["tokens_per_s"] > 0 and r["floor_step_ms"] > 0 for r in data["decode"])
    assert all(c["greedy_token_agreement"] == 1.0 for c in data["checks"].values())
    off, on = data["prefill"]
    assert not off["last_token_logits"] and on["last_token_logits"] and on["rewrites"] >= 1
    assert on["rel_err"] < 1e-4 and off["rel_err"] < 1e-4
    assert proc.stdout.rstrip().splitlines()[-1].startswith("| on |")  # the tables are printed last
