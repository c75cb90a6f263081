"""Fused activation quant on the GPU: SiLU-mul -> quant and residual-add + RMSNorm -> quant, FP8 e4m3 per-token-
group-128 (vLLM QuantFP8 native form) and INT8 per-token (torch.round form).

Columns, all measured in this run with CUDA-graph replay (launch overhead excluded, medians of 7 replays, rotating
input copies so small problems do not sit in L2): eager PyTorch (the user's code), torch.compile default,
torch.compile with the moefx passes (`moefx.backend`) -- both compiled per shape, dynamic=False --, the moefx
fused op called directly, and the bytes floor
(bytes read + written / device-to-device copy bandwidth measured here). Before timing, every Triton kernel is
checked against the eager reference on this GPU (FP8 codes: < 0.1% elements off by one last bit, scales 1e-6).
Also measured: the FP8 block-scaled GEMM (Triton) against `torch._scaled_mm` blockwise where this torch has it.

    python bench/fusions.py            # on the H200: correctness, GEMM table, fusion table last; JSON to $OUT
    python bench/fusions.py --quick    # CPU smoke run, tiny shapes, no compile columns
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moefx
from moefx.ops import block_gemm, quant
from moefx.ops.quant import QuantScheme

ops = torch.ops.moefx
FP8 = torch.float8_e4m3fn
MIN_SCALE = 1.0 / (448.0 * 512.0)  # vLLM's _FP8_MIN_SCALING_FACTOR
FP8_G128 = QuantScheme("fp8_group", 128, 0.0, MIN_SCALE, 448.0).args()
INT8_TOK = QuantScheme("int8_token", 0, 0.0, 0.0, 127.0).args()
NORM_EPS = 1e-6


# --- the user's eager code (what the passes match and what the ops must reproduce) ------------------------------

def group_quant_fp8(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM QuantFP8 native group path (group 128, scale clamped after dividing)."""
    g = y.shape[-1] // 128
    yg = y.view(-1, g, 128)
    s = yg.abs().max(dim=-1, keepdim=True)[0].float() / 448.0
    s = torch.clamp(s, min=MIN_SCALE)
    q = (yg / s).clamp(-448.0, 448.0).to(FP8)
    return q.view(y.shape), s.squeeze(-1).reshape(*y.shape[:-1], g)


