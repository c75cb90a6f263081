"""Probe: the grouped defaults with half tiles (GemmConfig.half) against the tiles before them, A B A B in one run,
at M=1024 and 4096, bf16 and FP8; CUDA-graph replay plus the kernel breakdown.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from moe import BACKENDS, kernel_times, quant_block, relerr, routing, time_graph

from moefx.backends.kernels.fused_moe_kernels import GemmConfig, default_tiles, fused_moe, normalize_tiles

E, H, I, K = 128, 2048, 768, 8


def balanced(m: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(E, generator=gen, device="cuda")
    ids = perm[(torch.arange(m, device="cuda")[:, None] * K + torch.arange(K, device="cuda")[None, :]) % E]
    return ids, torch.full((m, K), 1.0 / K, device="cuda")


def variants(m: int, fp8: bool) -> dict[str, tuple[GemmConfig, GemmConfig]]:
    """The defaults and the tiles before half tiles (sixth session), each twice, interleaved (A B A B)."""
    c1, c2 = default_tiles(m, K, E, fp8)
    if c1.half and c2.block_m < c1.block_m:
        o1 = replace(c1, block_m=c2.block_m, half=False, num_warps=8 if fp8 else 4, num_stages=4, tma=True,
                     running=False, block_k=128 if fp8 else 64)
    else:
        o1 = replace(c1, half=False)
    old = (o1, replace(c2, half=False))
    return {"default": (c1, c2), "before": old, "default again": (c1, c2), "before again": old}


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5).to(torch.bfloat16)
    q13, s13 = quant_block(w13, (128, 128))
    q2, s2 = quant_block(w2, (128, 128))
    weights = {"bf16": (w13, w2, {}), "fp8": (q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=(128, 128)))}
    rows = []
    for m in (int(a) for a in (sys.argv[1] if len(sys.argv) > 1 else "1024,4096").split(",")):
        for dt, (a13, a2, kw) in weights.items():
            bs = kw.get("block_shape")
            tiles = {n: normalize_tiles(*t, bs) for n, t in variants(m, dt == "fp8").items()}
            for route in ("random",):
                sets = [(torch.randn(m, H, device="cuda", generator=gen, dtype=torch.bfloat16),
                         *(routing(m, E, K, "cuda", gen) if route == "random" else balanced(m, gen))) for _ in range(4)]
                ref = BACKENDS["legacy"](*sets[0], a13, a2, **kw)
                for name, (t1, t2) in tiles.items():
                    if route == "balanced" and name != "default":
                        continue

                    def call(x, ids, tw, t1=t1, t2=t2, a13=a13, a2=a2, kw=kw, bs=bs):
                        return fused_moe(x, ids, tw, a13, a2, kw.get("w13_scale"), kw.get("w2_scale"), bs,
                                         config=t1, config2=t2)
                    row = dict(M=m, dtype=dt, routing=route, tiles=name)
                    try:
                        row["relerr"] = relerr(call(*sets[0]), ref)
                        row["us"] = round(time_graph(lambda call=call, sets=sets: [call(*s) for s in sets],
                                                     reps=10, trials=5) / 4, 1)
                        row |= {k[:13]: round(v, 1) for k, v in kernel_times(call, sets).items() if "gemm" in k}
                    except Exception as exc:  # a tile this GPU cannot hold is a result
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:80]}"
                    rows.append(row)
                    print(row, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "probe_balance.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'M':>5} {'dtype':5} {'routing':9} {'tiles':20} {'us':>7} {'gemm1':>7} {'gemm2':>7}")
    for r in rows:
        print(f"{r['M']:5d} {r['dtype']:5} {r['routing']:9} {r['tiles']:20} {r.get('us', 0):7.1f} "
              f"{r.get('_gemm1_kernel', 0):7.1f} {r.get('_gemm2_kernel', 0):7.1f} {r.get('error', '')}")


if __name__ == "__main__":
    main()
