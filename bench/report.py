"""docs/PERFORMANCE.md from bench/results/: one kept JSON per stage, one section per workload.

The page is generated so it cannot drift from the data: each section reads the newest
`bench/results/<stage>_<device>_<YYYY-MM-DD>.json` of its stage (one file per stage is kept; git keeps the
older ones) and prints the run (date, device, versions, commit), the command that reproduces it, the same-run
peer, the floor, and a table. Every kept file has the keys `stage`, `date`, `device`, `versions` (torch, triton,
transformers), `commit`, `command`, plus what its bench script wrote.

    python bench/report.py                  # rewrite docs/PERFORMANCE.md
    python bench/report.py --check          # exit 1 when the page is not what the results say
    python bench/report.py --ingest DIR [--commit SHA]
        # DIR = an unpacked `bash bench/run_h200.sh STAGES` tarball: each stage's JSON is stamped with the run's
        # versions, date and commit, kept as bench/results/<stage>_<device>_<date>.json (the stage's older file
        # is removed), and the page is rewritten

Plain Python (no torch): the docs test runs it in CI.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import date as _date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "PERFORMANCE.md"
NAME = re.compile(r"^(?P<stage>[a-z0-9-]+)_(?P<device>[a-z0-9-]+)_(?P<date>\d{4}-\d{2}-\d{2})\.json$")

# Qwen3-30B-A3B experts, the geometry of bench/moe.py and the probes.
E, H, I, TOP_K = 128, 2048, 768, 8
BF16_EXPERT_BYTES = 2 * (2 * I * H + H * I)


# ------------------------------------------------------------------------------------------- loading


def load_results(folder: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """stage -> its kept result (with `_file` set). More than one file for a stage is an error: keep one."""
    found: dict[str, list[Path]] = {}
    for path in sorted(folder.glob("*.json")):
        m = NAME.match(path.name)
        if not m:
            raise ValueError(f"{path}: result files are named <stage>_<device>_<YYYY-MM-DD>.json")
        found.setdefault(m["stage"], []).append(path)
    out = {}
    for stage, paths in found.items():
        if len(paths) > 1:
            raise ValueError(f"stage {stage!r} has {len(paths)} result files {[p.name for p in paths]}: keep the "
                             "newest only (git keeps the others)")
        data = json.loads(paths[0].read_text())
        missing = [k for k in ("stage", "date", "device", "versions", "commit", "command") if k not in data]
        if missing or data["stage"] != stage:
            raise ValueError(f"{paths[0]}: missing keys {missing} or stage {data.get('stage')!r} != {stage!r}")
        data["_file"] = paths[0].relative_to(ROOT).as_posix()
        out[stage] = data
    return out


# ------------------------------------------------------------------------------------------ formatting


def num(x: float | None, nd: int = 1) -> str:
    if x is None:
        return "–"
    if abs(x) >= 1000 and nd <= 1:
        return f"{x:.0f}"
    return f"{x:.{nd}f}"


def sig(x: float | None) -> str:
    """About three significant digits: 7787, 541.9, 62.07, 0.731."""
    if x is None:
        return "–"
    return f"{x:.0f}" if x >= 1000 else f"{x:.1f}" if x >= 100 else f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def ratio(a: float | None, b: float | None, nd: int = 2) -> str:
    return "–" if a is None or not b else f"{a / b:.{nd}f}"


def span(values: Iterable[float], nd: int = 2, unit: str = "") -> str:
    vals = sorted(values)
    if not vals:
        return "–"
    lo, hi = f"{vals[0]:.{nd}f}", f"{vals[-1]:.{nd}f}"
    return f"{lo}{unit}" if lo == hi else f"{lo}–{hi}{unit}"


def runs(selected: Sequence[Any], grid: Sequence[Any]) -> str:
    """Selected grid points as runs of neighbours: 'M = 1–1024', 'M = 1, 1024 and 4096'."""
    idx = sorted(grid.index(s) for s in selected)
    parts, start = [], None
    for j, i in enumerate(idx):
        if start is None:
            start = i
        if j + 1 == len(idx) or idx[j + 1] != i + 1:
            parts.append(f"{grid[start]}" if start == i else f"{grid[start]}–{grid[i]}")
            start = None
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def versions(v: dict[str, str]) -> str:
    return ", ".join(f"{k} {v[k]}" for k in ("torch", "triton", "transformers") if v.get(k))


def section(title: str, r: dict[str, Any], *, what: str, peer: str, floor: str, body: str,
            reproduce: str | None = None) -> str:
    """One workload: the run, how to reproduce it, its peer and floor, then the tables (`body`)."""
    commit = f"commit `{r['commit']}`" if r.get("commit") else (
        f"commit not recorded (results committed in `{r['results_commit']}`)" if r.get("results_commit")
        else "commit not recorded")
    lines = [f"### {title}", "", what, "",
             f"- **Run**: {r['date']}, {r['device']}, {versions(r['versions'])}, {commit}; data `{r['_file']}`"]
    if r.get("source"):
        lines.append(f"- **Source**: {r['source']}")
    lines += [f"- **Reproduce**: {reproduce or '`' + r['command'] + '`'}",
              f"- **Peer**: {peer}", f"- **Floor**: {floor}", "", body.strip(), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- end to end

E2E_ARMS = {
    "hf_eager": "transformers `generate()`, eager, dynamic cache",
    "hf_static": "transformers `generate()` with its static cache and auto-compile (the peer)",
    "moefx": "`moefx.optimize(model)` + `generate()`: moefx's engine (static cache, compiled prefill and decode "
             "step, one CUDA graph per step)",
    "moefx_fp8": "the same model after `moefx.quantize(model, 'fp8_block128')`, then as `moefx`",
}
TTFT_ARMS = {
    "hf_eager": "transformers `generate(ids, max_new_tokens=1)`, eager",
    "hf_compiled": "transformers forward over the prompt under `torch.compile(dynamic=True)`, logits_to_keep=1 + "
                   "argmax",
    "moefx": "`generate(ids, max_new_tokens=1)` after `moefx.optimize`",
}
PREFILL_ARMS = {
    "hf_eager": "transformers forward, eager (grouped_mm experts)",
    "hf_compiled": "transformers forward (grouped_mm experts) under `torch.compile`",
    "moefx": "`generate(max_new_tokens=1)` after `moefx.optimize`: the engine's compiled prefill",
}


def _arm_order(arm: str) -> int:
    keys = list(E2E_ARMS)
    return keys.index(arm) if arm in keys else len(keys)


def pct(row: dict[str, Any]) -> str:
    return "–" if row.get("pct_floor") is None else f"{row['pct_floor']:.0f}%"


def e2e_peers(decode: list[dict[str, Any]]) -> dict[tuple[int, int], float]:
    """(layers, B) -> the peer's tok/s: the faster `hf_static` reading where it ran more than once."""
    peers: dict[tuple[int, int], float] = {}
    for row in decode:
        if row["arm"] == "hf_static" and row.get("tok_s"):
            key = (row["layers"], row["B"])
            peers[key] = max(peers.get(key, 0.0), row["tok_s"])
    return peers


def e2e_best(decode: list[dict[str, Any]], peers: dict[tuple[int, int], float]) -> list[tuple[int, int, float, dict]]:
    """The fastest moefx arm per (layers, B, dtype) that has a peer."""
    out = []
    for (layers, b), peer in sorted(peers.items()):
        for dt in dict.fromkeys(x.get("dtype") for x in decode):
            ours = [x for x in decode if (x["layers"], x["B"], x.get("dtype")) == (layers, b, dt)
                    and x["arm"].startswith("moefx") and x.get("tok_s")]
            if ours:
                out.append((layers, b, peer, max(ours, key=lambda x: x["tok_s"])))
    return out


