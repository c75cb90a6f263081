"""One arm of `moefx bench`: optimize the tiny model with a config, warm up, time one greedy run.
Prints one JSON line. Run as `python -m moefx.cli.bench_arm` (its own process and inductor cache)."""

from __future__ import annotations

import argparse
import json

import torch

import moefx
from moefx.cli.demo import greedy
from moefx.models import build_model, tiny_qwen3_moe_config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = moefx.optimize(build_model(tiny_qwen3_moe_config(), dtype=dtype, device=device), config=args.config)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len), device=device)
    greedy(model, ids, args.new_tokens)
    greedy(model, ids, args.new_tokens)
    r = greedy(model, ids, args.new_tokens)
    result = {"prefill_ms": r.prefill_s * 1e3, "itl_ms": r.itl_ms, "decode_tok_s": r.decode_tok_s * args.batch}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
