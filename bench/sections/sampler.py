"""The section of bench/sampler.py's kept result: the sync-free decode loop; the README's sampling line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.sections.markdown import Section, num, ratio, section, span, table


@dataclass(frozen=True)
class DecodeRow:
    """One row of bench/sampler.py's `decode` list: an arm's decode speed, its host syncs and its floor."""

    arm: str
    mode: str  # "sample" or "greedy"
    batch: int
    tokens_per_s: float
    syncs_per_step: float | None  # counted with CUDA's sync debug mode; None where nothing counts them (the CPU)
    step_ms: float
    floor_step_ms: float  # weight bytes one step reads / the SM-copy ceiling (bench/harness.py)
    experts_hit: float | None = None  # distinct experts per layer the batch routed to (older kept runs lack it)
    routing: str | None = None

SAMPLER_ARMS = {
    "hf": "transformers `generate()` with static cache and its auto-compile",
    "hf+stop": "the same with moefx's deferred stop check (what `moefx.optimize` turns on for CUDA)",
    "moefx": "`moefx.engine.engine.DecodeLoop` (forward and sampler compiled with the moefx passes, CUDA graphs)",
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


def headline(results: dict[str, dict[str, Any]]) -> list[str]:
    """The README's sampling line, from the host syncs counted per `moefx` step (the most any row counted)."""
    rows = [DecodeRow(**x) for x in (results.get("sampler") or {}).get("decode", [])]
    counts = [x.syncs_per_step for x in rows if x.arm == "moefx" and x.syncs_per_step is not None]
    if not counts:  # not counted (a CPU run): no claim
        return []
    most = max(counts)
    syncs = "zero host syncs" if most == 0 else f"up to {most:.2f} host syncs"
    return [f"Sampling: {syncs} per decode step (counted with CUDA's sync debug mode)."]


SECTIONS = (Section("sampler", render_sampler),)
