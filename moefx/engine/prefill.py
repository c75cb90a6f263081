"""The prefill per prompt-length bucket: the prompt right-padded to the bucket, static-shaped, and on CUDA
captured in a CUDA graph per (slot, bucket, left-padded or not), so replaying it costs no Python per layer.

Why padding leaves the result unchanged: attention is causal, so a real position never sees the padded ones
after it; the logits come from the last real position (`logits_to_keep` as a one-element index tensor on the
device); the keys and values go to the slot's static cache through a device-side mask (positions at or past the
prompt length keep what the cache held, zeros after its reset), and each static layer's write position is set
to the real length. A left-padded request's mask is extended with ones over the padded tail (causal only there).
The MoE op sees rows × bucket tokens: padded rows cost compute, not correctness.

The forward runs over a DynamicCache, as the unpadded prefill does (attention over the prompt only); under a
graph its tensors live in the graph's pool, which is the decode graphs' pool. One compiled function serves every
bucket: the prompt dimension is marked dynamic from the first call, so a new bucket is a new capture, not a new
inductor compile of the whole model.
Prompts longer than the largest bucket, or whose rows × bucket exceed the token cap, take the dynamic compiled prefill
(`DecodeLoop._prompt`), as do batches an engine that captures runs without graphs (above its capture sizes):
padding pays only where it buys a graph, or where the caller asked for it without graphs (the CPU tests).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moefx.backends.capture_mode import as_captured
from moefx.config import PREFILL_BUCKETS
from moefx.log import get_logger, warn_once

log = get_logger("moefx.sampling")

PREFILL_CAPTURE_TOKENS = 4096  # default cap on rows × bucket: bounds the activations one graph holds


def prefill_buckets(max_tokens: int) -> tuple[int, ...]:
    """The buckets a token cap allows (0: none, the prefill is neither padded nor captured)."""
    if max_tokens != 0 and max_tokens not in PREFILL_BUCKETS:
        raise ValueError(f"config key 'prefill_capture_tokens' must be 0 (off) or one of {list(PREFILL_BUCKETS)}, "
                         f"got {max_tokens!r}")
    return tuple(b for b in PREFILL_BUCKETS if b <= max_tokens)


def pick_bucket(rows: int, prompt: int, buckets: Sequence[int], max_tokens: int) -> int | None:
    """The smallest bucket holding the prompt with rows × bucket within the cap, or None (dynamic prefill)."""
    for size in buckets:
        if size >= prompt:
            return size if rows * size <= max_tokens else None
    return None


@dataclass
class _Bucketed:
    """One (slot, bucket, masked, by_head) prefill: its static inputs, and its graph once captured."""

    tokens: torch.Tensor  # [rows, bucket]
    positions: torch.Tensor  # [rows, bucket]
    cache_position: torch.Tensor  # [bucket]
    mask: torch.Tensor | None  # [rows, bucket] or None (unpadded rows: causal only)
    last: torch.Tensor  # [1]: the last real position
    length: torch.Tensor  # (): the real prompt length
    keep: torch.Tensor  # [min(bucket, cache length)] bool: written to the static cache
    graph: Any = None
    out: torch.Tensor | None = None
    tried: bool = False  # capture attempted (a graph or the reason it has none)


class BucketedPrefill:
    """The padded prefill of a `DecodeLoop`: one compiled function for all buckets, graphs kept on the slots."""

    def __init__(self, loop: Any, buckets: Sequence[int], max_tokens: int) -> None:
        self.loop = loop
        self.buckets = tuple(sorted(buckets))
        self.max_tokens = max_tokens
        self._fn = loop._compile("prefill[padded]", types.MethodType(_forward, loop), dict(loop._compile_kwargs))

    def run(self, slot: Any, prompt: int, positions: torch.Tensor, masked: bool, by_head: bool,
            graphs: bool, stand_in: bool = False) -> torch.Tensor | None:
        """The first-token scores (logits, or tokens with `by_head`) of the padded prefill into `slot`'s static
        cache, or None when no bucket holds this prompt. `stand_in`: run without a graph the kernels a captured
        one would (capture_mode.py), unless this bucket's capture was refused."""
        bucket = pick_bucket(slot.batch, prompt, self.buckets, self.max_tokens)
        if bucket is None:
            return None
        key = (bucket, masked, by_head)
        run = slot.prefill.get(key)
        if run is None:
            run = slot.prefill[key] = _buffers(slot, bucket, masked)
        _fill(run, slot, prompt, positions, masked)
        if graphs and not run.tried:
            run.tried = True
            self._capture(slot, run, key)
        if graphs and run.graph is not None:
            run.graph.replay()
            return run.out
        refused = run.tried and run.graph is None
        with as_captured(stand_in and not refused):
            return self._call(slot, run, by_head)

    def _call(self, slot: Any, run: _Bucketed, by_head: bool) -> torch.Tensor:
        from transformers import DynamicCache

        prompt_cache = DynamicCache(config=self.loop.model.config)
        scores = self._fn(run.tokens, run.positions, run.cache_position, run.mask,
                                               prompt_cache, by_head, run.last)
        n = run.keep.shape[0]
        keep = run.keep[None, None, :, None]
        layers = slot.cache.layers
        with torch.no_grad():  # a cache write (where out= takes no autograd)
            for static, dynamic in zip(layers, prompt_cache.layers):
                # written where they lie (out= the cache's own slice): one kernel per tensor, not a where and a copy
                for old, new in ((static.keys[:, :, :n], dynamic.keys[:, :, :n]),
                                 (static.values[:, :, :n], dynamic.values[:, :, :n])):
                    torch.where(keep, new, old, out=old)
            torch._foreach_copy_([layer.cumulative_length for layer in layers], [run.length] * len(layers))
        return scores

    def _capture(self, slot: Any, run: _Bucketed, key: tuple) -> None:
        """Capture this prefill into the engine's graph pool (`GraphPool.capture`: warm-ups first, deciding kernels
        as the capture will); a prefill that cannot be captured runs without a graph, with the reason in the
        stats."""
        loop, (bucket, masked, by_head) = self.loop, key
        device = run.tokens.device
        reserved = torch.cuda.memory_reserved(device)
        rng = torch.cuda.get_rng_state(device)
        graph, out, why = loop.graph_pool.capture(lambda: self._call(slot, run, by_head), device)
        if graph is None:
            self._uncaptured(slot, bucket, f"its forward {why}")
            return
        torch.cuda.set_rng_state(rng, device)
        run.graph, run.out = graph, out
        loop.stats.prefill_captures += 1
        grown = max(0, torch.cuda.memory_reserved(device) - reserved)
        loop.stats.prefill_graph_bytes += grown
        loop.slots.record_graph_bytes("prefill", grown, device, keep=slot)  # within the engine's memory budget
        log.info("prefill captured for bucket %d, batch %d%s", bucket, slot.batch, " (left-padded)" if masked else "")

    def _uncaptured(self, slot: Any, bucket: int, why: str) -> None:
        message = f"prefill bucket {bucket} for batch {slot.batch} runs without a CUDA graph: {why}"
        self.loop.stats.uncaptured.append(message)
        warn_once(f"moefx generate(): {message}")


