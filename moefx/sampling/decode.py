"""moefx's decode engine for transformers causal LMs: static KV cache, compiled steps, CUDA graphs per bucket.

A request (prompt [B, T], new tokens, sampling params, EOS/pad ids, optional left-padding mask and stopping
criteria) runs as:
- prefill: the model forward over the whole prompt into a DynamicCache, as transformers' own loop runs it
  (`logits_to_keep` keeps one row per sequence for the LM head); its keys and values are copied into the
  bucket's StaticCache and the first token is picked. With prefill buckets (on by default where decode steps
  are captured) the prompt is right-padded to its bucket and on CUDA replayed from a CUDA graph
  (moefx/sampling/prefill.py); a prompt no bucket holds runs compiled with a dynamic prompt length;
- decode: one step per token = model forward (one token per sequence) + sampler + EOS bookkeeping, reading
  and writing static per-bucket buffers. On CUDA the whole step is captured once per (slot, sampling
  params form) in a CUDA graph and replayed: no Python per layer and no host sync per token. With the graphs
  turned off the same steps run directly and decide their kernels as the capture did (capture_mode.py), so they
  give the graphs' bits.
The only host read is the "every row finished?" flag, copied to pinned memory and read one step late (the
step queued meanwhile is dropped). Batches are padded to the capture bucket with copies of row 0 that count
as finished from the start; a batch above the largest bucket runs the same steps without graphs, and says so
once (a warning and a line in `stats.uncaptured`).
Slots (a bucket's static cache at one cache length, its buffers and graphs) live in a `SlotPool`
(`moefx/sampling/slots.py`): cache lengths grow geometrically, and all slots and graph pools share one memory
budget, least-recently-used slots freed first; a request whose slot cannot fit raises before it allocates.

Each compiled function gets a code object of its own (`_own_code`): dynamo keeps compiled entries per code
object and stops compiling one after `recompile_limit` entries, so two models must not share them, and the
prefill and decode step (both `_run`) compile apart.
Compiles are counted per function (`compiles`). Batch rows and the cache length are dynamic from the first
compile (a batch of 1 compiles apart: dynamo specializes size 1; so does a left-padded request, whose step takes a
mask); the sampler compiles per params form (`SamplingParams.form`), its values
(temperature, top-p, min-p, top-k) read from the slot's state. So a long stream of mixed requests compiles each
function a handful of times (tests/test_generate_engine.py counts them).
"""

from __future__ import annotations

import inspect
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moefx.backends.capture_mode import as_captured
from moefx.log import get_logger, progress_logger, warn_once
from moefx.sampling.aot import AotFunction, AotSteps, why_no_aot
from moefx.sampling.prefill import PREFILL_CAPTURE_TOKENS, BucketedPrefill, prefill_buckets
from moefx.sampling.regions import layer_frames
from moefx.sampling.sampler import SamplingParams, sample
from moefx.sampling.slots import GraphPool, SlotPool, cache_bytes

log = get_logger("moefx.sampling")
progress = progress_logger()

MAX_EOS_IDS = 8  # EOS ids live in a fixed-size buffer (padded with -1) so graphs survive a change of EOS


def cache_kwarg(forward: Callable[..., Any]) -> str:
    """The name this transformers version gives the cache argument (`past_key_values` became `cache`)."""
    try:
        names = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in names and "past_key_values" not in names else "past_key_values"


