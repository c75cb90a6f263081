"""bench/fusions.py --quick: the CPU smoke run finishes, checks every kernel, and every fused variant class it
times fuses (FX-level check), with the table printed last."""

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
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from fusions import CLASSES
    finally:
        sys.path.pop(0)
    table = lines[-len(CLASSES):]
    assert all(line.split()[-1] == "yes" for line in table), table
    assert (tmp_path / "fusions.json").exists()
