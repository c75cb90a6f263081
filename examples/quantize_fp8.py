"""Quantize a MoE model to FP8 (block-128 weights, dynamic per-group activations), then optimize it.

    python examples/quantize_fp8.py                                  # embedded tiny Qwen3-MoE (H=128)
    python examples/quantize_fp8.py --model Qwen/Qwen3-30B-A3B       # a real bf16 checkpoint (GPU)

`moefx.quantize` swaps every linear and experts module (except `lm_head` and the routers) for FP8 ones and records
the format in `config.quantization_config`, so the plan sees FP8 activations: on CUDA it turns the SiLU-mul and
RMSNorm quant fusions on. The script prints the plan's quant lines and the logits' error against the unquantized
model. A checkpoint already released in FP8 (DeepSeek-V3, Qwen3-FP8) loads with `moefx.quantize.load_fp8_checkpoint`.
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import AutoModelForCausalLM

import moefx
from moefx.models import build_model, tiny_qwen3_moe_config


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face name or folder (default: the embedded tiny Qwen3-MoE)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", default="compile", choices=["eager", "compile", "capture"])
    args = p.parse_args(argv)
    if args.model is None:  # widths that are multiples of the 128 quant block
        cfg = tiny_qwen3_moe_config(hidden_size=128, moe_intermediate_size=128, intermediate_size=256, head_dim=32)
        model = build_model(cfg, dtype=torch.bfloat16, device=args.device)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map=args.device)
    reference = copy.deepcopy(model) if args.model is None else None
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)

    # [readme:quantize]
    model = moefx.quantize(model, "fp8_block128")  # or "int8"
    model = moefx.optimize(model, config={"mode": args.mode})
    print("\n".join(line for line in model.moefx_plan.explain().splitlines() if "quant" in line))
    # [/readme]

    with torch.no_grad():
        logits = model(ids).logits.float()
        if reference is not None:
            ref = reference(ids).logits.float()
            rel = ((logits - ref).norm() / ref.norm()).item()
            # e4m3 keeps 3 mantissa bits: each rounding of a weight or activation moves it by up to 6%
            print(f"logits vs the bf16 model: {rel:.1e} relative (FP8 weights and activations; bound 0.25)")
            if not rel < 0.25:
                raise SystemExit(1)


if __name__ == "__main__":
    main()
