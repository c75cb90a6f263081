"""MoE experts benchmark: every backend (and `auto`) vs the floor and transformers' grouped_mm + torch.compile.

Qwen3-30B-A3B geometry (E=128, H=2048, I=768, top-8), M in {1, 4, 16, 64, 256, 1024, 4096}, bf16 and FP8
block-128 (w8a8). Order: measure the ceilings (HBM copy, bf16 / fp8 matmul), check every backend against
`reference` on fresh random inputs (M=1, odd M, experts with no tokens, all tokens on one expert), then time
CUDA-graph replays: each graph holds one call per rotating input set (different routing each), so weights
come from HBM, not L2. Floor = max(touched-expert bytes / copy bandwidth, FLOPs / matmul rate) with
experts touched counted on the very inputs timed. Prints a table last; JSON to $OUT/moe.json.
`--quick`: tiny shapes on the CPU (smoke run for CI): correctness of every backend, no timing claims.
`--sweep`: also run a budgeted tile sweep (grouped at M=1024/4096, gemv at M=1/4, bf16 and fp8; the best tiles
per point next to the defaults' time, to adopt into the kernels' DEFAULT_TILES; docs/FINDINGS.md has what was tried).
`--sweep-only`: just the ceilings and the sweep (JSON to $OUT/moe_sweep.json).
`--profile`: just a per-kernel breakdown (torch.profiler, eager calls on the rotating sets) of each backend
variant at `--ms`, next to its CUDA-graph time, so the gap between the two is launch/dependency overhead
(JSON to $OUT/moe_profile.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import ceilings, input_sets, kernel_times, relerr, routing, time_graph, wall_s, write_json
from moefx.backends import BACKENDS, MoeCall
from moefx.ops.quant import quant_weight_fp8_block

MS = (1, 4, 16, 64, 256, 1024, 4096)
PEER_TRITON_US = {  # tuned Triton fused-MoE on this H200 (anchors/h200_peers_2026-11-29.json, kernels only)
    "bf16": (46.5, 90.5, 216, 315, 344, 422, 949),
    "fp8": (38.9, 66.1, 134, 184, 229, 346, 1001),
}
BOUNDS = {"bf16": 2e-2, "fp8": 8e-2}  # ||out - reference|| / ||reference||; fp8: w8a8 vs dequantized-weight oracle


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
    ap.add_argument("--sweep-only", action="store_true", help="only the tile sweep (no backend table)")
    ap.add_argument("--sweep-budget", type=float, default=SWEEP_BUDGET_S, help="seconds for the sweep (default 150)")
    ap.add_argument("--sweep-ms", default="",
                    help="e.g. grouped=256,1024;gemv=1 (default: grouped 1024,4096, gemv 1,4); 'grouped=' skips one")
    ap.add_argument("--profile", action="store_true", help="only the per-kernel breakdown at --ms")
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
        q13, s13 = quant_weight_fp8_block(w13, *bs)
        q2, s2 = quant_weight_fp8_block(w2, *bs)
        weights["fp8"] = dict(w13=q13, w2=q2, kw=dict(w13_scale=s13, w2_scale=s2, block_shape=bs))
    reference = BACKENDS["reference"]
    result: dict = {"device": torch.cuda.get_device_name() if not quick else "cpu", "torch": torch.__version__,
                    "geometry": dict(E=e, H=h, I=inter, top_k=k), "ceilings": ceil, "check": [], "rows": []}
    if args.profile:
        if not quick:
            result["pieces"] = profile_pieces(ms, e, h, k, gen)
        result["profile"] = profile(weights, ms, dtypes, e, h, inter, k, gen, quick)
        write_json("moe_profile.json", result)
        print_profile(result["profile"])
        return
    sweep_ms = dict(SWEEP_MS)
    for part in filter(None, args.sweep_ms.split(";")):
        kind, _, vals = part.partition("=")
        if kind not in SWEEP_MS:
            raise ValueError(f"--sweep-ms: unknown kind {kind!r}; valid: {sorted(SWEEP_MS)}")
        sweep_ms[kind] = tuple(int(v) for v in vals.split(",") if v)  # "grouped=" leaves grouped out
    if args.sweep_only:
        def save(res: dict) -> None:
            write_json("moe_sweep.json", {**result, "sweep": res})

        result["sweep"] = sweep({d: weights[d] for d in dtypes}, e, h, inter, k, gen, ceil, args.sweep_budget, quick,
                                checkpoint=save, sweep_ms=sweep_ms)
        print_sweep(result["sweep"])
        return

    # ---- correctness vs reference, fresh inputs ----
    check_ms = (1, 7, 33) if quick else (1, 7, 33, 300, 3000)  # 3000: above 128 rows per expert (FP8 running tiles)
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
            ref = reference(x, ids, tw, wt["w13"], wt["w2"], **wt["kw"])
            if dt == "bf16" and m in (1, 33):
                with torch.no_grad():
                    err = relerr(make_peer(wt["w13"], wt["w2"], compile_=False)(x, ids, tw.to(x.dtype)), ref)
                result["check"].append(dict(dtype=dt, M=m, backend="hf_grouped_mm", relerr=err, ok=err < BOUNDS[dt]))
            for name, be in BACKENDS.items():
                if name == "reference" or be.unsupported_reason(MoeCall(x, ids, tw, wt["w13"], wt["w2"], **wt["kw"])):
                    continue
                err = relerr(be(x, ids, tw, wt["w13"], wt["w2"], **wt["kw"]), ref)
                ok = err < BOUNDS[dt]
                result["check"].append(dict(dtype=dt, M=m, backend=name, relerr=err, ok=ok))
                if not ok:
                    failures.append(f"{name} {dt} M={m}: relerr {err:.3g} >= {BOUNDS[dt]}")
    print(f"check: {len(result['check'])} backend/input pairs vs reference, {len(failures)} failures "
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

    for dt in dtypes:
        wt = weights[dt]
        for mi, m in enumerate(ms):
            sets = input_sets(m, h, e, k, dev, gen, nsets)
            touched = statistics.mean(len(torch.unique(s[1])) for s in sets)
            floor = floor_us(dt, m, sets, weights, ceil, h, inter, k)
            row = dict(dtype=dt, M=m, experts_touched=touched, floor_us=floor,
                       peer_triton_us=PEER_TRITON_US.get(dt, (None,) * 7)[mi] if len(ms) == 7 else None)
            cands = {n: b for n, b in BACKENDS.items() if n != "reference"}
            for name, be in cands.items():
                if be.unsupported_reason(MoeCall(*sets[0], wt["w13"], wt["w2"], **wt["kw"])):
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
    if args.sweep:
        result["sweep"] = sweep({d: weights[d] for d in dtypes}, e, h, inter, k, gen, ceil, args.sweep_budget, quick,
                                sweep_ms=sweep_ms)
    write_json("moe.json", result)
    if args.sweep:
        print_sweep(result["sweep"])
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
    """CUDA-graph replay time; --quick (no timing claims) times one eager call, without a warm-up."""
    return wall_s(fn) * 1e6 if quick else time_graph(fn)


SWEEP_BUDGET_S = 150.0
SWEEP_MS = {"grouped": (1024, 4096), "gemv": (1, 4)}  # where the gaps to the floor are (docs/PERFORMANCE.md)
# µs per call on the H200 on 2026-11-29 (`git show 6d12c5a:bench/results/moe_h200_final_2026-11-29.json`), for the
# sweep's time estimate only
PRIOR_US = {("grouped", "bf16"): {1024: 396.0, 4096: 889.0}, ("grouped", "fp8"): {1024: 314.0, 4096: 843.0},
            ("gemv", "bf16"): {1: 25.6, 4: 75.1}, ("gemv", "fp8"): {1: 21.9, 4: 57.6}}
COMPILE_S = {"grouped": 2.0, "gemv": 1.0}  # a new tile's first launch (one Triton compile), estimated
SWEEP_SHARE = {"grouped": 2.0, "gemv": 1.0}  # budget weight of each (kind, dtype) group
SMEM_LIMIT = 227 * 1024  # H200 shared memory per block
ACC_REGS = 128  # fp32 accumulator registers per thread above which a tile spills
GEMV_TILE_ELEMS = 256  # weight elements per thread per K step above which a gemv tile is not tried
TRIAL_US = 30_000.0  # one timing trial replays the graph for about this long
TRIALS = 3
GROUPED_AXES = {"num_warps": (8, 4), "block_n": (256, 64, 128), "group_m": (16, 1, 8), "num_stages": (4, 3, 5),
                "block_k": (128, 64, 32), "tma": (True, False), "pdl": (False,),
                "half": (True, False)}  # a budget cut drops the tail
GEMV_AXES = {1: {"block_k1": (1024, 2048, 512, 256), "block_n1": (4, 8, 16, 2, 32), "num_warps1": (4, 8, 2)},
             2: {"block_k2": (256, 512, 128, 1024), "rows2": (32, 64, 16, 128, 8), "num_warps2": (4, 8, 2)}}


def grouped_fits(cfg, gemm: int, elem: int) -> bool:
    """Pipelined A + B tiles (GEMM 1 loads gate and up tiles) within shared memory, accumulators in registers."""
    from moefx.kernels.moe_grouped import tile_smem_bytes

    nb = 2 if gemm == 1 else 1
    regs_ok = cfg.block_m * cfg.block_n * nb <= ACC_REGS * 32 * cfg.num_warps
    return tile_smem_bytes(cfg, nb, elem) <= SMEM_LIMIT and regs_ok


def grouped_candidates(dt: str, ms: tuple[int, ...], e: int, k: int, block) -> list[tuple[str, tuple]]:
    """(part, (GEMM 1 tile, GEMM 2 tile)): a reference pair per BLOCK_M (the defaults at `ms` first), then one
    change at a time: part '1' varies GEMM 1, '2' GEMM 2. Tiles as they run (normalize_tiles), no repeats."""
    from dataclasses import replace

    from moefx.kernels.moe_grouped import default_tiles, normalize_tiles

    fp8, elem = dt == "fp8", 1 if dt == "fp8" else 2
    refs = list(dict.fromkeys(normalize_tiles(*default_tiles(m, k, e, fp8), block) for m in ms))
    if fp8:  # running-scale accumulators free the dot result tile: the defaults with them, and BLOCK_M 128
        refs += [(replace(c1, running=True), replace(c2, running=True)) for c1, c2 in refs]
    for running in (True, False) if fp8 else (False,):
        for bm in (128, 64):
            if not any(r[0].block_m == bm and r[0].running == running for r in refs):
                c1, c2 = refs[0]
                w1, w2 = (8, 8) if bm == 128 else (c1.num_warps, c2.num_warps)
                refs.append(normalize_tiles(replace(c1, block_m=bm, num_warps=w1, running=running),
                                            replace(c2, block_m=bm, num_warps=w2, running=running), block))
    refs = sorted(dict.fromkeys(refs), key=lambda r: (r[0].running, r[0].block_m), reverse=True)
    out = [("ref", pair) for pair in refs]
    seen = set(refs)
    for field, values in GROUPED_AXES.items():
        for v in values:
            for r1, r2 in refs:
                for part in ("2", "1"):
                    pair = normalize_tiles(replace(r1, **{field: v}), r2, block) if part == "1" else \
                        normalize_tiles(r1, replace(r2, **{field: v}), block)
                    if pair not in seen and grouped_fits(pair[0], 1, elem) and grouped_fits(pair[1], 2, elem):
                        seen.add(pair)
                        out.append((part, pair))
    return out


def gemv_effective(cfg, h: int, inter: int, k: int, block):
    """The GemvConfig as it runs: automatic BLOCK_K resolved, rows clamped to the FP8 block (as gemv_moe does)."""
    import math
    from dataclasses import replace

    from moefx.kernels.moe_gemv import block_k_for

    fp8 = block is not None
    kp = 1 << (k - 1).bit_length()
    bn1, bn2 = cfg.block_n1, max(1, cfg.rows2 // kp)
    if fp8:
        bn1, bn2 = math.gcd(bn1, block[0]), math.gcd(bn2, block[0])
    return replace(cfg, block_n1=bn1, rows2=bn2 * kp, block_k1=block_k_for(h, cfg.block_k1),
                   block_k2=block_k_for(inter, cfg.block_k2))


def gemv_candidates(ms: tuple[int, ...], h: int, inter: int, k: int, block) -> list[tuple[str, tuple]]:
    """(part, (GemvConfig,)): the defaults at `ms`, then for stage 2 ('2') and stage 1 ('1') in turn every
    combination of that stage's GEMV_AXES, the other stage as in the default (the two are separate launches)."""
    import itertools
    from dataclasses import replace

    from moefx.kernels.moe_gemv import default_gemv_config

    fp8 = block is not None
    refs = list(dict.fromkeys(gemv_effective(default_gemv_config(m, fp8), h, inter, k, block) for m in ms))
    out = [("ref", (r,)) for r in refs]
    seen = set(refs)
    for stage in (2, 1):
        axes = GEMV_AXES[stage]
        for values in itertools.product(*axes.values()):
            for r in refs:
                c = gemv_effective(replace(r, **dict(zip(axes, values))), h, inter, k, block)
                elems1 = 2 * c.block_n1 * c.block_k1 // (32 * c.num_warps1)
                elems2 = c.rows2 * c.block_k2 // (32 * c.num_warps2)
                if c not in seen and max(elems1, elems2) <= GEMV_TILE_ELEMS:
                    seen.add(c)
                    out.append((str(stage), (c,)))
    return out


