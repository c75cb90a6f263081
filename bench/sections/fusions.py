"""The section of bench/fusions.py's kept result: fused activation quantization; the README's fusion line."""

from __future__ import annotations

from typing import Any

from bench.sections.markdown import Section, num, ratio, section, span, table


def _exact(chk: dict[str, Any] | None) -> str:
    if not chk:
        return "–"
    if chk["q_mismatch"] == 0 and chk["scale_rel"] == 0 and chk["residual_equal"]:
        return "yes"
    out = f"{chk['q_mismatch']:.1e} of codes off by ≤ {chk['q_max_code_diff']:.0f}"
    if chk["scale_rel"]:
        out += f"; scales within {chk['scale_rel']:.1e}"
    return out + ("" if chk["residual_equal"] else "; residual differs")


def fusion_bandwidth(r: dict[str, Any]) -> float:
    """The copy rate the floors use: the kept run's SM-copy ceiling where it was recorded apart, else its own."""
    return r.get("copy_ceiling_Bps") or r["meta"]["copy_bw_Bps"]


def render_fusions(r: dict[str, Any]) -> str:
    bw = fusion_bandwidth(r)
    rows, last = [], None
    for x in r["fusions"]:
        fl = x["bytes"] / bw * 1e6
        best = x.get("moefx_us")
        fused = "yes" if x.get("moefx_matches") else "no"
        label = "" if x["class"] == last else f"{x['class']} (width {x['width']})"
        last = x["class"]
        rows.append((label, x["M"], num(x["eager_us"]), num(x["inductor_us"]), f"**{num(best)}**", num(fl),
                     ratio(best, fl) if fl >= 1 else "–", ratio(x["inductor_us"], best), fused,
                     _exact(x.get("moefx_check")), _exact(x.get("inductor_check"))))
    body = table(["variant class", "M", "eager", "inductor", "**inductor + moefx**", "floor", "moefx / floor",
                  "inductor / moefx", "fused", "moefx = eager", "inductor = eager"], rows)
    big = [x for x in r["fusions"] if x["M"] == max(y["M"] for y in r["fusions"])]
    checks = r.get("checks") or []
    body += (f"\n\n- at M={big[0]['M']}: inductor + moefx at "
             f"{span(x['moefx_us'] / (x['bytes'] / bw * 1e6) for x in big)}× the floor, inductor alone "
             f"{span(x['inductor_us'] / (x['bytes'] / bw * 1e6) for x in big)}×"
             "\n- ratios to the floor are left out where the floor is under 1 µs (launch-bound sizes)"
             f"\n- before timing, {sum(c['ok'] for c in checks)} of {len(checks)} kernel variants (each scaling mode) "
             "matched the reference on this GPU")
    if r.get("exactness_note"):
        body += f"\n- {r['exactness_note']}"
    grows = [(g["M"], f"{g['N']}×{g['K']}", num(g["triton_us"]), num(g.get("scaled_mm_us")), num(g["bf16_mm_us"]),
              num(max((g["M"] * g["K"] + g["N"] * g["K"] + 2 * g["M"] * g["N"]) / bw,
                      2 * g["M"] * g["N"] * g["K"] / r["meta"]["fp8_flops"]) * 1e6))
             for g in r.get("gemm", [])]
    if grows:
        body += ("\n\nFP8 block-scaled GEMM (`moefx::fp8_block_gemm`, bf16 out), µs; peer: bf16 `mm` at the same "
                 "shape, same run; floor = max(bytes / copy rate, FLOPs / measured FP8 matmul rate):\n\n"
                 + table(["M", "N×K", "Triton", "`torch._scaled_mm` blockwise", "bf16 mm (peer)", "floor"], grows))
    return section(
        "Fused activation quantization", r,
        what="One row per fused variant class: the user's SiLU-mul / add + RMSNorm → quant code, written after "
             "vLLM, SGLang, DeepGEMM, transformers and Gemma forms (the classes of `tests/test_fusion_corpus.py`), "
             "bf16. µs per call, CUDA-graph replay of many calls with rotating inputs, token dimension dynamic in "
             "both compiled arms. \"inductor + moefx\" is `torch.compile(backend=moefx.backend(cfg))` with both "
             "fusion passes on; \"= eager\" compares FP8/INT8 codes and scales with eager.",
        peer="eager PyTorch (the user's code) and inductor alone (`torch.compile` default), same run",
        floor=f"bytes read + written / {bw / 1e12:.2f} TB/s"
              + (f" ({r['copy_ceiling_note']})" if r.get("copy_ceiling_note") else ""), body=body)


def headline(results: dict[str, dict[str, Any]]) -> list[str]:
    """The README's fusion line: the largest M's classes against the bytes floor, with and without moefx."""
    fus = results.get("fusions")
    if not fus:
        return []
    bw = fusion_bandwidth(fus)
    big = [x for x in fus["fusions"] if x["M"] == max(y["M"] for y in fus["fusions"])]
    return [f"Fused SiLU-mul / add+RMSNorm → FP8/INT8 quant at M={big[0]['M']} ({len(big)} variant classes): "
            f"{span(x['moefx_us'] / (x['bytes'] / bw * 1e6) for x in big)}× the bytes floor "
            f"(torch.compile alone {span(x['inductor_us'] / (x['bytes'] / bw * 1e6) for x in big)}×)."]


SECTIONS = (Section("fusions", render_fusions),)
