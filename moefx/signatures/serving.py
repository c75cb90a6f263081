"""Serving hints (SPEC §6): CUDA-graph capture sizes, prefill token budget, vocab-parallel LM head.

Each hint comes with the source that decided it, so `Plan.explain()` can say why.
"""

from __future__ import annotations

from typing import Any

from moefx.signatures.execution import ExecutionSignature
from moefx.signatures.model import ModelSignature
from moefx.signatures.registry import PlanFragment

DENSE_CAPTURE_MAX = 16  # every batch size up to here gets its own graph
CAPTURE_STEP = 8  # above it, multiples of 8
MOE_PREFILL_TOKEN_BUDGET = 4096
PREFILL_BUDGET_MIN_BATCH = 32


def capture_sizes(max_batch_size: int) -> list[int]:
    """1..16, then multiples of 8, plus max_batch_size itself; nothing above it."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = list(range(1, min(DENSE_CAPTURE_MAX, max_batch_size) + 1))
    sizes += range(DENSE_CAPTURE_MAX + CAPTURE_STEP, max_batch_size + 1, CAPTURE_STEP)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def serving_hints(
    ms: ModelSignature, es: ExecutionSignature, cfg: Any, fragment: PlanFragment | None
) -> tuple[dict[str, Any], dict[str, str]]:
    """(values, sources) for capture_sizes, prefill_token_budget and vocab_parallel_lm_head."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    mbs = es.max_batch_size
    if es.mode == "capture" and es.device_type == "cuda":
        values["capture_sizes"] = capture_sizes(mbs)
        sources["capture_sizes"] = f"mode capture, max_batch_size {mbs}: 1..16, multiples of 8, the maximum"
    else:
        values["capture_sizes"] = []
        sources["capture_sizes"] = f"no CUDA-graph capture in mode {es.mode} on {es.device_type}"

    if cfg.prefill_token_budget is not None:
        values["prefill_token_budget"] = cfg.prefill_token_budget
        sources["prefill_token_budget"] = "user config"
    elif fragment is not None and fragment.moe_family and mbs >= PREFILL_BUDGET_MIN_BATCH:
        values["prefill_token_budget"] = MOE_PREFILL_TOKEN_BUDGET
        sources["prefill_token_budget"] = (
            f"provider {fragment.provider}: MoE family at max_batch_size {mbs} >= {PREFILL_BUDGET_MIN_BATCH}"
        )
    else:
        values["prefill_token_budget"] = None
        why = "profile unknown" if fragment is None else f"max_batch_size {mbs} < {PREFILL_BUDGET_MIN_BATCH}"
        sources["prefill_token_budget"] = f"no budget: {why}"

    if fragment is None or not fragment.causal_lm:
        eligible, why = False, "needs a known causal-LM profile"
    elif es.tp_size < 2:
        eligible, why = False, f"tp_size {es.tp_size}: the LM head is not split"
    else:
        eligible, why = True, (
            f"tp_size {es.tp_size}: greedy by local (max, argmax) + one gather of 2 values per row; full logits "
            f"(one gather of the vocab slices) for sampling and raw logits"
        )
    values["vocab_parallel_lm_head"] = eligible
    sources["vocab_parallel_lm_head"] = why
    return values, sources