def render_e2e(r: dict[str, Any]) -> str:
    decode = sorted(r.get("decode") or [], key=lambda x: (x["layers"], x["B"], _arm_order(x["arm"])))
    peers = e2e_peers(decode)
    hit = any("experts_hit" in row for row in decode)  # rows of runs before routing was counted have none
    rows = []
    for row in decode:
        peer = peers.get((row["layers"], row["B"]))
        agree = row.get("agree_with_eager")
        rows.append((row["layers"], row["B"], row.get("dtype") or "–", f"`{row['arm']}`", sig(row.get("tok_s")),
                     num(row.get("floor_tok_s"), 0),
                     num(row.get("pct_floor"), 1) + ("%" if row.get("pct_floor") is not None else ""),
                     ratio(row.get("tok_s"), peer) if row["arm"] != "hf_static" and peer else "–",
                     num(row.get("first_call_s"), 1), num(row.get("peak_mem_gib"), 1),
                     "–" if agree is None else f"{agree:.2f}") + ((routing_cell(row),) if hit else ()))
    body = [table(["layers", "B", "dtype", "arm", "tok/s", "floor tok/s", "% of floor", "× peer", "first call s",
                   "peak GiB", "tokens = eager"] + (["experts hit / layer"] if hit else []), rows)]
    if hit:
        body.append(ROUTING_NOTE)
    errors = (r.get("extra") or {}).get("errors") or {}
    if errors:  # an arm that failed has no row: say so under the table
        body.append("Failed arms: " + "; ".join(f"`{arm}`: {why.splitlines()[0]}" for arm, why in errors.items()))
    body.append("Arms:\n" + "\n".join(f"- `{a}`: {E2E_ARMS.get(a, a)}" for a in
                                       dict.fromkeys(row["arm"] for row in decode)))
    best = [f"{layers} layers, B={b}, {top['dtype']}: fastest moefx arm `{top['arm']}` {top['tok_s']:.0f} tok/s = "
            f"{top['tok_s'] / peer:.2f}× the peer ({peer:.0f}), {pct(top)} of the floor"
            for layers, b, peer, top in e2e_best(decode, peers)]
    if best:
        body.append("\n".join(f"- {line}" for line in best))
    layer_md = render_step_parts(r, decode)
    if layer_md:
        body.append(layer_md)
    decode_md = section(
        "Decode", r, what=r.get("workload") or "transformers MoE decode, greedy (`bench/e2e.py`).",
        peer="`hf_static` in the same run (where it ran twice at one size, the faster reading); `× peer` = tok/s "
             "over the peer's tok/s",
        floor=("weight bytes one decode step reads (in each layer the experts its batch hit)" if hit else
               "weight bytes one decode step must read") + " / the measured HBM copy rate "
              + f"({num((r.get('ceilings') or {}).get('hbm_copy_TBps'), 2)} TB/s)", body="\n\n".join(body))
    prefill = r.get("prefill") or []
    ttft_md = render_ttft(r)
    if not prefill:
        return decode_md + ttft_md
    peer_arm = "hf_compiled" if any(p["arm"] == "hf_compiled" for p in prefill) else "hf_eager"
    ppeer = {(p["layers"], p["tokens"]): p["ms"] for p in prefill if p["arm"] == peer_arm}
    prow = [(p["layers"], p["tokens"], f"`{p['arm']}`", num(p["ms"], 1), num(p.get("floor_ms"), 1),
             num(p.get("x_floor"), 2), ratio(ppeer.get((p["layers"], p["tokens"])), p["ms"])
             if p["arm"] != peer_arm else "–") for p in prefill]
    pbody = table(["layers", "tokens", "arm", "ms", "floor ms", "× floor", "peer ms / ms"], prow)
    pbody += "\n\nArms:\n" + "\n".join(f"- `{a}`: {PREFILL_ARMS.get(a, a)}" for a in
                                       dict.fromkeys(p["arm"] for p in prefill))
    prefill_md = section(
        "Prefill", r, what="One forward over the prompt, B=1, same model family and run as the decode table.",
        peer=f"`{peer_arm}` in the same run", body=pbody,
        floor=f"the forward's FLOPs / the measured bf16 matmul rate "
              f"({num((r.get('ceilings') or {}).get('bf16_matmul_TFLOPs'), 0)} TFLOP/s)")
    return decode_md + "\n" + prefill_md + ttft_md


# Kernel name -> part of a decoder layer (the first match wins); inductor's generated kernels are the rest.
STEP_PARTS = (("dense projections (q/k/v, o, router; the norms and routing they fuse)", ("_dense_kernel",)),
              ("MoE experts (gate/up, down + residual add)", ("_gemv_gate_up_kernel", "_gemv_down_kernel")),
              ("attention (decode kernel, combine)", ("_decode_attn_kernel", "_combine_kernel")),
              ("routing top-k", ("_fused_topk_kernel",)),
              ("q/k norm + RoPE + KV-cache write", ("_qk_norm_rope_cache_kernel",)),
              ("inductor: norms, residual add (and what the fusions above left)", ("triton_",)))


def _part_floors_us(layers: int, hit: float, copy_tbps: float) -> dict[str, float]:
    """Bytes floor per layer of the parts that read weights or the cache (Qwen3-30B-A3B widths, bf16, the
    engine's first cache length of 256 positions)."""
    from moefx.models import qwen3_moe_config

    c = qwen3_moe_config(layers)
    h, d, q, kv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    dense = h * (q + 2 * kv) * d + q * d * h + h * c.num_experts
    moe = hit * 3 * c.moe_intermediate_size * h
    attention = 2 * kv * d * 256
    return {name: 2 * n / (copy_tbps * 1e6) for name, n in zip([p for p, _ in STEP_PARTS], (dense, moe, attention))}


def render_step_parts(r: dict[str, Any], decode: list[dict[str, Any]]) -> str:
    """Where the captured 48-layer B=1 step's time goes, per layer (the run's kernel profile)."""
    profile = (r.get("extra") or {}).get("profile_B1_48")
    row = next((d for d in decode if d["layers"] == 48 and d["B"] == 1 and d["arm"] == "moefx"), None)
    if not profile or row is None:
        return ""
    layers, parts = 48, {name: [0.0, 0.0] for name, _ in STEP_PARTS}
    other = [0.0, 0.0]
    for k in profile:
        per_layer = k["calls_per_step"] >= layers and k["calls_per_step"] % layers == 0
        name = next((p for p, prefixes in STEP_PARTS if k["kernel"].startswith(prefixes)), None)
        bucket = parts[name] if per_layer and name else other
        bucket[0] += k["us_per_step"] / (layers if bucket is not other else 1)
        bucket[1] += k["calls_per_step"] / (layers if bucket is not other else 1)
    floors = _part_floors_us(layers, float(row.get("experts_hit") or 8.0),
                             (r.get("ceilings") or {}).get("hbm_copy_TBps") or 4.26)
    step_us = 1e6 / row["tok_s"]
    kernel_us = sum(k["us_per_step"] for k in profile)
    rows = [(name, num(us, 2), num(n, 1), num(floors.get(name), 1) if name in floors else "–")
            for name, (us, n) in parts.items()]
    rows.append(("per layer, all parts", num(sum(us for us, _ in parts.values()), 1),
                 num(sum(n for _, n in parts.values()), 1), num(sum(floors.values()), 1)))
    rows.append(("once per step (LM head, embedding, sampler)", f"{num(other[0], 0)} per step",
                 f"{num(other[1], 0)} per step", "–"))
    rows.append(("gaps between kernels", num((step_us - kernel_us) / layers, 1), "–", "–"))
    return ("Where the 48-layer B=1 step goes (the same run's `moefx` row, one captured step under torch.profiler: "
            f"{num(kernel_us, 0)} µs of kernels in a {num(step_us, 0)} µs step; floors: the bytes each part reads "
            "/ the copy rate):\n\n"
            + table(["part", "µs per layer", "kernels per layer", "floor µs per layer"], rows))


