"""MoE experts benchmark: every backend (and `auto`) vs the floor and transformers' grouped_mm + torch.compile.

Qwen3-30B-A3B geometry (E=128, H=2048, I=768, top-8), M in {1, 4, 16, 64, 256, 1024, 4096}, bf16 and FP8
block-128 (w8a8). Order: measure the ceilings (HBM copy, bf16 / fp8 matmul), check every backend against
`legacy` on fresh random inputs (M=1, odd M, experts with no tokens, all tokens on one expert), then time
CUDA-graph replays: each graph holds one call per rotating input set (different routing each), so weights
come from HBM, not L2. Floor = max(touched-expert bytes / copy bandwidth, FLOPs / matmul rate) with
experts touched counted on the very inputs timed. Prints a table last; JSON to $OUT/moe.json.
`--quick`: tiny shapes on the CPU (smoke run for CI): correctness of every backend, no timing claims.
`--sweep`: also time alternative kernel tile configs (used to pick the defaults; see bench/NOTES-moe.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moefx.backends import BACKENDS

MS = (1, 4, 16, 64, 256, 1024, 4096)
PEER_TRITON_US = {  # tuned Triton fused-MoE on this H200 (anchors/h200_peers_2026-11-29.json, kernels only)
    "bf16": (46.5, 90.5, 216, 315, 344, 422, 949),
    "fp8": (38.9, 66.1, 134, 184, 229, 346, 1001),
}
BOUNDS = {"bf16": 2e-2, "fp8": 8e-2}  # ||out - legacy|| / ||legacy||; fp8: w8a8 vs dequantized-weight oracle


def quant_block(w: torch.Tensor, bs: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    bn, bk = bs
    e, n, k = w.shape
    blocks = w.float().reshape(e, n // bn, bn, k // bk, bk)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-8) / 448.0
    q = (blocks / scale[:, :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(e, n, k)
    return q, scale.contiguous()


def routing(m: int, e: int, k: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(m, e, device=device, generator=gen)
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).float()


def input_sets(m: int, h: int, e: int, k: int, dev: str, gen: torch.Generator, n: int) -> list[tuple]:
    """n independent (hidden, topk_ids, topk_weights) sets: each call in a timed graph routes differently."""
    return [(torch.randn(m, h, device=dev, generator=gen, dtype=torch.bfloat16), *routing(m, e, k, dev, gen))
            for _ in range(n)]


def relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def time_graph(fn, reps: int = 20, trials: int = 5) -> float:
    """Median µs of one replay of a CUDA graph of `fn()` (warmed up eagerly first, so compiles stay out)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def ceilings() -> dict[str, float]:
    """Matmul first (it also brings the clocks up), then a 1 GiB device copy; best of the trials' medians."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_us = min(time_graph(lambda: a @ b, reps=10) for _ in range(3))
    res = {"bf16_flops": 2 * 8192**3 / (mm_us * 1e-6)}
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        f8_us = time_graph(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), reps=10)
        res["fp8_flops"] = 2 * 8192**3 / (f8_us * 1e-6)
    except (RuntimeError, TypeError) as exc:
        print(f"fp8 matmul ceiling not measured ({exc}); using 2x bf16", flush=True)
        res["fp8_flops"] = 2 * res["bf16_flops"]
    n = 1 << 30
    src = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    # an SM copy kernel (torch.mul), as our kernels stream: a graph memcpy node uses the copy engines instead
    us = min(time_graph(lambda: torch.mul(src, 1.0, out=dst), reps=20) for _ in range(3))
    res["copy_Bps"] = 2 * n / (us * 1e-6)
    return res


def make_peer(w13: torch.Tensor, w2: torch.Tensor, compile_: bool):
    """transformers' Qwen3-MoE experts module with experts_implementation='grouped_mm' (torch.compile'd)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    e, two_i, h = w13.shape
    cfg = Qwen3MoeConfig(num_experts=e, hidden_size=h, moe_intermediate_size=two_i // 2, num_experts_per_tok=8)
    cfg._experts_implementation = "grouped_mm"
    mod = Qwen3MoeExperts(cfg)
    mod.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    mod.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return torch.compile(mod, dynamic=True) if compile_ else mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny CPU smoke run (no timing claims)")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--calibrate", action="store_true",
                    help="first run `moefx calibrate --modes capture` for this geometry, so `auto` has rows to use")
    args = ap.parse_args()
    quick = args.quick or not torch.cuda.is_available()
    dev = "cpu" if quick else "cuda"
    e, h, inter, k = (8, 64, 32, 2) if quick else (128, 2048, 768, 8)
    bs = (16, 16) if quick else (128, 128)
    ms = (1, 5) if quick else tuple(int(x) for x in args.ms.split(","))
    dtypes = args.dtypes.split(",")
    nsets = 2 if quick else 4
    gen = torch.Generator(device=dev).manual_seed(0)
    torch.manual_seed(0)
    t0 = time.time()
    ceil = {"copy_Bps": float("nan"), "bf16_flops": float("nan"), "fp8_flops": float("nan")} if quick else ceilings()
    print(f"ceilings: copy {ceil['copy_Bps'] / 1e12:.2f} TB/s, bf16 mm {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s, "
          f"fp8 mm {ceil['fp8_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    w13 = (torch.randn(e, 2 * inter, h, device=dev, generator=gen) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, device=dev, generator=gen) / inter**0.5).to(torch.bfloat16)
    weights = {"bf16": dict(w13=w13, w2=w2, kw={})}
    if "fp8" in dtypes:
        q13, s13 = quant_block(w13, bs)
        q2, s2 = quant_block(w2, bs)
        weights["fp8"] = dict(w13=q13, w2=q2, kw=dict(w13_scale=s13, w2_scale=s2, block_shape=bs))
    legacy = BACKENDS["legacy"]
    result: dict = {"device": torch.cuda.get_device_name() if not quick else "cpu", "torch": torch.__version__,
                    "geometry": dict(E=e, H=h, I=inter, top_k=k), "ceilings": ceil, "check": [], "rows": []}

    # ---- correctness vs legacy, fresh inputs ----
    check_ms = (1, 7, 33) if quick else (1, 7, 33, 300)
    failures = []
    for dt in dtypes:
        wt = weights[dt]
        for m in check_ms:
            x = torch.randn(m, h, device=dev, generator=gen, dtype=torch.bfloat16)
            ids, tw = routing(m, e, k, dev, gen)
            if m == 33:
                ids, tw = routing(m, 2 * k, k, dev, gen)  # experts 2k.. get no tokens
            if m == 300:
                ids[:, 0] = 5  # every token on expert 5
            ref = legacy(x, ids, tw, wt["w13"], wt["w2"], **wt["kw"])
            if dt == "bf16" and m in (1, 33):
                with torch.no_grad():
                    err = relerr(make_peer(wt["w13"], wt["w2"], compile_=False)(x, ids, tw.to(x.dtype)), ref)
                result["check"].append(dict(dtype=dt, M=m, backend="hf_grouped_mm", relerr=err, ok=err < BOUNDS[dt]))
            for name, be in BACKENDS.items():
                if name == "legacy" or be.unsupported_reason(x, wt["w13"], wt["w2"], wt["kw"].get("w13_scale"), bs):
                    continue
                err = relerr(be(x, ids, tw, wt["w13"], wt["w2"], **wt["kw"]), ref)
                ok = err < BOUNDS[dt]
                result["check"].append(dict(dtype=dt, M=m, backend=name, relerr=err, ok=ok))
                if not ok:
                    failures.append(f"{name} {dt} M={m}: relerr {err:.3g} >= {BOUNDS[dt]}")
    print(f"check: {len(result['check'])} backend/input pairs vs legacy, {len(failures)} failures "
          f"({time.time() - t0:.0f}s)", flush=True)
    for f in failures:
        print("  FAIL", f, flush=True)

    if args.calibrate and not quick:
        calibrate(dtypes, e, h, inter, k)
    # ---- timing ----
    peer = None
    if not quick and not args.no_peer and "bf16" in dtypes:
        peer = make_peer(w13, w2, compile_=True)
    from moefx.backends import moe_experts
    from moefx.backends.op import select_backend
    from moefx.backends.policy import HOST_SYNCING_BACKENDS

    bytes_per_expert = {dt: (weights[dt]["w13"][0].numel() + weights[dt]["w2"][0].numel())
                        * weights[dt]["w13"].element_size() for dt in weights}
    for dt in dtypes:
        wt = weights[dt]
        for mi, m in enumerate(ms):
            sets = input_sets(m, h, e, k, dev, gen, nsets)
            touched = statistics.mean(len(torch.unique(s[1])) for s in sets)
            flops = m * k * 6 * h * inter
            rate = ceil["fp8_flops" if dt == "fp8" else "bf16_flops"]
            floor = max(touched * bytes_per_expert[dt] / ceil["copy_Bps"], flops / rate) * 1e6
            row = dict(dtype=dt, M=m, experts_touched=touched, floor_us=floor,
                       peer_triton_us=PEER_TRITON_US.get(dt, (None,) * 7)[mi] if len(ms) == 7 else None)
            cands = {n: b for n, b in BACKENDS.items() if n != "legacy"}
            for name, be in cands.items():
                if be.unsupported_reason(sets[0][0], wt["w13"], wt["w2"], wt["kw"].get("w13_scale"), bs):
                    continue
                row[name] = run_timed(quick, lambda be=be, wt=wt, sets=sets: [
                    be(x, i, w, wt["w13"], wt["w2"], **wt["kw"]) for x, i, w in sets]) / nsets

            def auto_call(wt=wt, sets=sets):
                return [moe_experts(x, i, w, wt["w13"], wt["w2"], "auto", **wt["kw"]) for x, i, w in sets]

            try:
                picked = select_backend(sets[0][0], sets[0][1], wt["w13"], wt["w2"], wt["kw"].get("w13_scale"),
                                        wt["kw"].get("block_shape"), "auto", capturing=not quick)
                row["auto_backend"] = picked
                if picked in HOST_SYNCING_BACKENDS and not quick:
                    raise RuntimeError(f"auto picks {picked!r} here (no capture calibration row): not capturable")
                row["auto"] = run_timed(quick, auto_call) / nsets
            except Exception as exc:  # report, keep the run going
                row["auto"] = None
                row["auto_error"] = f"{type(exc).__name__}: {exc}"[:200]
            if peer is not None and dt == "bf16":
                with torch.no_grad():
                    row["hf_grouped_mm_compiled"] = run_timed(
                        quick, lambda sets=sets: [peer(x, i, w.to(x.dtype)) for x, i, w in sets]) / nsets
            result["rows"].append(row)
            print(f"{dt} M={m} done ({time.time() - t0:.0f}s)", flush=True)
    if args.sweep and not quick:
        result["sweep"] = sweep(weights, e, h, inter, k, bs, gen)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "moe.json").write_text(json.dumps(result, indent=1))
    print_table(result, dtypes)
    if failures:
        sys.exit(1)