def combine(kind: str, cands: list[tuple[str, tuple]], us: list[dict], m: int):
    """Best part-1 change + best part-2 change (same BLOCK_M for grouped) at M, or None when nothing new."""
    from dataclasses import replace

    from moefx.kernels.moe_grouped import normalize_tiles

    timed = [(t[m], i) for i, t in enumerate(us) if isinstance(t.get(m), float)]
    if not timed:
        return None
    best = cands[min(timed)[1]][1]

    def best_of(part: str):
        ok = [(t, i) for t, i in timed if cands[i][0] in ("ref", part)
              and (kind == "gemv" or cands[i][1][0].block_m == best[0].block_m)]
        return cands[min(ok)[1]][1] if ok else best

    b1, b2 = best_of("1"), best_of("2")
    if kind == "grouped":
        tiles = normalize_tiles(b1[0], b2[1], None)
    else:
        s2 = {f: getattr(b2[0], f) for f in GEMV_AXES[2]}
        tiles = (replace(b1[0], **s2),)
    return None if any(tiles == c[1] for c in cands) else tiles


def tiles_text(kind: str, tiles: tuple) -> str:
    if kind == "gemv":
        c = tiles[0]
        return (f"s1 n{c.block_n1} k{c.block_k1} w{c.num_warps1} | s2 rows{c.rows2} k{c.block_k2} w{c.num_warps2}"
                + ("" if c.pdl else " nopdl"))
    return " | ".join(f"g{i + 1} {c.block_m}x{c.block_n}x{c.block_k} G{c.group_m} w{c.num_warps} s{c.num_stages}"
                      + (" tma" if c.tma else "") + ("" if c.pdl else " nopdl") + (" run" if c.running else "")
                      + (" half" if c.half else "")
                      for i, c in enumerate(tiles))


