"""bench/offload.py --quick runs end to end on the CPU and writes its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_offload_bench_quick(tmp_path):
    # The moefx cache folder is shared: the host kernel is built once per run for this test and the CPU-expert tests.
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "offload.py"), "--quick"],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "offload.json").read_text())
    assert all(err <= 2e-2 for err in data["check_relerr"].values())
    assert [r["what"] for r in data["rows"]][:2] == ["decode B=1", "decode B=4"]
    assert all(r["tok_s"] > 0 for r in data["rows"])
    assert "| what | tok/s | floor tok/s | vs floor |" in proc.stdout
