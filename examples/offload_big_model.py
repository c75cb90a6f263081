"""Experts in host memory: a MoE model whose experts do not fit on the GPU, one config key.

    python examples/offload_big_model.py                              # embedded tiny Qwen3-MoE
    python examples/offload_big_model.py --model Qwen/Qwen3-30B-A3B   # a real checkpoint (GPU + large host RAM)

Attention, KV cache, embeddings, norms and routers stay on the GPU; the experts move to pinned host memory and
are computed there for decode (moefx's host kernel) and streamed to the GPU for long prompts. On a CPU-only
machine the experts already live in host memory: the transform still runs the host expert path, which is what
this script checks against the same model without offload (greedy tokens). docs/OFFLOAD.md has the details.

A checkpoint is loaded onto the GPU first and its experts then leave it (as bench/offload.py does with 48
Qwen3-30B-A3B layers on an H200); loading a checkpoint larger than the GPU straight into this layout is not
supported yet.
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
    p.add_argument("--new-tokens", type=int, default=8)
    args = p.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.model is None:
        model = build_model(tiny_qwen3_moe_config(), dtype=dtype, device=args.device)
        reference = copy.deepcopy(model)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, device_map=args.device).eval()
        reference = None
    input_ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))

    # [readme:offload]
    model = moefx.optimize(model, config={"offload": {"experts": "cpu"}, "mode": "eager"})
    print("\n".join(line for line in model.moefx_plan.explain().splitlines() if "offload" in line))
    out = model.generate(input_ids.to(args.device), max_new_tokens=args.new_tokens, do_sample=False)
    # [/readme]

    print("generated:", out[0, input_ids.shape[1]:].tolist())
    if reference is not None:
        expected = reference.generate(input_ids.to(args.device), max_new_tokens=args.new_tokens, do_sample=False)
        same = torch.equal(out.cpu(), expected.cpu())
        print(f"greedy tokens match the model without offload: {'yes' if same else 'NO'}")
        if not same and dtype == torch.float32:  # in bf16 another summation order may flip a near-tie
            raise SystemExit(1)


if __name__ == "__main__":
    main()
