"""The section of bench/attention.py's kept result: moefx::decode_attention against torch's SDPA and its floor."""

from __future__ import annotations

import re
from typing import Any

from bench.sections.markdown import Section, num, ratio, section, table

PEER = "sdpa (peer)"
SLICES = re.compile(r"moefx, (\d+) slices$")  # a forced slice count, K/V loads as the op runs them
OTHER_LOADS = re.compile(r"moefx, speculative loads (on|off)$")  # the op's slices, the other form of the K/V loads


def render_attention(r: dict[str, Any]) -> str:
    slices = sorted({int(m[1]) for x in r["rows"] for k in x["us"] if (m := SLICES.match(k))})
    other_loads = any(OTHER_LOADS.match(k) for x in r["rows"] for k in x["us"])
    rows = []
    for x in r["rows"]:
        choice = next(k for k in x["us"] if k.startswith("moefx ("))
        op, taken = x["us"][choice], int(choice[7:].split()[0])
        other = next((f"{num(us, 2)} ({m[1]})" for k, us in x["us"].items() if (m := OTHER_LOADS.match(k))), "–")
        rows.append((x["batch"], x["cache"], x["written"], f"{num(op, 2)} ({taken})",
                     *([other] if other_loads else []),
                     *(num(op if n == taken else x["us"].get(f"moefx, {n} slices"), 2) for n in slices),
                     num(x["us"].get(PEER), 2),
                     num(x["floor_us"], 2), ratio(op, x["floor_us"]), ratio(x["us"].get(PEER), op)))
    columns = [f"{n} slice{'s' * (n > 1)} µs" for n in slices]
    other_column = ["the op's slices, other K/V loads µs (speculative)"] if other_loads else []
    body = table(["B", "cache", "written", "the op's choice µs (slices)", *other_column, *columns, "SDPA µs (peer)",
                  "floor µs", "op / floor", "SDPA / op"], rows)
    body += ("\n\nBatch B, one query position, Qwen3-30B-A3B's attention (32 query heads, 4 KV heads, head_dim 128, "
             "bf16), a bool mask over `cache` positions of which `written` are kept; CUDA-graph replay medians over "
             "caches rotated past L2, every arm checked against an fp32 reference first (relative error ≤ 1e-2; "
             "kept in the data). The op's choice is `splits_for` (moefx/ops/decode_attention.py) at the run's "
             "commit (the same kernel in every column, the slice count forced). The op takes up to 32 slices "
             "(`MAX_SPLITS`), so at the 4096-long cache it runs the 32-slice column.")
    if other_loads:
        body += (" The other K/V loads column runs the op's slices with the form of the K/V loads the op does not "
                 "take there (`SPECULATE`, moefx/kernels/decode_attn.py: on, loaded with the mask; off, after it); "
                 "with `SPECULATE_DEFAULT` on the op speculates where a slice is at most `SPECULATE_BLOCKS` blocks. "
                 "The data also holds every forced slice count in its other form.")
    return section("Decode attention (`moefx::decode_attention`)", r,
                   what="The decode step's attention in one kernel launch (moefx/kernels/decode_attn.py), µs per call.",
                   peer="torch's `scaled_dot_product_attention` over the K/V expanded to every query head, same run",
                   floor=f"the kept positions' keys and values, q and the output / {r['copy_TBps']:.2f} TB/s "
                         f"(measured copy rate), at least one replayed launch ({r['launch_us']:.2f} µs)", body=body)


SECTIONS = (Section("attention", render_attention),)
