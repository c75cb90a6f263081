"""End to end: a transformers Qwen3-MoE through `moefx.optimize` + `generate()` against transformers alone.

Qwen3-MoE at Qwen3-30B-A3B widths (E=128, H=2048, I=768, top-8), `--layers` deep, seeded random weights built with
`build_model(..., routing="balanced")` (top-k spreads over the experts as a trained model's does; `--routing
as_built` for transformers' initialisation, which routes most tokens to a few experts), bf16, a `--prompt`-token
prompt, greedy. Arms, all in this process on one model (the transformers arms first, on the plain model; `optimize`
then rewrites it in place):
  hf_eager     model.generate() as shipped (dynamic cache, eager)
  hf_static    model.generate(cache_implementation="static"): transformers compiles its own decode step
  moefx        moefx.optimize(model) (no config: the README path; `--max-batch-size` caps the capture sizes) then
               model.generate(): moefx's engine (static cache, compiled prefill and decode step from CUDA graphs)
  moefx_fp8    a second model, moefx.quantize(model, "fp8_block128") then the same (`--fp8`); with `--fp8-forms`
               one such arm per FP8 decode form (`moefx_fp8_w8a8`, `moefx_fp8_weight_only`: pass_config.fp8_weight_only
               off / on), each on its own FP8 model built after the last one is freed
Decode tok/s = B * (n2 - n1) / (t(n2) - t(n1)), t = median wall time of generate(max_new_tokens=n); the prefill
cancels out. First call = the first generate() of the arm at that batch (compiles and captures included).
Floor = weight bytes one decode step reads (every non-expert weight, in each layer the distinct experts the
batch's top-k hit, B embedding rows) / the measured HBM copy rate; the distinct experts are counted on the plain
model over two decode steps of the measured batch before any arm runs (`experts_hit`: their mean per layer).
Greedy agreement = share of the first 8 new tokens equal to hf_eager's (bf16: near-tied logits of random weights
flip some; reported, not required). Correctness (`--score-batches`, default 1,16): every token of each arm's first
n2-token request at those batches is scored with an fp32 eager forward of the weights the arm ran (bench/scorer.py:
the model's own module tree, one decoder layer's weights in fp32 at a time; FP8: the FP8 weights dequantized):
`argmax_share` = share of steps whose token is the scorer's argmax, `max_gap_std` = the largest (best - chosen
logit) / std of the scorer's logits; hf_eager (where it runs) generates n2 tokens once more, untimed, to be scored.
Prefill (`--prefill T`): one T-token prompt, last-position logits: hf_eager
forward, hf_compiled (`torch.compile(model.forward)`), moefx (generate(max_new_tokens=1) on the engine); FLOP floor =
(2 x active parameters x T + causal attention) / the measured bf16 matmul rate.
TTFT (`--ttft 256,1024,4096` at B=1, `--ttft-batch 8x512`): time to the first token, median of `--runs` after one
warm-up call, per arm: hf_eager `generate(ids, max_new_tokens=1)`, hf_compiled a forward over the prompt under
`torch.compile(dynamic=True)` with logits_to_keep=1 + argmax, moefx `generate(ids, max_new_tokens=1)` after
`optimize`; then one run under torch.profiler for its GPU kernel time, wall time and kernel count. Floors: FLOPs
as for the prefill rows / the bf16 matmul rate, and bytes = every non-expert weight, the distinct experts the
prompt's tokens hit in each layer, the prompt's embedding rows / the HBM copy rate.
Forward (`--forward 256,1024,4096` at B=1, `--forward-batch 8x512`): the model's own forward, logits_to_keep=1,
median of `--runs` after one warm-up call, then one profiled call, floors as for TTFT; arms (`--forward-arms`):
hf_compiled `torch.compile(model.forward, dynamic=True)` on the plain model (before `optimize`; the peer),
moefx_forward `model(input_ids=ids, logits_to_keep=1)` after `optimize` (the engine's padded prefill,
moefx/engine/forward.py), moefx_ttft `generate(ids, max_new_tokens=1)` on the same optimized model,
moefx_ttft_in_layers the same with the prompt's keys and values written into the cache by the padded prefill's layer
bodies (buckets up to IN_LAYERS_MAX_BUCKET) and moefx_ttft_copies with them copied there after its forward
(`BucketedPrefill.write_in_layers` on / off, whichever the default is; their graphs captured again, then dropped:
both sides of that setting in the same process). The moefx
forward's logits are checked against the peer's (relative error, `extra.forward_logits_rel_err`) and the forward
front's counts kept (`extra.moefx_forward`: calls on the fast path, fallbacks). `--prefill-table`: each moefx forward
row gets one more profiled call (`extra.prefill_profile_<layers>[arm][BxT]`: every kernel's time and count, the
gaps between kernels, the host time from the call's start to the first kernel), the prefill step table of the
forward section (kernels by kind, bench/sections/kernel_kinds.py, against their bytes and FLOP floors).
Training step (`--train`, `--train-shape 4x512`): a model of its own per arm (same seed), bf16, AdamW on the experts'
weights only (the rest frozen), `loss = forward(input_ids, labels=input_ids).loss; loss.backward(); step`; arms
(`--train-arms`): hf_compiled `torch.compile(model.forward, dynamic=True)`, moefx `moefx.optimize(model)` then the
model's forward (a training call runs the compiled forward); median of `--runs` steps after one warm-up step, the
warm-up's loss (same weights and tokens in every arm) kept to compare.
Writes JSON (the `e2e` schema of bench/report.py) to $OUT and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moefx
from bench.harness import ceilings, median_wall_s, results_dir, sync, timed_call, wall_s, write_json
from bench.scorer import Fp32Scorer, fp8_block_weights
from bench.sections.e2e import DecodeRow
from moefx.config import LAYER_REGIONS
from moefx.integrations.transformers import is_experts_module
from moefx.models import build_model, qwen3_moe_config, tiny_qwen3_moe_config
from moefx.models.routing_stats import decode_distinct_experts, distinct_experts, experts_modules
from moefx.models.tiny import ROUTINGS

AGREE_TOKENS = 8
# moefx's first two steps' logits against transformers' eager ones (bf16 through every layer: fusion and kernel
# rounding move them by ~1e-2; a wrong kernel or a broken rewrite is O(1))
LOGITS_BOUND = 0.1


def step_bytes(model: torch.nn.Module, tokens: int, hit: dict[str, float]) -> float:
    """Bytes of weights a step over `tokens` tokens reads: every non-expert weight, `tokens` embedding rows, and of
    each experts module the share `hit[name] / E` of its experts (`hit`: distinct experts per module, counted on
    the plain model; a module not in it, e.g. renamed by a rewrite, reads the mean share)."""
    from moefx.quant_linear import Fp8BlockExperts, Int8Experts

    e = model.config.num_experts
    mean = sum(hit.values()) / len(hit) / e
    share = {}
    for name, m in model.named_modules():
        if is_experts_module(m) or isinstance(m, (Fp8BlockExperts, Int8Experts)):  # quantized experts too
            for p in m.parameters():
                share[id(p)] = hit[name] / e if name in hit else mean
    total = 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if id(p) in share:
            total += nbytes * share[id(p)]
        elif "embed_tokens" in name:
            total += tokens * p.shape[-1] * p.element_size()
        else:
            total += nbytes
    return total


def mean_hit(hit: dict[str, float]) -> float:
    return round(sum(hit.values()) / len(hit), 1)


def prefill_flops(model: torch.nn.Module, tokens: int, batch: int = 1) -> float:
    """FLOPs of a prefill of `batch` prompts of `tokens` tokens (last-position logits only)."""
    cfg = model.config
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attn_w = h * hd * (2 * heads + 2 * kv)
    experts = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
    linear = layers * (attn_w + experts + h * cfg.num_experts) + cfg.vocab_size * h / tokens  # LM head: 1 row
    causal = layers * 2 * 2 * heads * hd * tokens * tokens / 2
    return batch * (2 * linear * tokens + causal)


def _step_pdl(on: bool) -> Callable[[], None]:
    from moefx.kernels.pdl import set_step_pdl

    set_step_pdl(on)
    return set_step_pdl  # called with no argument: the default again


def _attention_speculates(on: bool) -> Callable[[], None]:
    from moefx.kernels.decode_attn import set_speculate_default

    set_speculate_default(on)
    return set_speculate_default  # called with no argument: the default again


# Before/after of one kernel setting over an arm's own model and compiled steps (`--step-variants`, `--step-pdl`): a
# setting the kernels' launchers read when the decode graphs are captured (custom ops launch from Python then), so
# only the graphs are captured again. name -> (what it changes, apply() returning its undo); rows `<arm>_<name>`.
STEP_VARIANTS: dict[str, tuple[str, Callable[[], Callable[[], None]]]] = {
    "pdl_off": ("the decode step's PDL chain off (kernels/pdl.py)", lambda: _step_pdl(False)),
    "pdl_chain": ("the decode step's PDL chain on (the default)", lambda: _step_pdl(True)),
    "attn_loads_after_mask": ("decode attention loads each block's K and V after its mask, never with it "
                              "(kernels/decode_attn.py SPECULATE_DEFAULT off)", lambda: _attention_speculates(False)),
    "attn_loads_with_mask": ("decode attention loads K and V with the mask in slices of up to SPECULATE_BLOCKS "
                             "blocks (SPECULATE_DEFAULT on)", lambda: _attention_speculates(True)),
}
# The TTFT arms that set how the padded prefill puts the prompt's keys and values into the cache
# (`BucketedPrefill.write_in_layers`, within IN_LAYERS_MAX_BUCKET), whatever the default: arm -> the setting
KV_WRITE_ARMS = {"moefx_ttft_in_layers": True, "moefx_ttft_copies": False}
# --fp8-forms: the FP8 decode form -> pass_config.fp8_weight_only (docs/DENSE.md)
FP8_FORMS = {"w8a8": False, "weight_only": True}


def greedy_kwargs(n: int) -> dict:
    return dict(max_new_tokens=n, min_new_tokens=None, do_sample=False, pad_token_id=0, eos_token_id=None)


def decode_row(arm: str, generate, ids, n1: int, n2: int, runs: int, floor_tok_s: float, layers: int,
               dtype: str, ref: torch.Tensor | None, routing: dict) -> tuple[dict, torch.Tensor]:
    batch = ids.shape[0]
    if ids.is_cuda:
        torch.cuda.reset_peak_memory_stats()
    out = None

    def first():
        nonlocal out
        out = generate(ids, n2)

    first_s = wall_s(first)
    generate(ids, n1)  # warm n1 too (a shorter request may recapture nothing, but keep both warm)
    t1 = median_wall_s(lambda: generate(ids, n1), runs)
    t2 = median_wall_s(lambda: generate(ids, n2), runs)
    tok_s = batch * (n2 - n1) / max(t2 - t1, 1e-9)
    new = out[:, ids.shape[1]:]
    agree = None
    if ref is not None:
        m = min(AGREE_TOKENS, new.shape[1], ref.shape[1])
        agree = float((new[:, :m] == ref[:, :m]).float().mean())
    row = asdict(DecodeRow(layers=layers, B=batch, dtype=dtype, arm=arm, tok_s=round(tok_s, 1),
                           step_ms=round(1e3 * (t2 - t1) / (n2 - n1), 3), floor_tok_s=round(floor_tok_s, 1),
                           pct_floor=round(100 * tok_s / floor_tok_s, 1), first_call_s=round(first_s, 1),
                           peak_mem_gib=round(_peak_gib(ids), 1), agree_with_eager=agree, **routing))
    print(f"  {arm:10s} B={batch:3d}: {tok_s:8.1f} tok/s ({row['pct_floor']}% of floor), first call "
          f"{first_s:.1f} s, agree {agree}", flush=True)
    return row, new


def score_row(row: dict, scorer: Fp32Scorer | None, ids: torch.Tensor, new: torch.Tensor, extra: dict) -> None:
    """Add the fp32 scorer's verdict on `new` (the arm's tokens after prompt `ids`) to `row`; a scorer that fails
    is recorded in `extra["errors"]` and leaves the arm's timed rows standing."""
    if scorer is None:
        return
    try:
        score = scorer.score(torch.cat([ids, new.to(ids.device)], dim=1), ids.shape[1])
    except Exception as exc:  # the check is reported, the measurement kept
        import traceback

        traceback.print_exc()
        extra.setdefault("errors", {})[f"scorer_{row['arm']}_B{row['B']}"] = f"{type(exc).__name__}: {exc}"[:2000]
        return
    row.update(scored_steps=score.steps, argmax_share=round(score.argmax_share, 4),
               max_gap_std=round(score.max_gap_std, 4))
    print(f"  {row['arm']:10s} B={row['B']:3d}: fp32 scorer argmax at {100 * score.argmax_share:.1f}% of "
          f"{score.steps} steps, largest gap {score.max_gap_std:.3f} std", flush=True)


