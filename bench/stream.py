"""A stream of mixed requests through `moefx.optimize(model)` (no max_batch_size: the default capture sizes) +
`generate()`.

Qwen3-MoE at Qwen3-30B-A3B widths, `--layers` deep (default 8), seeded random weights, bf16. `--requests` requests
(default 500) in a seeded random order, each drawn log-uniformly: batch 1..64, prompt 16..4096 tokens, 1..512 new
tokens; half greedy, half sampling (three temperature / top-k / top-p settings); some with EOS ids (taken from the
previous request's output, so they hit), some left-padded, some with stopping criteria (a length limit, a token
set). The warm-up is the first 50 requests; its last one is the stream's largest (batch 64, prompt 4096, 512 new
tokens), as a server's profile run is, so memory that grows afterwards is memory the engine did not bound. The
engine runs under `--memory-budget` (default 10GiB: small enough that its slots fill it during the warm-up and are
evicted and re-allocated all along the stream).

Reports p50/p99 latency and tokens/s per class (batch band x greedy/sampled), captures, compiles, slots (alive,
allocated, evicted), the buckets used (distinct batch bucket x cache length x sampling params x mask graph keys),
peak allocated memory after the warm-up vs at the end (and allocated / reserved / peak every 50 requests), and where
the time went (requests that compiled or captured something, the others, the graphs-off reruns). Every
`--check-every`-th request runs again on the same engine with its CUDA graphs off (the uncaptured engine: same
compiled steps, buckets and slots, steps called directly, their kernels chosen as in the graphs:
moefx/backends/capture_mode.py) from the same seed, and the tokens must be equal. PASS/FAIL lines: no error, tokens
equal, peak memory growth <= 2% after the warm-up, captures <= 2 x buckets used, and every request ran
(`--max-seconds`, default 480, stops issuing requests so the report is still written inside the stage's limit). Writes
$OUT/stream_<layers>l.json.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moefx
from bench.harness import timed_call, write_json
from moefx.models import build_model, qwen3_moe_config, tiny_qwen3_moe_config

WARMUP = 50
SAMPLING = ({"temperature": 0.8, "top_k": 50}, {"temperature": 1.0, "top_p": 0.9},
            {"temperature": 0.7, "top_k": 20, "top_p": 0.8})
GROWTH_BOUND = 0.02
BANDS = ((1, 1), (2, 8), (9, 32), (33, 64))


class StopAtLength:
    """Stops every row once the sequence is `length` long (decided on the host: no sync)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, device=input_ids.device)


