"""`moefx demo`: optimize an embedded tiny Qwen3-MoE, check its `generate()` against transformers' eager one, and
time both the way a user calls them (greedy `generate()`; decode rate from two lengths, so the prefill cancels)."""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import moefx
from moefx.cli.common import add_config_arg, format_table, load_config, progress
from moefx.models import build_model, tiny_qwen3_moe_config
from moefx.sampling.sampler import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per path; the median one is shown")
    add_config_arg(p)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate_s(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, repeats: int = 1) -> float:
    """Median wall time of `generate(ids, max_new_tokens=new_tokens)` (greedy, no EOS)."""
    times = []
    for _ in range(repeats):
        _sync(ids.device)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        _sync(ids.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def generate_metrics(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, repeats: int = 1) -> dict:
    """prefill_ms (prefill + first token), itl_ms (mean decode step) and decode_tok_s = B * (n - 1) / (t(n) - t(1))
    of greedy `generate()`: the prefill cancels out of the rate (also `moefx bench`'s arms)."""
    one = _generate_s(model, ids, 1, repeats)
    full = _generate_s(model, ids, new_tokens, repeats)
    step = max(full - one, 1e-9) / (new_tokens - 1)
    # decode_measured False: the machine's noise swallowed the decode steps (t(n) <= t(1)); the rate is meaningless
    return {"prefill_ms": one * 1e3, "itl_ms": step * 1e3, "decode_tok_s": ids.shape[0] / step,
            "decode_measured": full > one}


def _row(name: str, model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, repeats: int) -> tuple:
    m = generate_metrics(model, ids, new_tokens, repeats)
    if not m["decode_measured"]:
        return name, f"{m['prefill_ms']:.2f}", "noise", "noise (busy machine: rerun, or raise --new-tokens)"
    return name, f"{m['prefill_ms']:.2f}", f"{m['itl_ms']:.2f}", f"{m['decode_tok_s']:.1f}"


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
    greedy = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        ref = eager.generate(ids, output_logits=True, return_dict_in_generate=True, **greedy)
        with progress("compiling the optimized model (first call)"):
            tokens = optimized.generate(ids, **greedy)
        front = getattr(optimized, "moefx_generate", None)
        logits: list[torch.Tensor] = []
        if front is not None:  # the engine's first-step logits, against transformers' eager ones
            front.engine.generate(ids, 1, SamplingParams(temperature=0), logits_out=logits)
        else:  # no engine: the optimized forward's last position
            logits.append(optimized(input_ids=ids).logits[:, -1])
        got = logits[0].float()
        want = ref.logits[0].float()
        rel = ((got - want).norm() / want.norm()).item()
        match = torch.equal(tokens, ref.sequences)
        rows = [_row(name, m, ids, args.new_tokens, args.repeats)
                for name, m in (("transformers generate()", eager), ("moefx optimize + generate()", optimized))]
    bound = 1e-4 if dtype == torch.float32 else 3e-2
    print(f"\nfirst-step logits relative error: {rel:.2e} (bound {bound:.0e})")
    print(f"greedy tokens match eager: {'yes' if match else 'NO'} ({args.new_tokens} tokens x {args.batch})")
    if front is not None:
        print(f"generate(): {front.describe()}")
    print()
    print(format_table([f"median of {args.repeats} runs", "prefill + 1 token ms", "ms per step", "decode tok/s"],
                       rows))
    print(f"\ndevice={device.type} dtype={str(dtype).replace('torch.', '')} prompt={args.prompt_len} "
          f"batch={args.batch} torch={torch.__version__}")
    return 0 if (match and rel <= bound) else 1