def tiles_json(kind: str, tiles: tuple) -> dict:
    from dataclasses import asdict

    if kind == "gemv":
        return {"gemv": asdict(tiles[0])}
    return {"gemm1": asdict(tiles[0]), "gemm2": asdict(tiles[1])}


def sweep_reps(prior_us: float, nsets: int) -> int:
    """Graph replays per timing trial: about TRIAL_US of work, 5..100."""
    return int(min(100, max(5, TRIAL_US / (prior_us * nsets))))


def time_point(call, sets: list[tuple], ref: torch.Tensor, bound: float, quick: bool, prior_us: float) -> float | str:
    """µs per call of `call` over the rotating sets, after an output check vs reference; a failure is a result.
    --quick (the interpreter, no timing claims) times the checked call itself: one call per point."""
    try:
        start = time.perf_counter()
        err = relerr(call(*sets[0]), ref)
        if not err < bound:
            return f"relerr {err:.2e} >= {bound:.0e}"
        if quick:
            return (time.perf_counter() - start) * 1e6
        fn = lambda: [call(*s) for s in sets]  # noqa: E731
        return time_graph(fn, reps=sweep_reps(prior_us, len(sets)), trials=TRIALS) / len(sets)
    except Exception as exc:  # e.g. Triton OutOfResources for a tile this GPU cannot hold
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}" if str(exc) else type(exc).__name__


