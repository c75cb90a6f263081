"""Decode attention (`moefx::decode_attention`, one launch per call) against torch's SDPA, and its slice count.

Qwen3-30B-A3B's attention (32 query heads, 4 KV heads, head dim 128, bf16) over a static cache as the engine holds
it: `cache` positions allocated, the first `written` kept by a bool mask (the unwritten tail is skipped block by
block). Per shape: the kernel with the slices the op picks (`splits_for`), the kernel asked for 1, 2, 4, 8, 16 and 32
slices (which slice length pays at these lengths; a slice keeps whole 64-position blocks, so short caches run
fewer), each of these also with the other form of its K/V loads (with the mask or after it, `SPECULATE` in
moefx/kernels/decode_attn.py: the twin of the op's choice is "moefx, speculative loads on" where the op loads after
the mask, "off" where it speculates; the others "..., speculative loads on/off" alike), and the peer, torch's SDPA
over the KV heads expanded to every query head (what the op replaces in a compiled step, the expansion included).
Correctness first, on this device: every arm against an fp32 SDPA of the same inputs (relative error <= 1e-2, bf16
output). Timings are CUDA-graph replays of 64 calls cycling through input sets larger than the L2 (48 layers evict a
layer's cache), median of 7.
floor = max(one replayed launch, (the kept keys and values + q + out) / the copy rate).

    python bench/attention.py          # on the GPU: about a minute; table last, JSON to $OUT/attention.json
    python bench/attention.py --quick  # CPU smoke run (TRITON_INTERPRET=1, small shapes, checks only)
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __name__ == "__main__" and ("--quick" in sys.argv or not torch.cuda.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before moefx's kernels are defined: the smoke run interprets them

from bench.harness import copy_ceiling_Bps, relerr, time_rotated, write_json
from moefx.kernels.decode_attn import decode_attention_triton, speculates
from moefx.ops.decode_attention import decode_attention_reference, splits_for

HEADS, KV_HEADS, DIM = 32, 4, 128
# (batch, cache positions, written positions): decode at batch 1 in a 256- and a 512-position bucket, longer
# contexts, and batch 16
SHAPES = ((1, 256, 160), (1, 512, 300), (1, 1024, 1000), (1, 4096, 4000), (16, 512, 300))
QUICK_SHAPES = ((1, 128, 70), (2, 64, 64))
SPLITS = (1, 2, 4, 8, 16, 32)
L2_BYTES = 60 << 20
CALLS = 64
BOUND = 1e-2


def inputs(batch: int, cache: int, written: int, dev: str, dtype: torch.dtype, gen: torch.Generator,
           heads: int = HEADS, kv_heads: int = KV_HEADS, dim: int = DIM) -> tuple:
    q = torch.randn(batch, heads, 1, dim, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(batch, kv_heads, cache, dim, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(batch, kv_heads, cache, dim, device=dev, dtype=dtype, generator=gen)
    mask = torch.zeros(batch, cache, dtype=torch.bool, device=dev)
    mask[:, :written] = True
    return q, k, v, mask


class Arm(NamedTuple):
    """The kernel's slice count and K/V loads (speculate None: as the op runs it, by the slice length)."""

    splits: int
    speculate: bool | None = None


def arms(batch: int, kv_heads: int, cache: int) -> dict[str, Arm | None]:
    """Arm name -> the kernel's slices and K/V loads (None: the peer). Each slice count runs as the op would, then
    with the other form of the K/V loads."""
    auto = splits_for(batch, kv_heads, cache)
    out: dict[str, Arm | None] = {}
    for s in (auto, *(s for s in SPLITS if s != auto)):
        name = f"moefx ({s} slices, the op's choice)" if s == auto else f"moefx, {s} slices"
        other = not speculates(cache, s)
        twin = "moefx" if s == auto else name
        out[name] = Arm(s)
        out[f"{twin}, speculative loads {'on' if other else 'off'}"] = Arm(s, other)
    out["sdpa (peer)"] = None
    return out