ROUTING_NOTE = ("Experts hit / layer: the mean over layers of the distinct experts the row's tokens routed to "
                "(counted on the plain model before any arm ran; the floor reads those experts); `balanced` = "
                "`build_model(..., routing=\"balanced\")`, `as built` = transformers' initialisation (rows without "
                "a count: the floor assumed uniform routing).")


def routing_cell(row: dict[str, Any]) -> str:
    if "experts_hit" not in row:
        return "– (as built)"
    return f"{num(row['experts_hit'], 1)} ({(row.get('routing') or 'as_built').replace('_', ' ')})"


def render_ttft(r: dict[str, Any]) -> str:
    """Time to first token rows (bench/e2e.py --ttft / --ttft-batch); empty when the run had none."""
    ttft = r.get("ttft") or []
    if not ttft:
        return ""
    peer = {(t["layers"], t["B"], t["tokens"]): t["ms"] for t in ttft if t["arm"] == "hf_compiled"}
    rows = [(t["layers"], f"{t['B']} × {t['tokens']}", f"`{t['arm']}`", num(t.get("ms"), 1),
             ratio(peer.get((t["layers"], t["B"], t["tokens"])), t.get("ms")) if t["arm"] != "hf_compiled" else "–",
             num(t.get("flop_floor_ms"), 1), num(t.get("bytes_floor_ms"), 1), num(t.get("x_floor"), 2),
             num(t.get("prof_wall_ms"), 1), num(t.get("kernel_ms"), 1), num(t.get("kernel_pct"), 0),
             t.get("kernels", "–"), routing_cell(t), num(t.get("first_call_s"), 1)) for t in ttft]
    body = table(["layers", "B × tokens", "arm", "TTFT ms", "peer ms / ms", "FLOP floor ms", "bytes floor ms",
                  "× floor", "profiled wall ms", "kernel ms", "kernel %", "kernels", "experts hit / layer",
                  "first call s"], rows)
    body += "\n\nArms:\n" + "\n".join(f"- `{a}`: {TTFT_ARMS.get(a, a)}" for a in dict.fromkeys(t["arm"] for t in ttft))
    body += "\n\n" + ROUTING_NOTE
    ceil = r.get("ceilings") or {}
    return "\n" + section(
        "Time to first token", r, what="A prompt of B × tokens, to its first generated token, median of 3 after a "
        "warm-up call, all arms in one process; then one call under torch.profiler (its wall time, the GPU kernels' "
        "summed time and count).", peer="`hf_compiled` in the same run", body=body,
        floor=f"the larger of the prefill's FLOPs / {num(ceil.get('bf16_matmul_TFLOPs'), 0)} TFLOP/s and the weight "
              f"bytes it reads (every non-expert weight, the experts the prompt hit) / "
              f"{num(ceil.get('hbm_copy_TBps'), 2)} TB/s")

# -------------------------------------------------------------------------------- request stream, cold start


def _band_order(item: tuple[str, Any]) -> tuple[int, str]:
    """'B9-32 greedy' -> (9, 'greedy'): batch bands in numeric order."""
    band, _, kind = item[0].partition(" ")
    return int(re.sub(r"\D.*", "", band[1:]) or 0), kind


def render_stream(r: dict[str, Any]) -> str:
    """bench/stream.py: a long stream of mixed requests through the README path (correctness and memory first)."""
    checks = table(["check", "result"], [(name, "PASS" if ok else "**FAIL**") for name, ok in r["checks"].items()])
    classes = table(["class (batch band, decoding)", "requests", "p50 s", "p99 s", "tok/s"],
                    [(name, c["requests"], num(c["p50_s"], 3), num(c["p99_s"], 2), sig(c["tok_s"]))
                     for name, c in sorted(r["classes"].items(), key=_band_order)])
    split = r.get("time_split") or {}
    checked = r.get("checked") or {}
    facts = [
        f"{r['ran']} of {r['requests']} requests in {num(r['seconds'], 0)} s ({sig(r['tok_s'])} tok/s over the "
        f"stream); {sum(checked.values())} rerun with graphs off ({checked.get('greedy', 0)} greedy, "
        f"{checked.get('sampled', 0)} sampled), {len(r.get('mismatches') or [])} differ; {len(r.get('errors') or [])} "
        "errors",
        f"peak allocated {num(r['peak_warmup_gib'], 2)} GiB after the first 50 requests, {num(r['peak_end_gib'], 2)} "
        f"GiB at the end ({100 * r['peak_growth']:+.1f}%)",
        f"{r['captures']} captures for {r['buckets_used']} buckets used (batch bucket × cache length × sampling "
        f"params × mask); compiles {r['compiles']}; {r['slot_allocations']} slot allocations, {r['evictions']} "
        f"evictions under the budget {r['memory_budget']}",
        f"moefx compile-cache files at the start: {r.get('compile_cache_files_at_start', 0)}",
    ]
    if split:
        facts.append(f"time: {split['first_use_requests']} requests that compiled or captured took "
                     f"{split['first_use_s']} s, the other {split['steady_requests']} {split['steady_s']} s, the "
                     f"graphs-off reruns {split['graphs_off_reruns_s']} s")
    body = checks + "\n\n" + "\n".join(f"- {line}" for line in facts) + "\n\n" + classes
    return section(
        "A stream of mixed requests", r,
        what=f"`bench/stream.py`: {r['requests']} requests in a seeded random order through `moefx.optimize(model)` "
             f"(no config but a memory budget) + `generate()`, {r['layers']} layers at Qwen3-30B-A3B widths, bf16, "
             "routing like a trained model's: batch 1–64, prompts 16–4096, 1–512 new tokens, greedy and sampled, "
             "EOS ids, left padding, stopping criteria. Correctness and memory first; latencies include every "
             "compile and capture.",
        peer=f"the same engine with its CUDA graphs off, same seed (every {r.get('check_every', 4)}th request); no "
             "speed peer (a serving workload, not a kernel)",
        floor="none (latencies are set by first-use compiles and captures, see the time line)", body=body)


def render_coldstart(r: dict[str, Any]) -> str:
    """bench/coldstart.py: the first call in fresh processes, cold and with the compile cache, vs transformers."""
    runs_ = r.get("runs") or [r]
    rows = []
    for run in sorted(runs_, key=lambda x: (x["layers"], x["batch"])):
        peer = next((x.get("first_call_s") for x in run["rows"] if x["arm"] == "hf_static"), None)
        for x in run["rows"]:
            first = x.get("first_call_s")
            rows.append((run["layers"], run["batch"], f"`{x['arm']}`", num(first, 1), num(x.get("ready_s"), 1),
                         ratio(first, peer) if x["arm"] != "hf_static" and peer and first else "–",
                         f"{x.get('fxgraph_cache_miss', '–')} / {x.get('fxgraph_cache_hit', '–')}",
                         {True: "yes", False: "**no**"}.get(x.get("same_tokens_as_cold"), "–"),
                         x.get("error") or ""))
    body = table(["layers", "B", "arm", "first call s", "ready s", "× peer", "inductor cache miss / hit",
                  "tokens = cold", "error"], rows)
    body += ("\n\nArms (each a new process with empty inductor and Triton caches):\n"
             "- `hf_static`: transformers `generate(cache_implementation=\"static\")`, its own compile\n"
             "- `moefx_cold`: `moefx.optimize(model)` + the first `generate()`, moefx's compile cache empty\n"
             "- `moefx_warm`: the same with the compile cache file `moefx_cold` wrote\n"
             "- `moefx_restart`: as `moefx_warm`, with the Triton cache `moefx_cold` left (a restart on the same "
             "machine)\n\nFirst call = optimize + the first `generate()`; ready = from the process's start.")
    return section(
        "Cold start", r,
        what=f"Qwen3-30B-A3B widths, bf16, a {runs_[0]['prompt']}-token prompt, greedy (`bench/coldstart.py`).",
        peer="`hf_static` in the same run; `× peer` = first call s over the peer's",
        floor="none (compile time has no hardware floor)", body=body)


