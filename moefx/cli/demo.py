"""`moefx demo`: optimize an embedded tiny Qwen3-MoE, check its `generate()` against transformers' eager one, and
time both the way a user calls them (greedy `generate()`; decode rate from two lengths, so the prefill cancels)."""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import TYPE_CHECKING

from moefx.cli.bench import outside_noise, spread_pct
from moefx.cli.common import add_config_arg, format_table, load_config, progress

if TYPE_CHECKING:
    import torch

# The largest --batch: the largest capture size a plan proposes without max_batch_size
# (moefx.planner.serving.CAPTURE_SIZE_LIMIT, pinned by a test); a larger batch shows nothing new about the
# engine and only grows the eager reference's logits and activations until the host runs out of memory.
MAX_DEMO_BATCH = 512


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both models run")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per row (random ids, no pad token)")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens generated per row, at least 2")
    p.add_argument("--batch", type=int, default=1,
                   help=f"rows per request, 1 to {MAX_DEMO_BATCH} (the largest batch a plan captures unasked)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompts")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per path; the median one is shown")
    add_config_arg(p)


PAD = 0  # the pad id every generate() call here passes: no prompt holds it, so no position is masked


def demo_prompts(seed: int, batch: int, length: int, vocab: int) -> torch.Tensor:
    """Random prompts [batch, length] of ids in [1, vocab): never the pad id, which transformers' generate() would
    mask (and the engine's first-step check, called without a mask, would not): both sides see every token."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(PAD + 1, vocab, (batch, length), generator=gen)


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate_s(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> float:
    """Wall time of one `generate(ids, max_new_tokens=new_tokens)` (greedy, no EOS)."""
    _sync(ids.device)
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    _sync(ids.device)
    return time.perf_counter() - start


def _metrics(ones: list[float], fulls: list[float], batch: int, new_tokens: int) -> dict:
    """The metrics of `generate_metrics` from the wall times of 1-token and `new_tokens`-token runs, plus
    `spread_pct`: the interquartile range of the per-round decode times over their median (inf when unknown)."""
    one, full = statistics.median(ones), statistics.median(fulls)
    step = max(full - one, 1e-9) / (new_tokens - 1)
    spread = spread_pct([f - o for o, f in zip(ones, fulls)])
    # decode_measured False: the machine's noise swallowed the decode steps (t(n) <= t(1)); the rate is meaningless
    return {"prefill_ms": one * 1e3, "itl_ms": step * 1e3, "decode_tok_s": batch / step,
            "decode_measured": full > one, "spread_pct": spread}


def generate_metrics(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, repeats: int = 1) -> dict:
    """prefill_ms (prefill + first token), itl_ms (mean decode step) and decode_tok_s = B * (n - 1) / (t(n) - t(1))
    of greedy `generate()`: the prefill cancels out of the rate (also `moefx bench`'s arms)."""
    ones = [_generate_s(model, ids, 1) for _ in range(repeats)]
    fulls = [_generate_s(model, ids, new_tokens) for _ in range(repeats)]
    return _metrics(ones, fulls, ids.shape[0], new_tokens)


def time_arms(arms: dict[str, torch.nn.Module], ids: torch.Tensor, new_tokens: int, repeats: int) -> dict[str, dict]:
    """Each arm's metrics, timed fairly on a shared machine: every arm is warmed up first, then each round runs
    every arm once (1 token, then `new_tokens`), the order alternating per round, so load other jobs put on the
    machine during a round hits both arms; medians over the rounds."""
    for model in arms.values():
        _generate_s(model, ids, 1)
        _generate_s(model, ids, new_tokens)
    names = list(arms)
    ones: dict[str, list[float]] = {n: [] for n in names}
    fulls: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            ones[name].append(_generate_s(arms[name], ids, 1))
            fulls[name].append(_generate_s(arms[name], ids, new_tokens))
    return {n: _metrics(ones[n], fulls[n], ids.shape[0], new_tokens) for n in names}


def _row(name: str, m: dict) -> tuple:
    if not m["decode_measured"]:
        return name, f"{m['prefill_ms']:.2f}", "noise", "noise (busy machine: rerun, or raise --new-tokens)", "-"
    spread = "-" if m["spread_pct"] == float("inf") else f"{m['spread_pct']:.0f}%"
    return name, f"{m['prefill_ms']:.2f}", f"{m['itl_ms']:.2f}", f"{m['decode_tok_s']:.1f}", spread


def comparison(hf: dict, fx: dict, mode: str, engine: str | None, load: float | None, cores: int,
               threads: int) -> str:
    """One line: moefx's decode rate against transformers' loop, and when moefx is not faster, why: the
    machine's noise, or the facts of this run that explain it (never a number the timings do not support)."""
    if not (hf["decode_measured"] and fx["decode_measured"]):
        return ("decode speed not compared: the machine's noise swallowed the decode steps (rerun, or raise "
                "--new-tokens)")
    ratio = fx["decode_tok_s"] / hf["decode_tok_s"]
    noise = max(hf["spread_pct"], fx["spread_pct"])
    if noise == float("inf"):
        return (f"moefx decode: {ratio:.2f}x transformers' loop, one round: no spread measured, so no verdict "
                f"(faster, slower or within the noise needs --repeats 2 or more)")
    spread = f"{noise:.0f}%"
    beyond = outside_noise(100.0 * (ratio - 1.0), noise)
    if ratio >= 1.0 and beyond:
        return f"moefx decode: {ratio:.2f}x transformers' loop: faster, beyond the noise (decode-time spread {spread})"
    if ratio >= 1.0:
        return (f"moefx decode: {ratio:.2f}x transformers' loop: within the noise (decode-time spread {spread}), not "
                f"a measured speed-up: rerun on a quieter machine or with more --repeats")
    machine = f"load average {load:.1f} on {cores} cores" if load is not None else f"{cores} cores"
    if not beyond:
        return (f"moefx is not faster here: within the noise of the machine (the arms {100 * (1 - ratio):.0f}% "
                f"apart, decode-time spread {spread}; {machine}): rerun on a quieter machine or with more --repeats")
    if engine is not None:
        cause = f"generate() ran transformers' own loop ({engine})"
    elif mode == "eager":
        cause = "mode eager compiles nothing, so the optimized model runs the same eager kernels plus the engine"
    elif load is not None and load > cores:
        cause = (f"the machine is loaded ({machine}): the compiled step's {threads} thread(s) wait for cores other "
                 f"jobs hold, which slows it more than transformers' eager loop")
    else:
        cause = (f"on this CPU ({machine}, {threads} torch thread(s)) the compiled step does not beat transformers' "
                 f"eager loop at this size")
    return f"moefx is {1 / ratio:.2f}x slower than transformers' loop here, beyond the noise (spread {spread}): {cause}"


def run(args: argparse.Namespace) -> int:
    import torch

    import moefx
    from moefx.engine.request import check_prompt
    from moefx.models import build_model, tiny_qwen3_moe_config
    from moefx.sampling.sampler import SamplingParams

    for flag, value, low in (("--prompt-len", args.prompt_len, 1), ("--new-tokens", args.new_tokens, 2),
                             ("--batch", args.batch, 1), ("--repeats", args.repeats, 1)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}" +
                             (" (the decode rate is timed from 1 and --new-tokens tokens)" if low == 2 else ""))
    if args.batch > MAX_DEMO_BATCH:
        raise ValueError(f"--batch must be <= {MAX_DEMO_BATCH} (the largest batch a plan captures unasked), got "
                         f"{args.batch}")
    cfg = load_config(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available; use --device cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    eager = build_model(tiny_qwen3_moe_config(), seed=args.seed, dtype=dtype, device=device)
    check_prompt(eager.config, args.batch, args.prompt_len, args.new_tokens)
    optimized = moefx.optimize(copy.deepcopy(eager), config=cfg)
    print("plan:")
    print(optimized.moefx_plan.explain())

    ids = demo_prompts(args.seed, args.batch, args.prompt_len, eager.config.vocab_size).to(device)
    greedy = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=PAD)
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
        arms = {"transformers generate()": eager, "moefx optimize + generate()": optimized}
        with progress(f"timing both, interleaved: {args.repeats} rounds after a warm-up"):
            timed = time_arms(arms, ids, args.new_tokens, args.repeats)
        rows = [_row(name, m) for name, m in timed.items()]
    bound = 1e-4 if dtype == torch.float32 else 3e-2
    print(f"\nfirst-step logits relative error: {rel:.2e} (bound {bound:.0e})")
    print(f"greedy tokens match eager: {'yes' if match else 'NO'} ({args.new_tokens} tokens x {args.batch})")
    if front is not None:
        print(f"generate(): {front.describe()}")
    print()
    print(format_table([f"median of {args.repeats} runs", "prefill + 1 token ms", "ms per step", "decode tok/s",
                        "spread"], rows))
    engine = None if front is None else ("; ".join(front.fallbacks) or None)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print("\n" + comparison(*timed.values(), cfg.mode, engine, load, os.cpu_count() or 1, torch.get_num_threads()))
    print(f"\ndevice={device.type} dtype={str(dtype).replace('torch.', '')} prompt={args.prompt_len} "
          f"batch={args.batch} torch={torch.__version__}")
    return 0 if (match and rel <= bound) else 1
