"""The GPU stages: one table, read by the runner (`bash bench/run_h200.sh STAGE...`) and by `bench/report.py`.

Each stage runs `command` with bash from the repository root, under its own time limit, with `$OUT` set to the
run's results folder (packed into `$OUT/results-<stages>.tgz` by the runner). `after` runs next with the runner's
own `$OUT` (files the device tool returns on their own) and `$RES` (the results folder). `section` names the
kept result (`bench/results/<section>_<device>_<date>.json`) the stage's files feed, `keeps` the files of the
results folder that `report.py --ingest` keeps for it (stages whose files are merged by a pattern -- e2e, ttft,
coldstart, stream -- leave `keeps` empty). Plain Python, no torch.

    python3 bench/stages.py --list           # every stage, its limit and what it measures
    python3 bench/stages.py --shell STAGE    # the runner's view: bash assignments limit=, command=, after=
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass

NCU_GEMMS = '''for a in "bf16 1024" "fp8 1024" "fp8 4096"; do set -- $a
    ncu --clock-control none -k "regex:_gemm[12]_kernel" --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --section Occupancy --section LaunchStats --print-summary none \\
        -o "$OUT/ncu-$1-$2" python3 bench/moe.py --profile --no-peer --dtypes $1 --ms $2 >/dev/null
    ncu --import "$OUT/ncu-$1-$2.ncu-rep" --print-units base; done'''
NCU_STALLS = '''for a in "fp8 4096" "bf16 4096" "fp8 1024"; do set -- $a
    ncu --clock-control none -k "regex:_gemm1_kernel" --launch-skip 2 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters --section SpeedOfLight --print-summary none \\
        --metrics "regex:smsp__average_warps?_.*issue_stalled_.*" --import-source no \\
        -o "$OUT/ncu-stalls-$1-$2" python3 bench/moe.py --profile --no-peer --dtypes $1 --ms $2 >/dev/null
    python3 bench/probes/ncu_top.py "$OUT/ncu-stalls-$1-$2.ncu-rep" 30; done'''
BACKEND_TESTS = ("tests/test_backends_grouped.py tests/test_backends_gemv.py tests/test_backends_torch_grouped.py "
                 "tests/test_moe_op.py")


@dataclass(frozen=True)
class Stage:
    name: str
    limit_s: int
    command: str
    about: str
    after: str = ""
    section: str | None = None
    keeps: tuple[str, ...] = ()


STAGES: tuple[Stage, ...] = (
    Stage("demo", 150, "python3 -m moefx.cli demo --device cuda", "the CLI demo"),
    Stage("moe", 240, "python3 bench/moe.py --calibrate",
          "the MoE experts op: every backend and `auto` vs the floor and transformers", section="moe",
          keeps=("moe.json",)),
    Stage("fusions", 170, "python3 bench/fusions.py", "fused activation quantization: 10 variant classes x M "
          "16/512/8192", section="fusions", keeps=("fusions.json",)),
    Stage("routing", 180, "python3 bench/routing.py", "fused MoE routing vs inductor's softmax+topk"),
    Stage("attention", 150, "python3 bench/attention.py",
          "decode attention in one launch: the op's slices and 1-32 slices, each with both forms of the K/V loads, "
          "and torch's SDPA, with floors",
          section="attention", keeps=("attention.json",)),
    Stage("sampler", 200, "python3 bench/sampler.py", "the sync-free decode loop and sampler", section="sampler",
          keeps=("sampler.json",)),
    Stage("offload", 420, "python3 bench/offload.py --probe", "expert offload to host memory", section="offload",
          keeps=("offload.json",)),
    Stage("offload-profile", 360, "python3 bench/offload.py --profile --skip-peer --mode eager",
          "expert offload, per-kernel profile"),
    Stage("gpu-tests", 360, "python3 -m pytest -q -n 4 -p no:cacheprovider -m gpu tests; "
          f"python3 -m pytest -q -n 4 -p no:cacheprovider {BACKEND_TESTS}", "the GPU tests and the backend tests"),
    Stage("calibrate", 480, "bash bench/calibrate_shipped.sh",
          "this GPU's shipped calibration rows: the five catalog shapes, bf16 and FP8 block-128, both modes"),
    Stage("calibrate-model", 200, "python3 -m moefx.cli calibrate --model qwen3-30b-a3b "
          '--output "$OUT/calibrate-model.yaml" --plot none',
          "the user's one command (every row the plan reads), timed from an empty table"),
    Stage("moe-sweep", 240, "python3 bench/moe.py --sweep-only", "MoE tile sweep"),
    Stage("moe-profile", 200, "python3 bench/moe.py --profile --ms 1,4,16,256,1024,4096",
          "MoE per-kernel breakdown"),
    Stage("moe-sweep-gemv", 230, 'python3 bench/moe.py --sweep-only --sweep-budget 170 --sweep-ms "grouped=;gemv=1,4"',
          "MoE tile sweep, gemv only"),
    Stage("moe-sweep-1024", 150, 'python3 bench/moe.py --sweep-only --sweep-budget 100 --dtypes bf16 '
          '--sweep-ms "grouped=1024;gemv="', "MoE tile sweep, grouped bf16 at M=1024"),
    Stage("backend-tests", 150, f"python3 -m pytest -q -p no:cacheprovider {BACKEND_TESTS}", "the backend tests"),
    Stage("moe-sweep-grouped", 280, 'python3 bench/moe.py --sweep-only --sweep-budget 220 '
          '--sweep-ms "grouped=1024,4096;gemv="', "MoE tile sweep, grouped at M=1024/4096"),
    Stage("moe-ncu", 300, NCU_GEMMS, "Nsight Compute on the grouped GEMMs at M=1024/4096"),
    Stage("moe-ncu-stalls", 400, NCU_STALLS, "GEMM 1's stall reasons and hottest SASS lines"),
    Stage("e2e-check", 200, "python3 bench/e2e.py --layers 8 --batches 1,16 --arms hf_static,moefx --runs 1 --n1 8 "
          "--n2 24 --tag _check", "optimize + generate() vs transformers: one timed run per length, a check, not a "
          "median", section="e2e"),
    Stage("e2e-8-readme", 420, "python3 bench/e2e.py --layers 8 --batches 1,16,64 --arms hf_static,moefx --fp8 "
          "--fp8-batches 16 --tag _readme", "the README path (no config) at every batch, FP8 at 16", section="e2e"),
    Stage("e2e-48-readme", 560, "python3 bench/e2e.py --layers 48 --batches 1,16 --arms hf_static,moefx --runs 2 "
          "--tag _readme48", "48 layers B=1 and B=16, the README path (no config) against transformers' static "
          "compile", section="e2e"),
    Stage("e2e-48-b16", 560, "python3 bench/e2e.py --layers 48 --batches 16 --arms hf_static,moefx --runs 2 "
          "--tag _b16", "48 layers B=16 with the peer", section="e2e"),
    Stage("e2e-quick", 420, "python3 bench/e2e.py --layers 8 --batches 1,16 --arms hf_static,moefx --profile "
          "--tag _quick", "8 layers B=1/16 with the peer, profiled", section="e2e"),
    Stage("e2e-8", 420, "python3 bench/e2e.py --layers 8 --batches 1,16,64 --eager-batches 1,16 --fp8 "
          "--fp8-batches 16 --profile", "8 layers, every arm", section="e2e"),
    Stage("e2e-8-fp8", 260, "python3 bench/e2e.py --layers 8 --batches 16 --arms moefx --fp8 --tag _fp8",
          "8 layers B=16 FP8", section="e2e"),
    Stage("e2e-b1", 300, "python3 bench/e2e.py --layers 8 --batches 1 --arms hf_static,moefx --fp8 --tag _b1",
          "batch 1: 8 layers bf16 and FP8 with the peer", section="e2e"),
    Stage("e2e-48-peer", 200, "python3 bench/e2e.py --layers 48 --batches 1 --arms hf_static --runs 2 "
          '--score-batches "" --tag _peer48', "48 layers B=1, transformers' static compile alone: the peer of an "
          "e2e-48-fp8 run in the same device call", section="e2e"),
    Stage("e2e-8-pdl", 400, "python3 bench/e2e.py --layers 8 --batches 1,16 --eager-batches 1,16 "
          "--arms hf_eager,hf_static,moefx --fp8 --fp8-batches 1,16 --step-pdl off,chain --profile --runs 3 "
          "--eager-n 2,6 --tag _pdl8", "8 layers B=1/16, bf16 and FP8, every arm scored, the step's PDL chain off "
          "and on over the same compiled steps", section="e2e"),
    Stage("e2e-8-b1-fp8", 300, "python3 bench/e2e.py --layers 8 --batches 1 --eager-batches 1 "
          "--arms hf_eager,hf_static,moefx --fp8 --fp8-batches 1 --fp8-forms w8a8,weight_only --score-batches 1 "
          "--runs 3 --tag _b1_fp8",
          "8 layers B=1 in one process: bf16, FP8 in both decode forms (W8A8 and weight-only, each its own FP8 "
          "model), the peer; every arm's tokens scored (transformers' eager loop the scorer's reference)",
          section="e2e"),
    Stage("e2e-8-b1", 200, "python3 bench/e2e.py --layers 8 --batches 1 --arms hf_static,moefx --runs 3 --tag _b1",
          "8 layers B=1, the README path (no config) with the peer", section="e2e"),
    Stage("e2e-8-b1-attn", 260, "python3 bench/e2e.py --layers 8 --batches 1 --arms hf_static,moefx --runs 3 "
          "--step-variants attn_loads_after_mask,attn_loads_with_mask --tag _b1_attn",
          "8 layers B=1 with the peer, and the same compiled steps with the decode attention's K/V loaded after the "
          "mask and with it (SPECULATE, graphs captured again)"),
    Stage("e2e-48-fp8", 560, "python3 bench/e2e.py --layers 48 --batches 1 --eager-batches 1 --arms hf_eager,moefx "
          "--fp8 --profile --step-pdl off --tag _fp8_b1",
          "48 layers B=1, bf16 then FP8 in one process: the FP8 model quantized in place from the bf16 one on the "
          "GPU (its peak memory kept), each arm's decode step profile with and without the step's PDL chain (the "
          "step tables), every arm's tokens scored by the fp32 forward with transformers' eager loop as the "
          "reference",
          section="e2e"),
    Stage("e2e-48a", 560, "python3 bench/e2e.py --layers 48 --batches 1,16 --eager-batches 1 --prefill 4096 "
          "--profile --tag _b1_16 --prefill-peers hf_eager", "48 layers B=1/16 and a 4096-token prefill",
          section="e2e"),
    Stage("e2e-48-regions", 560, "python3 bench/e2e.py --layers 48 --batches 1 --eager-batches 1 "
          "--arms hf_eager,moefx --runs 1 --profile --tag _regions_all",
          "48 layers B=1, layer_regions all: compile seconds, launches per step", section="e2e"),
    Stage("e2e-48-inline", 560, "python3 bench/e2e.py --layers 48 --batches 1 --arms moefx --runs 1 --profile "
          "--layer-regions none --tag _regions_none", "48 layers B=1, layer_regions none", section="e2e"),
    Stage("e2e-48b", 560, "python3 bench/e2e.py --layers 48 --batches 64 --eager-batches 64 --tag _b64",
          "48 layers B=64", section="e2e"),
    Stage("stream", 575, "python3 bench/stream.py --layers 8 --check-every 8 --max-seconds 490",
          "500 mixed requests on the engine from cold caches in one call, every 8th request rechecked",
          section="stream"),
    Stage("stream-prime", 300, "env $KEPT python3 bench/stream.py --layers 8 --max-seconds 230 --tag _prime",
          "fills the kept compile caches (a server's first run) for stream-cached in the next call",
          section="stream"),
    Stage("stream-cached", 560, "env $KEPT python3 bench/stream.py --layers 8 --tag _cached",
          "the stream with the compile caches stream-prime kept (a restarted server)", section="stream"),
    Stage("ttft-8", 300, 'python3 bench/e2e.py --layers 8 --batches "" --arms moefx --ttft 256,1024,4096 '
          "--ttft-batch 8x512 --tag _ttft", "time to first token, 8 layers: 256/1024/4096 x B=1 and 8 x 512",
          section="ttft"),
    Stage("ttft-48", 560, 'python3 bench/e2e.py --layers 48 --batches "" --arms moefx --ttft 256,1024,4096 '
          "--ttft-batch 8x512 --ttft-batch-arms hf_eager,moefx --tag _ttft",
          "time to first token, 48 layers (no compiled 8 x 512: its compile takes 222 s)", section="ttft"),
    Stage("forward-8", 580, 'python3 bench/e2e.py --layers 8 --batches "" --arms moefx --forward 256,1024,4096 '
          "--forward-batch 8x512 --train --tag _forward", "the optimized model's forward vs torch.compile(forward) "
          "and the engine's TTFT, 8 layers: 256/1024/4096 x B=1 and 8 x 512; a training step (B=4 x 512, AdamW on "
          "the experts) vs torch.compile", section="forward"),
    Stage("forward-48", 580, 'python3 bench/e2e.py --layers 48 --batches "" --arms moefx --forward 256,1024,4096 '
          "--tag _forward48", "the optimized model's forward vs torch.compile(forward) and the engine's TTFT, 48 "
          "layers, B=1", section="forward"),
    Stage("prefill-table-48", 580, 'python3 bench/e2e.py --layers 48 --batches "" --arms moefx --forward '
          "256,1024,4096 --forward-batch 8x512 --forward-arms moefx_forward,moefx_ttft,moefx_ttft_copies "
          "--prefill-table --tag _forward48_table", "the prefill step table, 48 layers, 1 x 256/1024/4096 and "
          "8 x 512: the optimized forward's and the engine's TTFT kernels by kind against their floors, the gaps, the "
          "host time before the first kernel; the TTFT with the prompt's KV copied after the forward instead of "
          "written in the layer bodies (no torch.compile peer: forward-48 runs it)", section="forward"),
    Stage("forward-48-b8", 580, 'python3 bench/e2e.py --layers 48 --batches "" --arms moefx --forward-batch 8x512 '
          "--tag _forward48_b8", "the same at 48 layers, 8 x 512 (a process of its own: torch.compile's first "
          "compile there is its batch-8 compile)", section="forward"),
    Stage("gpu-gen", 240, "python3 -m pytest -q -n 4 --tb=short -p no:cacheprovider -m gpu tests/test_generate_gpu.py "
          "tests/test_routing_gpu.py", "the engine and routing GPU tests only"),
    Stage("moe-backward", 150, "python3 bench/moe_backward.py", "MoE experts autograd vs transformers' grouped_mm",
          section="moe-backward", keeps=("moe_backward.json",)),
    Stage("coldstart", 540, "python3 bench/coldstart.py --layers 8 --batch 1",
          "first call: transformers then moefx cold in the saving process, a new machine with moefx's file, a "
          "restart", section="coldstart"),
    Stage("coldstart-48", 580, "python3 bench/coldstart.py --layers 48 --batch 1", "cold start, 48 layers",
          section="coldstart"),
    Stage("coldstart-48-b16", 500, "python3 bench/coldstart.py --layers 48 --batch 16 --arms moefx_cold,moefx_warm "
          "--tag _b16", "cold start, 48 layers B=16: transformers then moefx cold, and a new machine",
          section="coldstart"),
    Stage("coldstart-48-frames", 580, "python3 bench/coldstart.py --layers 48 --batch 1 "
          "--arms moefx_cold,moefx_warm --layer-regions frames --tag _frames",
          "cold start, 48 layers B=1, layer_regions frames", section="coldstart"),
    Stage("dispatch", 420, "python3 bench/dispatch.py", "host time per moefx op call vs the 15 us target"),
    Stage("moe-bounds", 300, "python3 bench/probe_read.py; python3 bench/probe_ceilings.py",
          "read-only and library-GEMM lower bounds", section="moe-bounds",
          keeps=("moe-bounds-probe_read.json", "moe-bounds-probe_ceilings.json")),
    Stage("dense", 180, "python3 bench/dense.py --ms 1,2,4,8,16,32,64",
          "dense-linear gemv vs cuBLAS, the floors and the decode-layer forms", section="dense", keeps=("dense.json",)),
    Stage("dense-fp8", 150, "python3 bench/dense.py --fp8-forms",
          "FP8 decode forms: bf16 vs W8A8 (+ its activation quant) vs FP8 weight-only at M = 1, 2, 4, with floors",
          section="dense", keeps=("dense.json",)),
    Stage("dense-sweep", 240, "python3 bench/dense.py --sweep --sweep-budget 180", "dense-linear tile sweep"),
    Stage("dense-sweep-fp8", 170, "python3 bench/dense.py --sweep --sweep-budget 130 --sweep-ms 2,4 "
          "--sweep-forms fp8,fp8-wo --shapes qkv,o", "dense-linear tile sweep, both FP8 forms at M = 2, 4"),
    Stage("dense-sweep-m1", 200, "python3 bench/dense.py --sweep --sweep-budget 160 --sweep-ms 1 "
          "--sweep-forms bf16,fp8-wo --shapes qkv,o", "dense-linear tile sweep at M = 1: bf16 and FP8 weight-only, "
          "q/k/v and o_proj (the batch-1 decode step's projections)"),
    Stage("moe-sweep-wide", 280, 'python3 bench/moe.py --sweep-only --sweep-budget 230 '
          '--sweep-ms "grouped=16,256,1024,4096;gemv=1,4"', "MoE tile sweep, every kind and M"),
    Stage("tp-calibrate", 300, 'for t in 2 4; do python3 -m moefx.cli calibrate --model qwen3-30b-a3b --tp $t '
          '--output "$OUT/nvidia-h200-tp.yaml" --plot none; done',
          "per-rank expert shapes of Qwen3-30B-A3B at TP=2/4 (one GPU)"),
    Stage("tp", 540, "python3 bench/tp.py", "tensor parallel decode, 2-4 GPUs"),
    Stage("tp-peer", 560, "python3 bench/tp.py --peer --batches 1,16", "tensor parallel decode with the peer"),
)
BY_NAME = {s.name: s for s in STAGES}
if len(BY_NAME) != len(STAGES):
    raise ValueError("bench/stages.py: two stages share a name")


def stage(name: str) -> Stage:
    """The stage called `name`; ValueError naming the valid stages otherwise."""
    if name not in BY_NAME:
        raise ValueError(f"unknown stage {name!r}; valid: {' '.join(BY_NAME)}")
    return BY_NAME[name]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="every stage, its limit and what it measures")
    p.add_argument("--shell", metavar="STAGE", help="bash assignments limit=, command=, after= for the runner")
    args = p.parse_args(argv)
    if args.shell:
        try:
            s = stage(args.shell)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        print(f"limit={s.limit_s}; command={shlex.quote(s.command)}; after={shlex.quote(s.after)}")
        return 0
    width = max(len(s.name) for s in STAGES)
    for s in STAGES:
        print(f"{s.name:<{width}} {s.limit_s:>4}s  {s.about}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
