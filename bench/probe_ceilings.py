"""Probe: what library GEMMs reach at the MoE's large-M shapes, next to our grouped GEMMs, in one run.

At M tokens (top-8) GEMM 1 is [8M, H] x [H, 2I] and GEMM 2 [8M, I] x [I, H] in FLOPs. Timed (CUDA-graph replay,
median): cuBLAS dense bf16 and FP8 (rowwise scales, and block-128 scales where torch's `_scaled_mm` takes them) at
those shapes, and a plain Triton GEMM (TMA operands, best of a few tiles; FP8 without scales); CUTLASS grouped bf16
(`torch._grouped_mm`) over the 128 experts with real routing on rows already sorted by expert; our GEMM 1 / GEMM 2
kernels (profiler) with the same routing, and with "dense-like" routing (8 experts, every token to all 8: full
blocks, weights from L2). The floor's matmul rates come from an 8192^3 matmul; this says how close a library gets
at these shapes. Usage: python3 bench/probe_ceilings.py [Ms]; JSON to $OUT/probe_ceilings.json."""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import ceilings, kernel_times, routing, time_graph, write_json
from moefx.kernels.moe_call import MoeCall
from moefx.kernels.moe_grouped import fused_moe
from moefx.ops.quant import quant_weight_fp8_block

E, H, I, K = 128, 2048, 768, 8
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
GEMMS = (("gemm1", H, 2 * I), ("gemm2", I, H))  # (name, K, N) of each expert GEMM


def expert_weights(e: int, gen: torch.Generator) -> dict[str, tuple]:
    """Random experts as fused_moe takes them: bf16 (w13, w2) and their FP8 block-128 quantization with scales."""
    w13 = (torch.randn(e, 2 * I, H, device="cuda", generator=gen) / H**0.5).to(BF16)
    w2 = (torch.randn(e, H, I, device="cuda", generator=gen) / I**0.5).to(BF16)
    q13, s13 = quant_weight_fp8_block(w13, 128, 128)
    q2, s2 = quant_weight_fp8_block(w2, 128, 128)
    return {"bf16": (w13, w2, None, None, None), "fp8": (q13, q2, s13, s2, (128, 128))}


def ours(label: str, m: int, weights: dict, inputs: tuple, rows: list[dict]) -> None:
    """Our GEMM 1 and GEMM 2 kernel times (profiler) for both weight kinds on one (hidden, ids, weights) input."""
    r = m * inputs[1].shape[1]
    for dt, args in weights.items():
        kt = kernel_times(lambda x, i, w, args=args: fused_moe(MoeCall(x, i, w, *args)), [inputs])
        for gemm, k, n in GEMMS:
            us = next(v for name, v in kt.items() if gemm in name)
            rows.append(dict(name=f"{label} {dt} {gemm}", M=m, us=round(us, 1),
                             tflops=round(2 * r * k * n / us * 1e-6, 1)))
            print(rows[-1], flush=True)


def timed(name: str, flops: float, fn, rows: list[dict], **info) -> None:
    row = dict(name=name, **info)
    try:
        us = time_graph(fn, reps=10)
        row |= dict(us=round(us, 1), tflops=round(flops / us * 1e-6, 1))
    except Exception as exc:  # a library call this torch does not take is a result too
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    rows.append(row)
    print(row, flush=True)


@triton.jit
def _dense_mm_kernel(a_desc, b_desc, c_desc, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C = A @ B^T, both operands through TMA (no gather, no scales): what Triton reaches on a plain GEMM."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        acc = tl.dot(a_desc.load([pid_m * BLOCK_M, k]), b_desc.load([pid_n * BLOCK_N, k]).T, acc)
    c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(tl.bfloat16))


TRITON_TILES = {  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) per operand dtype
    "bf16": ((128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3)),
    "fp8": ((128, 256, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 128, 4, 4), (256, 128, 128, 8, 3)),
}


