"""The prefill per prompt-length bucket: the prompt right-padded to the bucket, static-shaped, and on CUDA
captured in a CUDA graph per (slot, bucket, left-padded or not, sampling params form), so replaying it costs no
Python per layer. The graph ends with the first token's pick (the sampler, `steps.advance`, over the slot's state)
after the prompt's keys and values are written into the slot's static cache: what follows the prefill's launch
before the first token is a replay, nothing run from Python.

Why padding leaves the result unchanged: attention is causal, so a real position never sees the padded ones
after it; the logits come from the last real position (`logits_to_keep` as a one-element index tensor on the
device); the keys and values go to the slot's static cache through a device-side mask (positions at or past the
prompt length get zeros, so the cache needs no reset where no earlier request wrote past the bucket:
`Slot.prepare_write`), and each static layer's write position is set to the real length. The forward fills a
DynamicCache and one masked copy per tensor follows it (96 kernels at 48 layers); with `write_in_layers` (the
default), for buckets up to IN_LAYERS_MAX_BUCKET, where the decoder layers run
as the compiled frames' stack op over the slot's cache buffers, the layer bodies write them there as they compute
them instead (`layer_body.PREFILL_INTO`: inductor stores the keys from the kernel that applies their norm and rotary
embedding, and no copy follows the forward). The bucket's inputs that follow from the prompt length are derived in
the graph from one length scalar. A left-padded request's mask is extended with ones over the padded tail (causal
only there).
The MoE op sees rows × bucket tokens: padded rows cost compute, not correctness.

The forward runs over a DynamicCache, as the unpadded prefill does (attention over the prompt only); under a
graph its tensors live in the graph's pool, which is the decode graphs' pool. One compiled function serves every
bucket: the prompt dimension is marked dynamic from the first call, so a new bucket is a new capture, not a new
inductor compile of the whole model.
Prompts longer than the largest bucket, or whose rows × bucket exceed the token cap, take the dynamic compiled prefill
(`DecodeLoop._prompt`), as do batches an engine that captures runs without graphs (above its capture sizes):
padding pays only where it buys a graph, or where the caller asked for it without graphs (the CPU tests).
The buckets and the default cap are `PREFILL_BUCKETS` and `PREFILL_CAPTURE_TOKENS` in `moefx/config.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moefx.backends.capture_mode import as_captured
from moefx.engine.graphs import Graphs
from moefx.engine.layers.layer_body import PREFILL_INTO, kv_buffers
from moefx.engine.steps import Steps
from moefx.log import get_logger
from moefx.sampling.sampler import SamplingParams

log = get_logger("moefx.engine")

# With `write_in_layers` on, prompts of buckets up to this length are written into the cache in the layer bodies and
# longer ones copied after the forward: on the H100 (48 layers, docs/FINDINGS.md) the writes in the layers took
# 25.37 / 32.05 / 64.14 ms to the copies' 26.06 / 32.43 / 64.84 at 1 x 256, 1 x 1024 and 8 x 512, and 76.42 to
# 75.36 at 1 x 4096.
IN_LAYERS_MAX_BUCKET = 2048


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
    # sampling params form -> (graph, its scores output) once its capture was tried; (None, None): refused
    graphs: dict[SamplingParams, tuple[Any, torch.Tensor | None]] = field(default_factory=dict)


class BucketedPrefill:
    """The padded prefill: one compiled function of `steps` for all buckets, captured by `graphs`, the graphs kept
    on the slots."""

    def __init__(self, steps: Steps, graphs: Graphs, buckets: Sequence[int], max_tokens: int) -> None:
        self.steps, self.graphs = steps, graphs
        self.buckets = tuple(sorted(buckets))
        self.max_tokens = max_tokens
        self._fns: dict[bool, Callable[..., Any]] = {False: steps.compile("prefill[padded]", steps.forward)}
        # Whether the compiled frames' layer bodies write the prompt into the slot's cache (`PREFILL_INTO`) instead of
        # the copies after the forward, for buckets up to IN_LAYERS_MAX_BUCKET (the numbers above it): on, so
        # `generate()`'s first token adds the sampler, not 96 copy kernels, to the forward. bench/e2e.py's
        # `moefx_ttft_copies` arm times the copies beside it (stage prefill-table-48).
        self.write_in_layers = True

    def _compiled(self, into: bool) -> Callable[..., Any]:
        """The compiled padded prefill for calls whose cache carries `PREFILL_INTO` (`into`) or not: one function
        each, as the layer bodies have (`layer[prefill]`, `layer[prefill_into]`), since a saved trace keeps no guard
        on the cache's attributes (compile_cache/aot.py `_keep`): a trace made without it would serve a call with it,
        and one made with it would read the attribute from a cache that lacks it."""
        fn = self._fns.get(into)
        if fn is None:
            fn = self._fns[into] = self.steps.compile("prefill[padded, in layers]", self.steps.forward)
        return fn

    def run(self, slot: Any, prompt: int, positions: torch.Tensor | None, masked: bool, by_head: bool,
            form: SamplingParams, graphs: bool, stand_in: bool = False) -> torch.Tensor | None:
        """The first-token scores (logits, or tokens with `by_head`) of the padded prefill into `slot`'s static
        cache, the first token picked with params of `form` into the slot's state, or None when no bucket holds
        this prompt. `stand_in`: run without a graph the kernels a captured one would (capture_mode.py), unless
        this capture was refused."""
        bucket = pick_bucket(slot.batch, prompt, self.buckets, self.max_tokens)
        if bucket is None:
            return None
        key = (bucket, masked, by_head)
        run = slot.prefill.get(key)
        if run is None:
            run = slot.prefill[key] = _buffers(slot, bucket, masked)
        slot.prepare_write(run.keep.shape[0])  # the prefill writes the whole of [0, n): zeros past the prompt
        _fill(run, slot, prompt, positions)
        if graphs and form not in run.graphs:
            run.graphs[form] = self._capture(slot, run, key, form)
        graph, out = run.graphs.get(form, (None, None))
        if graphs and graph is not None:
            graph.replay()
            return out
        refused = form in run.graphs and graph is None
        with as_captured(stand_in and not refused):
            return self._call(slot, run, by_head, form)

    def _call(self, slot: Any, run: _Bucketed, by_head: bool, form: SamplingParams) -> torch.Tensor:
        from transformers import DynamicCache

        # What follows from the prompt length alone is derived here, in the graph, not written from the host: the
        # tokens (the slot's prompt, 0 over the padded tail), the last real position, the cache positions kept
        layers = slot.cache.layers
        zeros = {dtype: torch.zeros((), dtype=dtype, device=run.keep.device)
                 for dtype in {run.tokens.dtype} | {t.dtype for layer in layers for t in (layer.keys, layer.values)}}
        tail = run.cache_position >= run.length
        bucket = run.tokens.shape[1]
        if bucket <= slot.max_len:
            torch.where(tail, zeros[run.tokens.dtype], slot.state["seq"][:, :bucket], out=run.tokens)
        else:
            run.tokens.masked_fill_(tail, 0)  # `_fill` copied the prompt
        torch.logical_not(tail[: run.keep.shape[0]], out=run.keep)
        torch.sub(run.length.view(1), 1, out=run.last)
        prompt_cache = DynamicCache(config=self.steps.model.config)
        buffers = kv_buffers(slot.cache)
        into = self.write_in_layers and buffers is not None and bucket <= min(slot.max_len, IN_LAYERS_MAX_BUCKET)
        if into:  # the compiled frames' layer bodies write the prompt into the slot's cache themselves
            setattr(prompt_cache, PREFILL_INTO, (buffers[0], buffers[1], run.keep))
        scores = self._compiled(into)(run.tokens, run.positions, run.cache_position, run.mask, prompt_cache, by_head,
                                      run.last)
        n = run.keep.shape[0]
        keep = run.keep[None, None, :, None]
        with torch.no_grad():  # a cache write (where out= takes no autograd)
            for static, dynamic in zip(layers, prompt_cache.layers):
                if not dynamic.is_initialized:  # written in the forward (`PREFILL_INTO`)
                    continue
                # written where they lie (out= the cache's own slice): one kernel per tensor, not a where and a copy;
                # zeros past the prompt, so the cache needs no reset before (`Slot.prepare_write`)
                for old, new in ((static.keys[:, :, :n], dynamic.keys[:, :, :n]),
                                 (static.values[:, :, :n], dynamic.values[:, :, :n])):
                    torch.where(keep, new, zeros[old.dtype], out=old)
            torch._foreach_copy_([layer.cumulative_length for layer in layers], [run.length] * len(layers))
        self._pick_first(slot, run, scores, by_head, form)
        return scores

    def _pick_first(self, slot: Any, run: _Bucketed, scores: torch.Tensor, by_head: bool,
                    form: SamplingParams) -> None:
        """The first token: the state's positions set at the last real one, then the sampler picks and moves them
        on (`steps.advance`)."""
        st = slot.state
        torch.index_select(run.positions, 1, run.last, out=st["position_ids"])
        st["cache_position"].copy_(run.last)
        self.steps.pick(scores, st, form, by_head)

    def _capture(self, slot: Any, run: _Bucketed, key: tuple,
                 form: SamplingParams) -> tuple[Any, torch.Tensor | None]:
        """Capture this prefill and pick (`Graphs.capture`): (graph, its scores), or (None, None) for a prefill that
        cannot be captured, which runs without a graph, with the reason in the stats. The warm-ups' picks change
        the slot's state (a row that drew an EOS id counts as finished): it is put back before the capture."""
        bucket, masked, by_head = key
        st = slot.state
        saved = {name: value.clone() for name, value in st.items()}

        def restore() -> None:
            for name, value in saved.items():
                st[name].copy_(value)

        captured = self.graphs.capture("prefill", st["seq"].device, lambda: self._call(slot, run, by_head, form),
                                       restore, keep=slot)
        if captured.graph is None:
            self.graphs.uncaptured(f"prefill bucket {bucket} for batch {slot.batch} runs without a CUDA graph: its "
                                   f"forward {captured.why}")
            return None, None
        stats = self.graphs.stats
        stats.prefill_captures += 1
        stats.prefill_graph_bytes += captured.nbytes
        log.info("prefill captured for bucket %d, batch %d%s", bucket, slot.batch, " (left-padded)" if masked else "")
        return captured.graph, captured.out


