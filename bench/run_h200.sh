#!/usr/bin/env bash
# Run moefx's GPU benchmarks in one device call: each stage has its own time limit and a failing stage
# does not stop the others. Logs and JSON go to a folder that is packed into $OUT/results-<stages>.tgz
# (the device tool returns at most 8 files), and each stage's last lines are printed at the end.
#   bash bench/run_h200.sh demo moe fusions sampler      # stages: demo moe moe-sweep fusions sampler offload offload-profile
#                                                        #   gpu-tests gpu-gen (the engine and routing GPU tests only)
#                                                        #   backend-tests calibrate calibrate-fp8 moe-profile
#                                                        #   moe-sweep-wide moe-sweep-gemv moe-sweep-1024 moe-sweep-grouped
#                                                        #   moe-ncu (Nsight Compute on the grouped GEMMs at M=1024/4096)
#                                                        #   moe-ncu-stalls (GEMM 1's stall reasons and hottest SASS lines)
#                                                        #   moe-bounds (read-only and library-GEMM lower bounds)
#                                                        #   e2e-quick e2e-8 e2e-8-fp8 e2e-8-readme e2e-48a e2e-48b e2e-48-b16
#                                                        #   e2e-b1 e2e-48-fp8 (batch 1: 8 layers bf16/FP8 with the peer;
#                                                        #   48 layers FP8 against bf16)
#                                                        #   (optimize + generate()
#                                                        #   vs transformers, bench/e2e.py)
#                                                        #   e2e-48-regions e2e-48-inline (48 layers B=1, config
#                                                        #   layer_regions all / none: compile seconds, launches per step)
#                                                        #   stream (500 mixed requests on the engine, bench/stream.py,
#                                                        #   from cold caches in one call: every 8th request rechecked)
#                                                        #   stream-prime, then stream-cached in the next call: the
#                                                        #   same with compile caches kept between the two calls
#                                                        #   ttft-8 ttft-48 (time to first token: 256/1024/4096 x B=1 and
#                                                        #   8 x 512, hf eager, hf compiled, moefx; bench/e2e.py --ttft)
#                                                        #   routing (fused MoE routing vs inductor's softmax+topk)
#                                                        #   tp-calibrate (per-rank expert shapes of Qwen3-30B-A3B at
#                                                        #   TP=2/4; one GPU), tp, tp-peer (2-4 GPUs: bench/tp.py)
#                                                        #   dense (dense-linear gemv vs cuBLAS + calibration rows) dense-sweep
#                                                        #   moe-backward (autograd vs transformers' grouped_mm)
#                                                        #   coldstart coldstart-48 (first call: cold vs a new process
#                                                        #   with moefx's compile cache, vs transformers; bench/coldstart.py)
#                                                        #   coldstart-48-b16 (48 layers B=16: cold vs transformers only)
#                                                        #   coldstart-48-frames (48 layers B=1, layer_regions frames)
#                                                        #   dispatch (host time per moefx op call vs the 15 us target)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
RES=$(mktemp -d /tmp/moefx-res.XXXX)
export TORCHINDUCTOR_CACHE_DIR=$RES/inductor
export MOEFX_COMPILE_CACHE=$RES/moefx-compile  # every call starts cold, like the inductor cache
# stream-prime / stream-cached keep their compile caches on the machine between two calls (a restarted server).
KEPT="TORCHINDUCTOR_CACHE_DIR=/tmp/moefx-kept/inductor MOEFX_COMPILE_CACHE=/tmp/moefx-kept/moefx-compile"
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
    for f in moe_sweep.json moe_profile.json calibrate_h200.json probe_read.json probe_ceilings.json tp.json; do
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
    case $s in
        demo) run_stage demo 150 python3 -m moefx.cli demo --device cuda ;;
        moe) run_stage moe 240 python3 bench/moe.py --calibrate ;;
        fusions) run_stage fusions 170 python3 bench/fusions.py ;;  # 10 variant classes x M 16/512/8192
        routing) run_stage routing 180 python3 bench/routing.py ;;
        sampler) run_stage sampler 200 python3 bench/sampler.py ;;
        offload) run_stage offload 420 python3 bench/offload.py --probe ;;
        offload-profile) run_stage offload-profile 360 python3 bench/offload.py --profile --skip-peer --mode eager ;;
        gpu-tests) run_stage gpu-tests 240 bash -c "python3 -m pytest -q -n 4 -p no:cacheprovider -m gpu tests; \
            python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_backends_grouped.py tests/test_backends_gemv.py \
            tests/test_backends_torch_grouped.py tests/test_moe_op.py" ;;
        calibrate) run_stage calibrate 300 bash bench/calibrate_h200.sh ;;
        calibrate-fp8) run_stage calibrate-fp8 300 bash bench/calibrate_h200.sh --quant fp8-block128 ;;
        moe-sweep) run_stage moe-sweep 240 python3 bench/moe.py --sweep-only ;;
        moe-profile) run_stage moe-profile 200 python3 bench/moe.py --profile --ms 1,4,16,256,1024,4096 ;;
        moe-sweep-gemv) run_stage moe-sweep-gemv 230 python3 bench/moe.py --sweep-only --sweep-budget 170 \
            --sweep-ms "grouped=;gemv=1,4" ;;
        moe-sweep-1024) run_stage moe-sweep-1024 150 python3 bench/moe.py --sweep-only --sweep-budget 100 \
            --dtypes bf16 --sweep-ms "grouped=1024;gemv=" ;;
        backend-tests) run_stage backend-tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_backends_grouped.py \
            tests/test_backends_gemv.py tests/test_backends_torch_grouped.py tests/test_moe_op.py ;;
        moe-sweep-grouped) run_stage moe-sweep-grouped 280 python3 bench/moe.py --sweep-only --sweep-budget 220 \
            --sweep-ms "grouped=1024,4096;gemv=" ;;
        moe-ncu) run_stage moe-ncu 300 bash -c 'for a in "bf16 1024" "fp8 1024" "fp8 4096"; do set -- $a
            ncu --clock-control none -k "regex:_gemm[12]_kernel" --launch-skip 2 --launch-count 2 \
                --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
                --section SchedulerStats --section Occupancy --section LaunchStats --print-summary none \
                -o "$OUT/ncu-$1-$2" python3 bench/moe.py --profile --no-peer --dtypes $1 --ms $2 >/dev/null
            ncu --import "$OUT/ncu-$1-$2.ncu-rep" --print-units base; done' ;;
        moe-ncu-stalls) run_stage moe-ncu-stalls 400 bash -c 'for a in "fp8 4096" "bf16 4096" "fp8 1024"; do set -- $a
            ncu --clock-control none -k "regex:_gemm1_kernel" --launch-skip 2 --launch-count 1 \
                --section WarpStateStats --section SourceCounters --section SpeedOfLight --print-summary none \
                --metrics "regex:smsp__average_warps?_.*issue_stalled_.*" --import-source no \
                -o "$OUT/ncu-stalls-$1-$2" python3 bench/moe.py --profile --no-peer --dtypes $1 --ms $2 >/dev/null
            python3 bench/probes/ncu_top.py "$OUT/ncu-stalls-$1-$2.ncu-rep" 30; done' ;;
        e2e-check) run_stage e2e-check 200 python3 bench/e2e.py --layers 8 --batches 1,16 --arms hf_static,moefx \
            --runs 1 --n1 8 --n2 24 --tag _check ;;  # one timed run per length: a check, not a median
        e2e-8-readme) run_stage e2e-8-readme 420 python3 bench/e2e.py --layers 8 --batches 1,16,64 --arms hf_static,moefx \
            --fp8 --fp8-batches 16 --tag _readme ;;  # the README path (no config) at every batch, FP8 at 16
        e2e-48-b16) run_stage e2e-48-b16 560 python3 bench/e2e.py --layers 48 --batches 16 --arms hf_static,moefx \
            --runs 2 --tag _b16 ;;
        e2e-quick) run_stage e2e-quick 420 python3 bench/e2e.py --layers 8 --batches 1,16 --arms hf_static,moefx \
            --profile --tag _quick ;;
        e2e-8) run_stage e2e-8 420 python3 bench/e2e.py --layers 8 --batches 1,16,64 --eager-batches 1,16 --fp8 \
            --fp8-batches 16 --profile ;;
        e2e-8-fp8) run_stage e2e-8-fp8 260 python3 bench/e2e.py --layers 8 --batches 16 --arms moefx --fp8 --tag _fp8 ;;
        e2e-b1) run_stage e2e-b1 300 python3 bench/e2e.py --layers 8 --batches 1 --arms hf_static,moefx --fp8 \
            --tag _b1 ;;  # batch-1 rows of the kernels-per-layer issue: 8 layers bf16 and FP8 with the peer
        e2e-48-fp8) run_stage e2e-48-fp8 560 python3 bench/e2e.py --layers 48 --batches 1 --arms moefx --fp8 \
            --profile --tag _fp8_b1 ;;  # 48 layers B=1, FP8 against bf16 in one process
        e2e-48a) run_stage e2e-48a 560 python3 bench/e2e.py --layers 48 --batches 1,16 --eager-batches 1 --prefill 4096 \
            --profile --tag _b1_16 --prefill-peers hf_eager ;;
        e2e-48-regions) run_stage e2e-48-regions 560 python3 bench/e2e.py --layers 48 --batches 1 --eager-batches 1 \
            --arms hf_eager,moefx --runs 1 --profile --tag _regions_all ;;
        e2e-48-inline) run_stage e2e-48-inline 560 python3 bench/e2e.py --layers 48 --batches 1 --arms moefx --runs 1 \
            --profile --layer-regions none --tag _regions_none ;;
        e2e-48b) run_stage e2e-48b 560 python3 bench/e2e.py --layers 48 --batches 64 --eager-batches 64 --tag _b64 ;;
        stream) run_stage stream 575 python3 bench/stream.py --layers 8 --check-every 8 --max-seconds 490 ;;  # one cold call
        stream-prime) run_stage stream-prime 300 env $KEPT python3 bench/stream.py --layers 8 --max-seconds 230 \
            --tag _prime ;;  # fills the kept caches (a server's first run) for stream-cached in the next call
        stream-cached) run_stage stream-cached 560 env $KEPT python3 bench/stream.py --layers 8 --tag _cached ;;
        ttft-8) run_stage ttft-8 300 python3 bench/e2e.py --layers 8 --batches "" --arms moefx --ttft 256,1024,4096 \
            --ttft-batch 8x512 --tag _ttft ;;
        ttft-48) run_stage ttft-48 560 python3 bench/e2e.py --layers 48 --batches "" --arms moefx --ttft 256,1024,4096 \
            --ttft-batch 8x512 --ttft-batch-arms hf_eager,moefx --tag _ttft ;;  # no compiled 8x512: its compile takes 222 s
        gpu-gen) run_stage gpu-gen 240 python3 -m pytest -q -n 4 --tb=short -p no:cacheprovider -m gpu \
            tests/test_generate_gpu.py tests/test_routing_gpu.py ;;
        moe-backward) run_stage moe-backward 150 python3 bench/moe_backward.py ;;
        coldstart) run_stage coldstart 540 python3 bench/coldstart.py --layers 8 --batch 1 ;;
        coldstart-48) run_stage coldstart-48 580 python3 bench/coldstart.py --layers 48 --batch 1 ;;
        coldstart-48-b16) run_stage coldstart-48-b16 500 python3 bench/coldstart.py --layers 48 --batch 16 \
            --arms hf_static,moefx_cold --tag _b16 ;;
        coldstart-48-frames) run_stage coldstart-48-frames 580 python3 bench/coldstart.py --layers 48 --batch 1 \
            --arms hf_static,moefx_cold,moefx_warm --layer-regions frames --tag _frames ;;
        dispatch) run_stage dispatch 420 python3 bench/dispatch.py ;;
        moe-bounds) run_stage moe-bounds 300 bash -c "python3 bench/probe_read.py; python3 bench/probe_ceilings.py" ;;
        dense) run_stage dense 180 python3 bench/dense.py --calibrate --ms 1,2,4,8,16,32,64
            cp "$RES/dense_calibration.yaml" "$OUT/" 2>/dev/null ;;
        dense-sweep) run_stage dense-sweep 240 python3 bench/dense.py --sweep --sweep-budget 180 ;;
        moe-sweep-wide) run_stage moe-sweep-wide 280 python3 bench/moe.py --sweep-only --sweep-budget 230 \
            --sweep-ms "grouped=16,256,1024,4096;gemv=1,4" ;;
        tp-calibrate) run_stage tp-calibrate 300 bash -c 'for t in 2 4; do python3 -m moefx.cli calibrate \
            --model qwen3-30b-a3b --tp $t --output "$OUT/nvidia-h200-tp.yaml" --plot none; done' ;;
        tp) run_stage tp 540 python3 bench/tp.py ;;
        tp-peer) run_stage tp-peer 560 python3 bench/tp.py --peer --batches 1,16 ;;
        *) echo "unknown stage $s (demo moe moe-sweep fusions sampler offload offload-profile gpu-tests backend-tests" \
            "calibrate calibrate-fp8 moe-profile moe-ncu moe-ncu-stalls moe-bounds moe-backward moe-sweep-wide moe-sweep-gemv" \
            "moe-sweep-1024 moe-sweep-grouped routing tp-calibrate tp tp-peer e2e-quick e2e-8 e2e-8-fp8 e2e-48a e2e-48b" \
            "e2e-check e2e-8-readme e2e-48-b16 e2e-48-regions e2e-48-inline dense dense-sweep gpu-gen stream stream-prime" \
            "stream-cached coldstart coldstart-48 coldstart-48-b16 coldstart-48-frames dispatch ttft-8 ttft-48)" ;;
    esac
done
pack
for s in "${stages[@]}"; do
    echo "##### $s"
    tail -n 25 "$RES/$s.log" 2>/dev/null
done