def sweep(weights: dict, e: int, h: int, inter: int, k: int, gen: torch.Generator, ceil: dict, budget_s: float,
          quick: bool, checkpoint=None, sweep_ms: dict | None = None) -> dict:
    """Budgeted tile sweep: grouped at M=1024/4096 and gemv at M=1/4, bf16 and fp8; best tiles vs the defaults.

    Each (kind, dtype) group gets a share of what is left of the budget. Candidates: the default tiles,
    then one change at a time from them (most promising first; the tail is dropped when the share runs
    out), then the best GEMM-1 change combined with the best GEMM-2 change. Every point is checked
    against reference first. Adopt a result by editing DEFAULT_TILES in the kernel module.
    """
    from moefx.kernels.moe_gemv import default_gemv_config, gemv_moe
    from moefx.kernels.moe_grouped import default_tiles, fused_moe, normalize_tiles

    dev = "cpu" if quick else "cuda"
    nsets = 1 if quick else 4
    reference = BACKENDS["reference"]
    groups = [(kind, dt) for kind in ("grouped", "gemv") for dt in weights if quick or (sweep_ms or SWEEP_MS)[kind]]
    start = time.time()
    res: dict = {"budget_s": budget_s, "groups": [], "points": [], "best": []}
    for gi, (kind, dt) in enumerate(groups):
        wt = weights[dt]
        block = wt["kw"].get("block_shape")
        fp8 = block is not None
        ms = (5, 33) if quick and kind == "grouped" else (sweep_ms or SWEEP_MS)[kind]
        cands = grouped_candidates(dt, ms, e, k, block) if kind == "grouped" else gemv_candidates(ms, h, inter, k,
                                                                                                  block)
        defaults = {m: normalize_tiles(*default_tiles(m, k, e, fp8), block) if kind == "grouped"
                    else (gemv_effective(default_gemv_config(m, fp8), h, inter, k, block),) for m in ms}
        if quick:  # the interpreter takes seconds per call: each M's defaults, timed at every M, exercise the choice
            cands = [("ref", tiles) for tiles in dict.fromkeys(defaults.values())]
        sets = {m: input_sets(m, h, e, k, dev, gen, nsets) for m in ms}
        refs = {m: reference(*sets[m][0], wt["w13"], wt["w2"], **wt["kw"]) for m in ms}
        prior = {m: PRIOR_US.get((kind, dt), {}).get(m, 1.0) for m in ms}
        per_cand = COMPILE_S[kind] + sum(prior[m] * nsets * (sweep_reps(prior[m], nsets) * TRIALS + 5)
                                         for m in ms) / 1e6
        left = budget_s - (time.time() - start)
        share = max(0.0, left) * SWEEP_SHARE[kind] / sum(SWEEP_SHARE[g] for g, _ in groups[gi:])
        group_start = time.time()
        group_end = group_start + share
        print(f"sweep {kind} {dt} M={ms}: {len(cands)} candidates, ~{per_cand:.1f} s each (estimate), "
              f"share {share:.0f} s -> ~{min(len(cands), int(share / per_cand))} timed", flush=True)

        def call(tiles, wt=wt, kind=kind):
            if kind == "grouped":
                return lambda x, ids, tw: fused_moe(MoeCall(x, ids, tw, wt["w13"], wt["w2"], **wt["kw"]),
                                                    config=tiles[0], config2=tiles[1])
            return lambda x, ids, tw: gemv_moe(MoeCall(x, ids, tw, wt["w13"], wt["w2"], **wt["kw"]), config=tiles[0])

        us: list[dict] = []
        n_refs = sum(p == "ref" for p, _ in cands)
        spent: list[float] = []
        for ci, (_, tiles) in enumerate(list(cands)):
            cost = statistics.mean(spent) if spent else per_cand  # measured cost per candidate once known
            if ci >= n_refs and time.time() + 2 * cost > group_end:  # keep one slot for the combination
                break
            t_c = time.time()
            us.append({m: time_point(call(tiles), sets[m], refs[m], BOUNDS[dt], quick, prior[m]) for m in ms})
            spent.append(time.time() - t_c)
        total = len(cands)
        cands = cands[: len(us)]  # the budget may have cut the tail
        for m in ms:
            combo = combine(kind, cands, us, m)
            if combo is not None and time.time() < group_end and all(combo != c for _, c in cands):
                cands.append(("combo", combo))
                us.append({mm: time_point(call(combo), sets[mm], refs[mm], BOUNDS[dt], quick, prior[mm])
                           for mm in ms})
        for (part, tiles), t in zip(cands, us):
            for m in ms:
                res["points"].append(dict(kind=kind, dtype=dt, M=m, part=part, tiles=tiles_json(kind, tiles),
                                          text=tiles_text(kind, tiles), us=t[m]))
        for m in ms:
            ok = [(t[m], i) for i, t in enumerate(us) if isinstance(t[m], float)]
            dflt = next((t[m] for (_, tiles), t in zip(cands, us) if tiles == defaults[m]), None)
            best_us, bi = min(ok) if ok else (None, None)
            floor = floor_us(dt, m, sets[m], weights, ceil, h, inter, k)
            retimed = None
            if bi is not None and cands[bi][1] != defaults[m] and not quick:  # the minimum of noisy points flatters
                retimed = {name: time_point(call(t), sets[m], refs[m], BOUNDS[dt], quick, prior[m])
                           for name, t in (("default", defaults[m]), ("best", cands[bi][1]))}
            res["best"].append(dict(
                kind=kind, dtype=dt, M=m, default_us=dflt, default=tiles_json(kind, defaults[m]),
                default_text=tiles_text(kind, defaults[m]), best_us=best_us, floor_us=floor, retimed_us=retimed,
                best=tiles_json(kind, cands[bi][1]) if bi is not None else None,
                best_text=tiles_text(kind, cands[bi][1]) if bi is not None else "-"))
        used = time.time() - group_start
        res["groups"].append(dict(kind=kind, dtype=dt, candidates=total, timed=len(us), share_s=round(share, 1),
                                  used_s=round(used, 1), estimate_per_candidate_s=round(per_cand, 2)))
        print(f"sweep {kind} {dt}: timed {len(us)} ({total} generated + combinations) in {used:.0f} s "
              f"({time.time() - start:.0f} s of {budget_s:.0f})", flush=True)
        for b in res["best"][-len(ms):]:
            print(f"  M={b['M']}: default {b['default_us']} us, best {b['best_us']} us: {b['best_text']}", flush=True)
        res["used_s"] = round(time.time() - start, 1)
        if checkpoint is not None:  # partial results survive a stage time limit
            checkpoint(res)
    res["used_s"] = round(time.time() - start, 1)
    return res


