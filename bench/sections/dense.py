"""The section of bench/dense.py's kept result: small-M projections against cuBLAS."""

from __future__ import annotations

from typing import Any

from bench.sections.markdown import Section, num, ratio, section, table

DENSE_SHAPES = {"qkv": "q/k/v (three weights, one launch)", "o": "o_proj", "router": "router gate"}


FP8_FORMS = {"qkv+norm": "q/k/v with the input RMSNorm", "o": "o_proj"}


def render_dense(r: dict[str, Any]) -> str:
    body = ""
    if r["rows"]:
        rows = [(f"{DENSE_SHAPES.get(x['shape'], x['shape'])} {x['kind']}", x["M"], num(x["gemv"], 2),
                 num(x["upstream"], 2), num(x["floor_us"], 2), ratio(x["gemv"], x["floor_us"]),
                 ratio(x["upstream"], x["gemv"])) for x in r["rows"]]
        body = table(["shape", "M", "gemv µs", "cuBLAS µs (peer)", "floor µs", "gemv / floor", "cuBLAS / gemv"], rows)
        body += ("\n\nCUDA-graph replay medians over rotating weight sets larger than 3× L2. Eager calls (launch "
                 "overhead included, in the kept data as `*_eager`) are 70–580 µs either way on this machine; there "
                 "the table runs cuBLAS except for FP8 q/k/v (the gemv's one launch against three block-FP8 ones) "
                 "and FP8 o_proj at M=1. Which backend each call runs is the shipped table's ranges (docs/DENSE.md).")
    if r.get("fp8_forms"):
        fp8 = [(FP8_FORMS.get(x["form"], x["form"]), x["M"], num(x["bf16"], 2), num(x["w8a8"], 2),
                num(x["weight_only"], 2), num(x["floor_fp8"], 2), ratio(x["weight_only"], x["floor_fp8"]),
                ratio(x["w8a8"], x["weight_only"])) for x in r["fp8_forms"]]
        body += ("\n\n" if body else "") + (
            "FP8 decode forms (`bench/dense.py --fp8-forms`), CUDA-graph replay medians over rotating weight sets: "
            "the bf16 GEMV, W8A8 (the activation-quant kernel + the FP8 GEMV, the peer) and the weight-only FP8 GEMV "
            "on the bf16 input (`fp8_weight_only`, docs/DENSE.md); the floor counts the FP8 weights, their scales, "
            "X and the outputs:\n\n")
        body += table(["form", "M", "bf16 µs", "W8A8 µs (peer)", "weight-only µs", "FP8 floor µs",
                       "weight-only / floor", "W8A8 / weight-only"], fp8)
    if r.get("forms"):
        forms = [(x["form"], x["M"], num(x["gemv"], 2), num(x["upstream"], 2), num(x["plain"], 2),
                  ratio(x["upstream"], x["gemv"])) for x in r["forms"]]
        body += ("\n\nDecode-layer forms, one gemv launch each, against the same op's upstream path (torch's add and "
                 "norm ops, cuBLAS, `moefx::fused_topk`); `plain gemv` is the GEMV alone, so the difference is what "
                 "the fused prologue and routing cost:\n\n")
        body += table(["form", "M", "gemv µs", "upstream µs (peer)", "plain gemv µs", "upstream / gemv"], forms)
    return section(
        "Small-M projections (`moefx::dense_linear`)", r,
        what="Qwen3-30B-A3B projection shapes (q/k/v N = 4096 + 512 + 512, K = 2048; o N = 2048, K = 4096; router "
             "N = 128, K = 2048), bf16 and FP8 block-128 weights, µs per call.",
        peer=("cuBLAS: `F.linear` per weight (bf16) or `moefx::fp8_block_gemm` per weight (FP8), same run" if r["rows"]
              else "the W8A8 form (`moefx::quant` + the FP8 GEMV), same run"),
        floor=f"weight + activation + output bytes / {r['copy_TBps']:.2f} TB/s", body=body)


SECTIONS = (Section("dense", render_dense),)