def calibrate(dtypes: list[str], e: int, h: int, inter: int, k: int) -> None:
    """`moefx calibrate` in-process (the repo need not be pip-installed); rows go to the user's table folder."""
    from moefx.backends.calibration import invalidate
    from moefx.cli import main as cli_main

    for dt in dtypes:
        argv = ["calibrate", "--experts", str(e), "--hidden", str(h), "--intermediate", str(inter), "--topk", str(k),
                "--dtype", "bfloat16", "--quant", "fp8-block128" if dt == "fp8" else "none", "--modes", "capture"]
        t = time.time()
        rc = cli_main(argv)
        print(f"calibrate {dt}: rc={rc} ({time.time() - t:.0f}s)", flush=True)
    invalidate()


def run_timed(quick: bool, fn) -> float:
    if not quick:
        return time_graph(fn)
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


def sweep(weights: dict, e: int, h: int, inter: int, k: int, bs: tuple[int, int], gen: torch.Generator) -> list:
    from moefx.backends.kernels.fused_moe_kernels import GemmConfig, fused_moe
    from moefx.backends.kernels.gemv_kernels import gemv_moe

    out = []
    grouped_cfgs = {  # run 1 swept M=16/256/1024/4096 (bench/NOTES-moe.md); these are the open questions left
        64: [GemmConfig(16, 64, 128, 1, 4, 4), GemmConfig(16, 128, 128, 1, 4, 4)],
        4096: [GemmConfig(128, 128, 64, 8, 8, 4), GemmConfig(128, 128, 32, 8, 8, 4), GemmConfig(64, 128, 64, 8, 8, 4),
               GemmConfig(64, 128, 64, 8, 4, 3)],
    }
    for dt, wt in weights.items():
        for m, cfgs in grouped_cfgs.items():
            sets = input_sets(m, h, e, k, "cuda", gen, 4)
            for cfg in cfgs:
                if dt == "fp8" and cfg.block_n != 128:
                    continue  # FP8 tiles are set by the quant block: only BLOCK_M / warps / stages differ
                try:
                    us = time_graph(lambda cfg=cfg, sets=sets, wt=wt: [
                        fused_moe(x, i, w, wt["w13"], wt["w2"], wt["kw"].get("w13_scale"), wt["kw"].get("w2_scale"),
                                  wt["kw"].get("block_shape"), config=cfg) for x, i, w in sets]) / 4
                except Exception as exc:  # a config that fails is a result too
                    us = f"{type(exc).__name__}"
                out.append(dict(kind="grouped", dtype=dt, M=m, config=str(cfg), us=us))
                print("sweep", out[-1], flush=True)
        for m in (1, 4):
            sets = input_sets(m, h, e, k, "cuda", gen, 4)
            for bn in ((16, 4), (8, 4), (16, 2), (16, 8), (32, 8)):
                us = time_graph(lambda bn=bn, sets=sets, wt=wt: [
                    gemv_moe(x, i, w, wt["w13"], wt["w2"], wt["kw"].get("w13_scale"), wt["kw"].get("w2_scale"),
                             wt["kw"].get("block_shape"), block_n=bn) for x, i, w in sets]) / 4
                out.append(dict(kind="gemv", dtype=dt, M=m, config=str(bn), us=us))
                print("sweep", out[-1], flush=True)
    return out


