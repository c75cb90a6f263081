"""`moefx demo`: optimize an embedded tiny Qwen3-MoE, check it against eager, and time both."""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

import moefx
from moefx.cli.common import add_config_arg, format_table, load_config, progress
from moefx.models import build_model, tiny_qwen3_moe_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per path; the median one is shown")
    add_config_arg(p)


@dataclass
class GreedyRun:
    prefill_logits: torch.Tensor
    tokens: torch.Tensor
    prefill_s: float
    token_times: list[float]  # host time at which each generated token was available

    @property
    def decode_tok_s(self) -> float:
        # (output tokens - 1) / (last-token time - first-token time), per sequence
        span = self.token_times[-1] - self.token_times[0]
        return (len(self.token_times) - 1) / span if span > 0 else float("nan")

    @property
    def itl_ms(self) -> float:
        gaps = sorted(b - a for a, b in zip(self.token_times, self.token_times[1:]))
        return 1e3 * gaps[len(gaps) // 2] if gaps else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def greedy(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int) -> GreedyRun:
    device = input_ids.device
    cache = DynamicCache(config=model.config)
    _sync(device)
    start = time.perf_counter()
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    prefill_logits = out.logits[:, -1].float()
    token = prefill_logits.argmax(-1, keepdim=True)
    _sync(device)
    times = [time.perf_counter()]
    prefill_s = times[0] - start
    tokens = [token]
    for _ in range(new_tokens - 1):
        out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        times.append(time.perf_counter())
        tokens.append(token)
    return GreedyRun(prefill_logits, torch.cat(tokens, dim=1), prefill_s, times)


def _timed_runs(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, repeats: int) -> list[GreedyRun]:
    return [greedy(model, ids, new_tokens) for _ in range(repeats)]


def _medians(runs: list[GreedyRun], batch: int) -> tuple[str, str, str]:
    """Median of each metric over the timed runs (a noisy run moves no number)."""
    med = statistics.median
    return (
        f"{med(r.prefill_s for r in runs) * 1e3:.2f}",
        f"{med(r.itl_ms for r in runs):.2f}",
        f"{med(r.decode_tok_s for r in runs) * batch:.1f}",
    )


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available; use --device cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    eager = build_model(tiny_qwen3_moe_config(), seed=args.seed, dtype=dtype, device=device)
    optimized = moefx.optimize(copy.deepcopy(eager), config=cfg)
    print("plan:")
    print(optimized.moefx_plan.explain())

    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, eager.config.vocab_size, (args.batch, args.prompt_len), generator=gen).to(device)
    greedy(eager, ids, args.new_tokens)
    with progress("compiling the optimized model (first call)"):
        greedy(optimized, ids, args.new_tokens)
    ref_runs = _timed_runs(eager, ids, args.new_tokens, args.repeats)
    opt_runs = _timed_runs(optimized, ids, args.new_tokens, args.repeats)
    ref, opt = ref_runs[0], opt_runs[0]

    rel = (opt.prefill_logits - ref.prefill_logits).norm() / ref.prefill_logits.norm()
    match = torch.equal(opt.tokens, ref.tokens)
    bound = 1e-4 if dtype == torch.float32 else 3e-2
    print(f"\nlast-position logits relative error: {rel.item():.2e} (bound {bound:.0e})")
    print(f"greedy tokens match eager: {'yes' if match else 'NO'} ({args.new_tokens} tokens x {args.batch})")
    rows = [(name, *_medians(runs, args.batch)) for name, runs in (("eager", ref_runs), ("moefx", opt_runs))]
    print()
    print(format_table([f"median of {args.repeats} runs", "prefill ms", "ITL ms", "decode tok/s"], rows))
    print(f"\ndevice={device.type} dtype={str(dtype).replace('torch.', '')} prompt={args.prompt_len} "
          f"batch={args.batch} torch={torch.__version__}")
    return 0 if (match and rel.item() <= bound) else 1