def triton_dense(a: torch.Tensor, b: torch.Tensor, flops: float, m: int, gemm: str, rows: list[dict]) -> None:
    """The best of TRITON_TILES for A [R, K] @ B [N, K]^T, checked against torch first."""
    dt = "fp8" if a.dtype == FP8 else "bf16"
    ref = (a.float() @ b.float().t())
    best: dict = dict(name=f"triton dense {dt} {gemm}", M=m)
    for bm, bn, bk, warps, stages in TRITON_TILES[dt]:
        c = torch.empty(a.shape[0], b.shape[0], dtype=BF16, device="cuda")
        descs = (TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bn, bk]),
                 TensorDescriptor.from_tensor(c, [bm, bn]))
        grid = (triton.cdiv(a.shape[0], bm) * triton.cdiv(b.shape[0], bn),)

        def fn(descs=descs, grid=grid, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, c=c):
            _dense_mm_kernel[grid](*descs, c.shape[0], c.shape[1], a.shape[1], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                   GROUP_M=8, num_warps=warps, num_stages=stages)
        try:
            fn()
            err = ((c.float() - ref).norm() / ref.norm()).item()
            us = time_graph(fn, reps=10)
        except Exception as exc:  # a tile this GPU cannot take
            print(f"triton tile {(bm, bn, bk, warps, stages)}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        if err < 1e-2 and us < best.get("us", float("inf")):
            best |= dict(us=round(us, 1), tflops=round(flops / us * 1e-6, 1), tile=(bm, bn, bk, warps, stages),
                         relerr=err)
    rows.append(best)
    print(best, flush=True)


def dense(m: int, gen: torch.Generator, rows: list[dict]) -> None:
    r = m * K
    for gemm, k, n in GEMMS:
        flops = 2 * r * k * n
        a = torch.randn(r, k, device="cuda", generator=gen).to(BF16)
        b = torch.randn(n, k, device="cuda", generator=gen).to(BF16)
        timed(f"cublas bf16 {gemm}", flops, lambda a=a, b=b: a @ b.t(), rows, M=m)
        triton_dense(a, b, flops, m, gemm, rows)
        a8, b8 = a.to(FP8), b.to(FP8)
        triton_dense(a8, b8, flops, m, gemm, rows)
        sa, sb = torch.ones(r, 1, device="cuda"), torch.ones(1, n, device="cuda")
        timed(f"cublas fp8 rowwise {gemm}", flops,
              lambda a8=a8, b8=b8, sa=sa, sb=sb: torch._scaled_mm(a8, b8.t(), sa, sb, out_dtype=BF16), rows, M=m)
        # block-128 (DeepSeek) scales: A 1x128 per row and K group, B 128x128; cuBLAS wants them outer-dim major
        sa_blk = torch.ones(k // 128, r, device="cuda").t()
        sb_blk = torch.ones(n // 128, k // 128, device="cuda").t()
        timed(f"cublas fp8 block128 {gemm}", flops,
              lambda a8=a8, b8=b8, sa=sa_blk, sb=sb_blk: torch._scaled_mm(a8, b8.t(), sa, sb, out_dtype=BF16),
              rows, M=m)


def grouped(m: int, gen: torch.Generator, weights: dict, rows: list[dict]) -> None:
    """CUTLASS grouped bf16 on expert-sorted rows (the sort itself untimed), and our kernels on the same routing."""
    w13, w2 = weights["bf16"][:2]
    x = torch.randn(m, H, device="cuda", generator=gen).to(BF16)
    ids, tw = routing(m, E, K, "cuda", gen)
    order = ids.flatten().argsort()
    offs = torch.bincount(ids.flatten(), minlength=E).cumsum(0).to(torch.int32)
    xs = x[order // K]
    inter = torch.randn(m * K, I, device="cuda", generator=gen).to(BF16)
    for (gemm, k, n), a, w in zip(GEMMS, (xs, inter), (w13, w2)):
        timed(f"cutlass grouped bf16 {gemm}", 2 * m * K * k * n,
              lambda a=a, w=w: torch._grouped_mm(a, w.transpose(1, 2), offs=offs), rows, M=m)
    ours("ours", m, weights, (x, ids, tw), rows)


def dense_like(m: int, gen: torch.Generator, rows: list[dict]) -> None:
    """Our kernels with 8 experts and every token routed to all 8: full blocks, no padding, weights reused from L2."""
    e = K
    x = torch.randn(m, H, device="cuda", generator=gen).to(BF16)
    ids = torch.arange(e, device="cuda").repeat(m, 1)
    tw = torch.full((m, e), 1.0 / e, device="cuda")
    ours("ours dense-like", m, expert_weights(e, gen), (x, ids, tw), rows)


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    ceil = ceilings()
    print({k: round(v / 1e12, 1) for k, v in ceil.items()}, "(TFLOP/s, TB/s)", flush=True)
    weights = expert_weights(E, gen)
    rows: list[dict] = []
    for m in (int(a) for a in (sys.argv[1] if len(sys.argv) > 1 else "1024,4096").split(",")):
        dense(m, gen, rows)
        grouped(m, gen, weights, rows)
        dense_like(m, gen, rows)
    write_json("probe_ceilings.json", dict(ceilings=ceil, rows=rows))
    print(f"\nceilings: bf16 {ceil['bf16_flops'] / 1e12:.0f}, fp8 {ceil['fp8_flops'] / 1e12:.0f} TFLOP/s (8192^3)")
    print(f"{'M':>5} {'name':34} {'us':>8} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['M']:5d} {r['name']:34} {r.get('us', 0):8.1f} {r.get('tflops', 0):8.1f} {r.get('error', '')[:60]}")


if __name__ == "__main__":
    main()
