#!/usr/bin/env bash
# Run moefx's GPU benchmarks in one device call: each stage has its own time limit and a failing stage
# does not stop the others. Logs and JSON go to a folder that is packed into $OUT/results-<stages>.tgz
# (the device tool returns at most 8 files), and each stage's last lines are printed at the end.
#   bash bench/run_h200.sh demo moe fusions sampler
# The stages (command, time limit, the published section each feeds) are the table in bench/stages.py:
#   python3 bench/stages.py --list
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
RES=$(mktemp -d /tmp/moefx-res.XXXX)
export RES  # for the stages' `after` commands
export TORCHINDUCTOR_CACHE_DIR=$RES/inductor
export MOEFX_COMPILE_CACHE=$RES/moefx-compile  # every call starts cold, like the inductor cache
# stream-prime / stream-cached keep their compile caches on the machine between two calls (a restarted server).
export KEPT="TORCHINDUCTOR_CACHE_DIR=/tmp/moefx-kept/inductor MOEFX_COMPILE_CACHE=/tmp/moefx-kept/moefx-compile"
mkdir -p "$OUT"
stages=("$@")

run_stage() {  # name, limit seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
    local start=$SECONDS
    OUT=$RES timeout "$limit" "$@" 2>&1 | tee "$RES/$name.log"
    echo "=== $name exit ${PIPESTATUS[0]} after $((SECONDS - start))s"
    # two stages in one call must not clash
    for f in moe_sweep.json moe_profile.json probe_read.json probe_ceilings.json tp.json; do
        if [ -f "$RES/$f" ]; then mv "$RES/$f" "$RES/$name-$f"; fi
    done
    pack  # after every stage, so a call stopped at its limit still returns what the finished stages wrote
}

pack() {
    tar czf "$OUT/results-$(IFS=-; echo "${stages[*]}").tgz" --exclude=./inductor --exclude=./moefx-compile -C "$RES" .
}

python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$RES/versions.txt"
for s in "${stages[@]}"; do
    if ! spec=$(python3 bench/stages.py --shell "$s"); then
        continue  # an unknown stage: bench/stages.py named the valid ones
    fi
    eval "$spec"  # limit, command, after
    run_stage "$s" "$limit" bash -c "$command"
    if [ -n "$after" ]; then bash -c "$after"; fi
done
pack
for s in "${stages[@]}"; do
    echo "##### $s"
    tail -n 25 "$RES/$s.log" 2>/dev/null
done