class StopOnTokens:
    """Stops a row whose last token is in `ids` (on the device: no sync)."""

    def __init__(self, ids: list[int], device: str) -> None:
        self.ids = torch.tensor(ids, device=device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.isin(input_ids[:, -1], self.ids)


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return min(high, max(low, round(math.exp(rng.uniform(math.log(low), math.log(high))))))


def make_stream(n: int, seed: int, vocab: int, max_batch: int, max_prompt: int, max_new: int) -> list[dict]:
    rng = random.Random(seed)
    stream = []
    for i in range(n):
        batch, prompt = _log_uniform(rng, 1, max_batch), _log_uniform(rng, 16, max_prompt)
        new = _log_uniform(rng, 1, max_new)
        if i == WARMUP - 1:
            batch, prompt, new = max_batch, max_prompt, max_new
        r = {"i": i, "batch": batch, "prompt": prompt, "new": new, "seed": 1000 + i,
             "greedy": rng.random() < 0.5, "masked": batch > 1 and rng.random() < 0.3,
             "eos": rng.random() < 0.3, "criteria": rng.choice([None, None, None, "length", "tokens"]),
             "pad_rows": [rng.randint(0, prompt - 1) for _ in range(batch)]}
        r["sampling"] = None if r["greedy"] else rng.choice(SAMPLING)
        r["stop_tokens"] = rng.sample(range(1, vocab), 64)
        r["stop_at"] = prompt + max(1, new // 2)
        stream.append(r)
    return stream


def build_kwargs(r: dict, device: str, vocab: int, last_tokens: list[int]) -> tuple[torch.Tensor, dict]:
    gen = torch.Generator().manual_seed(r["seed"])
    ids = torch.randint(1, vocab, (r["batch"], r["prompt"]), generator=gen)
    kwargs: dict = {"max_new_tokens": r["new"], "pad_token_id": 0}
    if r["masked"]:
        mask = torch.ones_like(ids)
        for row, pad in enumerate(r["pad_rows"][1:], start=1):
            mask[row, :pad] = 0
        ids = ids.masked_fill(mask == 0, 0)
        kwargs["attention_mask"] = mask.to(device)
    if r["eos"] and last_tokens:
        kwargs["eos_token_id"] = last_tokens[:2]
    if r["criteria"] == "length":
        kwargs["stopping_criteria"] = [StopAtLength(r["stop_at"])]
    elif r["criteria"] == "tokens":
        kwargs["stopping_criteria"] = [StopOnTokens(r["stop_tokens"], device)]
    kwargs.update({"do_sample": False} if r["greedy"] else {"do_sample": True, **r["sampling"]})
    return ids.to(device), kwargs


def _peak(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device == "cuda" else 0


def _memory(device: str, i: int) -> dict:
    """GiB allocated and reserved now, and the peak allocated so far (CUDA; zeros elsewhere): where memory grew."""
    cuda = device == "cuda"
    now = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), torch.cuda.max_memory_allocated()) if cuda \
        else (0, 0, 0)
    return {"request": i, **{k: round(v / 2**30, 3) for k, v in zip(("allocated", "reserved", "peak"), now)}}


def _first_uses(stats) -> tuple[int, int, int]:
    """Compiles, decode captures and prefill captures so far: a request that moved them paid a first use."""
    return sum(stats.compiles.values()), stats.captures, stats.prefill_captures


def _band(batch: int) -> str:
    low, high = next(b for b in BANDS if b[0] <= batch <= b[1])
    return f"B{low}" if low == high else f"B{low}-{high}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--seed", type=int, default=30)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=4096)
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--memory-budget", default="10GiB", help="config key memory_budget (fraction or bytes)")
    ap.add_argument("--check-every", type=int, default=4, help="replay every k-th request without graphs (0: none)")
    ap.add_argument("--max-seconds", type=float, default=480, help="issue no request after this many seconds")
    ap.add_argument("--mode", default="capture")
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny model (smoke run, e.g. on the CPU)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    from moefx.config import parse_memory_budget

    budget = parse_memory_budget(args.memory_budget)
    kept = Path(os.environ.get("MOEFX_COMPILE_CACHE", "/nonexistent"))
    cached_files = sum(1 for f in kept.rglob("*") if f.is_file()) if kept.is_dir() else 0
    print(f"moefx compile cache: {cached_files} files at start", flush=True)
    cfg = tiny_qwen3_moe_config(num_hidden_layers=args.layers) if args.tiny else qwen3_moe_config(args.layers)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(cfg, seed=0, dtype=dtype, device=args.device, routing="balanced").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model = moefx.optimize(model, config={"mode": args.mode, "memory_budget": budget})
    front = model.moefx_generate
    engine = front.engine
    plan_sizes = model.moefx_plan.serving.get("capture_sizes")
    print(f"capture sizes {plan_sizes} [{model.moefx_plan.serving_sources.get('capture_sizes')}]", flush=True)
    stream = make_stream(args.requests, args.seed, cfg.vocab_size, args.max_batch, args.max_prompt, args.max_new)
    rows: list[dict] = []
    errors: list[str] = []
    mismatches: list[dict] = []
    checked = {"greedy": 0, "sampled": 0}
    buckets: set[tuple] = set()
    peak_warm = 0
    last_tokens: list[int] = []
    graphs_on = engine.cuda_graphs
    check_s = 0.0
    memory: list[dict] = []  # every 50th request and the last
    start_all = time.perf_counter()
    for r in stream:
        if time.perf_counter() - start_all > args.max_seconds:
            print(f"stopped after {r['i']} requests: --max-seconds {args.max_seconds:g} reached", flush=True)
            break
        ids, kwargs = build_kwargs(r, args.device, cfg.vocab_size, last_tokens)
        try:
            torch.manual_seed(r["seed"])
            before = _first_uses(engine.stats)
            seconds, out = timed_call(lambda ids=ids, kwargs=kwargs: model.generate(ids, **kwargs))
        except Exception as exc:  # a stream reports every request it can
            errors.append(f"request {r['i']} (B={r['batch']} T={r['prompt']} n={r['new']}): {exc!r}")
            traceback.print_exc()
            continue
        slot_rows, slot_len = engine.slots.keys()[-1]
        sampling = tuple(sorted((r["sampling"] or {}).items()))
        buckets.add((slot_rows, slot_len, sampling, "attention_mask" in kwargs))
        new_tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
        kind = "greedy" if r["greedy"] else "sampled"
        rows.append({"i": r["i"], "class": f"{_band(r['batch'])} {kind}", "seconds": seconds, "tokens": new_tokens,
                     "first_use": _first_uses(engine.stats) != before})
        last_tokens = [t for t in out[0, ids.shape[1]:].tolist() if t != 0]  # 0 is the pad id
        if args.check_every and r["i"] % args.check_every == 0:
            engine.cuda_graphs = False
            try:
                torch.manual_seed(r["seed"])
                rerun_s, ref = timed_call(lambda ids=ids, kwargs=kwargs: model.generate(ids, **kwargs))
            finally:
                engine.cuda_graphs = graphs_on
            check_s += rerun_s
            checked[kind] += 1
            if not torch.equal(out, ref):
                same = out.shape == ref.shape
                mismatches.append({"i": r["i"], "kind": kind, "batch": r["batch"], "prompt": r["prompt"],
                                   "shape": list(out.shape), "ref_shape": list(ref.shape),
                                   "equal_share": round(float((out == ref).float().mean()), 3) if same else None})
        if r["i"] == WARMUP - 1:
            peak_warm = _peak(args.device)
            print(f"warm-up done: peak {peak_warm / 2**30:.2f} GiB; {front.describe()}", flush=True)
        if r["i"] % 50 == 0 or r["i"] == len(stream) - 1:
            memory.append(_memory(args.device, r["i"]))
            print(f"request {r['i']}: {memory[-1]}; {front.describe()}", flush=True)
    total_s = time.perf_counter() - start_all
    peak_end = _peak(args.device)
    stats = engine.stats
    classes = {}
    for name in sorted({row["class"] for row in rows}):
        lat = sorted(row["seconds"] for row in rows if row["class"] == name)
        toks = sum(row["tokens"] for row in rows if row["class"] == name)
        p99 = lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)]
        classes[name] = {"requests": len(lat), "p50_s": round(statistics.median(lat), 4), "p99_s": round(p99, 4),
                         "tok_s": round(toks / sum(lat), 1)}
    growth = (peak_end - peak_warm) / peak_warm if peak_warm else 0.0
    first = [row["seconds"] for row in rows if row["first_use"]]
    steady = [row["seconds"] for row in rows if not row["first_use"]]
    where = {"first_use_requests": len(first), "first_use_s": round(sum(first), 1), "steady_requests": len(steady),
             "steady_s": round(sum(steady), 1), "graphs_off_reruns_s": round(check_s, 1)}
    checks = {
        "no error": not errors,
        "tokens equal to the uncaptured engine's": not mismatches and sum(checked.values()) > 0,
        f"peak memory growth <= {GROWTH_BOUND:.0%} after the first {WARMUP}": growth <= GROWTH_BOUND,
        "captures <= 2 x buckets used": stats.captures <= 2 * len(buckets),
        f"all {len(stream)} requests ran": len(rows) + len(errors) == len(stream),
    }
    result = dict(
        stage="stream", date=datetime.date.today().isoformat(),
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke run)",
        versions=dict(torch=torch.__version__), command=" ".join(["python3", *sys.argv]),
        commit=os.environ.get("MOEFX_COMMIT", "unknown"), layers=args.layers, requests=len(stream), ran=len(rows),
        check_every=args.check_every,
        compile_cache_files_at_start=cached_files, capture_sizes=plan_sizes, memory_budget=stats.memory_budget,
        seconds=round(total_s, 1),
        tok_s=round(sum(row["tokens"] for row in rows) / sum(row["seconds"] for row in rows), 1) if rows else 0,
        classes=classes, captures=stats.captures, buckets_used=len(buckets), compiles=stats.compiles,
        compile_s=stats.compile_s, slots=stats.slots, slot_allocations=stats.slot_allocations,
        evictions=stats.evictions, cache_gib=round(stats.cache_bytes / 2**30, 2),
        graph_gib=round(stats.graph_bytes / 2**30, 2), above_cap=stats.above_cap, uncaptured=stats.uncaptured,
        peak_warmup_gib=round(peak_warm / 2**30, 3), peak_end_gib=round(peak_end / 2**30, 3), memory=memory,
        peak_growth=round(growth, 4), time_split=where, checked=checked, mismatches=mismatches[:20], errors=errors[:20],
        fallbacks=sorted(set(front.fallbacks)), checks=checks,
    )
    path = write_json(f"stream_{args.layers}l{args.tag}.json", result)
    print("| class | requests | p50 s | p99 s | tok/s |")
    print("|---|---|---|---|---|")
    for name, c in classes.items():
        print(f"| {name} | {c['requests']} | {c['p50_s']} | {c['p99_s']} | {c['tok_s']} |")
    print(f"{len(stream)} requests in {total_s:.0f} s, {result['tok_s']} tok/s; captures {stats.captures}, "
          f"buckets used {len(buckets)}, compiles {stats.compiles}; {stats.describe_slots()}")
    print(f"peak allocated: {peak_warm / 2**30:.2f} GiB after the warm-up, {peak_end / 2**30:.2f} GiB at the end "
          f"({growth:+.2%}); checked {checked} without graphs, {len(mismatches)} differ")
    print(f"requests that compiled or captured: {where['first_use_requests']} in {where['first_use_s']} s; the others: "
          f"{where['steady_requests']} in {where['steady_s']} s; graphs-off reruns {where['graphs_off_reruns_s']} s")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    print(f"wrote {path}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