def _buffers(slot: Any, bucket: int, masked: bool) -> _Bucketed:
    device = slot.state["seq"].device
    long = {"dtype": torch.long, "device": device}
    run = _Bucketed(
        tokens=torch.zeros(slot.batch, bucket, **long),
        positions=torch.arange(bucket, **long).repeat(slot.batch, 1),  # unpadded rows' positions, for any prompt
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


def _fill(run: _Bucketed, slot: Any, prompt: int, positions: torch.Tensor | None) -> None:
    """This request's prompt into the static inputs: its length, its tokens when the bucket is longer than the
    slot's cache (else `BucketedPrefill._call` reads them from the slot), and when left-padded its positions and
    mask (the positions go on after the last real one, the mask is 1 over the tail). Unpadded rows' positions are
    0 .. bucket-1 whatever the prompt (written once, `_buffers`); the rest `BucketedPrefill._call` derives from the
    length."""
    if run.tokens.shape[1] > slot.max_len:  # else `BucketedPrefill._call` reads the prompt from the slot
        run.tokens[:, :prompt].copy_(slot.state["seq"][:, :prompt])
    run.length.fill_(prompt)
    if positions is not None:
        bucket = run.tokens.shape[1]
        run.positions[:, :prompt].copy_(positions)
        run.positions[:, prompt:].copy_(positions[:, -1:] + run.cache_position[1: bucket - prompt + 1])
        run.mask[:, :prompt].copy_(slot.mask[:, :prompt])
        run.mask[:, prompt:].fill_(1)
