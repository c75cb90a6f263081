"""bench/moe.py --quick runs end to end on the CPU (every backend checked against legacy, table printed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_moe_quick(tmp_path: Path) -> None:
    env = {"OUT": str(tmp_path), "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "moe.py"), "--quick"], capture_output=True, text=True,
                         timeout=240, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "0 failures" in res.stdout
    assert (tmp_path / "moe.json").exists()
    assert res.stdout.strip().splitlines()[-1].startswith("fp8")
