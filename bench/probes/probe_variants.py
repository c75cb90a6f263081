"""Probe: tile variants of one backend against its defaults, A B C A B C in one run, at the M given (default 4096)
and dtypes (default bf16,fp8); CUDA-graph replay plus the kernel breakdown. The variants are the current experiment's.
Usage: python3 bench/probes/probe_variants.py [Ms] [dtypes] [grouped|gemv]"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.harness import kernel_times, relerr, routing, time_graph, write_json
from moefx.backends import BACKENDS, MoeCall
from moefx.kernels.moe_gemv import GemvConfig, default_gemv_config, gemv_moe
from moefx.kernels.moe_grouped import GemmConfig, default_tiles, fused_moe, normalize_tiles
from moefx.ops.quant import quant_weight_fp8_block

E, H, I, K = 128, 2048, 768, 8


def variants(c1: GemmConfig, c2: GemmConfig) -> dict[str, tuple[GemmConfig, GemmConfig]]:
    """The experiment: named (GEMM 1, GEMM 2) tiles next to the defaults (here, the last one run, 7fdb728: the plain
    Triton GEMM's best tile at these shapes, 128x128 with 4 warps and 4 stages, as GEMM 1 (gate 64 + up 64 columns)
    and as GEMM 2; bf16 only, FP8 GEMM 1's BLOCK_N is the quant block)."""
    g1 = replace(c1, block_n=64, num_warps=4, num_stages=4)
    g2 = replace(c2, block_m=c1.block_m, block_n=128, num_warps=4, num_stages=4)
    return {"default": (c1, c2), "g1 64n w4 s4": (g1, c2), "g2 128x128 w4 s4": (c1, g2), "both": (g1, g2)}


def gemv_variants(cfg: GemvConfig) -> dict[str, GemvConfig]:
    """The gemv experiment: named GemvConfigs next to the default (here: PDL off; the stage-1 L2
    prefetch of w2, `GemvConfig.l2_prefetch`, is in git at 2fd0eda)."""
    return {"default": cfg, "no pdl": replace(cfg, pdl=False)}


def calls(kind: str, m: int, fp8: bool, bs) -> dict:
    """name -> fused_moe / gemv_moe keyword arguments of each variant."""
    if kind == "gemv":
        return {n: dict(config=c) for n, c in gemv_variants(default_gemv_config(m, fp8)).items()}
    return {n: dict(zip(("config", "config2"), normalize_tiles(*v, bs)))
            for n, v in variants(*default_tiles(m, K, E, fp8)).items()}


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5).bfloat16()
    q13, s13 = quant_weight_fp8_block(w13, 128, 128)
    q2, s2 = quant_weight_fp8_block(w2, 128, 128)
    weights = {"bf16": (w13, w2, None, None, None), "fp8": (q13, q2, s13, s2, (128, 128))}
    rows = []
    for m in (int(a) for a in (sys.argv[1] if len(sys.argv) > 1 else "4096").split(",")):
        for dt, (a13, a2, sc13, sc2, bs) in weights.items():
            if dt not in (sys.argv[2] if len(sys.argv) > 2 else "bf16,fp8").split(","):
                continue
            sets = [(torch.randn(m, H, device="cuda", generator=gen, dtype=torch.bfloat16),
                     *routing(m, E, K, "cuda", gen)) for _ in range(4)]
            ref = BACKENDS["reference"](*sets[0], a13, a2, **({} if bs is None else dict(w13_scale=sc13, w2_scale=sc2,
                                                                                        block_shape=bs)))
            kind = sys.argv[3] if len(sys.argv) > 3 else "grouped"
            fn = gemv_moe if kind == "gemv" else fused_moe
            vs = calls(kind, m, dt == "fp8", bs)
            for name in [n for _ in range(2) for n in vs]:
                def call(x, ids, tw, kw=vs[name], a13=a13, a2=a2, sc13=sc13, sc2=sc2, bs=bs, fn=fn):
                    return fn(MoeCall(x, ids, tw, a13, a2, sc13, sc2, bs), **kw)
                row = dict(M=m, dtype=dt, variant=name)
                try:
                    row["relerr"] = relerr(call(*sets[0]), ref)
                    row["us"] = round(time_graph(lambda c=call, s=sets: [c(*a) for a in s], reps=10, trials=5) / 4, 1)
                    row |= {k: round(v, 1) for k, v in kernel_times(call, sets).items() if "gem" in k}
                except Exception as exc:  # a failure is a result
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                rows.append(row)
                print(row, flush=True)
    write_json("probe_variants.json", rows)
    print(f"\n{'M':>5} {'dtype':5} {'variant':18} {'us':>7} {'k1':>7} {'k2':>7} {'relerr':>8}")
    for r in rows:
        g1 = next((v for k, v in r.items() if "gemm1" in k or "gate_up" in k), 0)
        g2 = next((v for k, v in r.items() if "gemm2" in k or "down" in k), 0)
        print(f"{r['M']:5d} {r['dtype']:5} {r['variant']:18} {r.get('us', 0):7.1f} {g1:7.1f} {g2:7.1f} "
              f"{r.get('relerr', 0):8.2e} {r.get('error', '')}")


if __name__ == "__main__":
    main()