# ------------------------------------------------------------------------------------------ dense linears

DENSE_SHAPES = {"qkv": "q/k/v (three weights, one launch)", "o": "o_proj", "router": "router gate"}


def render_dense(r: dict[str, Any]) -> str:
    rows = [(f"{DENSE_SHAPES.get(x['shape'], x['shape'])} {x['kind']}", x["M"], num(x["gemv"], 2),
             num(x["upstream"], 2), num(x["floor_us"], 2), ratio(x["gemv"], x["floor_us"]),
             ratio(x["upstream"], x["gemv"])) for x in r["rows"]]
    body = table(["shape", "M", "gemv µs", "cuBLAS µs (peer)", "floor µs", "gemv / floor", "cuBLAS / gemv"], rows)
    body += ("\n\nCUDA-graph replay medians over rotating weight sets larger than 3× L2. Eager calls (launch "
             "overhead included, in the kept data as `*_eager`) are 70–580 µs either way on this machine; there "
             "the table runs cuBLAS except for FP8 q/k/v (the gemv's one launch against three block-FP8 ones) and "
             "FP8 o_proj at M=1. Which backend each "
             "call runs is the shipped table's ranges (docs/DENSE.md).")
    if r.get("forms"):
        forms = [(x["form"], x["M"], num(x["gemv"], 2), num(x["upstream"], 2), num(x["plain"], 2),
                  ratio(x["upstream"], x["gemv"])) for x in r["forms"]]
        body += ("\n\nDecode-layer forms, one gemv launch each, against the same op's upstream path (torch's add and "
                 "norm ops, cuBLAS, `moefx::fused_topk`); `plain gemv` is the GEMV alone, so the difference is what "
                 "the fused prologue and routing cost:\n\n")
        body += table(["form", "M", "gemv µs", "upstream µs (peer)", "plain gemv µs", "upstream / gemv"], forms)
    return section(
        "Small-M projections (`moefx::dense_linear`)", r,
        what="Qwen3-30B-A3B projection shapes (q/k/v N = 4096 + 512 + 512, K = 2048; o N = 2048, K = 4096; router "
             "N = 128, K = 2048), bf16 and FP8 block-128 weights, µs per call.",
        peer="cuBLAS: `F.linear` per weight (bf16) or `moefx::fp8_block_gemm` per weight (FP8), same run",
        floor=f"weight + activation + output bytes / {r['copy_TBps']:.2f} TB/s", body=body)


# --------------------------------------------------------------------------------------- MoE backward

BACKWARD_KINDS = {
    "full": "gradients of hidden, routing weights and both expert weights (training the experts)",
    "frozen": "hidden and routing weights only (expert weights frozen: LoRA on attention, router training)",
    "fwd_bwd": "one forward and the full backward",
}


def render_moe_backward(r: dict[str, Any]) -> str:
    rows = []
    for x in r["rows"]:
        for kind in BACKWARD_KINDS:
            floor = (x.get("floor_us") or {}).get(kind)
            rows.append((x["M"], kind, num(x["moefx"][kind], 1), num(x["grouped_mm"][kind], 1),
                         ratio(x["moefx"][kind], x["grouped_mm"][kind]), num(floor, 1),
                         ratio(x["moefx"][kind], floor)))
    errs = "; ".join(f"M={x['M']}: moefx {span(x['moefx_err'], 4)}, grouped_mm {span(x['grouped_mm_err'], 4)}"
                     for x in r["rows"])
    body = table(["M", "gradients", "moefx µs", "grouped_mm µs", "moefx / grouped_mm", "floor µs", "moefx / floor"],
                 rows)
    body += ("\n\nKinds:\n" + "\n".join(f"- `{k}`: {v}" for k, v in BACKWARD_KINDS.items())
             + f"\n\nGradients against the fp32 reference backward, relative L2 (hidden, routing weights, w13, w2): "
               f"{errs}. moefx's backward recomputes GEMM 1 (its forward saves only its inputs), which is where its "
               "extra time against grouped_mm's goes; one forward plus backward is on par.")
    return section(
        "Experts backward (autograd of `moefx::moe_experts`)", r,
        what="Qwen3-30B-A3B experts (E=128, H=2048, I=768, top-8), bf16, `torch.autograd.grad` through one call, CUDA "
             "events over eager calls, medians; four forward graphs on different inputs rotate.",
        peer="transformers' `grouped_mm` experts forward and its autograd, same run",
        floor="max(FLOPs / measured bf16 matmul rate, bytes / measured copy rate) of a backward without recompute",
        body=body)


# --------------------------------------------------------------------------------------------- MoE op


def _moe_ceilings(c: dict[str, float]) -> str:
    return (f"copy {c['copy_Bps'] / 1e12:.2f} TB/s, bf16 matmul {c['bf16_flops'] / 1e12:.0f} TFLOP/s, fp8 "
            f"{c['fp8_flops'] / 1e12:.0f} TFLOP/s")


def moe_summary(r: dict[str, Any]) -> dict[str, Any]:
    """Ratios the page and the README quote: auto vs peers, the points within / over 1.3× of the floor."""
    rows = r["rows"]
    out: dict[str, Any] = {"grid": {}, "within": {}, "over": {}, "vs_triton": {}, "vs_hf": {}}
    for dt in dict.fromkeys(x["dtype"] for x in rows):
        sub = [x for x in rows if x["dtype"] == dt]
        out["grid"][dt] = [x["M"] for x in sub]
        out["within"][dt] = [x["M"] for x in sub if x["auto"] / x["floor_us"] <= 1.3]
        out["over"][dt] = [(x["M"], x["auto"] / x["floor_us"]) for x in sub if x["auto"] / x["floor_us"] > 1.3]
        out["vs_triton"][dt] = [x["auto"] / x["peer_triton_us"] for x in sub if x.get("peer_triton_us")]
        out["vs_hf"][dt] = [x["hf_grouped_mm_compiled"] / x["auto"] for x in sub if x.get("hf_grouped_mm_compiled")]
    return out


