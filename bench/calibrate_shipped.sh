#!/usr/bin/env bash
# Regenerate the shipped calibration rows of this GPU for the catalog shapes, in one process: `moefx calibrate`
# per shape (MoE rows in bf16 and FP8 block-128, eager and capture; Qwen3-30B-A3B's dense rows too).
#
# Shapes: Qwen3-30B-A3B, OLMoE-1B-7B, Mixtral-8x7B, and the per-GPU expert shapes of Qwen3-235B-A22B (TP=8; TP=4 for
# FP8, whose per-GPU I=192 at TP=8 is not a multiple of the 128 block) and DeepSeek-V3 at TP=8. The table is
# $OUT/<device>.yaml (nvidia-h200.yaml, nvidia-h100.yaml: the name `moefx/backends/tables/` uses), seeded with the
# shipped rows when it does not exist yet, so it ends with the shipped rows plus this run's (a row with the same
# key is replaced). Also one latency-vs-M PNG per shape and format. Ship the rows with:
#   cp "$OUT/nvidia-h100.yaml" moefx/backends/tables/
# Extra arguments go to every `moefx calibrate` call (e.g. --reps 10, --quick).
set -euo pipefail
OUT="${OUT:-$PWD/calibration}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

python - "$OUT" "$@" <<'PY'
import shutil
import sys
import time
from pathlib import Path

import torch

from moefx.backends.calibration import PACKAGE_TABLES, load_table
from moefx.cli import main

out, extra = Path(sys.argv[1]), sys.argv[2:]
if not torch.cuda.is_available():
    sys.exit("calibrate_shipped.sh needs a CUDA device")
# "NVIDIA H100 80GB HBM3" -> nvidia-h100, "NVIDIA H200" -> nvidia-h200
table = out / ("-".join(torch.cuda.get_device_name().lower().split()[:2]) + ".yaml")
shipped = PACKAGE_TABLES / table.name
if not table.is_file() and shipped.is_file():
    shutil.copyfile(shipped, table)
    print(f"seeded {table} with the {len(load_table(table))} shipped rows of {shipped}", flush=True)
jobs = [("qwen3-30b-a3b", 1, None, "moe,dense"), ("olmoe-1b-7b", 1, None, "moe"), ("mixtral-8x7b", 1, None, "moe"),
        ("qwen3-235b-a22b", 8, "none", "moe"), ("qwen3-235b-a22b", 4, "fp8-block128", "moe"),
        ("deepseek-v3", 8, None, "moe")]
start, failed = time.perf_counter(), []
for name, tp, quant, parts in jobs:
    t0 = time.perf_counter()
    argv = ["calibrate", "--model", name, "--tp", str(tp), "--device", "cuda", "--parts", parts,
            "--output", str(table), *(["--quant", quant] if quant else []), *extra]
    try:
        rc = main(argv)
    except Exception as exc:  # one shape failing must not cost the other rows
        print(f"== {name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        rc = 1
    torch.cuda.empty_cache()
    print(f"== {name} tp={tp}: rc={rc} in {time.perf_counter() - t0:.1f}s", flush=True)
    if rc:
        failed.append(f"{name} tp={tp}")
print(f"\n{len(load_table(table))} MoE rows in {table} ({time.perf_counter() - start:.0f} s); failed: {failed or 'none'}")
sys.exit(1 if failed else 0)
PY