def call(arm: Arm | None, q, k, v, mask, scale: float, out: torch.Tensor) -> torch.Tensor:
    if arm is None:
        return decode_attention_reference(q, k, v, mask, scale)
    decode_attention_triton(q, k, v, mask, scale, out, arm.splits, arm.speculate)
    return out


def run_shape(batch: int, cache: int, written: int, dev: str, quick: bool, copy_bps: float | None,
              launch_us: float) -> dict:
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(batch * 7919 + cache)
    dims = dict(heads=8, kv_heads=2, dim=32) if quick else {}
    q, k, v, mask = inputs(batch, cache, written, dev, dtype, gen, **dims)
    scale = q.shape[-1] ** -0.5
    want = decode_attention_reference(q.float(), k.float(), v.float(), mask, scale)
    row: dict = {"batch": batch, "cache": cache, "written": written, "checks": {}, "us": {}}
    for name, arm in arms(batch, k.shape[1], cache).items():
        got = call(arm, q, k, v, mask, scale, torch.empty_like(q))
        err = relerr(got.float(), want)
        row["checks"][name] = {"relerr": err, "ok": err <= BOUND}
    if dev != "cuda":
        return row
    per_set = sum(t.nbytes for t in (q, k, v, mask)) * 2
    sets = [inputs(batch, cache, written, dev, dtype, gen) for _ in range(max(2, -(-2 * L2_BYTES // per_set)))]
    outs = [torch.empty_like(s[0]) for s in sets]
    arg_sets = [(*s, o) for s, o in zip(sets, outs)]
    for name, arm in arms(batch, KV_HEADS, cache).items():
        row["us"][name] = time_rotated(lambda q, k, v, m, o, a=arm: call(a, q, k, v, m, scale, o), arg_sets, CALLS)
    kept = batch * KV_HEADS * written * DIM * 2 * 2 + 2 * q.nbytes
    row["floor_us"] = max(launch_us, kept / copy_bps * 1e6)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run (interpreted kernel, checks only)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    result: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
                    "date": datetime.date.today().isoformat(), "rows": []}
    copy_bps = launch_us = None
    if dev == "cuda":
        copy_bps = copy_ceiling_Bps("cuda")
        x = torch.zeros(1, device="cuda")
        launch_us = time_rotated(lambda: x.add_(1), [()], CALLS)
        result.update(copy_TBps=copy_bps / 1e12, launch_us=launch_us)
    for shape in QUICK_SHAPES if dev == "cpu" else SHAPES:
        row = run_shape(*shape, dev, dev == "cpu", copy_bps, launch_us or 0.0)
        result["rows"].append(row)
        for name, c in row["checks"].items():
            print(f"check B={row['batch']} cache={row['cache']} written={row['written']} {name:40} "
                  f"relerr {c['relerr']:.1e} (bound {BOUND:.0e}) {'ok' if c['ok'] else 'FAIL'}", flush=True)
    bad = [name for r in result["rows"] for name, c in r["checks"].items() if not c["ok"]]
    write_json("attention.json", result)
    if bad:
        print(f"correctness: {len(bad)} arms out of bound: {bad}")
        sys.exit(1)
    if dev == "cuda":
        print(f"\ndecode attention, {result['device']}, torch {torch.__version__}, copy {copy_bps / 1e12:.2f} TB/s, "
              f"one replayed launch {launch_us:.2f} µs (µs per call, CUDA-graph replay, caches rotated past L2)")
        for r in result["rows"]:
            cells = "  ".join(f"{name}: {us:.2f}" for name, us in r["us"].items())
            print(f"B={r['batch']:2d} cache {r['cache']:4d} written {r['written']:4d} floor {r['floor_us']:.2f} | "
                  f"{cells}")


if __name__ == "__main__":
    main()
