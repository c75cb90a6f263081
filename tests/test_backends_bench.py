"""bench/moe.py --quick runs end to end on the CPU (every backend checked against reference, table printed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_moe_quick(tmp_path: Path) -> None:
    env = {"OUT": str(tmp_path), "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "moe.py"), "--quick"], capture_output=True, text=True,
                         timeout=240, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "0 failures" in res.stdout
    assert (tmp_path / "moe.json").exists()
    assert res.stdout.strip().splitlines()[-1].startswith("fp8")


@pytest.mark.slow
def test_bench_moe_sweep_only_quick(tmp_path: Path) -> None:
    """--sweep-only: budgeted tile sweep (interpreter, tiny shapes), best tiles next to the defaults in the JSON."""
    import json

    env = {"OUT": str(tmp_path), "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "moe.py"), "--quick", "--sweep-only",
                          "--sweep-budget", "8"], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    sweep = json.loads((tmp_path / "moe_sweep.json").read_text())["sweep"]
    assert not (tmp_path / "moe.json").exists()
    points = {(b["kind"], b["dtype"], b["M"]) for b in sweep["best"]}
    assert points == {(kind, dt, m) for dt in ("bf16", "fp8")
                      for kind, ms in (("grouped", (5, 33)), ("gemv", (1, 4))) for m in ms}
    for b in sweep["best"]:
        assert isinstance(b["default_us"], float) and b["best_us"] <= b["default_us"]
        assert set(b["best"]) == ({"gemv"} if b["kind"] == "gemv" else {"gemm1", "gemm2"})
    assert all(isinstance(p["us"], float) for p in sweep["points"])  # every tile matched reference
    assert res.stdout.strip().splitlines()[-1].startswith("gemv    fp8")


def test_bench_moe_backward_quick(tmp_path: Path) -> None:
    """bench/moe_backward.py --quick: both arms' gradients checked against the fp32 reference (tiny, CPU)."""
    import json

    env = {"OUT": str(tmp_path), "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_backward.py"), "--quick"], capture_output=True,
                         text=True, timeout=240, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = json.loads((tmp_path / "moe_backward.json").read_text())
    assert not out["failures"] and out["rows"][0]["moefx_err"] and max(out["rows"][0]["moefx_err"]) < 3e-2
