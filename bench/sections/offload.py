"""The section of bench/offload.py's kept result: expert offload to host memory; the README's offload line."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from bench.sections.markdown import Section, section, sig, table


@dataclass(frozen=True)
class OffloadRow:
    """One row bench/offload.py writes: a decode or prefill measurement with the experts in host memory. Its floor:
    decode = routed-expert bytes per token / host copy rate, prefill = all expert bytes / pinned H2D rate (both
    measured in the run)."""

    what: str
    tok_s: float
    floor_tok_s: float | None

    def to_json(self) -> dict[str, Any]:
        """The JSON row, with `vs_floor` = tok/s over the floor (None without a floor)."""
        return {**asdict(self), "vs_floor": self.tok_s / self.floor_tok_s if self.floor_tok_s else None}


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
             "the GPU vs `reference` (bf16): " + ", ".join(f"{k} {v:.1e}" for k, v in chk.items()) + " relative"
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


def headline(results: dict[str, dict[str, Any]]) -> list[str]:
    """The README's offload line: against accelerate, and graph-replayed decode against the host-bandwidth floor."""
    off = results.get("offload")
    if not off:
        return []
    graph = [x for x in off["rows"] if "CUDA graph" in x["what"]]
    return [f"Offload ({off['layers']} layers, experts in host memory): {off['vs_accelerate_8_layers']:.0f}× "
            "accelerate's `dispatch_model`; graph-replayed decode at "
            + ", ".join(f"{100 * x['tok_s'] / x['floor_tok_s']:.0f}% ({x['what'].split(',')[0][7:]})"
                        for x in graph) + " of the host-bandwidth floor."]


SECTIONS = (Section("offload", render_offload),)