def render_moe(r: dict[str, Any]) -> str:
    rows = []
    for x in r["rows"]:
        hf = x.get("hf_grouped_mm_compiled")
        rows.append((x["dtype"], x["M"], num(x["floor_us"]), num(x.get("peer_triton_us")), num(hf),
                     num(x.get("gemv")), num(x.get("grouped")), num(x.get("torch_grouped")),
                     f"**{num(x['auto'])}** ({x['auto_backend']})", ratio(x["auto"], x["floor_us"]),
                     ratio(x["auto"], x.get("peer_triton_us")), ratio(hf, x["auto"])))
    s = moe_summary(r)
    checks = r.get("check") or []
    worst: dict[str, float] = {}
    for c in checks:
        key = f"{c['dtype']} `{c['backend']}`"
        worst[key] = max(worst.get(key, 0.0), c["relerr"])
    failed = sum(1 for c in checks if not c["ok"])
    ms = sorted({c["M"] for c in checks})
    lines = [
        f"- `auto` takes {span(v)}× the Triton fused-MoE peer's time in {dt}" for dt, v in s["vs_triton"].items() if v]
    lines += [f"- `auto` is {span(v, 1)}× faster than transformers' compiled grouped_mm in {dt} (same run)"
              for dt, v in s["vs_hf"].items() if v]
    lines += [f"- within 1.3× of the floor: {dt} M = {runs(v, s['grid'][dt])}" for dt, v in s["within"].items() if v]
    lines += ["- over 1.3×: " + "; ".join(f"{dt} M={m} ({q:.2f})" for dt, v in s["over"].items() for m, q in v)
              + " — the lower bounds below and [FINDINGS.md](FINDINGS.md) say how far each can go"]
    body = table(["dtype", "M", "floor µs", "peer Triton", "HF grouped_mm+compile", "gemv", "grouped",
                  "torch_grouped", "**auto** (pick)", "auto/floor", "auto/peer", "HF/auto"], rows)
    body += ("\n\n" + "\n".join(lines) + f"\n\nCorrectness first, on the GPU against `legacy`: {len(checks)} "
             f"backend/input pairs (M = {', '.join(map(str, ms))}), {failed} failed; largest relative error "
             + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + ".")
    geo = r.get("geometry", {})
    return section(
        "Experts op `moefx::moe_experts`", r,
        what=f"Qwen3-30B-A3B experts (E={geo.get('E', E)}, H={geo.get('H', H)}, I={geo.get('I', I)}, "
             f"top-{geo.get('top_k', TOP_K)}), random weights and routing, µs per call, CUDA-graph replay of four "
             "rotating input sets (weights come from HBM). `auto` = the capture-mode policy from the calibration "
             "rows that `bench/moe.py --calibrate` wrote in the same run (the shipped ones are in "
             "`moefx/backends/tables/nvidia-h200.yaml`); `gemv`, `grouped`, `torch_grouped` = each backend forced. "
             f"Ceilings measured in the run: {_moe_ceilings(r['ceilings'])}.",
        peer="transformers' `grouped_mm` experts under `torch.compile`, graph-replayed, same run (HF). "
             "\"peer Triton\" = a tuned Triton fused-MoE kernel timed on this machine kind on 2026-11-29 "
             "(`shared/anchors/h200_peers_2026-11-29.json`, kernels only; not re-run in this run; a same-run "
             "comparison with vLLM's Triton kernel follows)",
        floor="max(experts touched × bytes per expert / measured copy rate, 6·M·top_k·H·I FLOP / measured matmul "
              "rate)", body=body)


def render_moe_vllm_peer(r: dict[str, Any]) -> str:
    """A cited measurement, not a table: no command in this repository reproduces it (a harness with vLLM, outside
    this repository, measured it; the H200 machine has no vLLM)."""
    spans = "; ".join(f"{span(x['moefx_over_peer'] for x in r['rows'] if x['dtype'] == dt)}× its time in {dt}"
                      for dt in dict.fromkeys(x["dtype"] for x in r["rows"]))
    ms = sorted({x["M"] for x in r["rows"]})
    return (f"#### A check against vLLM's Triton fused-MoE kernel (not reproducible here)\n\n"
            f"On {r['date']} ({r['device']}, torch {r['versions']['torch']}, moefx at `{r['commit']}`) a harness "
            f"outside this repository timed moefx's experts op and vLLM's Triton fused-MoE kernel in one run at the "
            f"same geometry, M = {ms[0]}–{ms[-1]}: moefx took {spans}. The H200 machine has no vLLM, so no command "
            f"here reproduces it; the numbers are in `{r['_file']}` ({r.get('source', 'source not recorded')}).")


def _pair(rows: list[dict[str, Any]], name: str, m: int) -> tuple[float, float] | None:
    got = {x["name"]: x for x in rows if x["M"] == m}
    a, b = got.get(f"{name} gemm1"), got.get(f"{name} gemm2")
    return (a["us"], b["us"]) if a and b else None


def render_moe_bounds(r: dict[str, Any], moe: dict[str, Any] | None) -> str:
    pr, pc = r["probe_read"], r["probe_ceilings"]
    read = {x["name"]: x for x in pr["rows"]}
    auto = {(x["dtype"], x["M"]): x["auto"] for x in (moe or {}).get("rows", [])}
    cols = [("fp8", 1), ("bf16", 1), ("fp8", 1024), ("bf16", 1024)]

    def cell(name: str) -> str:
        x = read.get(name)
        return "–" if x is None else f"{x['us']:.2f} ({x['us'] / x['floor_us']:.2f})"

    names = {(dt, m): f"{dt} M={m} ({8 if m == 1 else 128} experts)" for dt, m in cols}
    t1 = [("floor (bytes / copy rate)", *(num(read[names[c]]["floor_us"], 2) for c in cols)),
          ("one read-only kernel over those bytes", *(cell(names[c]) for c in cols)),
          ("two dependent read-only kernels (stage-1 bytes, then stage-2 bytes)",
           *(cell(f"{dt} M=1 two dependent reads") if m == 1 else "–" for dt, m in cols))]
    if auto:
        t1.append(("moefx `auto` (the `moe` table: another run)",
                   *(f"{auto[c]:.1f} ({auto[c] / read[names[c]]['floor_us']:.2f})" for c in cols)))
    body = table(["µs (× floor)", *(f"{dt} M={m}" for dt, m in cols)], t1)

    c = pc["ceilings"]
    kinds = [("cuBLAS dense bf16", "cublas bf16", "bf16"),
             ("Triton dense bf16 (TMA, best tile)", "triton dense bf16", "bf16"),
             ("CUTLASS grouped bf16 (`torch._grouped_mm`), real routing", "cutlass grouped bf16", "bf16"),
             ("ours bf16, dense-like routing", "ours dense-like bf16", "bf16"),
             ("ours bf16, real routing", "ours bf16", "bf16"),
             ("cuBLAS dense FP8, block-128 scales", "cublas fp8 block128", "fp8"),
             ("cuBLAS dense FP8, rowwise scales", "cublas fp8 rowwise", "fp8"),
             ("Triton dense FP8, no scales", "triton dense fp8", "fp8"),
             ("ours FP8, dense-like routing", "ours dense-like fp8", "fp8"),
             ("ours FP8, real routing", "ours fp8", "fp8")]

    def floor(dt: str, m: int) -> float:
        bytes_ = E * BF16_EXPERT_BYTES / (2 if dt == "fp8" else 1)
        flops = 6 * m * TOP_K * H * I
        return 1e6 * max(bytes_ / c["copy_Bps"], flops / c[f"{dt}_flops"])

    t2 = []
    for label, key, dt in kinds:
        p1, p4 = _pair(pc["rows"], key, 1024), _pair(pc["rows"], key, 4096)
        if not p4:
            continue
        both1 = f"{sum(p1):.1f} ({sum(p1) / floor(dt, 1024):.2f})" if p1 else "–"
        t2.append((label, both1, f"{p4[0]:.1f}", f"{p4[1]:.1f}", f"{sum(p4):.1f} ({sum(p4) / floor(dt, 4096):.2f})"))
    body += "\n\n" + table(["GEMM 1 + GEMM 2, µs (× floor)", "M=1024 both", "M=4096 GEMM 1", "M=4096 GEMM 2",
                            "M=4096 both"], t2)
    body += (f"\n\nFloors in the second table, from this run's ceilings ({_moe_ceilings(c)}): bf16 M=1024 "
             f"{floor('bf16', 1024):.1f} / M=4096 {floor('bf16', 4096):.1f} µs, FP8 {floor('fp8', 1024):.1f} / "
             f"{floor('fp8', 4096):.1f} µs; at M=1024 a dense GEMM reads one weight matrix, not 128 experts' "
             "weights, so it runs below the MoE's bytes floor. \"Dense-like\" = 8 experts with every token routed "
             "to all 8 (full blocks, weights reused from L2). What these bounds mean for each unmet point: "
             "[FINDINGS.md](FINDINGS.md#moe-experts).")
    return section(
        "Experts op: lower bounds at the unmet points", r,
        what="How low the points over 1.3× can go on this GPU: `bench/probe_read.py` times a read-only Triton kernel "
             "over exactly the bytes a call must read (best of 12 grids, rotating over buffers larger than L2), once "
             "and as two dependent launches; `bench/probe_ceilings.py` times library GEMMs at the same shapes and "
             "FLOPs as GEMM 1 (`[8M, 2048] x [2048, 1536]`) and GEMM 2 (`[8M, 768] x [768, 2048]`), next to ours.",
        peer="cuBLAS dense and CUTLASS grouped (`torch._grouped_mm` on rows pre-sorted by expert, sort untimed), "
             "same run", floor="as in the experts table, with this run's ceilings (its copy rate for the read-only "
                               "probe)", body=body)


