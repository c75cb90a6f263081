"""Fused activation quant on the GPU, one row per fused variant class: the user's SiLU-mul / RMSNorm -> quant code
(the forms of vLLM, SGLang, DeepGEMM, torchao, transformers, DeepSeek-V3 that tests/test_fusion_corpus.py checks
at the FX level) timed three ways in the same run: eager PyTorch, inductor alone (`torch.compile` default) and
inductor with the moefx passes (`moefx.backend`, both fusion passes on). Both compiled arms keep the token
dimension dynamic (one graph for every M, as a serving graph) and float constants specialized (as
`moefx.optimize`). Timing: CUDA-graph replay of many calls, medians of 7 replays, rotating input copies so the
working set exceeds L2. Floor: bytes the class must move (inputs read + outputs written) / the best of the
measured device-copy and read-only bandwidths. Before timing, every Triton kernel variant (each scaling mode
included) is checked against the reference on this GPU, and every compiled moefx arm against eager
(FP8 codes: < 0.1% off by one last bit, INT8 off by at most one code in < 0.1%, scales 1e-6, residual exact).
Also measured: the FP8 block-scaled GEMM (Triton) against `torch._scaled_mm` blockwise where this torch has it.

    python bench/fusions.py            # on the H200: checks, GEMM table, fusion table last; JSON to $OUT
    python bench/fusions.py --quick    # CPU smoke run: tiny shapes, the FX-level fusion check, eager only
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moefx
from bench.harness import copy_ceiling_Bps, time_rotated, time_wall, write_json
from moefx.ops import block_gemm, quant
from moefx.ops.quant import QuantScheme

ops = torch.ops.moefx
FP8 = torch.float8_e4m3fn
MIN_SCALE = 1.0 / (448.0 * 512.0)  # vLLM's _FP8_MIN_SCALING_FACTOR
NORM_EPS = 1e-6


# --- the user's eager code: one function per fused variant class ----------------------------------------------

def silu_cat(x):
    """vLLM SiluAndMul.forward_native."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def hf_add_rms_norm(x, res, w):
    """transformers decoder layer: residual add in the model dtype, then Llama/Qwen3 RMSNorm."""
    s = res + x
    h = s.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    return w * h.to(s.dtype), s


