"""How a model routes: distinct experts hit per MoE layer, read off the top-k indices each experts module receives.

Benchmarks use it to report the routing they measured and to count the expert bytes a step actually reads; tests
use it to check `build_model(..., routing="balanced")`. It hooks transformers' experts modules (the ones its
experts interface dispatches), so it works on the plain model, before `moefx.optimize` compiles it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from moefx.integrations.transformers import is_experts_module


def expected_distinct(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts hit by `tokens` tokens that each pick `top_k` different experts uniformly at random:
    E * (1 - (1 - k/E)^T) (an expert is missed by one token with probability 1 - k/E, exactly, without replacement)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's experts modules by qualified name, in layer order."""
    return {name: m for name, m in model.named_modules() if is_experts_module(m)}


def _num_experts(module: nn.Module) -> int:
    n = getattr(module, "num_experts", None)
    return int(n) if n is not None else int(module.down_proj.shape[0])


@contextmanager
def record_routing(model: nn.Module) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Record the top-k expert indices every experts module receives while the block runs: {module name: one
    (tokens, k) tensor per call}."""
    calls: dict[str, list[torch.Tensor]] = {name: [] for name in experts_modules(model)}
    if not calls:
        raise ValueError(f"{type(model).__name__} has no transformers experts module to record routing from")

    def hook(name: str):
        def pre(_module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            index = kwargs["top_k_index"] if "top_k_index" in kwargs else args[1]
            calls[name].append(index.detach().reshape(-1, index.shape[-1]).cpu())

        return pre

    handles = [m.register_forward_pre_hook(hook(name), with_kwargs=True) for name, m in experts_modules(model).items()]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def _distinct(index: torch.Tensor, num_experts: int) -> int:
    return int(torch.bincount(index.reshape(-1), minlength=num_experts)[:num_experts].count_nonzero())


@torch.no_grad()
def distinct_experts(model: nn.Module, input_ids: torch.Tensor) -> list[int]:
    """Distinct experts each MoE layer's top-k picks over all tokens of one forward of `input_ids` (no cache)."""
    mods = experts_modules(model)
    with record_routing(model) as calls:
        model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    return [_distinct(torch.cat(calls[name]), _num_experts(m)) for name, m in mods.items()]


@torch.no_grad()
def decode_distinct_experts(model: nn.Module, input_ids: torch.Tensor, steps: int = 4) -> dict[str, float]:
    """Mean distinct experts per decode step, per experts module, for a batch: greedy `generate` over `input_ids`
    (B prompts) for `steps` decode steps after the prefill; each step routes B tokens."""
    mods = experts_modules(model)
    with record_routing(model) as calls:
        model.generate(input_ids, max_new_tokens=steps + 1, min_new_tokens=None, do_sample=False, pad_token_id=0,
                       eos_token_id=None)
    out = {}
    for name, m in mods.items():
        per_step = calls[name][1:]  # the first call is the prefill
        if not per_step:
            raise ValueError(f"{name} ran no decode step (generate() stopped after the prefill)")
        out[name] = sum(_distinct(i, _num_experts(m)) for i in per_step) / len(per_step)
    return out


def uniform_expected(model: nn.Module, tokens: int) -> float:
    """`expected_distinct` for the model's experts count and top-k at `tokens` tokens."""
    cfg = model.config
    mods = experts_modules(model)
    e = _num_experts(next(iter(mods.values())))
    return expected_distinct(e, int(cfg.num_experts_per_tok), tokens)