# --------------------------------------------------------------------------------------------- fusions

def _exact(chk: dict[str, Any] | None) -> str:
    if not chk:
        return "–"
    if chk["q_mismatch"] == 0 and chk["scale_rel"] == 0 and chk["residual_equal"]:
        return "yes"
    out = f"{chk['q_mismatch']:.1e} of codes off by ≤ {chk['q_max_code_diff']:.0f}"
    if chk["scale_rel"]:
        out += f"; scales within {chk['scale_rel']:.1e}"
    return out + ("" if chk["residual_equal"] else "; residual differs")


def fusion_bandwidth(r: dict[str, Any]) -> float:
    """The copy rate the floors use: the kept run's SM-copy ceiling where it was recorded apart, else its own."""
    return r.get("copy_ceiling_Bps") or r["meta"]["copy_bw_Bps"]


def render_fusions(r: dict[str, Any]) -> str:
    bw = fusion_bandwidth(r)
    rows, last = [], None
    for x in r["fusions"]:
        fl = x["bytes"] / bw * 1e6
        best = x.get("moefx_us")
        fused = "yes" if x.get("moefx_matches") else "no"
        label = "" if x["class"] == last else f"{x['class']} (width {x['width']})"
        last = x["class"]
        rows.append((label, x["M"], num(x["eager_us"]), num(x["inductor_us"]), f"**{num(best)}**", num(fl),
                     ratio(best, fl) if fl >= 1 else "–", ratio(x["inductor_us"], best), fused,
                     _exact(x.get("moefx_check")), _exact(x.get("inductor_check"))))
    body = table(["variant class", "M", "eager", "inductor", "**inductor + moefx**", "floor", "moefx / floor",
                  "inductor / moefx", "fused", "moefx = eager", "inductor = eager"], rows)
    big = [x for x in r["fusions"] if x["M"] == max(y["M"] for y in r["fusions"])]
    checks = r.get("checks") or []
    body += (f"\n\n- at M={big[0]['M']}: inductor + moefx at "
             f"{span(x['moefx_us'] / (x['bytes'] / bw * 1e6) for x in big)}× the floor, inductor alone "
             f"{span(x['inductor_us'] / (x['bytes'] / bw * 1e6) for x in big)}×"
             "\n- ratios to the floor are left out where the floor is under 1 µs (launch-bound sizes)"
             f"\n- before timing, {sum(c['ok'] for c in checks)} of {len(checks)} kernel variants (each scaling mode) "
             "matched the reference on this GPU")
    if r.get("exactness_note"):
        body += f"\n- {r['exactness_note']}"
    grows = [(g["M"], f"{g['N']}×{g['K']}", num(g["triton_us"]), num(g.get("scaled_mm_us")), num(g["bf16_mm_us"]),
              num(max((g["M"] * g["K"] + g["N"] * g["K"] + 2 * g["M"] * g["N"]) / bw,
                      2 * g["M"] * g["N"] * g["K"] / r["meta"]["fp8_flops"]) * 1e6))
             for g in r.get("gemm", [])]
    if grows:
        body += ("\n\nFP8 block-scaled GEMM (`moefx::fp8_block_gemm`, bf16 out), µs; peer: bf16 `mm` at the same "
                 "shape, same run; floor = max(bytes / copy rate, FLOPs / measured FP8 matmul rate):\n\n"
                 + table(["M", "N×K", "Triton", "`torch._scaled_mm` blockwise", "bf16 mm (peer)", "floor"], grows))
    return section(
        "Fused activation quantization", r,
        what="One row per fused variant class: the user's SiLU-mul / add + RMSNorm → quant code, written after "
             "vLLM, SGLang, DeepGEMM, transformers and Gemma forms (the classes of `tests/test_fusion_corpus.py`), "
             "bf16. µs per call, CUDA-graph replay of many calls with rotating inputs, token dimension dynamic in "
             "both compiled arms. \"inductor + moefx\" is `torch.compile(backend=moefx.backend(cfg))` with both "
             "fusion passes on; \"= eager\" compares FP8/INT8 codes and scales with eager.",
        peer="eager PyTorch (the user's code) and inductor alone (`torch.compile` default), same run",
        floor=f"bytes read + written / {bw / 1e12:.2f} TB/s"
              + (f" ({r['copy_ceiling_note']})" if r.get("copy_ceiling_note") else ""), body=body)


# -------------------------------------------------------------------------------------------- sampling

SAMPLER_ARMS = {
    "hf": "transformers `generate()` with static cache and its auto-compile",
    "hf+stop": "the same with moefx's deferred stop check (what `moefx.optimize` turns on for CUDA)",
    "moefx": "`moefx.sampling.DecodeLoop` (forward and sampler compiled with the moefx passes, CUDA graphs)",
}


def render_sampler(r: dict[str, Any]) -> str:
    dec = r["decode"]
    peer = {(x["mode"], x["batch"]): x["tokens_per_s"] for x in dec if x["arm"] == "hf"}
    rows = [(f"**{x['arm']}**" if x["arm"] == "moefx" else x["arm"], x["mode"], x["batch"], num(x["tokens_per_s"], 0),
             num(x["syncs_per_step"], 2), num(x["step_ms"], 2), num(x["floor_step_ms"], 2),
             ratio(x["tokens_per_s"], peer.get((x["mode"], x["batch"]))))
            for x in sorted(dec, key=lambda x: (x["batch"], list(SAMPLER_ARMS).index(x["arm"])
                                                if x["arm"] in SAMPLER_ARMS else 9, x["mode"] != "sample"))]
    body = table(["arm", "mode", "B", "tok/s", "host syncs / step", "step ms", "floor ms", "× hf"], rows)
    ours = {(x["mode"], x["batch"]): x["tokens_per_s"] for x in dec if x["arm"] == "moefx"}
    lines = ["- `moefx` sampling vs `hf` sampling: " + ", ".join(
        f"{ours[('sample', b)] / peer[('sample', b)]:.1f}× at B={b}" for b in sorted({b for _, b in ours})
        if ("sample", b) in peer)]
    lines.append("- host syncs per `moefx` step: " + span((x["syncs_per_step"] for x in dec if x["arm"] == "moefx"), 0))
    batches = sorted({b for _, b in ours})
    lines.append("- sampling vs greedy in `moefx`: " + ", ".join(
        f"{100 * (ours[('sample', b)] / ours[('greedy', b)] - 1):+.1f}% at B={b}" for b in batches))
    lines.append("- checks: " + "; ".join(
        f"{k} greedy tokens {v['greedy_token_agreement']:.0%} equal to eager, step logits "
        f"{v['step_logits_rel_err']:.1e} relative" for k, v in r["checks"].items()))
    body += "\n\n" + "\n".join(lines) + "\n\nArms:\n" + "\n".join(f"- `{k}`: {v}" for k, v in SAMPLER_ARMS.items())
    out = section(
        "Sync-free decode loop and sampling", r,
        what=f"{r['model']} at Qwen3-30B-A3B widths, random weights, bf16; top-k 50, top-p 0.9, temperature 0.8; "
             "32-token prompt, 64 new tokens, median of 3. Decode tok/s = B × (n − 1) / (t_last − t_first); syncs "
             "counted with `torch.cuda.set_sync_debug_mode`. All arms run the same transformers forward (no moefx MoE "
             "kernels), so the rows isolate the loop and the sampler."
             + (f" Note: {r['note']}." if r.get("note") else ""),
        peer="`hf` in the same run, same mode and B",
        floor="weight bytes one step reads / the HBM copy rate measured in the run",
        body=body)
    pre = r.get("prefill") or []
    if pre:
        off = next((p for p in pre if not p["last_token_logits"]), None)
        prow = [("on" if p["last_token_logits"] else "off", p["rewrites"], num(p["ms"], 1), num(p["peak_extra_mib"], 0),
                 f"{p['rel_err']:.1e}", ratio(off["ms"], p["ms"]) if off and p is not off else "–") for p in pre]
        pbody = table(["`last_token_logits`", "rewrites", "ms", "extra peak MiB", "logits vs eager", "off ms / ms"],
                      prow)
        out += "\n" + section(
            "`last_token_logits` on a 4096-token prefill", r,
            what="`logits[:, -1]` of an 8-layer prefill, compiled, with the pass off and on.",
            peer="the pass off, same run",
            floor=f"not measured for the whole prefill; the LM-head work the pass removes takes "
                  f"{r['prefill_lm_head_floor_ms']:.1f} ms at the measured matmul rate", body=pbody)
    return out


