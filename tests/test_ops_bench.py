"""bench/fusions.py --quick: the CPU smoke run finishes, checks every kernel and prints the table last."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_fusions_bench_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fusions.py"), "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert "within bounds" in proc.stdout and "OUT OF BOUNDS" not in proc.stdout
    table = lines[-4:]
    assert all(line.split()[-1] == "yes" for line in table), table
    assert (tmp_path / "fusions.json").exists()