def token_quant_int8(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = y.float().abs().amax(dim=-1, keepdim=True) / 127.0
    return torch.round(y.float() / s).clamp(-128, 127).to(torch.int8), s


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """vLLM SiluAndMul.forward_native (transformers' act_fn(gate) * up rounds the same way)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def add_rms_norm(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers decoder layer: residual add in the model dtype, then Qwen3 RMSNorm."""
    s = res + x
    h = s.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    return w * h.to(s.dtype), s


def silu_fp8(x):
    return group_quant_fp8(silu_mul(x))


def silu_int8(x):
    return token_quant_int8(silu_mul(x))


def add_norm_fp8(x, res, w):
    y, s = add_rms_norm(x, res, w)
    return (*group_quant_fp8(y), s)


def add_norm_int8(x, res, w):
    y, s = add_rms_norm(x, res, w)
    return (*token_quant_int8(y), s)


CASES = {
    # name: (eager fn, fused op call, kind, dims label)
    "silu_mul->fp8_g128": (silu_fp8, lambda x: ops.silu_mul_quant(x, *FP8_G128), "silu"),
    "silu_mul->int8_tok": (silu_int8, lambda x: ops.silu_mul_quant(x, *INT8_TOK), "silu"),
    "add_rmsnorm->fp8_g128": (
        add_norm_fp8, lambda x, r, w: ops.add_rms_norm_quant(x, r, w, NORM_EPS, False, False, *FP8_G128), "norm"),
    "add_rmsnorm->int8_tok": (
        add_norm_int8, lambda x, r, w: ops.add_rms_norm_quant(x, r, w, NORM_EPS, False, False, *INT8_TOK), "norm"),
}


def make_args(kind: str, m: int, width: int, device: str, copies: int) -> list[tuple]:
    g = torch.Generator(device=device).manual_seed(m)
    w = (torch.randn(width, device=device, generator=g) * 0.2 + 1).to(torch.bfloat16)
    sets = []
    for _ in range(copies):
        x = (torch.randn(m, width, device=device, generator=g) * 2).to(torch.bfloat16)
        sets.append((x,) if kind == "silu" else (x, torch.randn_like(x), w))
    return sets


def floor_bytes(case: str, m: int, width: int) -> int:
    int8 = case.endswith("int8_tok")
    if case.startswith("silu"):
        n = width // 2
        return m * width * 2 + m * n + m * (4 if int8 else n // 128 * 4)
    return 2 * m * width * 2 + width * 2 + m * width * 2 + m * width + m * (4 if int8 else width // 128 * 4)


# --- correctness ----------------------------------------------------------------------------------------------

def q_mismatch(q: torch.Tensor, q_ref: torch.Tensor) -> tuple[float, float]:
    """(fraction of differing codes, largest difference in code units)."""
    a = q.view(torch.uint8).float() if q.dtype == FP8 else q.float()
    b = q_ref.view(torch.uint8).float() if q.dtype == FP8 else q_ref.float()
    d = (a - b).abs()
    return (d > 0).float().mean().item(), d.max().item()


def compare(out, ref) -> dict:
    frac, maxd = q_mismatch(out[0], ref[0])
    srel = ((out[1] - ref[1]).abs() / ref[1].abs().clamp_min(1e-30)).max().item()
    res_equal = len(out) < 3 or torch.equal(out[2], ref[2])
    return {"q_mismatch": frac, "q_max_code_diff": maxd, "scale_rel": srel, "residual_equal": res_equal}


def exact_enough(c: dict, frac: float = 1e-3) -> bool:
    return c["q_mismatch"] < frac and c["q_max_code_diff"] <= 1 and c["scale_rel"] <= 1e-6 and c["residual_equal"]


def check_kernels(device: str) -> list[dict]:
    """Every Triton quant kernel variant against the eager reference, plus the GEMMs."""
    from moefx.ops import triton_gemm

    rows = []
    schemes = [QuantScheme("fp8_group", 128), QuantScheme("fp8_group", 64, scale_ue8m0=True, column_major_scales=True),
               QuantScheme("fp8_token", 0), QuantScheme("int8_token", 0),
               QuantScheme("int8_group", 128, tma_aligned_scales=True),
               QuantScheme("fp8_group", 128, 0.0, MIN_SCALE)]
    torch.manual_seed(0)
    x = torch.randn(300, 2 * 1536, device=device, dtype=torch.bfloat16) * 3
    r = torch.randn(300, 1536, device=device, dtype=torch.bfloat16)
    w = torch.randn(1536, device=device, dtype=torch.bfloat16)
    g, u = x[:, :1536], x[:, 1536:]
    for sc in schemes:
        a = sc.args()
        qm = quant.check_scheme(*a)

        def ref(y, sc=sc, qm=qm):
            return quant.ref_quant(y, sc.kind, sc.group_size, sc.eps, sc.min_scale, qm, sc.scale_ue8m0)

        variants = {
            "quant": (ops.quant(g, *a), ref(g)),
            "silu_mul_quant": (ops.silu_mul_quant(x, *a), ref(quant.ref_silu_mul(x))),
            "silu_mul_quant_split": (ops.silu_mul_quant_split(g, u, *a), ref(quant.ref_silu_mul_split(g, u))),
        }
        # every norm variant with the first scheme; the other schemes with the transformers form only
        combos = [(False, False), (False, True), (True, False), (True, True)] if sc is schemes[0] else [(False, False)]
        for wf, fs in combos:
            if not fs:
                variants[f"rms_norm_quant(w_fp32={wf})"] = (ops.rms_norm_quant(g, w, NORM_EPS, wf, *a),
                                                            ref(quant.ref_rms_norm(g, w, NORM_EPS, wf)))
            y, nr = quant.ref_add_rms_norm(g, r, w, NORM_EPS, wf, fs)
            variants[f"add_rms_norm_quant(w_fp32={wf},fp32_sum={fs})"] = (
                ops.add_rms_norm_quant(g, r, w, NORM_EPS, wf, fs, *a), (*ref(y), nr))
        for name, (out, rf) in variants.items():
            c = compare(out, rf)
            rows.append({"kernel": name, "scheme": f"{sc.kind}/{sc.group_size}", **c, "ok": exact_enough(c)})
    # GEMMs
    for m, n, k in [(5, 4096, 512), (300, 1024, 2048)]:
        a_q, a_s = ops.quant(torch.randn(m, k, device=device), *QuantScheme(column_major_scales=True).args())
        wq, ws = quant.quant_weight_fp8_block(torch.randn(n, k, device=device) * 0.05)
        ref = block_gemm.ref_fp8_block_gemm(a_q, a_s, wq, ws, 128, 128, None, torch.float32)
        # fp8 tensor-core sums within a 128-wide K block are not full fp32 on Hopper: ~1e-4 relative
        out = triton_gemm.fp8_block_gemm(a_q, a_s, wq, ws, 128, 128, None, torch.float32) if device == "cuda" \
            else ops.fp8_block_gemm(a_q, a_s, wq, ws, 128, 128, None, torch.float32)
        rel = ((out - ref).norm() / ref.norm()).item()
        rows.append({"kernel": f"fp8_block_gemm triton {m}x{n}x{k}", "scheme": "w8a8 128x128", "rel_err": rel,
                     "ok": rel < 1e-3})
        out = ops.fp8_block_gemm(a_q, a_s, wq, ws, 128, 128, None, torch.bfloat16).float()  # dispatching op
        rel = ((out - ref).norm() / ref.norm()).item()
        rows.append({"kernel": f"moefx::fp8_block_gemm bf16 {m}x{n}x{k}", "scheme": "w8a8 128x128",
                     "rel_err": rel, "ok": rel < 1e-2})
        ai, asi = ops.quant(torch.randn(m, k, device=device), *QuantScheme("int8_token", 0).args())
        wi, wsi = quant.quant_weight_int8_channel(torch.randn(n, k, device=device))
        out = ops.int8_gemm(ai, asi, wi, wsi, None, torch.float32)
        ref = (ai.double() @ wi.double().t()).float() * asi * wsi
        rel = ((out - ref).norm() / ref.norm()).item()
        rows.append({"kernel": f"int8_gemm {m}x{n}x{k}", "scheme": "w8a8 per-channel", "rel_err": rel,
                     "ok": rel < 1e-5})
    return rows


# --- timing ---------------------------------------------------------------------------------------------------

def time_gpu(fn: Callable, arg_sets: list[tuple], calls: int) -> float:
    """Median µs per call from CUDA-graph replays of `calls` calls cycling through arg_sets."""
    for a in arg_sets[:2]:
        fn(*a)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return statistics.median(times)


def time_cpu(fn: Callable, arg_sets: list[tuple], calls: int) -> float:
    fn(*arg_sets[0])
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])
        times.append((time.perf_counter() - t) * 1e6 / calls)
    return statistics.median(times)


def copy_bandwidth(device: str) -> float:
    """Bytes/s of large device-to-device copies (read + write counted), best of a few sizes and dtypes."""
    best = 0.0
    sizes = [(1 << 28, torch.float32), (1 << 29, torch.bfloat16), (1 << 27, torch.float32)] if device == "cuda" \
        else [(1 << 24, torch.float32)]
    for n, dt in sizes:
        src = torch.randn(n, device=device).to(dt)
        dst = torch.empty_like(src)
        us = time_gpu(dst.copy_, [(src,)], 10) if device == "cuda" else time_cpu(dst.copy_, [(src,)], 3)
        best = max(best, 2 * src.numel() * src.element_size() / (us * 1e-6))
        del src, dst
    return best


def compile_static(fn: Callable, backend, example: tuple) -> Callable:
    """torch.compile for this one shape (dynamic=False, as the PERF-NOTES baseline); warmed up once."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, dynamic=False) if backend else torch.compile(fn, dynamic=False)
    # Both compile columns keep float constants as constants, as moefx.optimize does (torch 2.11 otherwise
    # traces module-level floats such as the norm eps as graph inputs, which no exact fusion can match).
    compiled = torch._dynamo.config.patch(specialize_float=True)(compiled)
    compiled(*example)
    return compiled


def moefx_backend():
    return moefx.backend({"pass_config": {"fuse_act_quant": True, "fuse_norm_quant": True}})


def run_case(case: str, shapes: list[tuple[int, int]], device: str, quick: bool) -> list[dict]:
    eager, fused, kind = CASES[case]
    timer = time_gpu if device == "cuda" else time_cpu
    rows = []
    for m, width in shapes:
        one = make_args(kind, m, width, device, 1)[0]
        per_set = sum(t.numel() * t.element_size() for t in one)
        copies = 1 if quick else max(1, min(16, math.ceil(150e6 / per_set)))
        arg_sets = make_args(kind, m, width, device, copies)
        calls = 5 if quick else (10 if m >= 4096 else 40)
        ref = eager(*arg_sets[0])
        row = {"case": case, "M": m, "width": width, "bytes": floor_bytes(case, m, width)}
        row["eager_us"] = timer(eager, arg_sets, calls)
        row["fused_op_us"] = timer(fused, arg_sets, calls)
        row["fused_op_check"] = compare(fused(*arg_sets[0]), ref)
        if not quick:
            compiled = compile_static(eager, None, arg_sets[0])
            row["compile_us"] = timer(compiled, arg_sets, calls)
            row["compile_check"] = compare(compiled(*arg_sets[0]), ref)
            moefx.clear_compile_reports()
            try:
                with_pass = compile_static(eager, moefx_backend(), arg_sets[0])
                reps = moefx.compile_reports()
                row["moefx_matches"] = {k: v for rep in reps for k, v in rep.matches.items() if v}
                row["moefx_skipped"] = [x for rep in reps for v in rep.skipped.values() for x in v][:3]
                if row["moefx_matches"]:
                    row["moefx_us"] = timer(with_pass, arg_sets, calls)
                    row["moefx_check"] = compare(with_pass(*arg_sets[0]), ref)
            except Exception as e:  # report it and keep measuring the other columns
                row["moefx_error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    return rows


# --- FP8 block GEMM: Triton vs torch._scaled_mm blockwise ------------------------------------------------------

def scaled_mm_blockwise(a, a_s, w, w_s):
    """torch._scaled_mm with 1x128 activation and 128x128 weight scales (cuBLASLt, torch >= 2.9, CUDA >= 12.9)."""
    return torch._scaled_mm(a, w.t(), scale_a=a_s, scale_b=w_s.t(), out_dtype=torch.bfloat16)


def gemm_rows(device: str) -> list[dict]:
    from moefx.ops import triton_gemm

    rows = []
    for m, n, k in [(16, 4096, 4096), (512, 4096, 4096), (8192, 4096, 4096)]:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        a, a_s = ops.quant(x, *QuantScheme(column_major_scales=True).args())
        wq, ws = quant.quant_weight_fp8_block(torch.randn(n, k, device=device) * 0.05)
        wb = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        ref = block_gemm.ref_fp8_block_gemm(a, a_s, wq, ws, 128, 128, None, torch.float32)
        row = {"M": m, "N": n, "K": k}
        operands = [(a, a_s, wq, ws)]
        row["triton_us"] = time_gpu(
            lambda *o: triton_gemm.fp8_block_gemm(*o, 128, 128, None, torch.bfloat16), operands, 20)
        row["bf16_mm_us"] = time_gpu(lambda xx, ww: xx @ ww.t(), [(x, wb)], 20)
        try:
            out = scaled_mm_blockwise(a, a_s, wq, ws).float()
            row["scaled_mm_rel_err"] = ((out - ref).norm() / ref.norm()).item()
            row["scaled_mm_us"] = time_gpu(scaled_mm_blockwise, operands, 20)
        except Exception as e:
            row["scaled_mm_error"] = f"{type(e).__name__}: {e}"[:200]
        flop_us = 2 * m * n * k / FP8_RATE * 1e6 if FP8_RATE else 0.0
        row["floor_us"] = max((m * k + n * k + m * n * 2) / BW * 1e6, flop_us)
        rows.append(row)
    return rows


BW = 0.0
FP8_RATE = 0.0


def fp8_matmul_rate(device: str) -> float:
    """FLOP/s of a tensorwise-scaled fp8 `torch._scaled_mm` at 8192^3: the FLOP ceiling for the GEMM floor."""
    n = 8192
    a = torch.randn(n, n, device=device).to(FP8)
    b = torch.randn(n, n, device=device).to(FP8)
    one = torch.ones((), device=device)
    us = time_gpu(lambda x, y: torch._scaled_mm(x, y.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                  [(a, b)], 5)
    return 2 * n**3 / (us * 1e-6)


def fmt(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def main() -> None:
    global BW, FP8_RATE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes, no compile columns")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                    help="cpu: the same table on the host CPU (M = 16 and 512), where inductor may already fuse")
    args = ap.parse_args()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        device = "cpu"
    t0 = time.time()
    checks = check_kernels(device)
    bad = [c for c in checks if not c["ok"]]
    print(f"kernel checks on {device}: {len(checks) - len(bad)}/{len(checks)} within bounds", flush=True)
    for c in bad:
        print("  OUT OF BOUNDS:", c, flush=True)
    BW = copy_bandwidth(device)
    print(f"copy bandwidth: {BW / 1e12:.2f} TB/s", flush=True)
    if device == "cuda":
        try:
            FP8_RATE = fp8_matmul_rate(device)
            print(f"fp8 matmul rate: {FP8_RATE / 1e12:.0f} TFLOP/s", flush=True)
        except RuntimeError as e:
            print(f"fp8 matmul rate not measured ({e}); GEMM floors count bytes only", flush=True)
    gemms = gemm_rows(device) if device == "cuda" else []
    shapes = {"silu": [(16, 12288), (512, 12288), (8192, 12288)], "norm": [(16, 4096), (512, 4096), (8192, 4096)]}
    if args.quick:
        shapes = {"silu": [(4, 512)], "norm": [(4, 256)]}
    elif device == "cpu":
        shapes = {k: v[:2] for k, v in shapes.items()}
    rows = []
    for case, (_, _, kind) in CASES.items():
        for r in run_case(case, shapes[kind], device, args.quick):
            rows.append(r)
            print(f"  {case} M={r['M']}: eager {fmt(r['eager_us'])} compile {fmt(r.get('compile_us'))} "
                  f"moefx {fmt(r.get('moefx_us'))} op {fmt(r['fused_op_us'])} µs", flush=True)
    for r in rows:
        r["floor_us"] = r["bytes"] / BW * 1e6
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "copy_bw_Bps": BW, "fp8_flops": FP8_RATE, "seconds": time.time() - t0, "date": time.strftime("%Y-%m-%d")}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fusions.json").write_text(
            json.dumps({"meta": meta, "checks": checks, "gemm": gemms, "fusions": rows}, indent=1, default=str))
    if gemms:
        print("\nFP8 block GEMM (bf16 out), µs")
        print(f"{'M':>6} {'N':>6} {'K':>6} {'triton':>8} {'_scaled_mm':>10} {'bf16 mm':>8} {'floor':>7}")
        for g in gemms:
            sm = fmt(g.get("scaled_mm_us")) if "scaled_mm_us" in g else "n/a"
            print(f"{g['M']:>6} {g['N']:>6} {g['K']:>6} {g['triton_us']:>8.1f} {sm:>10} {g['bf16_mm_us']:>8.1f} "
                  f"{g['floor_us']:>7.1f}")
        errs = {g.get("scaled_mm_error") for g in gemms} - {None}
        if errs:
            print("  _scaled_mm blockwise unavailable:", "; ".join(errs))
    print(f"\nFusions on {meta['device']} (torch {meta['torch']}), µs per call; floor = bytes / {BW / 1e12:.2f} TB/s")
    print(f"{'case':<22} {'M':>5} {'width':>6} {'eager':>8} {'compile':>8} {'c+moefx':>8} {'op':>7} {'floor':>7} "
          f"{'best/floor':>10} {'exact':>6}")
    for r in rows:
        best = min(v for v in (r.get("moefx_us"), r["fused_op_us"]) if v is not None)
        chk = r.get("moefx_check", r["fused_op_check"])
        print(f"{r['case']:<22} {r['M']:>5} {r['width']:>6} {r['eager_us']:>8.1f} {fmt(r.get('compile_us')):>8} "
              f"{fmt(r.get('moefx_us')):>8} {r['fused_op_us']:>7.1f} {r['floor_us']:>7.1f} "
              f"{best / r['floor_us']:>10.2f} {('yes' if exact_enough(chk) else 'NO'):>6}")
    if not args.quick and not any("moefx_us" in r for r in rows):
        print("c+moefx: the moefx passes made no rewrite here (see JSON moefx_matches/moefx_skipped/moefx_error); "
              "'op' times the fused op called directly")


if __name__ == "__main__":
    main()
