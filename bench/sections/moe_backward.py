"""The section of bench/moe_backward.py's kept result: autograd through the experts op."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from bench.sections.markdown import Section, num, ratio, section, span, table


@dataclass(frozen=True)
class BackwardRow:
    """One M of bench/moe_backward.py: both arms' gradient errors; on the GPU also their µs per kind of backward
    (BACKWARD_KINDS) and the floors (max(FLOPs / bf16 matmul rate, bytes / SM-copy ceiling), no recompute)."""

    M: int
    backward_path: str
    moefx_err: list[float]  # relative L2 against the fp32 reference: hidden, routing weights, w13, w2
    grouped_mm_err: list[float]
    floor_us: dict[str, float] | None = None  # None: not timed (a CPU run, or a failed gradient check)
    moefx: dict[str, float] | None = None
    grouped_mm: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON row: the fields that were measured."""
        return {k: v for k, v in asdict(self).items() if v is not None}

BACKWARD_KINDS = {
    "full": "gradients of hidden, routing weights and both expert weights (training the experts)",
    "frozen": "hidden and routing weights only (expert weights frozen: LoRA on attention, router training)",
    "fwd_bwd": "one forward and the full backward",
}


def render_moe_backward(r: dict[str, Any]) -> str:
    kept = [BackwardRow(**x) for x in r["rows"]]
    rows = []
    for x in kept:
        for kind in BACKWARD_KINDS:
            floor = (x.floor_us or {}).get(kind)
            rows.append((x.M, kind, num(x.moefx[kind], 1), num(x.grouped_mm[kind], 1),
                         ratio(x.moefx[kind], x.grouped_mm[kind]), num(floor, 1), ratio(x.moefx[kind], floor)))
    errs = "; ".join(f"M={x.M}: moefx {span(x.moefx_err, 4)}, grouped_mm {span(x.grouped_mm_err, 4)}" for x in kept)
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
