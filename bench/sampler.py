"""Sampling without host syncs, and last_token_logits at prefill: moefx vs transformers' generate.

Model: 8-layer Qwen3-MoE at Qwen3-30B-A3B widths, seeded random weights with balanced routing
(`build_model(..., routing="balanced")`), bf16 (tiny model with --quick).
Decode arms (B=1 and B=16, top-k=50, top-p=0.9, temperature 0.8, and greedy):
  hf          transformers' generate(), static cache, its own torch.compile (reduce-overhead)
  hf+stop     the same, with moefx's deferred stop check (what moefx.optimize turns on for CUDA)
  moefx       moefx.engine.engine.DecodeLoop: forward and sampler compiled with moefx.backend, each step one CUDA graph,
              rewrite_sampler_syncs + last_token_logits on, sync-free sampler, no per-step host read
All arms run the same transformers model forward; what differs is the loop and the sampler.
Decode throughput = (n - 1) / (t(n tokens) - t(1 token)), medians of runs; host syncs per decode step are
counted with torch.cuda.set_sync_debug_mode("warn"). Floor: bytes a step reads (the experts: the distinct ones the
batch hit per layer, counted on two greedy decode steps of the plain model, `experts_hit`) / measured HBM bandwidth.
Prefill: one 4096-token sequence, `model(ids).logits[:, -1]` compiled with last_token_logits on vs off:
peak memory and time; floor for the LM head it removes: its FLOPs / measured bf16 matmul rate.
--quick (CPU smoke run, no timing claims) runs the graphs through the passes without code generation.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moefx
from bench.harness import copy_ceiling_Bps, median_wall_s, sync, timed_calls, write_json
from bench.sections.markdown import table as markdown
from bench.sections.sampler import DecodeRow
from moefx.cli.common import progress
from moefx.engine.engine import DecodeLoop
from moefx.engine.hf_generate import enable_deferred_stop
from moefx.models import build_model, qwen3_moe_config, tiny_qwen3_moe_config
from moefx.models.routing_stats import decode_distinct_experts
from moefx.sampling.sampler import SamplingParams
from moefx.testing import without_codegen

SAMPLE = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
GREEDY = SamplingParams(temperature=0.0)
# Compiled vs eager logits (bf16 on the GPU: fusion changes rounding through 8 layers; a wrong row or
# a broken rewrite is O(1)), and last_token_logits on vs off (the same graph but for the LM-head rows).
REL_BOUND = 0.1
ON_OFF_BOUND = 1e-2
DECODE_CFG = {
    "mode": "capture",
    "pass_config": {"rewrite_sampler_syncs": True, "sampler_exponential_race": True, "last_token_logits": True},
}


class SyncCounter:
    """Counts host syncs (CUDA sync-debug warnings) inside the block; None where there is no CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.on = device.type == "cuda"
        self.count: int | None = None

    def __enter__(self) -> SyncCounter:
        if self.on:
            self._rec = warnings.catch_warnings(record=True)
            self._log = self._rec.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode("default")
            self._rec.__exit__(*exc)
            self.count = sum("synchroniz" in str(w.message) for w in self._log)