def floor_us(dt: str, m: int, sets: list[tuple], weights: dict, ceil: dict, h: int, inter: int, k: int) -> float:
    """max(touched experts' bytes / copy bandwidth, FLOPs / matmul rate) on the very inputs timed, in µs."""
    wt = weights[dt]
    per_expert = (wt["w13"][0].numel() + wt["w2"][0].numel()) * wt["w13"].element_size()
    touched = statistics.mean(len(torch.unique(s[1])) for s in sets)
    rate = ceil["fp8_flops" if dt == "fp8" else "bf16_flops"]
    return max(touched * per_expert / ceil["copy_Bps"], m * k * 6 * h * inter / rate) * 1e6


def print_sweep(res: dict) -> None:
    print(f"\ntile sweep (µs per call, CUDA-graph replay; budget {res['budget_s']:.0f} s, used {res['used_s']:.0f} s)")
    print("best/def again: default and best re-timed back to back (trust a gain only when both ratios show it)")
    print(f"{'kind':7} {'dtype':5} {'M':>5} {'floor':>7} {'default':>8} {'best':>8} {'best/def':>8} {'again':>6} "
          f"{'best/floor':>10}  best tiles (default tiles)")

    def ratio(a: object, b: object, width: int) -> str:
        return f"{a / b:{width}.2f}" if isinstance(a, float) and isinstance(b, float) else f"{'-':>{width}}"

    for b in res["best"]:
        d, bu, again = b["default_us"], b["best_us"], b.get("retimed_us") or {}
        num = [f"{v:8.1f}" if isinstance(v, float) else f"{'-':>8}" for v in (d, bu)]
        print(f"{b['kind']:7} {b['dtype']:5} {b['M']:5d} {b['floor_us']:7.1f} {num[0]} {num[1]} {ratio(bu, d, 8)} "
              f"{ratio(again.get('best'), again.get('default'), 6)} {ratio(bu, b['floor_us'], 10)}  "
              f"{b['best_text']} ({b['default_text']})")