def vllm_add_rms_norm(x, res, w):
    """vLLM RMSNorm.forward_native with a residual: fp32 sum feeds the norm."""
    h = x.float() + res.float()
    new_res = h.to(x.dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    return h.to(x.dtype) * w, new_res


def gemma_add_rms_norm(x, res, w):
    """vLLM GemmaRMSNorm.forward_static with a residual: `x * (1 + w)` in fp32, one downcast."""
    s = x + res
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    return (h * (1.0 + w.float())).to(x.dtype), s


def vllm_group_fp8(y, ue8m0_late=False):
    """vLLM QuantFP8 native group-128 path (0.33 order when ue8m0_late: clamp, then power of two)."""
    g = y.shape[-1] // 128
    yg = y.view(-1, g, 128)
    s = (yg.abs().max(dim=-1, keepdim=True)[0].float() / 448.0).clamp(min=MIN_SCALE)
    if ue8m0_late:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (yg / s).clamp(-448.0, 448.0).to(FP8)
    return q.view(y.shape), s.squeeze(-1).reshape(*y.shape[:-1], g)


def deepseek_act_quant(y):
    """DeepSeek-V3 act_quant semantics in torch (no eps, no clamp)."""
    x = y.reshape(-1, 128).float()
    s = x.abs().amax(-1, keepdim=True) / 448.0
    return (x / s).to(FP8).view(y.shape), s.view(*y.shape[:-1], -1)


def deepgemm_recip(y):
    """DeepGEMM per_token_cast_to_fp8: sf = amax / 448, multiplies by 1.0 / sf."""
    m, n = y.shape
    v = y.view(m, n // 128, 128)
    sf = v.abs().float().amax(dim=2).view(m, n // 128).clamp(1e-4) / 448.0
    return (v * (1.0 / sf.unsqueeze(2))).to(FP8).view(m, n), sf


def deepgemm_qmax_over_amax(y):
    """DeepGEMM's early per_token_cast_to_fp8: multiplies by 448 / amax."""
    m, n = y.shape
    v = y.view(m, -1, 128)
    amax = v.abs().float().amax(dim=2).view(m, -1).clamp(1e-4)
    return (v * (448.0 / amax.unsqueeze(2))).to(FP8).view(m, n), (amax / 448.0).view(m, -1)


def vllm_token_fp8(y):
    """vLLM QuantFP8 dynamic per-token: multiplies by scale.reciprocal()."""
    x_max = y.abs().max(dim=-1)[0].unsqueeze(-1).to(torch.float32)
    s = (x_max / 448.0).clamp(min=MIN_SCALE)
    return (y.to(torch.float32) * s.reciprocal()).clamp(-448.0, 448.0).to(FP8), s


def int8_token(y):
    s = y.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-5) / 127.0
    return torch.round(y.float() / s).clamp(-128, 127).to(torch.int8), s


def sglang_group_fp8(y):
    """SGLang native_per_token_group_quant_fp8: the eps clamp in the input dtype."""
    x_ = y.reshape(y.numel() // 128, 128)
    amax = x_.abs().max(dim=-1, keepdim=True)[0].clamp(min=1e-10).to(torch.float32)
    s = amax / 448.0
    return (x_ / s).clamp(-448.0, 448.0).to(FP8).reshape(y.shape), s.reshape(*y.shape[:-1], -1)


def _with_residual(norm, q):
    def fn(x, res, w):
        y, s = norm(x, res, w)
        return (*q(y), s)

    return fn


CLASSES: dict[str, tuple[Callable, str]] = {
    # name: (user code, inputs: "silu" x [M, 2N] | "split" gate, up [M, N] | "norm" x, res [M, H], w [H])
    "silu cat -> vLLM group128": (lambda x: vllm_group_fp8(silu_cat(x)), "silu"),
    "silu split -> DeepSeek act_quant": (lambda g, u: deepseek_act_quant(F.silu(g) * u), "split"),
    "silu cat -> DeepGEMM 1/sf": (lambda x: deepgemm_recip(silu_cat(x)), "silu"),
    "silu cat -> INT8 token": (lambda x: int8_token(silu_cat(x)), "silu"),
    "silu cat -> vLLM 0.33 UE8M0": (lambda x: vllm_group_fp8(silu_cat(x), ue8m0_late=True), "silu"),
    "HF add+norm -> vLLM group128": (_with_residual(hf_add_rms_norm, vllm_group_fp8), "norm"),
    "HF add+norm -> SGLang group128": (_with_residual(hf_add_rms_norm, sglang_group_fp8), "norm"),
    "vLLM add+norm -> vLLM token": (_with_residual(vllm_add_rms_norm, vllm_token_fp8), "norm"),
    "Gemma add+norm -> DeepGEMM 448/amax": (_with_residual(gemma_add_rms_norm, deepgemm_qmax_over_amax), "norm"),
    "HF add+norm -> INT8 token": (_with_residual(hf_add_rms_norm, int8_token), "norm"),
}
WIDTH = {"silu": 12288, "split": 6144, "norm": 4096}


def make_args(kind: str, m: int, width: int, device: str, copies: int) -> list[tuple]:
    g = torch.Generator(device=device).manual_seed(m)
    w = (torch.randn(width, device=device, generator=g) * 0.2 + 1).to(torch.bfloat16)
    sets = []
    for _ in range(copies):
        x = (torch.randn(m, width, device=device, generator=g) * 2).to(torch.bfloat16)
        if kind == "silu":
            sets.append((x,))
        elif kind == "split":
            sets.append((x, torch.randn_like(x)))
        else:
            sets.append((x, torch.randn_like(x), w))
    return sets


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


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


def check_kernels(device: str, quick: bool = False) -> list[dict]:
    """Every Triton quant kernel variant against the eager reference, plus the GEMMs (small shapes if quick)."""
    from moefx.kernels import fp8_gemm

    rows = []
    schemes = [QuantScheme("fp8_group", 128), QuantScheme("fp8_group", 64, scale_ue8m0=True, column_major_scales=True),
               QuantScheme("fp8_token", 0), QuantScheme("int8_token", 0),
               QuantScheme("int8_group", 128, tma_aligned_scales=True),
               QuantScheme("fp8_group", 128, 0.0, MIN_SCALE),
               QuantScheme("fp8_token", 0, 0.0, MIN_SCALE, scaling="reciprocal"),
               QuantScheme("fp8_group", 128, 1e-4, 0.0, scaling="qmax_over_amax"),
               QuantScheme("fp8_group", 128, 0.0, MIN_SCALE, scale_ue8m0=True, ue8m0_after_min_scale=True)]
    torch.manual_seed(0)
    m, h = (24, 256) if quick else (300, 1536)
    x = torch.randn(m, 2 * h, device=device, dtype=torch.bfloat16) * 3
    r = torch.randn(m, h, device=device, dtype=torch.bfloat16)
    w = torch.randn(h, device=device, dtype=torch.bfloat16)
    g, u = x[:, :h], x[:, h:]
    for sc in schemes:
        a = sc.args()
        qm = quant.check_scheme(*a)

        def ref(y, sc=sc, qm=qm):
            return quant.ref_quant(y, sc.kind, sc.group_size, sc.eps, sc.min_scale, qm, sc.scale_ue8m0, sc.scaling,
                                   sc.ue8m0_after_min_scale)

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
            rows.append({"kernel": name, "scheme": f"{sc.kind}/{sc.group_size}/{sc.scaling}", **c,
                         "ok": exact_enough(c)})
    # GEMMs
    for m, n, k in [(5, 256, 256)] if quick else [(5, 4096, 512), (300, 1024, 2048)]:
        a_q, a_s = ops.quant(torch.randn(m, k, device=device), *QuantScheme(column_major_scales=True).args())
        wq, ws = quant.quant_weight_fp8_block(torch.randn(n, k, device=device) * 0.05)
        ref = block_gemm.ref_fp8_block_gemm(a_q, a_s, wq, ws, 128, 128, None, torch.float32)
        # fp8 tensor-core sums within a 128-wide K block are not full fp32 on Hopper: ~1e-4 relative
        out = fp8_gemm.fp8_block_gemm(a_q, a_s, wq, ws, 128, 128, None, torch.float32) if device == "cuda" \
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

def read_bandwidth(device: str) -> float:
    """Bytes/s of a read-only pass (amax of a large bf16 tensor): the ceiling for read-heavy kernels."""
    n = (1 << 30) if device == "cuda" else (1 << 24)
    src = torch.randn(n // 2, device=device).to(torch.bfloat16)
    timer = time_rotated if device == "cuda" else time_wall
    us = timer(lambda t: t.abs().amax(), [(src,)], 10 if device == "cuda" else 3)
    del src
    return n / (us * 1e-6)


def compile_arm(fn: Callable, backend, example: tuple) -> Callable:
    """torch.compile with the token dimension dynamic (one graph for every M, as serving) and float constants
    specialized (as moefx.optimize); compiled and warmed up on `example`."""
    for t in example:
        if t.dim() >= 2:
            torch._dynamo.mark_dynamic(t, 0)
    compiled = torch.compile(fn, backend=backend) if backend else torch.compile(fn)
    compiled = torch._dynamo.config.patch(specialize_float=True)(compiled)
    compiled(*example)
    return compiled


def moefx_backend():
    # the timer captures the calls in its own CUDA graph, as for the inductor arm: no inductor graphs inside
    return moefx.backend({"pass_config": {"fuse_act_quant": True, "fuse_norm_quant": True}}, cudagraphs=False)


def run_class(name: str, ms: list[int], device: str, quick: bool) -> list[dict]:
    """One fused variant class: compile both arms once (dynamic M), then check and time every M."""
    fn, kind = CLASSES[name]
    width = WIDTH[kind] if not quick else {"silu": 512, "split": 256, "norm": 256}[kind]
    rows = []
    arms: dict[str, Callable] = {}
    info: dict = {}
    torch._dynamo.reset()
    if quick:
        from moefx.explain import explain_fusions

        expl = explain_fusions(fn, *make_args(kind, 8, width, device, 1)[0], dynamic_rows=True)
        info["moefx_fused"] = [c.detail for c in expl.fused]
        info["moefx_skipped"] = [c.detail for c in expl.left_alone]
    else:
        example = make_args(kind, 64, width, device, 1)[0]
        arms["inductor"] = compile_arm(fn, None, tuple(t.clone() for t in example))
        moefx.clear_compile_reports()
        try:
            arms["moefx"] = compile_arm(fn, moefx_backend(), tuple(t.clone() for t in example))
            reps = moefx.compile_reports()
            info["moefx_matches"] = {k: v for r in reps for k, v in r.matches.items() if v}
            info["moefx_skipped"] = [x for r in reps for v in r.skipped.values() for x in v][:3]
        except Exception as e:  # report it and keep measuring the other arms
            info["moefx_error"] = f"{type(e).__name__}: {e}"[:300]
    timer = time_rotated if device == "cuda" else time_wall
    for m in ms:
        one = make_args(kind, m, width, device, 1)[0]
        per_set = nbytes(one)
        copies = 1 if quick else max(1, min(16, math.ceil(150e6 / per_set)))
        arg_sets = make_args(kind, m, width, device, copies)
        calls = 5 if quick else (10 if m >= 4096 else 40)
        ref = fn(*arg_sets[0])
        row = {"class": name, "M": m, "width": width, "bytes": per_set + nbytes(ref), **info}
        row["eager_us"] = timer(fn, arg_sets, calls)
        for arm, compiled in arms.items():
            row[f"{arm}_check"] = compare(compiled(*arg_sets[0]), ref)
            row[f"{arm}_us"] = timer(compiled, arg_sets, calls)
        rows.append(row)
    return rows


# --- FP8 block GEMM: Triton vs torch._scaled_mm blockwise ------------------------------------------------------

def scaled_mm_blockwise(a, a_s, w, w_s):
    """torch._scaled_mm with 1x128 activation and 128x128 weight scales (cuBLASLt, torch >= 2.9, CUDA >= 12.9)."""
    return torch._scaled_mm(a, w.t(), scale_a=a_s, scale_b=w_s.t(), out_dtype=torch.bfloat16)


def gemm_rows(device: str) -> list[dict]:
    from moefx.kernels import fp8_gemm

    rows = []
    for m, n, k in [(16, 4096, 4096), (512, 4096, 4096), (8192, 4096, 4096)]:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        a, a_s = ops.quant(x, *QuantScheme(column_major_scales=True).args())
        wq, ws = quant.quant_weight_fp8_block(torch.randn(n, k, device=device) * 0.05)
        wb = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        ref = block_gemm.ref_fp8_block_gemm(a, a_s, wq, ws, 128, 128, None, torch.float32)
        row = {"M": m, "N": n, "K": k}
        operands = [(a, a_s, wq, ws)]
        row["triton_us"] = time_rotated(
            lambda *o: fp8_gemm.fp8_block_gemm(*o, 128, 128, None, torch.bfloat16), operands, 20)
        row["bf16_mm_us"] = time_rotated(lambda xx, ww: xx @ ww.t(), [(x, wb)], 20)
        try:
            out = scaled_mm_blockwise(a, a_s, wq, ws).float()
            row["scaled_mm_rel_err"] = ((out - ref).norm() / ref.norm()).item()
            row["scaled_mm_us"] = time_rotated(scaled_mm_blockwise, operands, 20)
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
    us = time_rotated(lambda x, y: torch._scaled_mm(x, y.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                  [(a, b)], 5)
    return 2 * n**3 / (us * 1e-6)


def fmt(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def main() -> None:
    global BW, FP8_RATE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes, FX-level fusion check, eager")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                    help="cpu: the same table on the host CPU (M = 16 and 512), where inductor may already fuse")
    ap.add_argument("--classes", default="", help="comma-separated substrings: only the classes whose name has one")
    args = ap.parse_args()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        device = "cpu"
    t0 = time.time()
    checks = check_kernels(device, args.quick)
    bad = [c for c in checks if not c["ok"]]
    print(f"kernel checks on {device}: {len(checks) - len(bad)}/{len(checks)} within bounds", flush=True)
    for c in bad:
        print("  OUT OF BOUNDS:", c, flush=True)
    copy_bw, read_bw = copy_ceiling_Bps(device), read_bandwidth(device)
    BW = max(copy_bw, read_bw)
    print(f"bandwidth: copy {copy_bw / 1e12:.2f} TB/s, read-only {read_bw / 1e12:.2f} TB/s", flush=True)
    if device == "cuda":
        try:
            FP8_RATE = fp8_matmul_rate(device)
            print(f"fp8 matmul rate: {FP8_RATE / 1e12:.0f} TFLOP/s", flush=True)
        except RuntimeError as e:
            print(f"fp8 matmul rate not measured ({e}); GEMM floors count bytes only", flush=True)
    gemms = gemm_rows(device) if device == "cuda" else []
    ms = [4] if args.quick else ([16, 512, 8192] if device == "cuda" else [16, 512])
    wanted = [w for w in args.classes.split(",") if w]
    rows = []
    for name in CLASSES:
        if wanted and not any(w in name for w in wanted):
            continue
        for r in run_class(name, ms, device, args.quick):
            rows.append(r)
            print(f"  {name} M={r['M']}: eager {fmt(r['eager_us'])} inductor {fmt(r.get('inductor_us'))} "
                  f"moefx {fmt(r.get('moefx_us'))} µs", flush=True)
    for r in rows:
        r["floor_us"] = r["bytes"] / BW * 1e6
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "copy_bw_Bps": copy_bw, "read_bw_Bps": read_bw, "fp8_flops": FP8_RATE, "seconds": time.time() - t0,
            "date": time.strftime("%Y-%m-%d")}
    write_json("fusions.json", {"meta": meta, "checks": checks, "gemm": gemms, "fusions": rows})
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
    print(f"\nFused variant classes on {meta['device']} (torch {meta['torch']}), µs per call, dynamic M; "
          f"floor = bytes / {BW / 1e9:.0f} GB/s; 'fused' = the moefx arm holds the fused op")
    print(f"{'class':<36} {'M':>5} {'eager':>8} {'inductor':>8} {'+moefx':>8} {'floor':>7} {'ind/moefx':>9} "
          f"{'moefx/floor':>11} {'exact':>5} {'fused':>5}")
    for r in rows:
        fused = bool(r.get("moefx_matches") or r.get("moefx_fused"))
        chk = r.get("moefx_check")
        exact = "-" if chk is None else ("yes" if exact_enough(chk) else "NO")
        speed = f"{r['inductor_us'] / r['moefx_us']:.2f}" if "moefx_us" in r and "inductor_us" in r else "-"
        vs_floor = f"{r['moefx_us'] / r['floor_us']:.2f}" if "moefx_us" in r else "-"
        print(f"{r['class']:<36} {r['M']:>5} {r['eager_us']:>8.1f} {fmt(r.get('inductor_us')):>8} "
              f"{fmt(r.get('moefx_us')):>8} {r['floor_us']:>7.1f} {speed:>9} {vs_floor:>11} {exact:>5} "
              f"{('yes' if fused else 'NO'):>5}")


if __name__ == "__main__":
    main()
