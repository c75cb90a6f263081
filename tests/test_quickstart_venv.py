"""The README's quick start, first line, as a new user on a CPU machine runs it: a fresh venv, PyTorch's CPU build
(which brings no Triton), `pip install -e .` of a fresh copy of the tree, `moefx demo --device cpu` with an empty
HOME. moefx must import and run without Triton.

The torch to install is `MOEFX_TORCH` (as in scripts/test.sh: a CPU wheel's path, or a requirement that resolves
to the CPU build); without it the test is skipped, since PyPI's default Linux torch is the CUDA build, which
brings Triton. pip keeps its own cache, so the dependencies are not downloaded again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_start_runs_with_the_cpu_torch_and_no_triton(tmp_path: Path) -> None:
    torch_req = os.environ.get("MOEFX_TORCH")
    if not torch_req:
        pytest.skip("MOEFX_TORCH (a CPU torch wheel or requirement) is not set")
    src = tmp_path / "moefx"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):  # the tracked tree as it is now: a fresh clone
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    venv = tmp_path / "venv"
    pip_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*cmd: str, env: dict[str, str] = pip_env, timeout: int = 300) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=timeout)

    assert run(sys.executable, "-m", "venv", str(venv)).returncode == 0
    py = str(venv / "bin" / "python")
    for args in ([torch_req], ["-e", "."]):
        proc = run(py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert run(py, "-c", "import triton").returncode != 0, "this venv has triton: the test needs a CPU torch without it"

    home = tmp_path / "home"
    home.mkdir()
    user_env = {k: v for k, v in pip_env.items() if not k.startswith(("XDG_", "MOEFX_", "TORCHINDUCTOR_"))}
    demo = run(str(venv / "bin" / "moefx"), "demo", "--device", "cpu",
               env={**user_env, "HOME": str(home), "OMP_NUM_THREADS": "1"}, timeout=600)
    assert demo.returncode == 0 and "Traceback" not in demo.stderr, demo.stderr[-3000:]
    assert "greedy tokens match eager: yes" in demo.stdout, demo.stdout[-3000:]
