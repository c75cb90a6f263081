"""`moefx.precompile`: build a model's persistent compile artifacts ahead of time (e.g. in a container build).

A model named by a built-in name, config.json or folder is built with seeded random weights from its config:
compiled code depends on shapes, dtypes and the plan, not on weight values, so the artifacts serve the trained
model of the same config, device, dtype, mode and buckets. The model is optimized, one greedy request per
(batch size, prompt length) compiles the prefill, decode step and sampler and captures each bucket's decode
step, and the artifacts are written where the engine of a later process looks for them
(`moefx/engine/compile_cache/file.py`). Sampling requests (temperature, top-k, ...) compile their sampler on
first use; that is the one compile left to a serving process.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moefx.config import CompilationConfig
from moefx.log import progress_logger


@dataclass
class PrecompileResult:
    path: Path
    artifacts: int
    seconds: float
    requests: list[tuple[int, int]]  # (batch, prompt length) run
    compiles: dict[str, int] = field(default_factory=dict)
    captures: int = 0
    model: str = ""

    def describe(self) -> str:
        runs = ", ".join(f"B={b} T={t}" for b, t in self.requests)
        return (f"precompiled {self.model} in {self.seconds:.1f} s: requests {runs}; "
                f"compiles {self.compiles or 'none'}; {self.captures} CUDA graphs captured; "
                f"{self.artifacts} artifacts in {self.path}")


def _build(spec: str, layers: int | None, device: torch.device, dtype: torch.dtype) -> tuple[Any, str]:
    from moefx.models.spec import build_model_from_spec, model_config

    depth = layers if layers is not None else model_config(spec).get("num_hidden_layers")
    return build_model_from_spec(spec, depth if isinstance(depth, int) else None, device, dtype)


def precompile(
    model: Any,
    *,
    batch_sizes: Sequence[int] | None = None,
    prompt_lengths: Sequence[int] = (128,),
    new_tokens: int = 2,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    layers: int | None = None,
    config: Any = None,
) -> PrecompileResult:
    """Compile and save the artifacts of `model` (an `nn.Module`, or a built-in name / config.json / folder,
    built at full depth or `layers` with random weights on `device`, default cuda when present, in `dtype`, default
    bf16 on CUDA and fp32 on the CPU). `batch_sizes` default to the plan's capture buckets (or 1)."""
    cfg = CompilationConfig.from_any(config)
    if cfg.mode == "eager":
        raise ValueError("precompile needs a compiled mode; config key 'mode' is 'eager' (valid: compile, capture)")
    if new_tokens < 2:
        raise ValueError(f"precompile new_tokens must be >= 2 (one decode step at least), got {new_tokens}")
    if any(int(t) < 1 for t in prompt_lengths) or not prompt_lengths:
        raise ValueError(f"precompile prompt_lengths must be integers >= 1, got {list(prompt_lengths)}")
    start = time.perf_counter()
    if isinstance(model, torch.nn.Module):
        name = type(model).__name__
    else:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("precompile device 'cuda' was asked for but no CUDA device is available; use 'cpu'")
        if dtype is None:
            dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        elif isinstance(dtype, str):
            dtype = getattr(torch, dtype.replace("torch.", ""), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError("precompile dtype must be a torch dtype name such as 'bfloat16' or 'float32'")
        progress_logger().info("building %s with random weights (shapes are what compiles)...", model)
        model, name = _build(str(model), layers, dev, dtype)
    if getattr(model, "moefx_plan", None) is None:
        from moefx.optimize import optimize

        model = optimize(model, config=cfg)
    front = getattr(model, "moefx_generate", None)
    cache = getattr(getattr(front, "engine", None), "compile_cache", None)
    if cache is None:
        why = "the compile cache is off (config key 'compile_cache' or MOEFX_COMPILE_CACHE)" if front else \
            "generate() does not run on moefx's engine for this model (see model.moefx_plan.explain())"
        raise ValueError(f"nothing to precompile: {why}")
    unwritable = cache.write_problem()
    if unwritable:
        raise ValueError(f"nothing to precompile into: {unwritable}; pass a writable folder (--cache-dir, config "
                         f"key 'compile_cache' or MOEFX_COMPILE_CACHE)")
    engine = front.engine
    sizes = list(batch_sizes) if batch_sizes else (engine.capture_sizes or [1])
    if any(int(b) < 1 for b in sizes):
        raise ValueError(f"precompile batch_sizes must be integers >= 1, got {sizes}")
    param = next(iter(model.parameters()))
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    runs = []
    for batch in sizes:
        for length in prompt_lengths:
            ids = torch.randint(1, vocab, (int(batch), int(length)), generator=gen).to(param.device)
            progress_logger().info("precompile request: batch %d, prompt %d, %d new tokens", batch, length, new_tokens)
            model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            runs.append((int(batch), int(length)))
    artifacts = cache.save(force=True) or cache.saved
    if cache.unwritable:
        raise ValueError(f"the compile cache {str(cache.path)!r} could not be written: {cache.unwritable}")
    stats = engine.stats
    return PrecompileResult(cache.path, artifacts, time.perf_counter() - start, runs, dict(stats.compiles),
                            stats.captures, name)
