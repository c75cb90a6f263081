"""Probe: FP8 GEMM 1 in Gluon (GemmConfig.gluon) against the Triton GEMM 1, A B A B in one run at M=1024 and 4096;
CUDA-graph replay plus the kernel breakdown."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from moe import BACKENDS, kernel_times, quant_block, relerr, routing, time_graph

from moefx.backends.kernels.fused_moe_kernels import default_tiles, fused_moe, normalize_tiles

E, H, I, K = 128, 2048, 768, 8


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q13, s13 = quant_block((torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H**0.5).bfloat16(), (128, 128))
    q2, s2 = quant_block((torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5).bfloat16(), (128, 128))
    rows = []
    for m in (int(a) for a in (sys.argv[1] if len(sys.argv) > 1 else "1024,4096").split(",")):
        sets = [(torch.randn(m, H, device="cuda", generator=gen, dtype=torch.bfloat16), *routing(m, E, K, "cuda", gen))
                for _ in range(4)]
        ref = BACKENDS["legacy"](*sets[0], q13, q2, w13_scale=s13, w2_scale=s2, block_shape=(128, 128))
        c1, c2 = default_tiles(m, K, E, True)
        t128 = replace(c1, block_m=128, half=False, running=True, tma=False, num_warps=8, num_stages=4)
        variants = {"default": (c1, c2), "triton 128": (t128, c2), "gluon 128": (replace(t128, gluon=True), c2),
                    "gluon 64": (replace(t128, gluon=True, block_m=64, num_warps=4), replace(c2, block_m=64))}
        base = None
        for name in [n for _ in range(2) for n in variants]:
            t1, t2 = normalize_tiles(*variants[name], (128, 128))

            def call(x, ids, tw, t1=t1, t2=t2):
                return fused_moe(x, ids, tw, q13, q2, s13, s2, (128, 128), config=t1, config2=t2)
            row = dict(M=m, variant=name)
            try:
                out = call(*sets[0])
                base = out if base is None else base
                row |= dict(relerr=relerr(out, ref), vs_default=relerr(out, base))
                row["us"] = round(time_graph(lambda c=call, s=sets: [c(*a) for a in s], reps=10, trials=5) / 4, 1)
                row |= {k[:17]: round(v, 1) for k, v in kernel_times(call, sets).items() if "gemm" in k}
            except Exception as exc:  # a failure is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            rows.append(row)
            print(row, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "probe_gluon.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'M':>5} {'variant':12} {'us':>7} {'gemm1':>7} {'gemm2':>7} {'relerr':>8} {'vs def':>8}")
    for r in rows:
        g1 = next((v for k, v in r.items() if "gemm1" in k), 0)
        g2 = next((v for k, v in r.items() if "gemm2" in k), 0)
        print(f"{r['M']:5d} {r['variant']:12} {r.get('us', 0):7.1f} {g1:7.1f} {g2:7.1f} {r.get('relerr', 0):8.2e} "
              f"{r.get('vs_default', 0):8.2e} {r.get('error', '')}")


if __name__ == "__main__":
    main()