def _own_code(fn: Callable) -> Callable:
    """`fn` with a code object of its own (see the module docstring)."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _advance(scores: torch.Tensor, state: dict[str, torch.Tensor], form: SamplingParams, by_head: bool) -> None:
    """Pick the next token of every row (`scores` are logits, or the tokens themselves when `by_head`) and move
    the static buffers one position on, in place. `form` is the params' form (`SamplingParams.form`); their
    values are read from `state["sampling"]`, so one compile and one graph serve every temperature."""
    nxt = scores if by_head else sample(scores, form, values=state["sampling"])
    finished = state["finished"]
    # Like transformers: finished rows emit the pad id only when EOS ids are set (`pad_finished`).
    nxt = torch.where(finished & state["pad_finished"], state["pad"], nxt)
    now = finished | torch.isin(nxt, state["eos"])
    state["tokens"].copy_(nxt[:, None])
    state["seq"].index_copy_(1, state["cache_position"] + 1, nxt[:, None])
    state["position_ids"].add_(1)
    state["cache_position"].add_(1)
    finished.copy_(now)
    state["done"].copy_(now.all())


def _mark_slot_dynamic(slot: _Slot) -> None:
    """Batch rows and cache length dynamic in every compile that reads the slot, from its first compile: a new
    batch bucket or cache length then reuses the compiled steps (a size-1 batch still gets a compile of its own:
    dynamo specializes sizes 0 and 1). transformers' StaticLayer answers the mask size from its Python int
    `max_cache_len`, which dynamo would specialize the length back to; the slot's layers answer it from their
    keys' shape instead (a left-padded step's mask and the sampler's sequence share that length)."""
    st = slot.state
    for t in (st["tokens"], st["position_ids"], st["finished"], st["seq"], slot.mask):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.maybe_mark_dynamic(st["seq"], 1)
    static_layers = slot.uncapturable is None  # every layer a StaticLayer: keys [rows, heads, length, dim]
    if static_layers:
        torch._dynamo.maybe_mark_dynamic(slot.mask, 1)
    for layer in slot.cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                if static_layers:
                    torch._dynamo.maybe_mark_dynamic(t, 2)
        if static_layers:
            layer.get_mask_sizes = types.MethodType(get_mask_sizes, layer)


