"""`moefx audit-syncs [MODEL]`: list the host syncs and graph breaks of a model's decode step and sampler.

MODEL is a built-in name, a config.json or a model folder; it is built with seeded random weights at a reduced
depth (`--layers`; every layer kind appears once by default, and syncs repeat per layer), and refused when even
that would not fit in memory.

The step is what transformers' `generate()` does per token: one forward with a static cache, the
temperature / top-k / top-p warpers, softmax, `torch.multinomial`, and the "all finished?" check.
Each sync and graph break is listed with its source line, whether moefx removes it, and why not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from moefx.cli.common import add_config_arg, add_model_args, load_config, progress
from moefx.models.spec import build_model_from_spec


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p, "tiny-qwen3-moe")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--batch", type=int, default=1, help="rows of the audited step")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature, > 0")
    p.add_argument("--top-k", type=int, default=50, help="top-k warper, >= 1")
    p.add_argument("--top-p", type=float, default=0.9, help="top-p warper, in (0, 1]; 1 leaves it out")
    p.add_argument("--json", dest="json_path", default=None, help="also write the findings to this JSON file")
    add_config_arg(p)


def make_decode_step(model: Any, processors: Any) -> Any:
    """The per-token work of transformers' sampling loop, as one function."""
    import torch

    from moefx.engine.steps import cache_kwarg

    cache_arg = cache_kwarg(model.forward)  # `cache` where transformers renamed it: no FutureWarning

    def decode_step(tokens, positions, cache, unfinished):
        logits = model(input_ids=tokens, position_ids=positions, logits_to_keep=1, **{cache_arg: cache}).logits
        scores = processors(tokens, logits[:, -1, :].float())
        probs = torch.softmax(scores, dim=-1)
        next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
        if unfinished.max() == 0:  # transformers' stop check, read on the host every step
            return next_tokens, None
        return next_tokens, unfinished

    return decode_step


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import StaticCache
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from moefx.audit import audit_syncs
    from moefx.engine.steps import cache_kwarg

    cfg = load_config(args)
    if args.config is None and not args.config_overrides:
        cfg = None  # audit_syncs' default: the sampler passes on
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available; use --device cpu")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    if not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0 (the audited step samples), got {args.temperature}")
    if args.top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with progress(f"building {args.model} on {device}"):
        model, what = build_model_from_spec(args.model, args.layers, device, dtype)
    print(f"model: {what}")
    processors = LogitsProcessorList([TemperatureLogitsWarper(args.temperature)])
    if args.top_k:
        processors.append(TopKLogitsWarper(args.top_k))
    if args.top_p < 1:
        processors.append(TopPLogitsWarper(args.top_p))
    prompt = 8
    cache = StaticCache(config=model.config, max_cache_len=prompt + 4)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, prompt), device=device)
    with torch.no_grad():
        pos = torch.arange(prompt, device=device).expand(args.batch, -1)
        model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(model.forward): cache})
    step_args = (
        ids[:, -1:].clone(),
        torch.full((args.batch, 1), prompt, device=device),
        cache,
        torch.ones(args.batch, dtype=torch.long, device=device),
    )
    with progress("auditing the decode step (dynamo explain, moefx compile, sync debug mode)"), torch.no_grad():
        report = audit_syncs(make_decode_step(model, processors), *step_args, config=cfg)
    print(report.format())
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report.to_dict(), indent=2))
    return 0
