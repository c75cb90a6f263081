"""The end-to-end sections of bench/e2e.py's kept results: decode, prefill and time to first token (stages
`e2e` and `ttft`), and the README's end-to-end lines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.sections import kernel_kinds as kinds
from bench.sections.markdown import Section, num, ratio, section, sig, span, table


@dataclass(frozen=True)
class DecodeRow:
    """One decode row bench/e2e.py writes: an arm at a depth and batch, its speed and its floor. (The page reads
    kept rows as plain dicts: runs kept before the routing count have no `routing` / `experts_hit`.)"""

    layers: int
    B: int
    dtype: str
    arm: str
    tok_s: float
    step_ms: float
    floor_tok_s: float  # B / (weight bytes one step reads, the experts the batch hit / the SM-copy ceiling)
    pct_floor: float
    first_call_s: float
    peak_mem_gib: float
    agree_with_eager: float | None  # share of greedy tokens equal to eager's; None where no eager reference ran
    routing: str
    experts_hit: float  # distinct experts per layer the batch routed to, counted on the plain model
    # the fp32 scorer's verdict on the arm's tokens (bench/scorer.py); None where the batch was not scored
    scored_steps: int | None = None
    argmax_share: float | None = None  # share of steps whose token is the scorer's argmax
    max_gap_std: float | None = None  # largest (best - chosen logit) / std of the scorer's logits

E2E_ARMS = {
    "hf_eager": "transformers `generate()`, eager, dynamic cache",
    "hf_static": "transformers `generate()` with its static cache and auto-compile (the peer)",
    "moefx": "`moefx.optimize(model)` + `generate()`: moefx's engine (static cache, compiled prefill and decode "
             "step, one CUDA graph per step)",
    "moefx_fp8": "the same model after `moefx.quantize(model, 'fp8_block128')`, then as `moefx`",
    "moefx_fp8_w8a8": "as `moefx_fp8` with `pass_config.fp8_weight_only: false` (activations quantized to e4m3 at "
                      "every M)",
    "moefx_fp8_weight_only": "as `moefx_fp8` with `pass_config.fp8_weight_only: true` (at decode M <= 4 the float "
                             "activations times the dequantized FP8 weights, no activation quant)",
}
# `<arm>_pdl_<setting>` rows (bench/e2e.py --step-pdl): the arm's model and compiled steps, graphs captured again with
# the decode step's PDL chain (moefx/kernels/pdl.py) set so
PDL_SETTINGS = {
    "off": "without the decode step's PDL chain",
    "chain": "with the decode step's PDL chain (the default)",
    "prefetch": "with the PDL chain and the dense GEMV's weight loads issued before its wait (not kept: no gain)",
}


def arm_text(arm: str) -> str:
    base, _, setting = arm.partition("_pdl_")
    if setting in PDL_SETTINGS:
        return f"`{base}`'s model and compiled steps, its graphs captured again {PDL_SETTINGS[setting]}"
    return E2E_ARMS.get(arm, arm)


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
    """The fastest moefx arm per (layers, B, dtype) that has a peer (a `--step-pdl` row is a before/after of its
    arm, not an arm of its own)."""
    out = []
    for (layers, b), peer in sorted(peers.items()):
        for dt in dict.fromkeys(x.get("dtype") for x in decode):
            ours = [x for x in decode if (x["layers"], x["B"], x.get("dtype")) == (layers, b, dt)
                    and x["arm"].startswith("moefx") and "_pdl_" not in x["arm"] and x.get("tok_s")]
            if ours:
                out.append((layers, b, peer, max(ours, key=lambda x: x["tok_s"])))
    return out


def render_e2e(r: dict[str, Any]) -> str:
    decode = sorted(r.get("decode") or [], key=lambda x: (x["layers"], x["B"], _arm_order(x["arm"])))
    peers = e2e_peers(decode)
    hit = any("experts_hit" in row for row in decode)  # rows of runs before routing was counted have none
    scored = any(row.get("argmax_share") is not None for row in decode)  # runs before the scorer have none
    rows = []
    for row in decode:
        peer = peers.get((row["layers"], row["B"]))
        agree = row.get("agree_with_eager")
        rows.append((row["layers"], row["B"], row.get("dtype") or "–", f"`{row['arm']}`", sig(row.get("tok_s")),
                     num(row.get("floor_tok_s"), 0),
                     num(row.get("pct_floor"), 1) + ("%" if row.get("pct_floor") is not None else ""),
                     ratio(row.get("tok_s"), peer) if row["arm"] != "hf_static" and peer else "–",
                     num(row.get("first_call_s"), 1), num(row.get("peak_mem_gib"), 1),
                     "–" if agree is None else f"{agree:.2f}") + ((routing_cell(row),) if hit else ())
                    + (score_cells(row) if scored else ()))
    body = [table(["layers", "B", "dtype", "arm", "tok/s", "floor tok/s", "% of floor", "× peer", "first call s",
                   "peak GiB", "tokens = eager"] + (["experts hit / layer"] if hit else [])
                  + (["fp32 argmax %", "largest gap (std)"] if scored else []), rows)]
    if hit:
        body.append(ROUTING_NOTE)
    if scored:
        body.append(score_note(r, decode))
    errors = (r.get("extra") or {}).get("errors") or {}
    if errors:  # an arm that failed has no row: say so under the table
        body.append("Failed arms: " + "; ".join(f"`{arm}`: {why.splitlines()[0]}" for arm, why in errors.items()))
    body.append("Arms:\n" + "\n".join(f"- `{a}`: {arm_text(a)}" for a in dict.fromkeys(row["arm"] for row in decode)))
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


# The decode step tables: (profile key in `extra`, the decode row's arm, what the table is called); the profile key
# carries the depth (`profile_B1_48`), as bench/e2e.py --profile writes it.
STEP_TABLES = (("profile_B1", "moefx", "step"), ("profile_fp8_B1", "moefx_fp8", "FP8 step"))
CACHE_POSITIONS = 256  # the engine's first cache length: what a decode step's attention reads at these prompts


def _part_floors_us(hit: float, copy_tbps: float, dtype: str) -> dict[str, float]:
    """Bytes floor per layer of the parts that read weights or the cache (Qwen3-30B-A3B widths, `dtype` weights --
    the router stays bf16 --, a bf16 cache of CACHE_POSITIONS positions)."""
    c, w = kinds.QWEN3_30B, kinds.layer_weights()
    wb = kinds.WEIGHT_BYTES.get(dtype, 2.0)
    nbytes = {"dense": w["attn"] * wb + w["router"] * 2, "moe": hit * w["expert"] * wb,
              "attention": 2 * 2 * c["kv_heads"] * c["head_dim"] * CACHE_POSITIONS}
    return {key: n / (copy_tbps * 1e6) for key, n in nbytes.items()}


def render_step_parts(r: dict[str, Any], decode: list[dict[str, Any]]) -> str:
    """Where each captured 48-layer B=1 step's time goes, per layer (the run's kernel profile of `moefx`, and of
    `moefx_fp8` where it ran)."""
    out = []
    extra = r.get("extra") or {}
    for key, arm, what in STEP_TABLES:
        # Under the decode step's PDL chain a kernel launches before the one ahead of it ends and the profiler
        # counts its wait as its time: the parts come from the same graphs captured without the chain where the
        # run has them (`<arm>_pdl_off`)
        unchained = extra.get(f"profile_B1_48_{arm}_pdl_off")
        profile = unchained or extra.get(f"{key}_48")
        row = next((d for d in decode if d["layers"] == 48 and d["B"] == 1
                    and d["arm"] == (f"{arm}_pdl_off" if unchained else arm)), None)
        if profile and row is not None:
            out.append(_step_table(r, profile, row, what))
    return "\n\n".join(out)


def _step_table(r: dict[str, Any], profile: list[dict[str, Any]], row: dict[str, Any], what: str) -> str:
    layers = 48
    parts = {key: [0.0, 0.0] for key in kinds.DECODE_ROWS}
    other = [0.0, 0.0]
    for k in profile:
        per_layer = k["calls_per_step"] >= layers and k["calls_per_step"] % layers == 0
        kind = kinds.classify(k["kernel"])
        bucket = parts.setdefault(kind, [0.0, 0.0]) if per_layer and kind != kinds.OTHER else other
        bucket[0] += k["us_per_step"] / (layers if bucket is not other else 1)
        bucket[1] += k["calls_per_step"] / (layers if bucket is not other else 1)
    floors = _part_floors_us(float(row.get("experts_hit") or 8.0),
                             (r.get("ceilings") or {}).get("hbm_copy_TBps") or 4.26, row.get("dtype") or "bf16")
    step_us = 1e6 / row["tok_s"]
    kernel_us = sum(k["us_per_step"] for k in profile)
    rows = [(kinds.BY_KEY[key].label, num(us, 2), num(n, 1), num(floors[key], 1) if key in floors else "–")
            for key, (us, n) in parts.items()]
    rows.append(("per layer, all parts", num(sum(us for us, _ in parts.values()), 1),
                 num(sum(n for _, n in parts.values()), 1), num(sum(floors.values()), 1)))
    rows.append(("once per step (LM head, embedding, sampler)", f"{num(other[0], 0)} per step",
                 f"{num(other[1], 0)} per step", "–"))
    rows.append(("gaps between kernels", num((step_us - kernel_us) / layers, 1), "–", "–"))
    unchained = row["arm"].endswith("_pdl_off")
    losses = {key: us - floors[key] for key, (us, _) in parts.items() if key in floors}
    worst = max(losses, key=losses.get)
    return (f"Where the 48-layer B=1 {what} goes (the same run's `{row['arm']}` row, one captured step under "
            f"torch.profiler: {num(kernel_us, 0)} µs of kernels in a {num(step_us, 0)} µs step; floors: the bytes each "
            "part reads / the copy rate"
            + ("; the graphs without the step's PDL chain, since with it the profiler counts a kernel's wait for the "
               "one before it as its time" if unchained else "") + "):\n\n"
            + table(["part", "µs per layer", "kernels per layer", "floor µs per layer"], rows)
            + f"\n\nLargest loss: {kinds.BY_KEY[worst].label}, {num(losses[worst], 1)} µs per layer over its floor.")


ROUTING_NOTE = ("Experts hit / layer: the mean over layers of the distinct experts the row's tokens routed to "
                "(counted on the plain model before any arm ran; the floor reads those experts); `balanced` = "
                "`build_model(..., routing=\"balanced\")`, `as built` = transformers' initialisation (rows without "
                "a count: the floor assumed uniform routing).")


def score_cells(row: dict[str, Any]) -> tuple[str, str]:
    if row.get("argmax_share") is None:
        return "–", "–"
    return f"{100 * row['argmax_share']:.1f} of {row.get('scored_steps', '?')}", num(row.get("max_gap_std"), 3)


def score_note(r: dict[str, Any], decode: list[dict[str, Any]]) -> str:
    """What the scorer columns mean, and how each scored arm compares with transformers' eager loop."""
    how = (r.get("extra") or {}).get("scorer") or "fp32 eager forward of the arm's weights"
    eager = {(x["layers"], x["B"]): x["argmax_share"] for x in decode
             if x["arm"] == "hf_eager" and x.get("argmax_share") is not None}
    lines = [f"fp32 argmax % / largest gap: each arm's generated tokens scored by an {how}: the share of steps whose "
             "token is the scorer's argmax, and the largest gap between the scorer's best logit and its logit of the "
             "chosen token, in units of the std of its logits (the bar: argmax share at least the eager loop's "
             "minus 2 points, gap at most 0.1 std)."]
    for x in decode:
        ref = eager.get((x["layers"], x["B"]))
        if x.get("argmax_share") is None or x["arm"] == "hf_eager":
            continue
        verdict = [] if ref is None else [f"{100 * (x['argmax_share'] - ref):+.1f} points against `hf_eager`"]
        ok = (ref is None or x["argmax_share"] >= ref - 0.02) and x["max_gap_std"] <= 0.1
        lines.append(f"- {x['layers']} layers B={x['B']} `{x['arm']}`: "
                     + ", ".join(verdict + [f"gap {x['max_gap_std']:.3f} std"]) + (": within" if ok else ": OUT OF")
                     + " the bound" + ("" if ref is not None else " (no eager loop in this run: gap only)"))
    return "\n".join(lines)


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


# The README claims the arms whose kept rows ran next to their peer in one call; the kept FP8 row's hf_static ran in
# another call (its ratio to moefx bf16 in its own call is on the page's Source line), so it is not claimed here.
HEADLINE_LABELS = {
    "moefx": "`moefx.optimize(model)` + `generate()`",
}


def headline(results: dict[str, dict[str, Any]]) -> list[str]:
    """The README's end-to-end lines: decode against the peer (stage `e2e`), then time to first token (`ttft`)."""
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
    return out


SECTIONS = (Section("e2e", render_e2e), Section("ttft", render_ttft))