def profile_variants(dt: str, m: int, wt: dict) -> dict:
    """name -> call(x, ids, tw) for the backends worth a breakdown at this M, at their default tiles (a tile
    experiment adds a variant here: `fused_moe(call, config=, config2=)`, `gemv_moe(call, config=)`)."""
    from moefx.kernels.moe_gemv import gemv_moe
    from moefx.kernels.moe_grouped import fused_moe

    out = {"grouped": lambda x, i, w: fused_moe(MoeCall(x, i, w, wt["w13"], wt["w2"], **wt["kw"]))}
    if m <= 16:
        out["gemv"] = lambda x, i, w: gemv_moe(MoeCall(x, i, w, wt["w13"], wt["w2"], **wt["kw"]))
    if dt == "bf16" and m >= 1024:
        out["torch_grouped"] = lambda x, i, w: BACKENDS["torch_grouped"](x, i, w, wt["w13"], wt["w2"])
    return out


def profile(weights: dict, ms: tuple[int, ...], dtypes: list[str], e: int, h: int, inter: int, k: int,
            gen: torch.Generator, quick: bool) -> list[dict]:
    dev = "cpu" if quick else "cuda"
    reference = BACKENDS["reference"]
    rows = []
    for dt in dtypes:
        wt = weights[dt]
        for m in ms:
            sets = input_sets(m, h, e, k, dev, gen, 4)
            ref = reference(*sets[0], wt["w13"], wt["w2"], **wt["kw"])
            for name, call in profile_variants(dt, m, wt).items():
                row = dict(dtype=dt, M=m, variant=name)
                try:
                    row["relerr"] = relerr(call(*sets[0]), ref)
                    row["graph_us"] = run_timed(quick, lambda call=call, sets=sets: [call(*s) for s in sets]) / 4
                    if not quick:
                        row["kernels_us"] = kernel_times(call, sets)
                except Exception as exc:  # report, keep going
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                rows.append(row)
                print(f"profile {dt} M={m} {name}: {row.get('graph_us', row.get('error'))}", flush=True)
    return rows


