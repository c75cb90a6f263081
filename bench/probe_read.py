"""Probe: how fast can a kernel only read the bytes a decode call must read? A lower bound for small-M MoE.

The floor divides the touched bytes by the copy rate of a 1 GiB copy; a decode call moves tens of MB, where launch,
ramp-up and tail weigh. Timed (CUDA-graph replay, median, rotating over regions that together exceed L2, so reads
come from HBM): one read-only Triton kernel over B bytes (best of a few grids), and two dependent kernels over the
gemv's stage-1 and stage-2 bytes, as the two-stage decode must. Sizes: Qwen3-30B-A3B experts at M=1 (FP8: 8 x 4.72
MB; bf16: 8 x 9.44 MB) and all 128 experts (M=1024). Usage: python3 bench/probe_read.py; JSON to
$OUT/probe_read.json."""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import ceilings, time_graph, write_json

EXPERT_FP8 = 3 * 2048 * 768  # bytes of one expert's w13 + w2 in FP8 (bf16: twice)
L2_BYTES = 60 << 20  # more than the H200's 50 MB L2


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Each program reads ITERS blocks of BLOCK int32 words, strided by the grid (16-byte loads), and keeps a sum."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERS):
        offs = (i * tl.num_programs(0) + pid) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + offs, mask=offs < n_words, other=0, eviction_policy="evict_first")
    tl.store(out_ptr + pid, tl.sum(acc))


def reader(nbytes: int, programs: int, block: int, warps: int):
    """fn(buf) reading the first `nbytes` of buf with this grid."""
    words = nbytes // 4
    iters = triton.cdiv(words, programs * block)
    out = torch.empty(programs, dtype=torch.int32, device="cuda")

    def fn(buf: torch.Tensor) -> None:
        _read_kernel[(programs,)](buf, out, words, BLOCK=block, ITERS=iters, num_warps=warps)
    return fn


def regions(nbytes: int) -> list[torch.Tensor]:
    """Enough disjoint buffers of nbytes that cycling through them misses L2."""
    n = max(2, -(-2 * L2_BYTES // nbytes))
    return [torch.ones(nbytes // 4, dtype=torch.int32, device="cuda") for _ in range(n)]


def best_read(nbytes: int, sms: int) -> tuple[float, tuple[int, int, int]]:
    """(µs, (programs, block, warps)) of the fastest grid reading nbytes from HBM."""
    bufs = regions(nbytes)
    best = (float("inf"), (0, 0, 0))
    for per_sm in (1, 2, 4, 8):
        for block, warps in ((1024, 4), (2048, 8), (4096, 8)):
            grid = (min(sms * per_sm, triton.cdiv(nbytes // 4, block)), block, warps)
            fn = reader(nbytes, *grid)
            best = min(best, (time_graph(lambda fn=fn: [fn(b) for b in bufs], reps=10) / len(bufs), grid))
    return best


def two_reads(b1: int, b2: int, grid1: tuple, grid2: tuple) -> float:
    """µs of reading b1 bytes, then (a dependent launch) b2 bytes."""
    bufs1, bufs2 = regions(b1), regions(b2)
    f1, f2 = reader(b1, *grid1), reader(b2, *grid2)
    pairs = list(zip(bufs1, bufs2))
    return time_graph(lambda: [(f1(x), f2(y)) for x, y in pairs], reps=10) / len(pairs)


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ceil = ceilings()
    rows = []

    def record(name: str, nbytes: int, us: float, grid: str) -> None:
        rows.append(dict(name=name, bytes=nbytes, us=round(us, 2), floor_us=round(nbytes / ceil["copy_Bps"] * 1e6, 2),
                         grid=grid))
        print(rows[-1], flush=True)

    grids = {}
    for dt, per_expert in (("fp8", EXPERT_FP8), ("bf16", 2 * EXPERT_FP8)):
        s1, s2 = f"{dt} M=1 stage 1 (w13 of 8 experts)", f"{dt} M=1 stage 2 (w2 of 8 experts)"
        for name, nbytes in ((s2, 8 * per_expert // 3), (s1, 16 * per_expert // 3), (f"{dt} M=1 (8 experts)",
                             8 * per_expert), (f"{dt} M=1024 (128 experts)", 128 * per_expert)):
            us, grids[name] = best_read(nbytes, sms)
            record(name, nbytes, us, "{} programs x {} words, {} warps".format(*grids[name]))
        b1, b2 = 16 * per_expert // 3, 8 * per_expert // 3
        us = two_reads(b1, b2, grids[s1], grids[s2])
        record(f"{dt} M=1 two dependent reads", b1 + b2, us, "each stage at its best grid")
    write_json("probe_read.json", dict(ceilings=ceil, rows=rows))
    print(f"\ncopy ceiling {ceil['copy_Bps'] / 1e12:.2f} TB/s (1 GiB)")
    print(f"{'what':38} {'MB':>7} {'us':>8} {'floor':>8} {'x floor':>7}")
    for r in rows:
        ratio = r["us"] / r["floor_us"]
        print(f"{r['name']:38} {r['bytes'] / 1e6:7.1f} {r['us']:8.2f} {r['floor_us']:8.2f} {ratio:7.2f}")


if __name__ == "__main__":
    main()
