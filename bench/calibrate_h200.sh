#!/usr/bin/env bash
# Calibrate the MoE backend policy on the H200 for the five shipped shapes, in one Python process.
#
# Shapes (eager + capture rows each): Qwen3-30B-A3B, OLMoE-1B-7B, Mixtral-8x7B, and the per-GPU expert
# shapes of Qwen3-235B-A22B (TP=8; TP=4 for FP8, whose per-GPU I=192 at TP=8 is not a multiple of the
# 128 block) and DeepSeek-V3 at TP=8. $OUT/nvidia-h200.yaml starts as a copy of the shipped table (when it
# does not exist yet), so it ends with the shipped rows plus this run's rows (a row with the same exact key
# is replaced, not duplicated). Also one latency-vs-M PNG per shape and $OUT/calibrate_h200.json (ranges).
# Ship the rows with: cp "$OUT/nvidia-h200.yaml" moefx/backends/tables/nvidia-h200.yaml
# Extra arguments go to every `moefx calibrate` call (e.g. --reps 10, --quant fp8-block128, --quick).
set -euo pipefail
OUT="${OUT:-$PWD/calibration-h200}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

python - "$OUT" "$@" <<'PY'
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from moefx.backends.calibration import PACKAGE_TABLES, load_table
from moefx.cli import main

out, extra = Path(sys.argv[1]), sys.argv[2:]
if not torch.cuda.is_available():
    sys.exit("calibrate_h200.sh needs a CUDA device")
table = out / os.environ.get("MOEFX_TABLE", "nvidia-h200.yaml")
shipped = PACKAGE_TABLES / table.name
if not table.is_file() and shipped.is_file():
    shutil.copyfile(shipped, table)
    print(f"seeded {table} with the {len(load_table(table))} shipped rows of {shipped}", flush=True)
before = {r.key: r.provenance.get("date") for r in (load_table(table) if table.is_file() else [])}
quant = next((a.split("=", 1)[1] if "=" in a else extra[j + 1] for j, a in enumerate(extra)
              if a.startswith("--quant") and ("=" in a or j + 1 < len(extra))), "none")
shapes = [("qwen3-30b-a3b", 1), ("olmoe-1b-7b", 1), ("mixtral-8x7b", 1),
          ("qwen3-235b-a22b", 4 if quant.startswith("fp8") else 8), ("deepseek-v3", 8)]
start = time.perf_counter()
failed = []
for name, tp in shapes:
    t0 = time.perf_counter()
    argv = ["calibrate", "--model", name, "--tp", str(tp), "--device", "cuda", "--modes", "eager,capture",
            "--output", str(table), "--plot", str(out / f"{name}-tp{tp}-{quant}.png"), *extra]
    try:
        rc = main(argv)
    except Exception as exc:  # one shape failing must not cost the other rows
        print(f"== {name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        rc = 1
    torch.cuda.empty_cache()
    print(f"== {name} tp={tp}: rc={rc} in {time.perf_counter() - t0:.1f}s", flush=True)
    if rc:
        failed.append(name)
rows = load_table(table) if table.is_file() else []
summary = {
    "device": torch.cuda.get_device_name(),
    "torch": str(torch.__version__),
    "seconds": round(time.perf_counter() - start, 1),
    "quant": quant,
    "failed": failed,
    "rows": [{"source": r.source, "key": r.key.describe(), "ranges": [x.text() for x in r.ranges],
              "written": before.get(r.key, "-") != r.provenance.get("date")} for r in rows],
}
(out / "calibrate_h200.json").write_text(json.dumps(summary, indent=2))
new = sum(r["written"] for r in summary["rows"])
print(f"\n{len(rows)} rows in {table}, {new} written by this run ({summary['seconds']} s)")
for r in summary["rows"]:
    mark = "new" if r["written"] else "old"
    print(f"  {mark} {r['source']:<22} {r['key']}\n      -> {', '.join(r['ranges'])}")
sys.exit(1 if failed else 0)
PY
