"""Serving hints (docs/SIGNATURES.md, "How a plan is resolved"):
CUDA-graph capture sizes, prefill token budget, vocab-parallel LM head.

Each hint comes with the source that decided it, so `Plan.explain()` can say why. Capture sizes are a geometric
set of batch buckets (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ...: powers of two, and above 16 also 1.5x each) up to
`max_batch_size`, or without it up to a cap derived from memory, as vLLM sizes its graphs from memory; the decode
engine captures each one lazily, on first use, so a large cap costs nothing until a batch that size arrives.
"""

from __future__ import annotations

from typing import Any

from moefx.facts.execution import DEVICE_MEMORY_GIB, ExecutionSignature
from moefx.facts.model import ModelSignature
from moefx.facts.sizes import DTYPE_BYTES, signature_kv_bytes_per_token
from moefx.machine import free_memory
from moefx.planner.preferences import PlanFragment

GEOMETRIC_FROM = 16  # powers of two up to here; above, each power of two and 1.5x it
CAPTURE_SIZE_LIMIT = 512  # the largest capture size a plan proposes without max_batch_size
CAP_SEQUENCE_TOKENS = 4096  # KV tokens per sequence the memory-derived cap makes room for ...
CAP_MEMORY_FRACTION = 0.5  # ... in this fraction of the free device memory
MOE_PREFILL_TOKEN_BUDGET = 4096
PREFILL_BUDGET_MIN_BATCH = 32
_GIB = 2**30


def geometric_sizes(limit: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... up to `limit` (inclusive)."""
    sizes, size = [], 1
    while size <= limit:
        sizes.append(size)
        if size >= GEOMETRIC_FROM and size * 3 // 2 <= limit:
            sizes.append(size * 3 // 2)
        size *= 2
    return sizes


def capture_sizes(max_batch_size: int) -> list[int]:
    """The geometric sizes up to max_batch_size, plus max_batch_size itself; nothing above it."""
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
    sizes = geometric_sizes(max_batch_size)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def _weight_bytes(ms: ModelSignature) -> int:
    """Rough weight bytes from the signature (experts, embeddings, attention); 0 where facts are missing."""
    width = DTYPE_BYTES.get(ms.dtype or "", 2)
    h, layers = ms.hidden_size or 0, ms.num_layers or 0
    experts = (ms.num_experts or 0) * 3 * h * (ms.moe_intermediate_size or 0) * layers
    heads = (ms.num_heads or 0) + 2 * (ms.num_kv_heads or 0)
    attention = layers * 2 * h * heads * (ms.head_dim or 0)
    embeddings = 2 * (ms.vocab_size or 0) * h
    return (experts + attention + embeddings) * width


def _free_memory(ms: ModelSignature, es: ExecutionSignature) -> tuple[int | None, str]:
    """(free device bytes for the engine, where the figure comes from)."""
    import torch

    # Only a process that already uses CUDA is asked (planning must not be what initializes it, e.g. in vLLM's
    # front-end process before it forks its workers).
    if torch.cuda.is_available() and torch.cuda.is_initialized() and es.device_name == torch.cuda.get_device_name():
        free = free_memory(torch.device("cuda"))
        return free, f"{free / _GIB:.1f} GiB free on this {es.device_name}"
    total = DEVICE_MEMORY_GIB.get(es.device_name or "")
    if total is None:
        return None, f"free memory of {es.device_name or 'this device'} unknown"
    weights = _weight_bytes(ms)
    free = max(0, int(total * _GIB) - weights)
    return free, f"{es.device_name} {total:.0f} GiB less about {weights / _GIB:.1f} GiB of weights"


def capture_cap(ms: ModelSignature, es: ExecutionSignature) -> tuple[int, str]:
    """(largest capture size, why) when max_batch_size is not given: the largest geometric size whose KV cache at
    CAP_SEQUENCE_TOKENS per sequence fits in CAP_MEMORY_FRACTION of the free memory, at most CAPTURE_SIZE_LIMIT."""
    free, where = _free_memory(ms, es)
    kv = signature_kv_bytes_per_token(ms)
    if free is None or kv is None:
        why = where if free is None else "KV bytes per token unknown"
        return CAPTURE_SIZE_LIMIT, f"{why}: the largest, {CAPTURE_SIZE_LIMIT}"
    fits = int(free * CAP_MEMORY_FRACTION) // (kv * CAP_SEQUENCE_TOKENS)
    sizes = geometric_sizes(min(CAPTURE_SIZE_LIMIT, max(1, fits)))
    return sizes[-1], (f"{where}: {CAP_MEMORY_FRACTION:.0%} of it holds {fits} sequences of "
                       f"{CAP_SEQUENCE_TOKENS} KV tokens ({kv} B each); at most {CAPTURE_SIZE_LIMIT}")


def serving_hints(
    ms: ModelSignature, es: ExecutionSignature, cfg: Any, fragment: PlanFragment | None
) -> tuple[dict[str, Any], dict[str, str]]:
    """(values, sources) for capture_sizes, prefill_token_budget and vocab_parallel_lm_head."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    mbs = es.max_batch_size
    if mbs is None and es.device_type == "cuda":
        mbs, cap_why = capture_cap(ms, es)
        cap_source = f"max_batch_size unset: cap {mbs} from memory ({cap_why})"
        mbs_label = f"capture cap {mbs} (max_batch_size unset)"
    else:
        cap_source = mbs_label = f"max_batch_size {mbs}"
    if es.mode == "capture" and es.device_type == "cuda":
        values["capture_sizes"] = capture_sizes(mbs)
        sources["capture_sizes"] = (f"mode capture, {cap_source}: 1, 2, 4, 8, 16, then x1.5 steps, captured on "
                                    f"first use; larger batches decode without a graph")
    else:
        values["capture_sizes"] = []
        sources["capture_sizes"] = f"no CUDA-graph capture in mode {es.mode} on {es.device_type}"

    if cfg.prefill_token_budget is not None:
        values["prefill_token_budget"] = cfg.prefill_token_budget
        sources["prefill_token_budget"] = "user config"
    elif fragment is not None and fragment.moe_family and mbs is not None and mbs >= PREFILL_BUDGET_MIN_BATCH:
        values["prefill_token_budget"] = MOE_PREFILL_TOKEN_BUDGET
        sources["prefill_token_budget"] = (
            f"provider {fragment.provider}: MoE family at {mbs_label} >= {PREFILL_BUDGET_MIN_BATCH}"
        )
    else:
        values["prefill_token_budget"] = None
        if fragment is None:
            why = "profile unknown"
        elif mbs is None:
            why = f"max_batch_size unset on {es.device_type} (no capture cap to size it from)"
        else:
            why = f"max_batch_size {mbs} < {PREFILL_BUDGET_MIN_BATCH}"
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