def profile_run(fn) -> dict:
    """One call of `fn` under torch.profiler: its wall time, the summed time of the GPU activity (kernels, copies,
    memsets) it ran, how many there were, and the ten that took longest (name, ms, count)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        seconds = wall_s(fn)
    kern = [e for e in prof.key_averages() if e.device_type is not None and "CUDA" in str(e.device_type)]
    kernel_ms = sum(e.device_time_total for e in kern) / 1e3
    top = sorted(kern, key=lambda e: -e.device_time_total)[:10]
    return dict(prof_wall_ms=round(1e3 * seconds, 2), kernel_ms=round(kernel_ms, 2), kernels=sum(e.count for e in kern),
                kernel_pct=round(100 * kernel_ms / (1e3 * seconds), 1),
                top_kernels=[[e.key[:80], round(e.device_time_total / 1e3, 2), e.count] for e in top])


PREFILL_MARK = "e2e_prefill_call"


def prefill_profile(fn) -> dict:
    """One call of `fn` under torch.profiler (CPU and CUDA activity): each GPU activity's summed time and count, the
    GPU's busy time (the union of the kernels' intervals) and span (first kernel start to last kernel end; span -
    busy = the gaps between kernels), and the host time before the first kernel (the call's start on the host to
    the first kernel's start on the GPU). Times in µs; no kernels (a CPU run): kernel figures None."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.no_grad(), profile(activities=acts) as prof:
        sync()
        with record_function(PREFILL_MARK):
            fn()
        sync()
    events = list(prof.events())
    call = next(e for e in events if e.name == PREFILL_MARK and "CUDA" not in str(e.device_type))  # the host's
    # the marker has a GPU-side range too (the span of what it launched): it is not a kernel
    gpu = [(e.name, e.time_range.start, e.time_range.end) for e in events
           if e.device_type is not None and "CUDA" in str(e.device_type) and e.name != PREFILL_MARK]
    return kernel_timeline(gpu, call.time_range.start, call.time_range.end)


def kernel_timeline(kernels: list[tuple[str, float, float]], call_start: float, call_end: float) -> dict:
    """prefill_profile's figures from (name, start µs, end µs) of each GPU activity and the call's host interval."""
    per: dict[str, list] = {}
    for name, a, b in kernels:
        d = per.setdefault(name[:160], [0.0, 0])
        d[0] += b - a
        d[1] += 1
    busy, end = 0.0, None
    for _, a, b in sorted(kernels, key=lambda k: k[1]):  # the union of the intervals (two streams may overlap)
        if end is None or a > end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    first = min((a for _, a, _ in kernels), default=None)
    return dict(host_us=round(call_end - call_start, 1),
                host_before_first_kernel_us=None if first is None else round(first - call_start, 1),
                kernel_span_us=None if first is None else round(end - first, 1),
                kernel_busy_us=None if first is None else round(busy, 1),
                kernels=sorted(([k, round(us, 2), n] for k, (us, n) in per.items()), key=lambda x: -x[1]))


def ttft_row(arm: str, fn, layers: int, batch: int, tokens: int, runs: int, floors: tuple[float, float],
             routing: dict) -> dict:
    """Time to first token of `fn` (one warm-up call, then the median of `runs`), then one profiled call."""
    with torch.no_grad():
        first = wall_s(fn)
        ms = 1e3 * median_wall_s(fn, runs)
        prof = profile_run(fn)
    flop_ms, bytes_ms = floors
    floor = max(flop_ms, bytes_ms)
    row = dict(layers=layers, B=batch, tokens=tokens, arm=arm, ms=round(ms, 2), first_call_s=round(first, 1),
               flop_floor_ms=round(flop_ms, 2), bytes_floor_ms=round(bytes_ms, 2), floor_ms=round(floor, 2),
               x_floor=round(ms / floor, 2), **prof, **routing)
    print(f"  ttft {arm:11s} {batch}x{tokens}: {ms:.1f} ms ({ms / floor:.2f}x floor {floor:.1f} ms), profiled "
          f"{prof['prof_wall_ms']:.1f} ms wall, {prof['kernel_ms']:.1f} ms kernels ({prof['kernel_pct']}%), "
          f"{prof['kernels']} kernels, first call {first:.1f} s", flush=True)
    return row


def check_logits(engine, ids: torch.Tensor, ref_tokens: torch.Tensor, ref: list[torch.Tensor]) -> list[float]:
    """Relative error of the engine's prefill and first decode-step logits against transformers' eager generate()
    (the second only when both picked the same first token); prints CHECK FAILED when one is over LOGITS_BOUND."""
    from moefx.sampling.sampler import SamplingParams

    got: list[torch.Tensor] = []
    tokens = engine.generate(ids, 2, SamplingParams(temperature=0), logits_out=got)[:, ids.shape[1]:]
    steps = 2 if torch.equal(tokens[:, :1], ref_tokens[:, :1]) else 1
    errs = [float((g.float() - r).norm() / r.norm()) for g, r in zip(got[:steps], ref[:steps])]
    print(f"  logits vs transformers eager (prefill, step 1): {[f'{e:.3g}' for e in errs]}", flush=True)
    if max(errs) > LOGITS_BOUND:
        print(f"  CHECK FAILED: moefx logits differ from eager by more than {LOGITS_BOUND}", flush=True)
    return errs


def profile_step(model, ids, n: int = 8) -> list[dict]:
    """Kernels of the decode steps (CUDA activity inside the graph replays), per step, largest first."""
    from torch.profiler import ProfilerActivity, profile

    gen = lambda m: model.generate(ids, **greedy_kwargs(m))  # noqa: E731
    gen(n)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gen(n)
    with profile(activities=[ProfilerActivity.CUDA]) as prof1:
        gen(1)
    per = {}
    for sign, p in ((1, prof), (-1, prof1)):
        for evt in p.key_averages():
            if evt.device_type is not None and "CUDA" in str(evt.device_type):
                d = per.setdefault(evt.key, [0.0, 0])
                d[0] += sign * evt.device_time_total
                d[1] += sign * evt.count
    steps = n - 1
    rows = [dict(kernel=k[:160], us_per_step=round(v[0] / steps, 2), calls_per_step=round(v[1] / steps, 1))
            for k, v in per.items() if v[0] > 0]
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    print(f"  profile: {total:.0f} us of kernels per decode step, "
          f"{sum(r['calls_per_step'] for r in rows):.0f} launches; top kernels:")
    for r in rows[:25]:
        print(f"    {r['us_per_step']:8.2f} us  x{r['calls_per_step']:<6} {r['kernel']}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,16,64", help="decode batch sizes ('' for none)")
    ap.add_argument("--arms", default="hf_eager,hf_static,moefx")
    ap.add_argument("--fp8", action="store_true", help="add moefx_fp8")
    ap.add_argument("--fp8-batches", default="", help="batches of moefx_fp8 (default: --batches)")
    ap.add_argument("--fp8-forms", default="", help="FP8 decode forms, one moefx_fp8_<form> arm each, in this order: "
                    f"{','.join(FP8_FORMS)} ('': one moefx_fp8 arm with the plan's default); at 48 layers name one "
                    "(each arm builds its bf16 model on the card before quantizing it)")
    ap.add_argument("--eager-batches", default="", help="batches of hf_eager (default: --batches)")
    ap.add_argument("--calibration", default="", help="extra calibration table for the moefx arms "
                    "(default: $OUT/dense_calibration.yaml when a dense stage wrote one)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--n1", type=int, default=16)
    ap.add_argument("--n2", type=int, default=48)
    ap.add_argument("--eager-n", default="2,6", help="n1,n2 for hf_eager (slow)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prefill", type=int, default=0, help="prompt length of the prefill arms (0: none)")
    ap.add_argument("--prefill-peers", default="hf_eager,hf_compiled",
                    help="transformers prefill arms (hf_compiled compiles the whole forward once more)")
    ap.add_argument("--profile", action="store_true", help="kernel profile of the moefx (and moefx_fp8) decode step at "
                    "the arm's smallest batch")
    ap.add_argument("--score-batches", default="1,16", help="decode batches whose tokens the fp32 scorer checks, every "
                    "arm ('' for none)")
    ap.add_argument("--step-pdl", default="", help="before/after of the decode step's PDL chain on each moefx arm's "
                    "model, same process: a comma list of off, chain (the default); each recaptures the graphs and "
                    "times the arm's smallest batch (rows `<arm>_pdl_<setting>`; with --profile, each profiled)")
    ap.add_argument("--step-variants", default="", help="before/after of kernel settings on each moefx arm's model, "
                    "same process, as --step-pdl: a comma list of " + ", ".join(STEP_VARIANTS) + " (rows "
                    "`<arm>_<variant>`)")
    ap.add_argument("--ttft", default="", help="B=1 prompt lengths of the TTFT rows, e.g. 256,1024,4096")
    ap.add_argument("--ttft-batch", default="", help="BxT TTFT rows, e.g. 8x512")
    ap.add_argument("--ttft-arms", default="hf_eager,hf_compiled,moefx")
    ap.add_argument("--ttft-batch-arms", default="", help="the arms that run the BxT rows (default: all TTFT arms); "
                    "transformers' compiled forward compiles a batch > 1 apart (222 s at 48 layers)")
    ap.add_argument("--forward", default="", help="B=1 prompt lengths of the forward rows, e.g. 256,1024,4096")
    ap.add_argument("--forward-batch", default="", help="BxT forward rows, e.g. 8x512")
    ap.add_argument("--forward-arms", default="hf_compiled,moefx_forward,moefx_ttft")
    ap.add_argument("--prefill-table", action="store_true", help="one more profiled call of each moefx forward row "
                    "(every kernel, the gaps, the host time before the first kernel): the prefill step table")
    ap.add_argument("--train", action="store_true", help="training-step rows (AdamW on the experts)")
    ap.add_argument("--train-shape", default="4x512", help="BxT of the training step")
    ap.add_argument("--train-arms", default="hf_compiled,moefx")
    ap.add_argument("--routing", default="balanced", choices=ROUTINGS, help="build_model's routing")
    ap.add_argument("--max-batch-size", type=int, default=0,
                    help="moefx config max_batch_size (default 0: no config key, the plan's capture sizes)")
    ap.add_argument("--mode", default="", help="moefx config mode (default: the config's; eager for CPU smoke runs)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--layer-regions", choices=LAYER_REGIONS, default="auto",
                    help="moefx config layer_regions (default: left out, the config's auto): decoder layers "
                         "compiled as one region (prefill and decode, prefill only), inlined, or as compiled frames")
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny model (smoke run, e.g. on the CPU)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    out_dir = results_dir()
    batches = [int(b) for b in args.batches.split(",") if b]
    fp8_batches = [int(b) for b in args.fp8_batches.split(",")] if args.fp8_batches else batches
    eager_batches = [int(b) for b in args.eager_batches.split(",")] if args.eager_batches else batches
    score_batches = {int(b) for b in args.score_batches.split(",") if b}
    step_variants = [f"pdl_{s}" for s in args.step_pdl.split(",") if s]
    step_variants += [v for v in args.step_variants.split(",") if v]
    unknown = [v for v in step_variants if v not in STEP_VARIANTS]
    if unknown:
        raise SystemExit(f"--step-pdl / --step-variants: {unknown} not among {sorted(STEP_VARIANTS)} (--step-pdl takes "
                         "off, chain)")
    calibration = args.calibration or str(out_dir / "dense_calibration.yaml")
    tables = [calibration] if Path(calibration).is_file() else []
    if tables:  # where `moefx calibrate` puts a user's rows: the plan then prefers what they enable, as for a user
        from moefx.backends import calibration as calib

        calib.user_table_dir().mkdir(parents=True, exist_ok=True)
        shutil.copy(tables[0], calib.user_table_dir() / "e2e-dense-calibration.yaml")
        calib.invalidate()
    print(f"extra calibration tables: {tables or 'none'}", flush=True)
    arms = args.arms.split(",")
    e1, e2 = (int(x) for x in args.eager_n.split(","))
    ceil = _ceilings(args.device)
    hbm = ceil["copy_Bps"]
    print(f"ceilings: copy {hbm / 1e12:.2f} TB/s, bf16 matmul {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    cfg = tiny_qwen3_moe_config(num_hidden_layers=args.layers) if args.tiny else qwen3_moe_config(args.layers)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(cfg, seed=0, dtype=dtype, device=args.device, routing=args.routing).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(1)
    inputs = {b: torch.randint(1, cfg.vocab_size, (b, args.prompt), generator=gen).to(args.device) for b in batches}
    shapes = [(1, int(t)) for t in args.ttft.split(",") if t]
    shapes += [tuple(int(x) for x in bt.split("x")) for bt in args.ttft_batch.split(",") if bt]
    fwd_shapes = [(1, int(t)) for t in args.forward.split(",") if t]
    fwd_shapes += [tuple(int(x) for x in bt.split("x")) for bt in args.forward_batch.split(",") if bt]
    ttft_ids = {bt: torch.randint(1, cfg.vocab_size, bt, generator=gen).to(args.device)
                for bt in dict.fromkeys(shapes + fwd_shapes)}
    # the routing each row measures, counted on the plain model before any arm rewrites it
    names = list(experts_modules(model))
    hits = {b: decode_distinct_experts(model, inputs[b], steps=2) for b in batches}
    prompt_hits = {bt: dict(zip(names, distinct_experts(model, ids))) for bt, ids in ttft_ids.items()}
    routing = {b: dict(routing=args.routing, experts_hit=mean_hit(h)) for b, h in {**hits, **prompt_hits}.items()}
    print(f"routing {args.routing}: mean distinct experts per layer (of {cfg.num_experts}) "
          + ", ".join(f"{_label(k)}: {v['experts_hit']}" for k, v in routing.items()), flush=True)
    floors = {b: b / (step_bytes(model, b, hits[b]) / hbm) for b in batches}
    ttft_floors = {(b, t): (1e3 * prefill_flops(model, t, b) / ceil["bf16_flops"],
                            1e3 * step_bytes(model, b * t, prompt_hits[(b, t)]) / hbm) for b, t in ttft_ids}
    ttft_arms = args.ttft_arms.split(",")
    fwd_arms = args.forward_arms.split(",")
    decode, prefill, ttft, refs, extra = [], [], [], {}, {}
    forward, train, fwd_logits = [], [], {}
    stock_generate = type(model).generate.__get__(model)
    # the plain model's tree and tensors, taken before `optimize` rewrites the model in place
    scorer = Fp32Scorer(model) if score_batches & {*batches, *eager_batches, *fp8_batches} else None
    if scorer is not None:
        extra["scorer"] = ("fp32 eager transformers forward (eager attention and experts) of the arm's weights, one "
                           "decoder layer in fp32 at a time; FP8: its weights dequantized; every token of the arm's "
                           f"first {args.n2}-token request (hf_eager: one more request of {args.n2} tokens)")

    def save() -> Path:
        device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke run)"
        result = dict(stage="e2e", date=datetime.date.today().isoformat(), device=device_name,
                      versions=dict(torch=torch.__version__, triton=_version("triton"),
                                    transformers=_version("transformers")),
                      commit=os.environ.get("MOEFX_COMMIT", "unknown"), command=" ".join(["python3", *sys.argv]),
                      ceilings=dict(hbm_copy_TBps=round(hbm / 1e12, 3),
                                    bf16_matmul_TFLOPs=round(ceil["bf16_flops"] / 1e12, 1)),
                      routing=args.routing, decode=decode, prefill=prefill, ttft=ttft, forward=forward, train=train,
                      extra=extra)
        return write_json(f"e2e_{args.layers}l{args.tag}.json", result)

    def guarded(name: str, fn) -> None:
        """One arm; its failure is recorded and the next arm still runs (and the JSON so far is written)."""
        try:
            fn()
        except Exception as exc:  # a benchmark reports every arm it can
            import traceback

            traceback.print_exc()
            extra.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:2000]
        save()


    ref_logits = None
    if "hf_eager" in arms and eager_batches:
        print("hf_eager", flush=True)
        for b in eager_batches:
            row, new = decode_row("hf_eager", lambda x, n: stock_generate(x, **greedy_kwargs(n)),
                                  inputs[b], e1, e2, args.runs, floors[b], args.layers, "bf16", None, routing[b])
            refs[b] = new
            if b in score_batches:
                scored = stock_generate(inputs[b], **greedy_kwargs(args.n2))[:, args.prompt:]  # n2 tokens, as others
                score_row(row, scorer, inputs[b], scored, extra)
            decode.append(row)
        with torch.no_grad():
            out = stock_generate(inputs[eager_batches[0]], output_logits=True, return_dict_in_generate=True,
                                 **greedy_kwargs(2))
        ref_logits = (out.sequences[:, args.prompt:], [t.float() for t in out.logits])
    ptoks, fl_ms = None, 0.0

    def prefill_row(arm: str, fn) -> None:
        with torch.no_grad():
            first = wall_s(fn)
            ms = 1e3 * median_wall_s(fn, args.runs)
        prefill.append(dict(layers=args.layers, tokens=args.prefill, arm=arm, ms=round(ms, 1),
                            floor_ms=round(fl_ms, 1), x_floor=round(ms / fl_ms, 2), first_call_s=round(first, 1)))
        print(f"  prefill {arm:11s}: {ms:.1f} ms ({ms / fl_ms:.2f}x floor), first call {first:.1f} s", flush=True)

    if args.prefill:
        ptoks = torch.randint(1, cfg.vocab_size, (1, args.prefill), generator=gen).to(args.device)
        fl_ms = 1e3 * prefill_flops(model, args.prefill) / ceil["bf16_flops"]
        print("prefill, transformers", flush=True)
        peers = args.prefill_peers.split(",")
        if "hf_eager" in peers:
            prefill_row("hf_eager", lambda: model(input_ids=ptoks, logits_to_keep=1))
        if "hf_compiled" in peers:
            compiled_fwd = torch.compile(model.forward)
            prefill_row("hf_compiled", lambda: compiled_fwd(input_ids=ptoks, logits_to_keep=1))
            del compiled_fwd
            torch._dynamo.reset()

    batch_arms = args.ttft_batch_arms.split(",") if args.ttft_batch_arms else ttft_arms

    def ttft_rows(arm: str, make) -> None:
        for bt in shapes:
            if bt[0] > 1 and arm not in batch_arms:
                continue
            ttft.append(ttft_row(arm, make(ttft_ids[bt]), args.layers, *bt, args.runs, ttft_floors[bt], routing[bt]))
            save()

    if shapes and "hf_eager" in ttft_arms:
        print("ttft, hf_eager", flush=True)
        guarded("ttft_hf_eager", lambda: ttft_rows("hf_eager", lambda ids: lambda: stock_generate(
            ids, **greedy_kwargs(1))))
    if shapes and "hf_compiled" in ttft_arms:
        print("ttft, hf_compiled", flush=True)
        compiled_ttft = torch.compile(model.forward, dynamic=True)
        guarded("ttft_hf_compiled", lambda: ttft_rows("hf_compiled", lambda ids: lambda: compiled_ttft(
            input_ids=ids, logits_to_keep=1).logits.argmax(-1)))
        del compiled_ttft
        torch._dynamo.reset()
    def forward_rows(arm: str, make) -> None:
        for bt in fwd_shapes:
            fn = make(ttft_ids[bt])
            forward.append(ttft_row(arm, fn, args.layers, *bt, args.runs, ttft_floors[bt], routing[bt]))
            if args.prefill_table and arm.startswith("moefx"):
                table = extra.setdefault(f"prefill_profile_{args.layers}", {}).setdefault(arm, {})
                table[f"{bt[0]}x{bt[1]}"] = dict(prefill_profile(fn), experts_hit=routing[bt]["experts_hit"],
                                                 ms=forward[-1]["ms"])
                p = table[f"{bt[0]}x{bt[1]}"]
                print(f"  prefill table {arm} {bt[0]}x{bt[1]}: host before the first kernel "
                      f"{p['host_before_first_kernel_us']} us, kernels busy {p['kernel_busy_us']} us of a "
                      f"{p['kernel_span_us']} us span", flush=True)
            save()

    def logits_of(fn, bt) -> torch.Tensor:
        with torch.no_grad():
            return fn(input_ids=ttft_ids[bt], logits_to_keep=1).logits[:, -1].float()

    if fwd_shapes and "hf_compiled" in fwd_arms:
        print("forward, hf_compiled", flush=True)
        compiled_fwd = torch.compile(model.forward, dynamic=True)

        def peer_rows() -> None:
            forward_rows("hf_compiled", lambda ids: lambda: compiled_fwd(input_ids=ids, logits_to_keep=1).logits)
            fwd_logits.update({bt: logits_of(compiled_fwd, bt) for bt in fwd_shapes})

        guarded("forward_hf_compiled", peer_rows)
        del compiled_fwd
        torch._dynamo.reset()
    if "hf_static" in arms:
        print("hf_static", flush=True)

        def hf_static() -> None:
            for b in batches:
                fn = lambda x, n: stock_generate(x, cache_implementation="static", **greedy_kwargs(n))  # noqa: E731
                row, new = decode_row("hf_static", fn, inputs[b], args.n1, args.n2, args.runs, floors[b],
                                      args.layers, "bf16", refs.get(b), routing[b])
                if b in score_batches:
                    score_row(row, scorer, inputs[b], new, extra)
                decode.append(row)
                save()

        guarded("hf_static", hf_static)
        torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    config = {"max_batch_size": args.max_batch_size} if args.max_batch_size else {}  # default: the README path
    if args.layer_regions != "auto":  # the default: left out, so the default run has no config at all
        config["layer_regions"] = args.layer_regions
    if args.mode:
        config["mode"] = args.mode

    def step_variant_rows(name: str, opt, dtype: str, b: int) -> None:
        """Batch b's decode rate (and kernel profile) under each step variant (STEP_VARIANTS), on this arm's model and
        compiled steps: only the captured graphs change. Each row says whether its greedy tokens equal the default's
        (a PDL chain changes when kernels start, not what they compute; the attention's loads give the same bits)."""
        fn = lambda x, n: opt.generate(x, **greedy_kwargs(n))  # noqa: E731
        engine = opt.moefx_generate.engine
        base = fn(inputs[b], args.n2)
        for variant in step_variants:
            undo = STEP_VARIANTS[variant][1]()
            engine.slots.drop_graphs()
            print(f"  step variant: {variant}", flush=True)
            try:
                row, new = decode_row(f"{name}_{variant}", fn, inputs[b], args.n1, args.n2, args.runs,
                                      b / (step_bytes(opt, b, hits[b]) / hbm), args.layers, dtype, refs.get(b),
                                      routing[b])
                row["tokens_equal_default"] = bool(torch.equal(new, base[:, inputs[b].shape[1]:]))
                decode.append(row)
                if args.profile:
                    extra[f"profile_B{b}_{args.layers}_{name}_{variant}"] = profile_step(opt, inputs[b])
            finally:
                undo()
                engine.slots.drop_graphs()
            save()

    def moefx_arm(name: str, mdl, dtype: str, arm_batches: list[int], arm_config: dict | None = None) -> None:
        print(name, flush=True)
        optimize_s, opt = timed_call(lambda: moefx.optimize(mdl, config={**config, **(arm_config or {})}))
        extra[f"{name}_optimize_s"] = round(optimize_s, 1)
        extra[f"{name}_plan"] = opt.moefx_plan.explain()
        fn = lambda x, n: opt.generate(x, **greedy_kwargs(n))  # noqa: E731
        for b in arm_batches:
            row, new = decode_row(name, fn, inputs[b], args.n1, args.n2, args.runs,
                                  b / (step_bytes(opt, b, hits[b]) / hbm), args.layers, dtype, refs.get(b), routing[b])
            if b in score_batches:
                score_row(row, scorer, inputs[b], new, extra)
            decode.append(row)
            save()  # a stage stopped at its limit keeps the rows measured so far
        front = opt.moefx_generate
        if ref_logits is not None and name == "moefx":
            extra["moefx_logits_rel_err"] = check_logits(front.engine, inputs[eager_batches[0]], *ref_logits)
        extra[f"{name}_engine"] = dict(compiles=front.engine.stats.compiles,
                                       compile_s=front.engine.stats.compile_s, captures=front.engine.stats.captures,
                                       uncaptured=front.engine.stats.uncaptured, fallbacks=front.fallbacks)
        extra[f"{name}_matches"] = _pass_matches()
        print(f"  {front.describe()}; passes {extra[f'{name}_matches']}", flush=True)
        if args.profile and arm_batches:
            # per depth (`profile_B1_48`: what the step table reads, and what keeps runs of two depths apart when
            # their results are merged); `profile_B1` as well for the bf16 arm, the key older runs wrote
            prof = profile_step(opt, inputs[min(arm_batches)])
            key = {"moefx": "profile_B1", "moefx_fp8": "profile_fp8_B1"}.get(name, f"profile_{name}_B1")
            extra[f"{key}_{args.layers}"] = prof
            if name == "moefx":
                extra[key] = prof
        if step_variants and arm_batches:
            step_variant_rows(name, opt, dtype, min(arm_batches))
        if ptoks is not None and name == "moefx":
            prefill_row("moefx", lambda: opt.generate(ptoks, **greedy_kwargs(1)))
        if shapes and name == "moefx" and "moefx" in ttft_arms:
            print("ttft, moefx", flush=True)
            ttft_rows("moefx", lambda ids: lambda: opt.generate(ids, **greedy_kwargs(1)))
        if fwd_shapes and name == "moefx":
            moefx_forward_rows(opt)

    def moefx_forward_rows(opt) -> None:
        if "moefx_forward" in fwd_arms:
            print("forward, moefx_forward", flush=True)
            forward_rows("moefx_forward", lambda ids: lambda: opt(input_ids=ids, logits_to_keep=1).logits)
            errs = {f"{b}x{t}": float((logits_of(opt, (b, t)) - ref).norm() / ref.norm())
                    for (b, t), ref in fwd_logits.items()}
            extra["forward_logits_rel_err"] = errs
            print(f"  forward logits vs hf_compiled: {errs}", flush=True)
            if errs and max(errs.values()) > LOGITS_BOUND:
                print(f"  CHECK FAILED: moefx forward logits differ from the peer's by more than {LOGITS_BOUND}",
                      flush=True)
            front = getattr(opt, "moefx_forward", None)
            extra["moefx_forward"] = (dict(describe=front.describe(), calls=front.calls, fallbacks=front.fallbacks,
                                           captures=front.captures) if front is not None
                                      else "no forward front (the plan's line says why)")
            print(f"  {extra['moefx_forward']}", flush=True)
        if "moefx_ttft" in fwd_arms:
            print("forward, moefx_ttft", flush=True)
            forward_rows("moefx_ttft", lambda ids: lambda: opt.generate(ids, **greedy_kwargs(1)))
        for arm, in_layers in KV_WRITE_ARMS.items():
            if arm not in fwd_arms:
                continue
            print(f"forward, {arm}", flush=True)
            engine = opt.moefx_generate.engine
            prefill = engine._bucketed
            if prefill is None:
                print(f"  no padded prefill on this engine: {arm} not run", flush=True)
                continue
            default = prefill.write_in_layers
            prefill.write_in_layers = in_layers
            engine.slots.drop_graphs()
            try:
                forward_rows(arm, lambda ids: lambda: opt.generate(ids, **greedy_kwargs(1)))
            finally:
                prefill.write_in_layers = default
                engine.slots.drop_graphs()

    def train_row(arm: str) -> None:
        """One arm's training step on a model of its own (the same seed: the same weights in every arm)."""
        b, t = (int(x) for x in args.train_shape.split("x"))
        mdl = build_model(cfg, seed=0, dtype=dtype, device=args.device, routing=args.routing)
        experts = {id(p): p for m in experts_modules(mdl).values() for p in m.parameters()}
        for p in mdl.parameters():
            p.requires_grad_(id(p) in experts)
        if arm == "hf_compiled":
            fwd = torch.compile(mdl.forward, dynamic=True)
        else:
            fwd = moefx.optimize(mdl, config=config)
        mdl.train()
        optim = torch.optim.AdamW(list(experts.values()), lr=1e-5)
        ids = torch.randint(1, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(7)).to(args.device)

        grad_norms: list[float] = []

        def step(keep_norms: bool = False) -> torch.Tensor:
            loss = fwd(input_ids=ids, labels=ids).loss
            loss.backward()
            if keep_norms:  # the first step's gradient of each expert weight, compared across arms
                grad_norms.extend(float(p.grad.float().norm()) if p.grad is not None else 0.0
                                  for p in experts.values())
            optim.step()
            optim.zero_grad(set_to_none=True)
            return loss.detach()

        first_loss = None

        def warm() -> None:
            nonlocal first_loss
            first_loss = float(step(keep_norms=True))

        first = wall_s(warm)
        ms = 1e3 * median_wall_s(step, args.runs)
        row = dict(layers=args.layers, B=b, tokens=t, arm=arm, ms=round(ms, 2), first_call_s=round(first, 1),
                   loss=round(first_loss, 5), grad_norms=[round(n, 6) for n in grad_norms],
                   trainable=f"experts ({sum(p.numel() for p in experts.values())} weights), AdamW",
                   dtype="bf16" if dtype == torch.bfloat16 else str(dtype).split(".")[-1])
        if arm == "moefx":
            front = getattr(mdl, "moefx_forward", None)
            row["fast_path_calls"] = front.calls if front is not None else 0  # a training step takes none
        train.append(row)
        print(f"  train {arm:11s} {b}x{t}: {ms:.1f} ms per step, loss {first_loss:.5f}, first step {first:.1f} s",
              flush=True)

    save()
    if "moefx" in arms:
        guarded("moefx", lambda: moefx_arm("moefx", model, "bf16", batches))
    if args.fp8:
        # Nothing may keep the bf16 model alive while the FP8 one is built (two 48-layer models do not fit 80 GB):
        # the scorer's weights and transformers' bound generate() go with it.
        if scorer is not None:
            scorer.fetch = None
        del model, stock_generate
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

        def fp8_arm(name: str, arm_config: dict | None) -> None:
            fp8 = build_model(cfg, seed=0, dtype=dtype, device=args.device, routing=args.routing).eval()
            fp8.generation_config.eos_token_id = None
            cuda = fp8.device.type == "cuda"
            if cuda:  # the bf16 model as built, then the peak while it is quantized in place
                torch.cuda.reset_peak_memory_stats()
                extra["moefx_fp8_bf16_model_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
            seconds, _ = timed_call(lambda: moefx.quantize(fp8, "fp8_block128"))
            extra["moefx_fp8_quantize_s"] = round(seconds, 1)
            if cuda:
                extra["moefx_fp8_quantize_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                extra["moefx_fp8_model_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
                print(f"  quantized in place in {extra['moefx_fp8_quantize_s']} s: bf16 model "
                      f"{extra['moefx_fp8_bf16_model_gib']} GiB, peak {extra['moefx_fp8_quantize_peak_gib']} GiB, "
                      f"FP8 model {extra['moefx_fp8_model_gib']} GiB", flush=True)
            if scorer is not None:
                scorer.fetch = fp8_block_weights(fp8, fp8.moefx_quantization.block_shape)
            moefx_arm(name, fp8, "fp8_block128", fp8_batches, arm_config)

        forms = [f for f in args.fp8_forms.split(",") if f]
        for form in forms:
            if form not in FP8_FORMS:
                raise SystemExit(f"--fp8-forms: {form!r} is not one of {list(FP8_FORMS)}")
        for name, arm_config in ([(f"moefx_fp8_{f}", {"pass_config": {"fp8_weight_only": FP8_FORMS[f]}})
                                  for f in forms] or [("moefx_fp8", None)]):
            guarded(name, lambda: fp8_arm(name, arm_config))  # noqa: B023 (called at once)
            if scorer is not None:
                scorer.fetch = None
            gc.collect()  # the last arm's model and engine go before the next is built
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    if args.train:
        for arm in args.train_arms.split(","):
            print(f"train, {arm}", flush=True)
            guarded(f"train_{arm}", lambda arm=arm: train_row(arm))
            torch._dynamo.reset()  # the arm's model and optimizer go with its compiled frames
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        losses = [r["loss"] for r in train]
        if len(losses) > 1:
            extra["train_loss_rel_diff"] = round((max(losses) - min(losses)) / abs(losses[0]), 5)
            print(f"  training losses {losses}: relative spread {extra['train_loss_rel_diff']}", flush=True)
            norms = [r["grad_norms"] for r in train]
            extra["train_grad_norm_max_rel_diff"] = round(max(
                abs(a - b) / max(abs(b), 1e-12) for a, b in zip(norms[-1], norms[0])), 5)
            print(f"  first-step gradient norms of the expert weights, largest relative difference between arms: "
                  f"{extra['train_grad_norm_max_rel_diff']}", flush=True)

    path = save()
    print(f"\nwrote {path}\n")
    if decode or prefill:
        print("| layers | B | dtype | arm | tok/s | % floor | floor | first call s | peak GiB | agree |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for r in decode:
        print(f"| {r['layers']} | {r['B']} | {r['dtype']} | {r['arm']} | {r['tok_s']} | {r['pct_floor']} | "
              f"{r['floor_tok_s']} | {r['first_call_s']} | {r['peak_mem_gib']} | {r['agree_with_eager']} |")
    for r in prefill:
        print(f"| {r['layers']} | prefill {r['tokens']} | bf16 | {r['arm']} | {r['ms']} ms | {r['x_floor']}x floor | "
              f"{r['floor_ms']} ms | {r['first_call_s']} | | |")
    if ttft:
        print("\n| layers | B x tokens | arm | TTFT ms | FLOP floor ms | bytes floor ms | x floor | profiled wall ms | "
              "kernel ms | kernel % | kernels | experts hit |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in ttft:
        print(f"| {r['layers']} | {r['B']}x{r['tokens']} | {r['arm']} | {r['ms']} | {r['flop_floor_ms']} | "
              f"{r['bytes_floor_ms']} | {r['x_floor']} | {r['prof_wall_ms']} | {r['kernel_ms']} | {r['kernel_pct']} | "
              f"{r['kernels']} | {r['experts_hit']} |")
    if forward:
        print("\n| layers | B x tokens | forward arm | ms | x floor | kernel ms | kernels |")
        print("|---|---|---|---|---|---|---|")
    for r in forward:
        print(f"| {r['layers']} | {r['B']}x{r['tokens']} | {r['arm']} | {r['ms']} | {r['x_floor']} | "
              f"{r['kernel_ms']} | {r['kernels']} |")
    if train:
        print("\n| layers | B x tokens | training arm | ms per step | loss |")
        print("|---|---|---|---|---|")
    for r in train:
        print(f"| {r['layers']} | {r['B']}x{r['tokens']} | {r['arm']} | {r['ms']} | {r['loss']} |")
    return 0


def _label(key: int | tuple[int, int]) -> str:
    return f"decode B={key}" if isinstance(key, int) else f"prompt {key[0]}x{key[1]}"


def _peak_gib(t: torch.Tensor) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if t.is_cuda else 0.0


def _ceilings(device: str) -> dict[str, float]:
    if device == "cpu":  # --tiny smoke runs: nominal numbers, the floors mean nothing there
        return {"copy_Bps": 1e10, "bf16_flops": 1e11}
    return ceilings()


def _pass_matches() -> dict[str, int]:
    total: dict[str, int] = {}
    for report in moefx.compile_reports():
        for name, count in report.matches.items():
            total[name] = total.get(name, 0) + count
    return total


def _version(name: str) -> str:
    try:
        return __import__(name).__version__
    except ImportError:
        return "absent"


if __name__ == "__main__":
    raise SystemExit(main())
