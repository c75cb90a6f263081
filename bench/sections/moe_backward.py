"""The section of bench/moe_backward.py's kept result: autograd through the experts op."""

from __future__ import annotations

from typing import Any

from bench.sections.markdown import Section, num, ratio, section, span, table

BACKWARD_KINDS = {
    "full": "gradients of hidden, routing weights and both expert weights (training the experts)",
    "frozen": "hidden and routing weights only (expert weights frozen: LoRA on attention, router training)",
    "fwd_bwd": "one forward and the full backward",
}


def render_moe_backward(r: dict[str, Any]) -> str:
    rows = []
    for x in r["rows"]:
        for kind in BACKWARD_KINDS:
            floor = (x.get("floor_us") or {}).get(kind)
            rows.append((x["M"], kind, num(x["moefx"][kind], 1), num(x["grouped_mm"][kind], 1),
                         ratio(x["moefx"][kind], x["grouped_mm"][kind]), num(floor, 1),
                         ratio(x["moefx"][kind], floor)))
    errs = "; ".join(f"M={x['M']}: moefx {span(x['moefx_err'], 4)}, grouped_mm {span(x['grouped_mm_err'], 4)}"
                     for x in r["rows"])
    body = table(["M", "gradients", "moefx µs", "grouped_mm µs", "moefx / grouped_mm", "floor µs", "moefx / floor"],
                 rows)
    body += ("\n\nKinds:\n" + "\n".join(f"- `{k}`: {v}" for k, v in BACKWARD_KINDS.items())
             + f"\n\nGradients against the fp32 reference backward, relative L2 (hidden, routing weights, w13, w2): "
               f"{errs}. moefx's backward recomputes GEMM 1 (its forward saves only its inputs), which is where its "
               "extra time against grouped_mm's goes; one forward plus backward is on par.")
    return section(
        "Experts backward (autograd of `moefx::moe_experts`)", r,
        what="Qwen3-30B-A3B experts (E=128, H=2048, I=768, top-8), bf16, `torch.autograd.grad` through one call, CUDA "
             "events over eager calls, medians; four forward graphs on different inputs rotate.",
        peer="transformers' `grouped_mm` experts forward and its autograd, same run",
        floor="max(FLOPs / measured bf16 matmul rate, bytes / measured copy rate) of a backward without recompute",
        body=body)


SECTIONS = (Section("moe-backward", render_moe_backward),)