class StopAfter(StoppingCriteria):
    """A stopping criterion (no host read) that ends generation at `length` tokens."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores: object, **kwargs: object) -> torch.Tensor:
        done = input_ids.shape[1] >= self.length
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def hf_generate(model, ids, params: SamplingParams, n: int, stop_after: int | None, deferred: bool):
    # Both runs stop through a criterion with the same cache size (n + 1), so a deferred stop check pays
    # its one extra step in both and the difference t(n) - t(1) stays n - 1 decode steps.
    kwargs = dict(max_new_tokens=n + 1, cache_implementation="static", pad_token_id=0)
    if params.greedy:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    kwargs["stopping_criteria"] = StoppingCriteriaList([StopAfter(ids.shape[1] + (stop_after or n))])
    generate = model.generate if deferred else type(model).generate.__get__(model)
    return generate(ids, **kwargs)


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    n = 8192 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    median_wall_s(lambda: a @ b, 2, device)
    t = median_wall_s(lambda: a @ b, 5, device)
    return 2 * n**3 / t


def decode_bytes(cfg, hit: float, dtype: torch.dtype) -> float:
    """Weight bytes one decode step reads: attention, `hit` distinct experts per layer, the routers, the LM head."""
    el = torch.finfo(dtype).bits // 8
    h, heads, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attn = h * hd * (2 * heads + 2 * kv)
    e = cfg.num_experts
    experts = hit * 3 * h * cfg.moe_intermediate_size
    return el * (cfg.num_hidden_layers * (attn + experts + h * e) + cfg.vocab_size * h)


def check_correctness(model, ids, loop_eager: DecodeLoop, loop: DecodeLoop, device) -> dict:
    """Eager moefx loop vs transformers greedy tokens; the compiled loop's logits close to the eager loop's.

    On the CPU the greedy tokens must be identical. In bf16 on the GPU, transformers' generate runs other attention
    kernels, and random weights give near-tied logits, so the agreement is reported rather than required; the
    compiled-vs-eager logits bound (prefill and the first decode step, same input tokens) is required everywhere.
    """
    ref = type(model).generate(
        model,
        ids,
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
        disable_compile=True,
    )
    eager_logits: list[torch.Tensor] = []
    got = loop_eager.generate(ids, 4, GREEDY, logits_out=eager_logits)
    agree = float((got == ref).float()[:, ids.shape[1] :].mean())
    if device.type == "cpu" and agree < 1:
        raise SystemExit(f"moefx eager loop differs from transformers greedy:\n{got}\n{ref}")
    compiled_logits: list[torch.Tensor] = []
    fast = loop.generate(ids, 4, GREEDY, logits_out=compiled_logits)
    steps = 2 if torch.equal(fast[:, : ids.shape[1] + 1], got[:, : ids.shape[1] + 1]) else 1
    rel = max(float((c.float() - e.float()).norm() / e.float().norm())
              for c, e in zip(compiled_logits[:steps], eager_logits[:steps]))
    if rel > REL_BOUND:
        raise SystemExit(f"compiled decode logits differ from eager: rel err {rel:.3g} > {REL_BOUND}")
    return {"greedy_token_agreement": agree, "step_logits_rel_err": rel, "steps_compared": steps}


def run_decode(model, cfg, device, dtype, batches, n, runs, prompt) -> tuple[list[dict], dict]:
    rows, checks = [], {}
    backend_kwargs = {"backend": moefx.backend(DECODE_CFG, cudagraphs=False)}
    max_len = prompt + n + 2
    loop = DecodeLoop(model, max_len, compile_kwargs=backend_kwargs, cuda_graphs=device.type == "cuda")
    eager_loop = DecodeLoop(model, max_len)
    enable_deferred_stop(model, devices=(device.type,))
    floor_bw = copy_ceiling_Bps(device)
    for batch in batches:
        ids = torch.randint(1, cfg.vocab_size, (batch, prompt), device=device, generator=None)
        with progress(f"routing B={batch}"):
            per_layer = decode_distinct_experts(model, ids, steps=2)
        hit = sum(per_layer.values()) / len(per_layer)
        with progress(f"correctness B={batch}"):
            checks[f"B{batch}"] = check_correctness(model, ids, eager_loop, loop, device)
        arms = {
            "hf": lambda p, m, s, ids=ids: hf_generate(model, ids, p, m, s, deferred=False),
            "hf+stop": lambda p, m, s, ids=ids: hf_generate(model, ids, p, m, s, deferred=True),
            "moefx": lambda p, m, s, ids=ids: loop.generate(ids, s or m, p),
        }
        floor_s = decode_bytes(cfg, hit, dtype) / floor_bw
        for name, fn in arms.items():
            for label, params in (("sample", SAMPLE), ("greedy", GREEDY)):
                with progress(f"{name} {label} B={batch} (compile + warm-up)"):
                    fn(params, n, None)
                    fn(params, n, 1)
                t_n, out = timed_calls(lambda fn=fn, params=params: fn(params, n, None), runs, device)
                t_1 = median_wall_s(lambda fn=fn, params=params: fn(params, n, 1), runs, device)
                with SyncCounter(device) as full:
                    fn(params, n, None)
                sync(device)
                with SyncCounter(device) as one:
                    fn(params, n, 1)
                sync(device)
                steps = out.shape[1] - prompt - 1
                syncs = None if full.count is None else (full.count - one.count) / max(steps, 1)
                tps = batch * steps / max(t_n - t_1, 1e-9)
                rows.append(
                    asdict(
                        DecodeRow(
                            arm=name,
                            mode=label,
                            batch=batch,
                            tokens_per_s=tps,
                            syncs_per_step=syncs,
                            step_ms=1e3 * (t_n - t_1) / max(steps, 1),
                            floor_step_ms=1e3 * floor_s,
                            experts_hit=round(hit, 1),
                            routing="balanced",
                        )
                    )
                )
    return rows, checks


def run_prefill(model, cfg, device, tokens, runs) -> list[dict]:
    ids = torch.randint(1, cfg.vocab_size, (1, tokens), device=device)
    with torch.no_grad():
        ref = model(input_ids=ids, logits_to_keep=1).logits[:, -1].float()
    rows, outs = [], {}
    for on in (False, True):
        conf = {"mode": "compile", "pass_config": {"last_token_logits": on}}
        torch._dynamo.reset()

        def last_logits(x):
            return model(input_ids=x, use_cache=False).logits[:, -1, :]

        fn = torch.compile(last_logits, backend=moefx.backend(conf))
        moefx.clear_compile_reports()
        label = f"prefill {tokens} tokens, last_token_logits={'on' if on else 'off'} (compile)"
        with progress(label), torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
            out = fn(ids).float()
        moved = sum(r.matches.get("last_token_logits", 0) for r in moefx.compile_reports())
        if on and moved < 1:
            raise SystemExit("last_token_logits did not rewrite the LM head of the prefill graph")
        rel = float((out - ref).norm() / ref.norm())
        if rel > REL_BOUND:
            raise SystemExit(f"prefill logits (last_token_logits={on}) differ from eager: rel err {rel:.3g}")
        outs[on] = out
        if on:
            # Same compiled graph but for the LM-head rows: only GEMM blocking may differ.
            vs_off = float((out - outs[False]).norm() / outs[False].norm())
            if vs_off > ON_OFF_BOUND:
                raise SystemExit(f"last_token_logits on vs off: rel err {vs_off:.3g} > {ON_OFF_BOUND}")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with torch.no_grad():
            t = median_wall_s(lambda fn=fn: fn(ids), runs, device)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else None
        rows.append(dict(last_token_logits=on, rewrites=moved, ms=1e3 * t, peak_extra_mib=peak, rel_err=rel))
    return rows


def save(result: dict) -> None:
    write_json("sampler.json", result)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run on the tiny model")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batches", default="1,16", help="comma-separated decode batch sizes")
    args = ap.parse_args(argv)

    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cfg = tiny_qwen3_moe_config() if args.quick else qwen3_moe_config(args.layers)
    batches = (2,) if args.quick else tuple(int(b) for b in args.batches.split(","))
    n = 6 if args.quick else args.new_tokens
    prefill = 64 if args.quick else args.prefill
    runs = 1 if args.quick else args.runs
    with progress(f"building {cfg.num_hidden_layers}-layer Qwen3-MoE ({dtype}, {device})"):
        model = build_model(cfg, seed=0, dtype=dtype, device=device, routing="balanced")
        model.generation_config.eos_token_id = None  # random weights: never stop early
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python bench/sampler.py" + (" --quick" if args.quick else ""),
        "model": f"Qwen3-MoE {cfg.num_hidden_layers} layers, E={cfg.num_experts}, H={cfg.hidden_size}",
    }
    torch.manual_seed(0)
    # --quick checks the arms, the passes and the tables, not the CPU's speed: graphs go through inductor's
    # post-grad passes (moefx's included) and run as PyTorch ops, without a C++ compile per graph.
    codegen = without_codegen if args.quick else contextlib.nullcontext
    with codegen():
        decode, checks = run_decode(model, cfg, device, dtype, batches, n, runs, prompt=32)
    result.update(checks=checks, decode=decode)
    save(result)  # the decode rows survive even if the prefill part is cut short
    with codegen():
        prefill_rows = run_prefill(model, cfg, device, prefill, runs)
    rate = matmul_rate(device, dtype)
    head_floor_ms = 1e3 * 2 * prefill * cfg.hidden_size * cfg.vocab_size / rate
    result.update(prefill=prefill_rows, prefill_lm_head_floor_ms=head_floor_ms)
    save(result)

    greedy = {(r["arm"], r["batch"]): r["tokens_per_s"] for r in decode if r["mode"] == "greedy"}
    hf = {(r["mode"], r["batch"]): r["tokens_per_s"] for r in decode if r["arm"] == "hf"}
    table = [
        [
            r["arm"],
            r["mode"],
            r["batch"],
            f"{r['tokens_per_s']:.0f}",
            "n/a" if r["syncs_per_step"] is None else f"{r['syncs_per_step']:.2f}",
            f"{r['tokens_per_s'] / greedy[(r['arm'], r['batch'])]:.3f}",
            f"{r['tokens_per_s'] / hf[(r['mode'], r['batch'])]:.2f}",
            f"{r['step_ms']:.3f}",
            f"{r['floor_step_ms']:.3f}",
        ]
        for r in decode
    ]
    prow = [
        [
            "on" if r["last_token_logits"] else "off",
            f"{r['ms']:.2f}",
            "n/a" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.0f}",
            f"{r['rel_err']:.1e}",
        ]
        for r in prefill_rows
    ]
    moefx_rows = [r for r in decode if r["arm"] == "moefx"]
    syncs = [r["syncs_per_step"] for r in moefx_rows if r["syncs_per_step"] is not None]
    ratios = {
        r["batch"]: r["tokens_per_s"] / greedy[("moefx", r["batch"])] for r in moefx_rows if r["mode"] == "sample"
    }
    print(f"\n{result['model']} on {result['device']}, torch {result['torch']}, {result['date']}, {n} new tokens")
    sync_verdict = f"{'PASS' if max(syncs) == 0 else 'FAIL'} (max {max(syncs):.2f}/step)" if syncs else "n/a (CPU)"
    print(f"target: zero host syncs in moefx's decode step: {sync_verdict}")
    verdicts = ", ".join(f"B={b} {x:.3f} {'PASS' if x >= 0.95 else 'FAIL'}" for b, x in ratios.items())
    print(f"target: moefx sampling within 5% of moefx greedy tok/s: {verdicts}")
    print(
        f"prefill {prefill} tokens: the LM-head FLOPs the pass removes take {head_floor_ms:.2f} ms at the measured rate"
    )
    print(
        "\n" + markdown(["arm", "mode", "B", "tok/s", "syncs/step", "vs greedy", "vs hf", "step ms", "floor ms"], table)
    )
    print("\n" + markdown(["last_token_logits", "ms", "peak extra MiB", "rel err"], prow))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
