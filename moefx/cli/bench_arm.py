"""One arm of `moefx bench`: optimize a model with a config, warm up, time `--repeats` greedy `generate()` runs
(each sample: prefill + first token, the mean decode step, and the decode rate from two lengths; see
`moefx.cli.demo.generate_metrics`). Prints one JSON line, {"samples": [{prefill_ms, itl_ms, decode_tok_s}, ...]}.
Run as `python -m moefx.cli.bench_arm` (its own process and inductor cache)."""

from __future__ import annotations

import argparse
import json

import torch

import moefx
from moefx.cli.bench import strict_json
from moefx.cli.demo import demo_prompts, generate_metrics
from moefx.models.spec import build_model_from_spec


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--model", default="tiny-qwen3-moe")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, _ = build_model_from_spec(args.model, args.layers, device, dtype)
    model = moefx.optimize(model, config=args.config)
    ids = demo_prompts(args.seed, args.batch, args.prompt_len, model.config.vocab_size).to(device)
    generate_metrics(model, ids, args.new_tokens)  # compile
    generate_metrics(model, ids, args.new_tokens)  # warm
    samples = [generate_metrics(model, ids, args.new_tokens) for _ in range(args.repeats)]
    print(json.dumps(strict_json({"samples": samples}), allow_nan=False))


if __name__ == "__main__":
    main()
