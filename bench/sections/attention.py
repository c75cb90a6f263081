"""The section of bench/attention.py's kept result: moefx::decode_attention against torch's SDPA and its floor."""

from __future__ import annotations

from typing import Any

from bench.sections.markdown import Section, num, ratio, section, table

PEER = "sdpa (peer)"


def render_attention(r: dict[str, Any]) -> str:
    slices = sorted({int(k.split(", ")[1].split()[0]) for x in r["rows"] for k in x["us"] if k.startswith("moefx, ")})
    rows = []
    for x in r["rows"]:
        choice = next(k for k in x["us"] if k.startswith("moefx ("))
        op, taken = x["us"][choice], int(choice[7:].split()[0])
        rows.append((x["batch"], x["cache"], x["written"], f"{num(op, 2)} ({taken})",
                     *(num(op if n == taken else x["us"].get(f"moefx, {n} slices"), 2) for n in slices),
                     num(x["us"].get(PEER), 2),
                     num(x["floor_us"], 2), ratio(op, x["floor_us"]), ratio(x["us"].get(PEER), op)))
    columns = [f"{n} slice{'s' * (n > 1)} µs" for n in slices]
    body = table(["B", "cache", "written", "the op's choice µs (slices)", *columns, "SDPA µs (peer)", "floor µs",
                  "op / floor", "SDPA / op"], rows)
    body += ("\n\nBatch B, one query position, Qwen3-30B-A3B's attention (32 query heads, 4 KV heads, head_dim 128, "
             "bf16), a bool mask over `cache` positions of which `written` are kept; CUDA-graph replay medians over "
             "caches rotated past L2, every arm checked against an fp32 reference first (relative error ≤ 1e-2; "
             "kept in the data). The op's choice is `splits_for` (moefx/ops/decode_attention.py) at the run's "
             "commit (the same kernel in every column, the slice count forced). The op now takes up to 32 slices "
             "(`MAX_SPLITS`), so at the 4096-long cache it runs the 32-slice column.")
    return section("Decode attention (`moefx::decode_attention`)", r,
                   what="The decode step's attention in one kernel launch (moefx/kernels/decode_attn.py), µs per call.",
                   peer="torch's `scaled_dot_product_attention` over the K/V expanded to every query head, same run",
                   floor=f"the kept positions' keys and values, q and the output / {r['copy_TBps']:.2f} TB/s "
                         f"(measured copy rate), at least one replayed launch ({r['launch_us']:.2f} µs)", body=body)


SECTIONS = (Section("attention", render_attention),)
