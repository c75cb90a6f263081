"""The section of bench/stream.py's kept result: a long stream of mixed requests through the engine."""

from __future__ import annotations

import re
from typing import Any

from bench.sections.markdown import Section, num, section, sig, table


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


SECTIONS = (Section("stream", render_stream),)
