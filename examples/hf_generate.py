"""Way of use 1: `moefx.optimize` a transformers MoE model, then `generate()` as usual.

    python examples/hf_generate.py                                   # embedded tiny Qwen3-MoE (CPU or GPU)
    python examples/hf_generate.py --model Qwen/Qwen3-30B-A3B        # a real checkpoint (GPU)

The tiny model is built from a transformers config with seeded random weights (no download). The script checks
the optimized model's greedy tokens against the same model run eagerly, and prints the plan.
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import AutoModelForCausalLM

import moefx
from moefx.models import build_model, tiny_qwen3_moe_config


def load(name: str | None, device: str) -> torch.nn.Module:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if name is None:
        return build_model(tiny_qwen3_moe_config(), dtype=dtype, device=device)
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, device_map=device).eval()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face name or folder (default: the embedded tiny Qwen3-MoE)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", default="capture", choices=["eager", "compile", "capture"])
    p.add_argument("--new-tokens", type=int, default=16)
    args = p.parse_args(argv)

    model = load(args.model, args.device)
    reference = copy.deepcopy(model) if args.model is None else None  # a second copy only of the tiny model
    input_ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    input_ids = input_ids.to(args.device)

    model = moefx.optimize(model, config={"mode": args.mode, "max_batch_size": 1})
    print(model.moefx_plan.explain())  # every decision and who made it
    out = model.generate(input_ids, max_new_tokens=args.new_tokens, do_sample=False)

    print("generated:", out[0, input_ids.shape[1]:].tolist())
    if reference is not None:
        expected = reference.generate(input_ids, max_new_tokens=args.new_tokens, do_sample=False)
        same = torch.equal(out, expected)
        print(f"greedy tokens match eager: {'yes' if same else 'NO'}")
        if not same and model.dtype == torch.float32:  # in bf16 compiled kernels may flip a near-tie
            raise SystemExit(1)


if __name__ == "__main__":
    main()