def profile_pieces(ms: tuple[int, ...], e: int, h: int, k: int, gen: torch.Generator) -> list[dict]:
    """CUDA-graph µs of the grouped path's small pieces on their own: the align (one program vs two launches) and
    the top-k sum (Triton vs torch's sum; max |difference| to an fp32 sum rounded once)."""
    from moefx.kernels.moe_align import moe_align
    from moefx.kernels.moe_grouped import default_tiles, topk_sum

    rows = []
    for m in ms:
        ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:k] for _ in range(m)]).int()
        bm = default_tiles(m, k, e, False)[0].block_m
        row = dict(M=m, pairs=m * k, block_m=bm)
        for name, one, chunk in (("align one program", True, 0), ("align two launches", False, 0),
                                 ("align two launches chunk 64", False, 64)):
            if (one and m * k <= 1024) or (not one and m * k > 8):
                row[name] = time_graph(lambda one=one, ids=ids, bm=bm, chunk=chunk: moe_align(
                    ids, e, bm, one_program=one, chunk=chunk), reps=50)
        if m >= 16:
            x = torch.randn(m * k, h, device="cuda", generator=gen).bfloat16()
            ref = x.float().view(m, k, h).sum(1).bfloat16().float()
            row["sum triton"] = time_graph(lambda x=x: topk_sum(x, k), reps=50)
            row["sum torch"] = time_graph(lambda x=x, m=m: x.view(m, k, h).sum(dim=1), reps=50)
            row["sum triton maxdiff"] = (topk_sum(x, k).float() - ref).abs().max().item()
            row["sum torch maxdiff"] = (x.view(m, k, h).sum(dim=1).float() - ref).abs().max().item()
        rows.append(row)
        print("pieces", {kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in row.items()}, flush=True)
    return rows


def print_profile(rows: list[dict]) -> None:
    print("\nper-kernel breakdown (µs per call: profiler over eager calls; graph = CUDA-graph replay)")
    for r in rows:
        if "error" in r:
            print(f"{r['dtype']:5} {r['M']:5d} {r['variant']:18} ERROR {r['error']}")
            continue
        ks = r.get("kernels_us", {})
        parts = ", ".join(f"{name.split('(')[0][:28]} {us:.1f}" for name, us in ks.items())
        print(f"{r['dtype']:5} {r['M']:5d} {r['variant']:18} graph {r['graph_us']:8.1f} kernels "
              f"{sum(ks.values()):8.1f} relerr {r['relerr']:.1e} | {parts}")


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
