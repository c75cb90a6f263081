"""The compile-cache file on CUDA: a new process with empty inductor and Triton folders loads the saved traces and
moefx's Triton kernel entries, captures and replays the decode step, compiles nothing, and gives the cold process's
tokens. Needs CUDA and a torch that can keep dynamo's output (`why_no_aot`: torch 2.11 with enable_aot_compile,
which moefx turns on for its own compiles, and 2.13); no step may fall back to tracing ("saved trace" warnings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moefx.engine.compile_cache.aot import why_no_aot

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.compile,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(why_no_aot() is not None, reason=f"saved traces are off here: {why_no_aot()}"),
]

SCRIPT = r"""
import json, os
import torch
import moefx
from torch._dynamo.utils import counters
from moefx.kernels import triton_cache
from moefx.models import build_model, tiny_qwen3_moe_config
folder = triton_cache.cache_dir()
before = set(os.listdir(folder)) if folder.is_dir() else set()
model = moefx.optimize(build_model(tiny_qwen3_moe_config(), seed=3, dtype=torch.bfloat16, device="cuda"),
                       config={"moe_backend": "gemv"})
ids = torch.randint(1, 256, (2, 7), generator=torch.Generator().manual_seed(0)).cuda()
tokens = model.generate(ids, max_new_tokens=6, do_sample=False).tolist()
engine = model.moefx_generate.engine
names = triton_cache.moefx_kernel_names()
# moefx's kernel entries this process compiled: new in the folder, and not written there from the file
carried = engine.compile_cache.kernel_entries if engine.compile_cache is not None else frozenset()
new = [e for e in set(os.listdir(folder)) - before - carried
       if triton_cache._entry_kind(folder / e, names) == "kernel"]
print(json.dumps({"tokens": tokens, "traced": counters["stats"]["unique_graphs"], "compiles": engine.stats.compiles,
                  "captures": engine.stats.captures, "traces_loaded": engine.aot_steps.loaded(),
                  "fx_miss": counters["inductor"]["fxgraph_cache_miss"], "new_kernels": new}))
"""


def _run(tmp: Path, name: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOEFX_COMPILE_CACHE": str(tmp / "moefx"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp / name / "inductor"), "TRITON_CACHE_DIR": str(tmp / name / "triton")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "saved trace" not in proc.stderr, proc.stderr[-3000:]  # every step saved, or loaded, its trace
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_new_machine_needs_only_the_file(tmp_path):
    cold = _run(tmp_path, "cold")
    assert cold["traced"] > 0 and cold["new_kernels"], cold
    warm = _run(tmp_path, "new-machine")  # the same file, fresh inductor and Triton folders
    assert warm["tokens"] == cold["tokens"]
    assert warm["traced"] == 0 and warm["compiles"] == {} and warm["fx_miss"] == 0, warm
    assert warm["traces_loaded"] == cold["traced"] and warm["captures"] >= 1
    assert warm["new_kernels"] == [], warm  # no first-launch compile of moefx's Triton kernels
