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
            after = first - x["optimize_s"] if first is not None and x.get("optimize_s") is not None else None
            rows.append((run["layers"], run["batch"], f"`{x['arm']}`", num(first, 1), num(after, 1),
                         num(x.get("ready_s"), 1),
                         ratio(first, peer) if x["arm"] != "hf_static" and peer and first else "–",
                         f"{x.get('fxgraph_cache_miss', '–')} / {x.get('fxgraph_cache_hit', '–')}, "
                         f"{x.get('aot_autograd_cache_miss', '–')}",
                         _triton(x), _decode_captures(x),
                         {True: "yes", False: "**no**"}.get(x.get("same_tokens_as_cold"), "–"),
                         x.get("error") or ("in the saving process" if x.get("in_process") else "")))
    body = table(["layers", "B", "arm", "first call s", "of it after optimize s", "ready s", "× peer",
                  "compiles: inductor miss / hit, AOTAutograd miss",
                  "moefx Triton first-launch compiles", "decode capture s (first run, check run, capture)",
                  "tokens = cold", "notes"], rows)
    body += ("\n\nArms (each a new process with empty inductor and Triton caches, except where the arm keeps them):\n"
             "- `hf_static`: transformers `generate(cache_implementation=\"static\")`, its own compile; from runs "
             "that mark it \"in the saving process\", the first call of `moefx_cold`'s process, which ran it first\n"
             "- `moefx_cold`: `moefx.optimize(model)` + the first `generate()`, moefx's compile cache empty (the "
             "saving process: transformers' compile ran before it where `hf_static` is marked so)\n"
             "- `moefx_warm`: a \"new machine\": the same with only the compile cache file `moefx_cold` wrote\n"
             "- `moefx_restart`: as `moefx_warm`, with the Triton cache `moefx_cold` left (a restart on the same "
             "machine)\n"
             "- `moefx_restart_serial`: as `moefx_restart` with `TORCHINDUCTOR_COMPILE_THREADS=1` (inductor loads "
             "its kernels in the process, no worker pool)\n\nFirst call = optimize + the first `generate()` "
             "(after optimize: the first `generate()` "
             "alone); ready = from the process's start, less "
             "transformers' run in the saving process. Compiles: inductor's FX graph cache misses and hits, and "
             "AOTAutograd's cache misses (the only count where a saved-trace compile bundles inductor's output). "
             "moefx Triton first-launch compiles: moefx's own kernels Triton compiled in the process (neither in "
             "its Triton folder nor written there from the file), with the seconds Triton's compile took for them "
             "and its launcher stubs' C builds (count, seconds) where the run timed them. A decode capture's "
             "seconds: its first run (compiles or loads), the check run (host syncs as errors) and the capture "
             "(`moefx/engine/graphs.py`).")
    return section(
        "Cold start", r,
        what=f"Qwen3-30B-A3B widths, bf16, a {runs_[0]['prompt']}-token prompt, greedy (`bench/coldstart.py`).",
        peer="`hf_static` in the same run; `× peer` = first call s over the peer's",
        floor="none (compile time has no hardware floor)", body=body)


def _or_dash(value: Any) -> str:
    return "–" if value is None else str(value)


def _decode_captures(row: dict[str, Any]) -> str:
    """Each decode capture's seconds by batch: total (first run, check run, capture)."""
    parts = []
    for c in row.get("capture_s") or []:
        if c.get("what") == "decode":
            first, check, capture = (c.get(k, 0.0) for k in ("first_run", "check_run", "capture"))
            parts.append(f"B{c['batch']}: {num(first + check + capture, 2)} ({num(first, 2)}, {num(check, 2)}, "
                         f"{num(capture, 2)})")
    return "; ".join(parts) or "–"


SECTIONS = (Section("coldstart", render_coldstart),)


def _triton(x: dict[str, Any]) -> str:
    """moefx's first-launch Triton compiles, and where timed their seconds and the launcher stubs' C builds."""
    count = _or_dash(x.get("moefx_triton_compiles"))
    if x.get("moefx_triton_compile_s") is None:
        return count
    return (f"{count} ({num(x['moefx_triton_compile_s'], 1)} s; {x.get('triton_c_builds', 0)} C builds "
            f"{num(x.get('triton_c_build_s'), 1)} s)")