def get_mask_sizes(layer: Any, *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """StaticLayer.get_mask_sizes (kv length, kv offset), the length read from the keys' (dynamic) shape."""
    return layer.keys.shape[2], 0


def _reset_cache(slot: _Slot) -> None:
    """Zero the slot's cache before a request in two launches: transformers' `Cache.reset` launches three kernels per
    layer (keys, values, write position), host work outside the captured prefill that grows with depth."""
    layers = slot.cache.layers
    if slot.uncapturable is not None or not all(layer.is_initialized for layer in layers):
        slot.cache.reset()
        return
    # one list per dtype: a mixed list takes the foreach slow path, a launch per tensor (H200 profile, 48 layers)
    torch._foreach_zero_([t for layer in layers for t in (layer.keys, layer.values)])
    torch._foreach_zero_([layer.cumulative_length for layer in layers])


def _uncapturable_cache(cache: Any) -> str | None:
    """Why replaying a captured step could go wrong with this cache (None: every layer keeps its state on
    the device, like transformers' StaticLayer; sliding-window layers keep a host-side length)."""
    kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", None) or []})
    if kinds != ["StaticLayer"]:
        return f"cache layers {kinds or 'unknown'} (only StaticLayer keeps all its state on the device)"
    return None


@dataclass
class _Slot:
    """A bucket's static cache and buffers, and the graphs captured over them."""

    batch: int
    max_len: int
    cache: Any
    state: dict[str, torch.Tensor]
    mask: torch.Tensor  # [batch, max_len] long: 0 at left padding
    # (params form, masked, by_head) -> (CUDAGraph, its logits output), or (None, None) for a step run without one
    graphs: dict[tuple, tuple[Any, torch.Tensor | None]] = field(default_factory=dict)
    # (prompt bucket, masked, by_head) -> the padded prefill's inputs and graph (moefx/sampling/prefill.py)
    prefill: dict[tuple, Any] = field(default_factory=dict)
    uncapturable: str | None = None  # _uncapturable_cache(cache), fixed when the slot is made

    def release(self) -> None:
        """Drop what the slot holds (the pool calls it on eviction), so its memory is free at once: the layers'
        `get_mask_sizes` override (`_mark_slot_dynamic`) is a bound method of its layer, a reference cycle that
        would otherwise keep the cache alive until Python's cyclic collector ran (on the H200 a 500-request
        stream's peak allocated memory doubled while evicted caches waited for it)."""
        for layer in getattr(self.cache, "layers", None) or []:
            vars(layer).pop("get_mask_sizes", None)
        self.graphs.clear()
        self.prefill.clear()


@dataclass
class EngineStats:
    """What the engine did in this process: compiles per function and the seconds their backend took (inductor and
    the moefx passes, not dynamo's tracing), graphs captured, why steps ran without one, and its slots: alive,
    allocated, evicted, the bytes their caches and graph pools hold, and the memory budget. Prefill graphs are
    counted apart too, with the bytes their captures added to the allocator's reserved memory (warm-ups
    included); those bytes also count against the memory budget."""

    compiles: dict[str, int] = field(default_factory=dict)
    compile_s: dict[str, float] = field(default_factory=dict)
    captures: int = 0
    uncaptured: list[str] = field(default_factory=list)
    requests: int = 0
    prefill_buckets: tuple[int, ...] = ()
    prefill_captures: int = 0
    prefill_graph_bytes: int = 0
    above_cap: int = 0  # requests whose batch was above the largest capture size
    slots: int = 0
    slot_allocations: int = 0
    evictions: int = 0
    cache_bytes: int = 0
    graph_bytes: int = 0
    memory_budget: str = "not set yet (fixed at the first allocation)"

    def describe_slots(self) -> str:
        mib = 2**20
        return (f"{self.slots} slots alive ({self.slot_allocations} allocated, {self.evictions} evicted), caches "
                f"{self.cache_bytes / mib:.1f} MiB + graph pools {self.graph_bytes / mib:.1f} MiB of budget "
                f"{self.memory_budget}")



def check_prompt(config: Any, batch: int, prompt: int, max_new_tokens: int) -> None:
    """ValueError for a request the model cannot run: an empty prompt, or more positions than the model has."""
    if batch < 1 or prompt < 1:
        raise ValueError(f"input_ids of shape ({batch}, {prompt}) holds an empty prompt; valid: at least 1 token in "
                         f"each of at least 1 row")
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and prompt + max_new_tokens > positions:
        raise ValueError(f"prompt length {prompt} + max_new_tokens {max_new_tokens} = {prompt + max_new_tokens} "
                         f"positions is past the model's max_position_embeddings {positions}; valid: prompt length + "
                         f"max_new_tokens <= {positions}")


class DecodeLoop:
    """Generate with `model` (a transformers causal LM) over a StaticCache.

    `compile_kwargs` go to `torch.compile` for the prefill, the decode step and the sampler (e.g.
    `{"backend": moefx.backend(cfg, cudagraphs=False)}`); None runs them eagerly. `cuda_graphs=True` (CUDA
    inputs) captures each decode step once per slot (batch bucket × cache length) and sampling params form and
    replays it; the backend must then not add inductor's own CUDA graphs. `capture_sizes` are the buckets
    (None: every batch size is its own bucket); batches above the largest run without graphs. `max_len` fixes
    the cache length (None: the request's prompt + new tokens, rounded up to a geometric length bucket,
    `moefx/sampling/slots.py`).
    `memory_budget` bounds all slots together (None: env MOEFX_MEMORY_BUDGET, else the default; see slots.py).
    `forward` is the model forward to call (default `model.forward`; `optimize` passes the uncompiled one).
    `prefill_capture_tokens` caps rows × prompt bucket of the padded prefill (one of `PREFILL_BUCKETS`; 0: off,
    every prompt runs unpadded; None: `PREFILL_CAPTURE_TOKENS` with `cuda_graphs` and `compile_kwargs`, else off).
    `saved_traces` compiles each function as traces a new process loads without tracing (`aot.py`), for an
    engine whose compile cache keeps them; `aot_steps` holds them (None: the ordinary torch.compile).
    """

    def __init__(
        self,
        model: Any,
        max_len: int | None = None,
        compile_kwargs: dict[str, Any] | None = None,
        cuda_graphs: bool = False,
        capture_sizes: Sequence[int] | None = None,
        forward: Callable[..., Any] | None = None,
        prefill_capture_tokens: int | None = None,
        memory_budget: float | None = None,
        saved_traces: bool = False,
    ) -> None:
        from transformers import StaticCache

        backend = (compile_kwargs or {}).get("backend")
        if cuda_graphs and getattr(backend, "cudagraphs", False):
            raise ValueError("DecodeLoop(cuda_graphs=True) captures the steps itself; its backend must not add "
                             "inductor's CUDA graphs (use moefx.backend(cfg, cudagraphs=False))")
        from moefx.parallel.lm_head import greedy_head

        self.model, self.max_len = model, max_len
        self._model_forward = forward or model.forward
        self._cache_arg = cache_kwarg(self._model_forward)
        # A vocab-parallel LM head (tensor parallelism): greedy steps take the token from one all-gather of
        # (max, argmax) per row and rank instead of the full logits (moefx/parallel/lm_head.py).
        self._head = greedy_head(model)
        decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
        self._decoder_cache_arg = cache_kwarg(decoder.forward) if self._head is not None else "past_key_values"
        self._cache_cls = StaticCache
        self.cuda_graphs = cuda_graphs
        self.capture_sizes = sorted(set(capture_sizes)) if capture_sizes else []
        self.compiled = compile_kwargs is not None
        self.stats = EngineStats()
        self.slots = SlotPool(self.stats, memory_budget)
        self.graph_pool = GraphPool()
        kw = self._compile_kwargs = dict(compile_kwargs or {})
        self.aot_steps = AotSteps() if saved_traces and self.compiled and why_no_aot() is None else None
        self._prefill = self._compile("prefill", self._run, kw)
        if prefill_capture_tokens is None:
            prefill_capture_tokens = PREFILL_CAPTURE_TOKENS if cuda_graphs and self.compiled else 0
        self.stats.prefill_buckets = prefill_buckets(prefill_capture_tokens)
        self._bucketed = (BucketedPrefill(self, self.stats.prefill_buckets, prefill_capture_tokens)
                          if prefill_capture_tokens else None)
        self._decode = self._compile("decode", self._run, kw)
        self._pick = self._compile("sampler", _advance, kw)
        frames = layer_frames(model)
        if frames is not None and self.compiled:
            frames.bind(lambda name, fn: self._compile(name, fn, kw))

    def _compile(self, name: str, fn: Callable, kw: dict[str, Any]) -> Callable:
        if not self.compiled:
            return fn
        bound = getattr(fn, "__self__", None)
        own = _own_code(fn.__func__ if bound is not None else fn)
        target = types.MethodType(own, bound) if bound is not None else own
        backend = kw.get("backend", "inductor")
        stats = self.stats

        label = backend if isinstance(backend, str) else (
            "inductor + moefx passes" if hasattr(backend, "pass_manager") else getattr(backend, "__name__", "backend"))
        counters = torch._dynamo.utils.counters["inductor"]

        def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            count = stats.compiles[name] = stats.compiles.get(name, 0) + 1
            progress.info("compiling %s%s (%s)...", name, f" again (compile {count})" if count > 1 else "", label)
            start, hits = time.perf_counter(), counters["fxgraph_cache_hit"]
            if isinstance(backend, str):
                from torch._dynamo import lookup_backend

                compiled = lookup_backend(backend)(gm, example_inputs)
            else:
                compiled = backend(gm, example_inputs)
            took = time.perf_counter() - start
            stats.compile_s[name] = round(stats.compile_s.get(name, 0.0) + took, 2)
            cached = " (from the compile cache)" if counters["fxgraph_cache_hit"] > hits else ""
            progress.info("%s compiled in %.1f s%s", name, took, cached)
            return compiled

        from moefx.compile import with_exact_floats

        compiled = with_exact_floats(torch.compile(target, **{**kw, "backend": counting_backend}))
        if self.aot_steps is None:
            return compiled
        return self.aot_steps.add(AotFunction(name, own, bound, counting_backend, compiled))

    # -- the model calls -------------------------------------------------------------------------------------

    def _run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor,
             attention_mask: torch.Tensor | None, cache: Any, by_head: bool = False) -> torch.Tensor:
        """Last-position logits [rows, V] of one forward, or with `by_head` the greedy tokens [rows] through the
        vocab-parallel head."""
        if by_head:
            from moefx.parallel.lm_head import greedy_step

            return greedy_step(self.model, input_ids=input_ids, position_ids=position_ids,
                               cache_position=cache_position, attention_mask=attention_mask,
                               **{self._decoder_cache_arg: cache})
        out = self._model_forward(
            input_ids=input_ids, position_ids=position_ids, cache_position=cache_position,
            attention_mask=attention_mask, use_cache=True, logits_to_keep=1, **{self._cache_arg: cache},
        )
        return out.logits[:, -1]

    def _step(self, slot: _Slot, form: SamplingParams, masked: bool, by_head: bool) -> torch.Tensor:
        st = slot.state
        scores = self._decode(st["tokens"], st["position_ids"], st["cache_position"],
                              slot.mask if masked else None, slot.cache, by_head)
        self._pick(scores, st, form, by_head)
        return scores

    # -- buckets, caches and graphs --------------------------------------------------------------------------

    def bucket(self, batch: int) -> tuple[int, bool]:
        """(rows the step runs with, whether the batch is within the capture sizes: a graph may be captured)."""
        if not self.capture_sizes:
            return batch, True
        for size in self.capture_sizes:
            if size >= batch:
                return size, True
        return batch, False

    def _slot(self, rows: int, needed: int, device: torch.device) -> _Slot:
        positions = getattr(self.model.config, "max_position_embeddings", None)
        max_len = self.max_len or self.slots.cache_len(needed, positions)
        if needed > max_len:
            raise ValueError(f"prompt + max_new_tokens = {needed} exceeds the cache length max_len={max_len}")
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        nbytes = cache_bytes(self.model.config, rows, max_len, dtype)
        slot = self.slots.find(rows, max_len, device, nbytes)
        if slot is not None:
            return slot
        # Before anything is allocated: evict least-recently-used slots, or raise MemoryBudgetError.
        self.slots.make_room(f"a static cache for batch {rows} x {max_len} positions", nbytes, device)
        cache = self._cache_cls(config=self.model.config, max_cache_len=max_len)
        long = {"dtype": torch.long, "device": device}
        state = {
            "tokens": torch.zeros(rows, 1, **long),
            "position_ids": torch.zeros(rows, 1, **long),
            "cache_position": torch.zeros(1, **long),
            "seq": torch.zeros(rows, max_len, **long),
            "finished": torch.zeros(rows, dtype=torch.bool, device=device),
            "done": torch.zeros((), dtype=torch.bool, device=device),
            "eos": torch.full((MAX_EOS_IDS,), -1, **long),
            "pad": torch.zeros((), **long),
            "pad_finished": torch.zeros((), dtype=torch.bool, device=device),
            "sampling": torch.ones(4, dtype=torch.float32, device=device),  # SamplingParams.values()
        }
        slot = _Slot(rows, max_len, cache, state, torch.ones(rows, max_len, **long))
        # The cache's layers allocate their tensors on the first update: do it eagerly, with one token, so no
        # compiled graph ever allocates them (their addresses must stay static for the graphs).
        with torch.no_grad():
            self._run(state["tokens"], state["position_ids"], state["cache_position"], None, cache)
        cache.reset()
        slot.uncapturable = _uncapturable_cache(cache)
        if self.compiled:
            _mark_slot_dynamic(slot)
        held = sum(t.nbytes for layer in cache.layers for t in (getattr(layer, "keys", None),
                                                                 getattr(layer, "values", None)) if t is not None)
        self.slots.add(slot, device, max(held + 2 * slot.mask.nbytes, nbytes))
        return slot

    def _graph(self, slot: _Slot, form: SamplingParams, masked: bool,
               by_head: bool) -> tuple[Any, torch.Tensor | None]:
        """The captured step for this params form (captured on first use), or (None, None) to run it directly."""
        key = (form, masked, by_head)
        if key not in slot.graphs:
            # The graph pool's growth counts against the memory budget (other slots may be freed for it).
            with self.slots.graph_memory("decode", slot.state["seq"].device, keep=slot):
                slot.graphs[key] = self._capture(slot, form, masked, by_head)
        return slot.graphs[key]

    def _capture(self, slot: _Slot, form: SamplingParams, masked: bool,
                 by_head: bool) -> tuple[Any, torch.Tensor | None]:
        if slot.uncapturable is not None:
            return self._uncaptured(slot, slot.uncapturable)
        progress.info("capturing the decode step for batch %d (cache length %d)...", slot.batch, slot.max_len)
        start = time.perf_counter()
        # The warm-ups compile the functions and advance the state; the state and each layer's write position are
        # put back afterwards. The KV rows they wrote sit at positions the real steps overwrite.
        saved = {k: v.clone() for k, v in slot.state.items()}
        lengths = [layer.cumulative_length.clone() for layer in slot.cache.layers]

        def restore() -> None:
            for name, value in saved.items():
                slot.state[name].copy_(value)
            for layer, length in zip(slot.cache.layers, lengths):
                layer.cumulative_length.copy_(length)

        graph, logits, why = self.graph_pool.capture(lambda: self._step(slot, form, masked, by_head),
                                                     slot.state["seq"].device, restore)
        if graph is None:
            return self._uncaptured(slot, f"its step {why}")
        self.stats.captures += 1
        progress.info("decode step for batch %d captured in %.1f s", slot.batch, time.perf_counter() - start)
        return graph, logits

    def _above_cap(self, batch: int) -> None:
        self.stats.above_cap += 1
        if self.stats.above_cap == 1:
            message = (f"batches above the largest capture size {self.capture_sizes[-1]} decode without a CUDA graph "
                       f"(first: batch {batch}); config key 'max_batch_size' sets the largest")
            self.stats.uncaptured.append(message)
            warn_once(f"moefx generate(): {message}")

    def _uncaptured(self, slot: _Slot, why: str) -> tuple[None, None]:
        message = f"batch {slot.batch} decodes without a CUDA graph: {why}"
        self.stats.uncaptured.append(message)
        warn_once(f"moefx generate(): {message}")
        return None, None

    # -- a request -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        params: SamplingParams,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int = 0,
        attention_mask: torch.Tensor | None = None,
        stopping_criteria: Sequence[Callable[..., Any]] = (),
        logits_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Prompt + new tokens [B, T + n]. Rows that finished are padded with `pad_token_id`, like transformers'
        generate() (when EOS ids are set; otherwise a row a criterion stopped goes on until all have stopped, as
        there); `attention_mask` (left padding only) marks prompt positions to ignore; each stopping
        criterion is called as `criterion(input_ids_so_far, logits)` and returns a bool per row. `logits_out`, when
        given, receives a copy of each step's last-position logits [B, V] (checks and benchmarks)."""
        batch, prompt = input_ids.shape
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_prompt(self.model.config, batch, prompt, max_new_tokens)
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        if len(eos) > MAX_EOS_IDS:
            raise ValueError(f"at most {MAX_EOS_IDS} EOS ids are supported, got {len(eos)}")
        device = input_ids.device
        rows, within = self.bucket(batch)
        if self.cuda_graphs and not within:
            self._above_cap(batch)
        graphs = within and self.cuda_graphs and device.type == "cuda"
        # With the graphs turned off, the steps a graph would have replayed run the kernels it would have run.
        stand_in = within and not self.cuda_graphs and device.type == "cuda"
        slot = self._slot(rows, prompt + max_new_tokens, device)
        self.stats.requests += 1
        st = slot.state
        masked = attention_mask is not None
        pad_rows = [0] * (rows - batch)
        st["seq"][:, :prompt].copy_(torch.cat([input_ids, input_ids[pad_rows]]) if pad_rows else input_ids)
        slot.mask.fill_(1)
        if masked:
            mask = attention_mask.to(device=device, dtype=torch.long)
            slot.mask[:, :prompt].copy_(torch.cat([mask, mask[pad_rows]]) if pad_rows else mask)
            positions = (slot.mask[:, :prompt].cumsum(-1) - 1).clamp(min=0)
        else:
            positions = torch.arange(prompt, device=device).expand(rows, prompt)
        st["eos"].fill_(-1)
        if eos:
            st["eos"][: len(eos)].copy_(torch.tensor(eos, device=device))
        st["pad"].fill_(pad_token_id)
        st["pad_finished"].fill_(bool(eos))
        st["finished"].fill_(False)
        st["finished"][batch:] = True
        form = params.form()
        for i, value in enumerate(params.values()):
            st["sampling"][i].fill_(value)
        _reset_cache(slot)
        # Greedy over a vocab-parallel head picks tokens without full logits, unless something needs the logits.
        by_head = self._head is not None and params.greedy and not stopping_criteria and logits_out is None
        logits = self._prompt(slot, prompt, positions, masked, by_head, graphs, stand_in)
        st["position_ids"].copy_(positions[:, -1:])
        st["cache_position"].fill_(prompt - 1)
        self._pick(logits, st, form, by_head)

        stopper = _LateStop(device, enabled=bool(eos) or bool(stopping_criteria))
        graph, graph_logits = (self._graph(slot, form, masked, by_head) if graphs and max_new_tokens > 1
                               else (None, None))
        tried = slot.graphs.get((form, masked, by_head))  # (None, None) when its capture was refused
        as_graph = stand_in and slot.uncapturable is None and (tried is None or tried[0] is not None)
        produced = max_new_tokens
        for step in range(max_new_tokens):
            if step > 0:
                if graph is not None:
                    graph.replay()
                    logits = graph_logits
                else:
                    with as_captured(as_graph):
                        logits = self._step(slot, form, masked, by_head)
            if logits_out is not None:
                logits_out.append(logits[:batch].clone())
            if stopping_criteria:
                self._apply_criteria(slot, stopping_criteria, batch, prompt + step + 1, logits)
            if stopper.finished_before(step, st["done"]):
                produced = step
                break
        return st["seq"][:batch, : prompt + produced].clone()

    def _prompt(self, slot: _Slot, prompt: int, positions: torch.Tensor, masked: bool,
                by_head: bool, graphs: bool, stand_in: bool = False) -> torch.Tensor:
        """Prefill. With a cache of static layers the prompt runs over a DynamicCache, as in transformers' own
        loop (attention over the prompt only, causal without a mask when unpadded), and its keys and values are
        then copied into the static cache: padded to its bucket (captured when `graphs`, run as captured when
        `stand_in`) where one holds it, else at its own length; other caches take the prompt directly."""
        from transformers import DynamicCache

        pad = self._bucketed is not None and (graphs or not self.cuda_graphs)
        if pad and slot.uncapturable is None:
            scores = self._bucketed.run(slot, prompt, positions, masked, by_head, graphs, stand_in)
            if scores is not None:
                return scores
        st = slot.state
        tokens = st["seq"][:, :prompt]
        cache_position = torch.arange(prompt, device=tokens.device)
        if self.compiled:
            for t in (tokens, positions):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 1)
            torch._dynamo.maybe_mark_dynamic(cache_position, 0)
        if slot.uncapturable is not None:
            return self._prefill(tokens, positions, cache_position, slot.mask if masked else None, slot.cache, by_head)
        prompt_cache = DynamicCache(config=self.model.config)
        mask = slot.mask[:, :prompt] if masked else None
        if mask is not None and self.compiled:
            torch._dynamo.maybe_mark_dynamic(mask, 0)
            torch._dynamo.maybe_mark_dynamic(mask, 1)
        logits = self._prefill(tokens, positions, cache_position, mask, prompt_cache, by_head)
        for static, dynamic in zip(slot.cache.layers, prompt_cache.layers):
            static.keys[:, :, :prompt].copy_(dynamic.keys)
            static.values[:, :, :prompt].copy_(dynamic.values)
            static.cumulative_length.fill_(prompt)
        return logits

    @staticmethod
    def _apply_criteria(slot: _Slot, criteria: Sequence[Callable[..., Any]], batch: int, length: int,
                        logits: torch.Tensor) -> None:
        st = slot.state
        so_far = st["seq"][:batch, :length]
        for criterion in criteria:
            hit = criterion(so_far, logits[:batch].float())
            hit = torch.as_tensor(hit, device=so_far.device).to(torch.bool).expand(batch)
            st["finished"][:batch] |= hit
        st["done"].copy_(st["finished"].all())


class _LateStop:
    """"Every row finished?" read one step late: the flag is copied to pinned memory as the step is queued
    and read when the next one has been queued, so the host never waits for the step it just launched."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        if enabled:
            self.flags = [torch.zeros((), dtype=torch.bool, pin_memory=self.cuda) for _ in range(2)]
            self.events = [torch.cuda.Event() if self.cuda else None for _ in range(2)]

    def finished_before(self, step: int, done: torch.Tensor) -> bool:
        """Queue the copy of this step's flag; True when the previous step had finished every row."""
        if not self.enabled:
            return False
        slot = step % 2
        self.flags[slot].copy_(done, non_blocking=self.cuda)
        if self.cuda:
            self.events[slot].record()
        if step == 0:
            return False
        prev = (step - 1) % 2
        if self.cuda:
            self.events[prev].synchronize()
        return bool(self.flags[prev])