def _forward(loop: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor,
             attention_mask: torch.Tensor | None, cache: Any, by_head: bool, last: torch.Tensor) -> torch.Tensor:
    """Scores at position `last` of one padded forward: logits [rows, V], or with `by_head` the greedy tokens."""
    if by_head:
        from moefx.parallel.lm_head import greedy_step

        return greedy_step(loop.model, input_ids=input_ids, position_ids=position_ids, cache_position=cache_position,
                           attention_mask=attention_mask, last=last, **{loop._decoder_cache_arg: cache})
    out = loop._model_forward(
        input_ids=input_ids, position_ids=position_ids, cache_position=cache_position, attention_mask=attention_mask,
        use_cache=True, logits_to_keep=last, **{loop._cache_arg: cache},
    )
    return out.logits[:, -1]


def _buffers(slot: Any, bucket: int, masked: bool) -> _Bucketed:
    device = slot.state["seq"].device
    long = {"dtype": torch.long, "device": device}
    run = _Bucketed(
        tokens=torch.zeros(slot.batch, bucket, **long),
        positions=torch.zeros(slot.batch, bucket, **long),
        cache_position=torch.arange(bucket, **long),
        mask=torch.ones(slot.batch, bucket, **long) if masked else None,
        last=torch.zeros(1, **long),
        length=torch.zeros((), **long),
        keep=torch.zeros(min(bucket, slot.max_len), dtype=torch.bool, device=device),
    )
    # Dynamic rows and prompt dimension from the first call: every bucket and batch shares one compile.
    for t in (run.tokens, run.positions, run.mask):
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 1)
    torch._dynamo.maybe_mark_dynamic(run.cache_position, 0)
    torch._dynamo.maybe_mark_dynamic(run.keep, 0)
    return run


def _fill(run: _Bucketed, slot: Any, prompt: int, positions: torch.Tensor, masked: bool) -> None:
    """This request's prompt into the static inputs; the padded tail gets token 0 and the positions after the
    last real one."""
    bucket = run.tokens.shape[1]
    run.tokens[:, :prompt].copy_(slot.state["seq"][:, :prompt])
    run.tokens[:, prompt:].zero_()
    run.positions[:, :prompt].copy_(positions)
    run.positions[:, prompt:].copy_(positions[:, -1:] + run.cache_position[1: bucket - prompt + 1])
    if masked:
        run.mask[:, :prompt].copy_(slot.mask[:, :prompt])
        run.mask[:, prompt:].fill_(1)
    run.last.fill_(prompt - 1)
    run.length.fill_(prompt)
    torch.lt(run.cache_position[: run.keep.shape[0]], prompt, out=run.keep)
