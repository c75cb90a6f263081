"""The section of bench/coldstart.py's kept result: the first call in fresh processes."""

from __future__ import annotations

from typing import Any

from bench.sections.markdown import Section, num, ratio, section, table


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


SECTIONS = (Section("coldstart", render_coldstart),)
