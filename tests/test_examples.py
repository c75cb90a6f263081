"""Every example runs on the CPU with the embedded tiny model at tiny sizes, in one fresh interpreter (one torch
import for all), and prints the line that shows it checked its own result. `hf_generate.py` and `quantize_fp8.py`
run with `--mode eager` here: their compiled path (minutes of cold inductor compiles on a 2-core machine) is what
tests/test_optimize.py and tests/test_quantize_e2e.py cover."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# example -> (CI arguments, a line its output must contain); the compiling example first
EXAMPLES = {
    "torch_compile_pass_config.py": (["--rows", "16"], "fuse_act_quant rewrites: 1;"),
    "signature_registry.py": ([], "profile = my_moe"),
    "hf_generate.py": (["--mode", "eager", "--new-tokens", "4"], "greedy tokens match eager: yes"),
    "offload_big_model.py": (["--new-tokens", "4"], "greedy tokens match the model without offload: yes"),
    "quantize_fp8.py": (["--mode", "eager"], "logits vs the bf16 model:"),
}

RUNNER = """
import contextlib, io, json, runpy, sys, traceback
out = {}
for path, args in json.loads(sys.argv[1]):
    buf = io.StringIO()
    sys.argv = [path, *args]
    ok = True
    with contextlib.redirect_stdout(buf):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            ok = exc.code in (0, None)
        except Exception:
            ok = False
            buf.write(traceback.format_exc())
    out[path] = {"ok": ok, "output": buf.getvalue()}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_examples_run_on_the_cpu(tmp_path):
    assert sorted(EXAMPLES) == sorted(p.name for p in (ROOT / "examples").glob("*.py")), "an example is not run"
    jobs = [(str(ROOT / "examples" / name), args) for name, (args, _) in EXAMPLES.items()]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(tmp_path)}
    env.pop("MOEFX_MOE_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(jobs)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (_, marker) in EXAMPLES.items():
        got = results[str(ROOT / "examples" / name)]
        assert got["ok"] and marker in got["output"], f"{name}:\n{got['output'][-3000:]}"


def test_vllm_example_states_what_is_untested():
    text = (ROOT / "examples" / "vllm_serve.md").read_text()
    assert "Untested on a GPU" in text
    for needed in ("vllm serve", "MOEFX_CONFIG=", "pass_manager(", "post_grad_custom_post_pass"):
        assert needed in text