# --------------------------------------------------------------------------------------------- offload


def render_offload(r: dict[str, Any]) -> str:
    targets = r.get("targets", {})

    def target(what: str) -> str:
        t = targets.get(what)
        m = re.search(r"\(target ([^)]*)\) (NOT met|met)", t or "")
        return f"{m[1]} — {m[2].lower()}" if m else ""

    rows = [(x["what"], sig(x["tok_s"]), sig(x["floor_tok_s"]), f"{100 * x['tok_s'] / x['floor_tok_s']:.0f}%",
             target(x["what"])) for x in r["rows"]]
    acc = r.get("accelerate") or {}
    if acc.get("decode_b1_tok_s"):
        rows.append((f"peer: accelerate `dispatch_model`, {acc['layers']} layers, decode B=1",
                     sig(acc["decode_b1_tok_s"]), "", f"moefx {acc['layers']} layers: "
                     f"**{r['vs_accelerate_8_layers']:.0f}×**", target("vs accelerate")))
    body = table(["what", "tok/s", "floor tok/s", "vs floor", "target"], rows)
    chk = r.get("check_relerr", {})
    body += ("\n\nRows run in this order (\"again at the end\" repeats the first row after all others). Correctness on "
             "the GPU vs `legacy` (bf16): " + ", ".join(f"{k} {v:.1e}" for k, v in chk.items()) + " relative"
             + ("; graph-replayed tokens equal the eager loop's (greedy)" if r.get("graph_tokens_match_eager") else "")
             + ". A prefill row above 100%: its calls are split between the CPU and the GPU, so the "
             "streaming-only floor does not bind. Why the first eager row is slow, and the spread over runs: "
             "[FINDINGS.md](FINDINGS.md#offload).")
    return section(
        "Expert offload", r,
        what=f"Qwen3-30B-A3B geometry, {r['layers']} layers, bf16 experts in pinned, huge-page host memory "
             f"({r['gpu_allocated_gib_after_offload']:.1f} GiB left on the GPU), "
             "`moefx.optimize(model, config={\"offload\": {\"experts\": \"cpu\"}, \"mode\": \"eager\"})`. Bandwidths "
             f"measured in the run: host copy {r['host_copy_gbps']:.1f} GB/s, pinned H2D {r['h2d_gbps']:.1f} GB/s.",
        peer="accelerate `dispatch_model` with the experts on the CPU (8 layers), same run",
        floor="decode = routed-expert bytes per token / host-memory copy rate; prefill = all expert bytes / pinned H2D "
              "rate (both measured in the run)", body=body)


# ------------------------------------------------------------------------------------------------ page

HEADER = """# Performance

Current results only, generated by `bench/report.py` from the one kept JSON per stage in `bench/results/`
(do not edit by hand: `python bench/report.py` rewrites this page, and a test checks it). Each section names the
run (date, device, versions, commit), the command that reproduces it, the same-run peer and the floor. What was
tried and did not work, with its measurements: [FINDINGS.md](FINDINGS.md). Older runs are in git history.

Unless a section says otherwise, the bench scripts check correctness first, time with CUDA events around
CUDA-graph replays, and report medians.
"""

WORKLOADS: list[tuple[str, list[str]]] = [
    ("End to end", ["e2e", "ttft", "coldstart", "stream"]),
    ("MoE experts", ["moe", "moe-vllm-peer", "moe-bounds", "moe-backward"]),
    ("Dense linears", ["dense"]),
    ("Fusions", ["fusions"]),
    ("Sampling", ["sampler"]),
    ("Offload", ["offload"]),
]


def render(results: dict[str, dict[str, Any]]) -> str:
    moe = results.get("moe")
    renderers: dict[str, Callable[[dict[str, Any]], str]] = {
        "e2e": render_e2e, "moe": render_moe, "fusions": render_fusions,
        "sampler": render_sampler, "offload": render_offload,
        "moe-vllm-peer": render_moe_vllm_peer, "moe-bounds": lambda r: render_moe_bounds(r, moe),
        "moe-backward": render_moe_backward, "dense": render_dense, "ttft": render_ttft,
        "stream": render_stream, "coldstart": render_coldstart,
    }
    unknown = sorted(set(results) - set(renderers))
    if unknown:
        raise ValueError(f"no renderer for stages {unknown}; add one to bench/report.py")
    parts = [HEADER]
    for title, stages in WORKLOADS:
        got = [renderers[s](results[s]) for s in stages if s in results]
        parts.append(f"## {title}\n\n" + ("\n".join(got) if got else "No kept result yet.\n"))
    return "\n".join(parts).rstrip() + "\n"


# The README claims the arms whose kept rows ran next to their peer in one call; the kept FP8 row's hf_static ran in
# another call (its ratio to moefx bf16 in its own call is on the page's Source line), so it is not claimed here.
HEADLINE_LABELS = {
    "moefx": "`moefx.optimize(model)` + `generate()`",
}