def print_table(result: dict, dtypes: list[str]) -> None:
    names = ["auto", "gemv", "grouped", "torch_grouped", "hf_grouped_mm_compiled"]
    print(f"\nMoE experts, {result['device']}, torch {result['torch']}, {result['geometry']} "
          f"(µs per call, CUDA-graph replay; best/floor = best moefx backend over the floor)")
    hdr = f"{'dtype':5} {'M':>5} {'floor':>7} {'peer':>7} " + " ".join(f"{n[:13]:>13}" for n in names)
    print(hdr + f" {'best/floor':>10} {'best/peer':>9}")
    for r in result["rows"]:
        vals = [r.get(n) for n in names]
        ours = [r[n] for n in ("gemv", "grouped", "torch_grouped") if isinstance(r.get(n), float)]
        best = min(ours) if ours else float("nan")
        peer = r.get("peer_triton_us") or float("nan")
        cells = " ".join(f"{v:13.1f}" if isinstance(v, float) else f"{'-':>13}" for v in vals)
        print(f"{r['dtype']:5} {r['M']:5d} {r['floor_us']:7.1f} {peer:7.1f} {cells} {best / r['floor_us']:10.2f} "
              f"{best / peer:9.2f}")
    errs = {r["auto_error"] for r in result["rows"] if r.get("auto_error")}
    for e in errs:
        print("auto:", e)


if __name__ == "__main__":
    main()