def headline(results: dict[str, dict[str, Any]]) -> list[str]:
    """The README's measured lines, end to end first, from the same data as the page."""
    out = []
    e2e = results.get("e2e")
    if e2e:
        decode = [x for x in e2e["decode"] if x.get("tok_s")]
        by_arm: dict[str, list[tuple[int, int, float, dict]]] = {}
        for best in e2e_best(decode, e2e_peers(decode)):
            if best[3]["arm"] in HEADLINE_LABELS or not set(HEADLINE_LABELS) & {x["arm"] for x in decode}:
                by_arm.setdefault(best[3]["arm"], []).append(best)
        lines = [f"  - {HEADLINE_LABELS.get(arm, f'`{arm}`')}: " + ", ".join(
                     f"{top['tok_s'] / peer:.2f}× at {layers} layers B={b}" for layers, b, peer, top in best)
                 + f" ({span((t['pct_floor'] for *_, t in best if t.get('pct_floor') is not None), 0)}% of the bytes "
                   "floor)" for arm, best in by_arm.items()]
        out.append(f"End to end, decode tok/s over transformers' static-cache compiled `generate()` in the same run "
                   f"({e2e['date']}, moefx at `{e2e['commit']}`; Qwen3-30B-A3B widths, random weights):")
        out += lines
    ttft = [t for t in (results.get("ttft") or {}).get("ttft", []) if t.get("ms")]
    if ttft:
        deepest = max(t["layers"] for t in ttft)
        rows = {(t["B"], t["tokens"], t["arm"]): t["ms"] for t in ttft if t["layers"] == deepest}
        pairs = [(b, n, ms, rows.get((b, n, "hf_compiled"))) for (b, n, arm), ms in rows.items() if arm == "moefx"]
        out.append(f"Time to first token, {deepest} layers (`generate(max_new_tokens=1)`, routing like a trained "
                   f"model's): " + ", ".join(f"{ms:.1f} ms at {b}×{n} tokens" + (f" ({peer / ms:.2f}× faster than "
                   "transformers' compiled forward, same run)" if peer else "") for b, n, ms, peer in pairs) + ".")
    moe = results.get("moe")
    if moe:
        s = moe_summary(moe)
        out.append("MoE experts op (Qwen3-30B-A3B shapes, M = 1–4096): bf16 " + ", ".join(
            f"{span(v, 1)}×" for v in s["vs_hf"].values() if v) + " faster than transformers' compiled "
            "grouped_mm (same run); within 1.3× of the bandwidth/FLOP floor at " + " and ".join(
                f"{dt} M = {runs(v, s['grid'][dt])}" for dt, v in s["within"].items() if v) + ".")
    fus = results.get("fusions")
    if fus:
        bw = fusion_bandwidth(fus)
        big = [x for x in fus["fusions"] if x["M"] == max(y["M"] for y in fus["fusions"])]
        out.append(f"Fused SiLU-mul / add+RMSNorm → FP8/INT8 quant at M={big[0]['M']} ({len(big)} variant classes): "
                   f"{span(x['moefx_us'] / (x['bytes'] / bw * 1e6) for x in big)}× the bytes floor "
                   f"(torch.compile alone {span(x['inductor_us'] / (x['bytes'] / bw * 1e6) for x in big)}×).")
    if results.get("sampler"):
        out.append("Sampling: zero host syncs per decode step (counted with CUDA's sync debug mode).")
    off = results.get("offload")
    if off:
        graph = [x for x in off["rows"] if "CUDA graph" in x["what"]]
        out.append(f"Offload ({off['layers']} layers, experts in host memory): {off['vs_accelerate_8_layers']:.0f}× "
                   "accelerate's `dispatch_model`; graph-replayed decode at "
                   + ", ".join(f"{100 * x['tok_s'] / x['floor_tok_s']:.0f}% ({x['what'].split(',')[0][7:]})"
                               for x in graph) + " of the host-bandwidth floor.")
    return out


# ------------------------------------------------------------------------------------------------ ingest

STAGE_OUTPUTS = {  # stage -> the file(s) its run_h200.sh command leaves in the results folder
    "moe": ["moe.json"], "fusions": ["fusions.json"], "sampler": ["sampler.json"], "offload": ["offload.json"],
    "moe-backward": ["moe_backward.json"], "dense": ["dense.json"],
    "moe-bounds": ["moe-bounds-probe_read.json", "moe-bounds-probe_ceilings.json"],
}


def merge_e2e(paths: list[Path]) -> dict[str, Any]:
    """One e2e result from the files its stages write (`e2e_<layers>l<tag>.json`, one per depth and batch set)."""
    runs_ = [json.loads(p.read_text()) for p in paths]
    first = runs_[0]
    return {**first, "decode": [row for r in runs_ for row in r["decode"]],
            "prefill": [row for r in runs_ for row in r.get("prefill") or []],
            "ttft": [row for r in runs_ for row in r.get("ttft") or []],
            "commit": ", ".join(dict.fromkeys(str(r.get("commit")) for r in runs_)),
            "command": " and ".join(dict.fromkeys(r["command"] for r in runs_))}


def _coldstart_stage(path: Path) -> tuple[int, str]:
    """coldstart_<layers>l[_<tag>].json -> (layers, its run_h200.sh stage: coldstart, coldstart-48[-b16])."""
    m = re.fullmatch(r"coldstart_(\d+)l(?:_(\w+))?", path.stem)
    layers, tag = (int(m[1]), m[2]) if m else (0, None)
    return layers, "coldstart" + ("" if layers == 8 else f"-{layers}") + (f"-{tag}" if tag else "")


def _stage_command(stage: str, paths: list[Path]) -> str:
    """The run_h200.sh call(s) that wrote these files."""
    if stage == "coldstart":
        return " and ".join(f"bash bench/run_h200.sh {_coldstart_stage(p)[1]}" for p in paths)
    if stage == "stream" and paths[0].stem.endswith("_cached"):
        return "bash bench/run_h200.sh stream-prime and bash bench/run_h200.sh stream-cached (the next call)"
    return f"bash bench/run_h200.sh {stage}"


def ingest(folder: Path, commit: str | None, day: str | None) -> list[Path]:
    """Keep each stage's output from an unpacked run_h200.sh results folder; returns the files written."""
    vt = (folder / "versions.txt").read_text().split()
    vers = {vt[i]: vt[i + 1] for i in range(0, 6, 2)}
    device = " ".join(vt[6:]) or "unknown device"
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower().replace("nvidia", "")).strip("-") or "device"
    day = day or _date.today().isoformat()
    written = []
    stages: dict[str, list[Path]] = {stage: [folder / f for f in files] for stage, files in STAGE_OUTPUTS.items()}
    # TTFT runs (`--tag _ttft`) are kept apart from the decode runs: a stage's kept result replaces the last one.
    e2e_files = sorted(folder.glob("e2e_*.json"))
    stages["ttft"] = [p for p in e2e_files if p.stem.endswith("_ttft")]
    stages["e2e"] = [p for p in e2e_files if not p.stem.endswith("_ttft")]
    stages["coldstart"] = sorted(folder.glob("coldstart_*.json"), key=_coldstart_stage)  # by depth
    # stream-prime only fills the compile caches for stream-cached: the kept run is the whole stream
    stages["stream"] = [p for p in sorted(folder.glob("stream_*.json")) if not p.stem.endswith("_prime")][:1]
    for stage, paths in stages.items():
        if not paths or not all(p.exists() for p in paths):
            continue
        if stage in ("e2e", "ttft"):
            data = merge_e2e(paths)
        elif stage == "coldstart":
            runs_ = [json.loads(p.read_text()) for p in paths]
            data = {**runs_[0], "runs": runs_, "command": " and ".join(r["command"] for r in runs_)}
        elif stage == "moe-bounds":
            data = {"probe_read": json.loads(paths[0].read_text()), "probe_ceilings": json.loads(paths[1].read_text())}
        else:
            data = json.loads(paths[0].read_text())
        command = data["command"] if stage in ("e2e", "ttft") else _stage_command(stage, paths)
        data = {**data, "stage": stage, "date": day, "device": device, "versions": vers,
                "commit": commit or data.get("commit"), "command": command}
        for old in RESULTS.glob(f"{stage}_*.json"):
            old.unlink()
        out = RESULTS / f"{stage}_{slug}_{day}.json"
        out.write_text(json.dumps(data, indent=1) + "\n")
        written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if docs/PERFORMANCE.md is not up to date")
    p.add_argument("--ingest", type=Path, help="an unpacked run_h200.sh results folder")
    p.add_argument("--commit", help="the commit the ingested run measured")
    p.add_argument("--date", help="the ingested run's date (default: today)")
    args = p.parse_args(argv)
    if args.ingest:
        for path in ingest(args.ingest, args.commit, args.date):
            print(f"kept {path.relative_to(ROOT)}")
    page = render(load_results())
    if args.check:
        if PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is not what bench/report.py generates: run `python bench/report.py`")
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
