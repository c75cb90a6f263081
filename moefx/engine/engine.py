"""moefx's decode engine for transformers causal LMs: static KV cache, compiled steps, CUDA graphs per bucket.

`DecodeLoop.generate` runs one request through five phases, each a method below, in this order:
- admit (`Request.admit`, `moefx/engine/request.py`; `bucket`): the request is checked, and its batch padded to
  the capture bucket with copies of row 0 that count as finished from the start; a batch above the largest bucket
  runs the same steps without graphs, and says so once (a warning and a line in `stats.uncaptured`);
- slot (`_slot`, `_load`): the bucket's static cache at a cache length that holds the request, with its buffers and
  graphs (`moefx/engine/slots.py`), found or allocated under one memory budget (`moefx/engine/memory.py`:
  least-recently-used slots freed first; a request whose slot cannot fit raises before it allocates); the prompt,
  mask, EOS and pad ids and sampling params are written into its buffers;
- prefill (`_prompt`): the model forward over the whole prompt into a DynamicCache, as transformers' own loop runs
  it (`logits_to_keep` keeps one row per sequence for the LM head); its keys and values are copied into the slot's
  StaticCache and the first token is picked. With prefill buckets (on by default where decode steps are captured)
  the prompt is right-padded to its bucket and on CUDA replayed from a CUDA graph (`moefx/engine/prefill.py`); a
  prompt no bucket holds runs compiled with a dynamic prompt length;
- decode (`_decode_tokens`): one step per token = model forward (one token per sequence) + sampler + EOS
  bookkeeping, reading and writing the slot's static buffers. On CUDA the whole step is captured once per (slot,
  sampling params form) in a CUDA graph (`moefx/engine/graphs.py`) and replayed: no Python per layer and no host
  sync per token. With the graphs turned off the same steps run directly and decide their kernels as the capture
  did (capture_mode.py), so they give the graphs' bits. The only host read is the "every row finished?" flag,
  copied to pinned memory and read one step late (`LateStop`; the step queued meanwhile is dropped);
- finish: the prompt and the tokens produced, the batch's own rows.

The compiled functions and how they compile are `moefx/engine/steps.py`. An engine's compile cache
(`moefx/engine/compile_cache/`) is attached as `compile_cache` (a `CompileStore`): loaded before a request, saved
after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from moefx.backends.capture_mode import as_captured
from moefx.config import PREFILL_CAPTURE_TOKENS, prefill_buckets
from moefx.engine.graphs import Graphs
from moefx.engine.memory import cache_bytes
from moefx.engine.prefill import BucketedPrefill
from moefx.engine.request import LateStop, Request, check_input_ids, check_prompt
from moefx.engine.slots import Slot, SlotPool, _uncapturable_cache, stack_cache_layers
from moefx.engine.steps import Steps, mark_slot_dynamic
from moefx.log import progress_logger, warn_once
from moefx.sampling.sampler import SamplingParams

progress = progress_logger()


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
    # One entry per capture, decode and prefill (`Graphs.capture`): what, batch, cache length, whether it captured,
    # and the wall seconds of its first run (compiles, loads, first launches), check run and capture.
    capture_seconds: list[dict[str, Any]] = field(default_factory=list)
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


class CompileStore(Protocol):
    """What keeps an engine's compiles across processes (`CompileCache`, `moefx/engine/compile_cache/file.py`):
    `load()` before a request, so its compiles are cache hits; `save()` after it, when something was compiled."""

    def load(self) -> int: ...

    def save(self, force: bool = False) -> int: ...


class DecodeLoop:
    """Generate with `model` (a transformers causal LM) over a StaticCache.

    `compile_kwargs` go to `torch.compile` for the prefill, the decode step and the sampler (e.g.
    `{"backend": moefx.backend(cfg, cudagraphs=False)}`); None runs them eagerly. `cuda_graphs=True` (CUDA
    inputs) captures each decode step once per slot (batch bucket × cache length) and sampling params form and
    replays it; the backend must then not add inductor's own CUDA graphs. `capture_sizes` are the buckets
    (None: every batch size is its own bucket); batches above the largest run without graphs. `max_len` fixes
    the cache length (None: the request's prompt + new tokens, rounded up to a geometric length bucket,
    `moefx/engine/slots.py`).
    `memory_budget` bounds all slots together (None: env MOEFX_MEMORY_BUDGET, else the default; see memory.py).
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
        self.model, self.max_len = model, max_len
        self._cache_cls = StaticCache
        self.cuda_graphs = cuda_graphs
        self.capture_sizes = sorted(set(capture_sizes)) if capture_sizes else []
        self.stats = EngineStats()
        self.slots = SlotPool(self.stats, memory_budget)
        self.graphs = Graphs(self.slots, self.stats)
        self.steps = Steps(model, forward, compile_kwargs, self.stats, saved_traces)
        self.compiled = self.steps.compiled
        self.aot_steps = self.steps.aot
        self._head = self.steps.head
        self._run = self.steps.forward  # the uncompiled model call the compiled steps are made of
        self._prefill, self._decode, self._pick = self.steps.prefill, self.steps.decode, self.steps.pick
        if prefill_capture_tokens is None:
            prefill_capture_tokens = PREFILL_CAPTURE_TOKENS if cuda_graphs and self.compiled else 0
        self.stats.prefill_buckets = prefill_buckets(prefill_capture_tokens)
        self._bucketed = (BucketedPrefill(self.steps, self.graphs, self.stats.prefill_buckets, prefill_capture_tokens)
                          if prefill_capture_tokens else None)
        self.compile_cache: CompileStore | None = None
        self._cache_bytes: dict[tuple[int, int, torch.dtype], int] = {}

    # -- a request, phase by phase ---------------------------------------------------------------------------

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
        check_input_ids(self.model.config, input_ids)
        if self.compile_cache is not None:
            self.compile_cache.load()  # before the first compile: a cache hit instead
        check_prompt(self.model.config, *input_ids.shape, max_new_tokens)
        request = Request.admit(input_ids, max_new_tokens, params, eos_token_id, pad_token_id, attention_mask,
                                stopping_criteria, logits_out)
        return self._serve(request)

    @torch.no_grad()
    def run(self, request: Request) -> torch.Tensor:
        """`generate` for a request read by the generate() front (`moefx/engine/hf_generate.py`), whose ids it
        checked already (`check_input_ids`: a host read, made once per request)."""
        if self.compile_cache is not None:
            self.compile_cache.load()
        check_prompt(self.model.config, *request.input_ids.shape, request.max_new_tokens)
        request.check()
        return self._serve(request)

    def _serve(self, request: Request) -> torch.Tensor:
        out = self._generate(request)
        if self.compile_cache is not None:
            self.compile_cache.save()
        return out

    def _generate(self, request: Request) -> torch.Tensor:
        batch, prompt = request.input_ids.shape
        device = request.input_ids.device
        # admit: the batch bucket, and whether its steps replay CUDA graphs
        rows, within = self.bucket(batch)
        if self.cuda_graphs and not within:
            self._above_cap(batch)
        graphs = within and self.cuda_graphs and device.type == "cuda"
        # With the graphs turned off, the steps a graph would have replayed run the kernels it would have run.
        stand_in = within and not self.cuda_graphs and device.type == "cuda"
        # slot
        slot = self._slot(rows, prompt + request.max_new_tokens, device)
        self.stats.requests += 1
        positions = self._load(slot, request)
        form = request.params.form()
        masked = request.attention_mask is not None
        # Greedy over a vocab-parallel head picks tokens without full logits, unless something needs the logits.
        by_head = (self._head is not None and request.params.greedy and not request.criteria
                   and request.logits_out is None)
        # prefill, and the first token's pick
        logits = self._prompt(slot, prompt, positions, masked, by_head, form, graphs, stand_in)
        # the decode's writes: step k writes the keys and values of position prompt + k - 1 (k = 1 .. n - 1)
        slot.written = max(slot.written, prompt + request.max_new_tokens - 1)
        st = slot.state
        # decode
        produced = self._decode_tokens(slot, request, logits, form, masked, by_head, graphs, stand_in)
        # finish
        return st["seq"][:batch, : prompt + produced].clone()

    def bucket(self, batch: int) -> tuple[int, bool]:
        """(rows the step runs with, whether the batch is within the capture sizes: a graph may be captured)."""
        if not self.capture_sizes:
            return batch, True
        for size in self.capture_sizes:
            if size >= batch:
                return size, True
        return batch, False

    def _above_cap(self, batch: int) -> None:
        self.stats.above_cap += 1
        if self.stats.above_cap == 1:
            message = (f"batches above the largest capture size {self.capture_sizes[-1]} decode without a CUDA graph "
                       f"(first: batch {batch}); config key 'max_batch_size' sets the largest")
            self.stats.uncaptured.append(message)
            warn_once(f"moefx generate(): {message}")

    def _slot(self, rows: int, needed: int, device: torch.device) -> Slot:
        """The slot for `rows` x `needed` positions: alive, or allocated within the memory budget."""
        positions = getattr(self.model.config, "max_position_embeddings", None)
        max_len = self.max_len or self.slots.cache_len(needed, positions)
        if needed > max_len:
            raise ValueError(f"prompt + max_new_tokens = {needed} exceeds the cache length max_len={max_len}")
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        sized = (rows, max_len, dtype)
        nbytes = self._cache_bytes.get(sized)
        if nbytes is None:  # the config's sizes read once per (rows, length, dtype): ~50 us of config lookups
            nbytes = self._cache_bytes[sized] = cache_bytes(self.model.config, rows, max_len, dtype)
        slot = self.slots.find(rows, max_len, device, nbytes)
        if slot is not None:
            return slot
        # Before anything is allocated: evict least-recently-used slots, or raise MemoryBudgetError.
        self.slots.make_room(f"a static cache for batch {rows} x {max_len} positions", nbytes, device)
        cache = self._cache_cls(config=self.model.config, max_cache_len=max_len)
        slot = Slot.buffers(rows, max_len, cache, device)
        state = slot.state
        # The cache's layers allocate their tensors on the first update: do it eagerly, with one token, so no
        # compiled graph ever allocates them (their addresses must stay static for the graphs).
        with torch.no_grad():
            self._run(state["tokens"], state["position_ids"], state["cache_position"], None, cache)
        cache.reset()
        slot.uncapturable = _uncapturable_cache(cache)
        if slot.uncapturable is None and self.steps.cache_buffers:
            stack_cache_layers(cache)
        if self.compiled:
            mark_slot_dynamic(slot)
        held = sum(t.nbytes for layer in cache.layers for t in (getattr(layer, "keys", None),
                                                                 getattr(layer, "values", None)) if t is not None)
        self.slots.add(slot, device, max(held + 2 * slot.mask.nbytes, nbytes))
        return slot

    @staticmethod
    def _load(slot: Slot, request: Request) -> torch.Tensor | None:
        """Write the request into the slot's buffers (prompt, mask, EOS and pad ids, sampling params, finished
        flags; padding rows count as finished); the prompt's positions [rows, T] when masked, else None (0 .. T-1
        in every row, made where needed). The EOS and pad ids and the sampling params are written only when they
        differ from what the slot holds (nothing else writes them), the mask is reset only after a request that
        wrote one, and the cache is left to the prefill, reset only where needed (`Slot.prepare_write`): each
        write is a launch before the prefill's."""
        input_ids, attention_mask = request.input_ids, request.attention_mask
        batch, prompt = input_ids.shape
        device = input_ids.device
        rows = slot.batch
        st = slot.state
        pad_rows = [0] * (rows - batch)
        st["seq"][:, :prompt].copy_(torch.cat([input_ids, input_ids[pad_rows]]) if pad_rows else input_ids)
        if slot.masked:
            slot.mask.fill_(1)
        slot.masked = attention_mask is not None
        positions = None
        if attention_mask is not None:
            mask = attention_mask.to(device=device, dtype=torch.long)
            slot.mask[:, :prompt].copy_(torch.cat([mask, mask[pad_rows]]) if pad_rows else mask)
            positions = (slot.mask[:, :prompt].cumsum(-1) - 1).clamp(min=0)
        held = (tuple(request.eos), request.pad, tuple(request.params.values()))
        if slot.held != held:
            st["eos"].fill_(-1)
            for i, eos in enumerate(request.eos):  # fills, not a copy from the host: no transfer to wait for
                st["eos"][i].fill_(eos)
            st["pad"].fill_(request.pad)
            st["pad_finished"].fill_(bool(request.eos))
            for i, value in enumerate(request.params.values()):
                st["sampling"][i].fill_(value)
            slot.held = held
        torch.ge(slot.row_index, batch, out=st["finished"])  # padding rows finished, the rest not: one launch
        return positions

    def _prompt(self, slot: Slot, prompt: int, positions: torch.Tensor | None, masked: bool, by_head: bool,
                form: SamplingParams, graphs: bool, stand_in: bool = False) -> torch.Tensor:
        """Prefill, and the first token picked (params of `form`) into the slot's state; the prefill's scores.
        With a cache of static layers the prompt runs over a DynamicCache, as in transformers' own loop (attention
        over the prompt only, causal without a mask when unpadded), and its keys and values are then copied into
        the static cache: padded to its bucket (captured with the pick when `graphs`, run as captured when
        `stand_in`) where one holds it, else at its own length; other caches take the prompt directly."""
        pad = self._bucketed is not None and (graphs or not self.cuda_graphs)
        if pad and slot.uncapturable is None:
            scores = self._bucketed.run(slot, prompt, positions, masked, by_head, form, graphs, stand_in)
            if scores is not None:
                return scores
        if positions is None:
            positions = torch.arange(prompt, device=slot.mask.device).expand(slot.batch, prompt)
        logits = self._unpadded_prompt(slot, prompt, positions, masked, by_head)
        st = slot.state
        st["position_ids"].copy_(positions[:, -1:])
        st["cache_position"].fill_(prompt - 1)
        self._pick(logits, st, form, by_head)
        return logits

    def _unpadded_prompt(self, slot: Slot, prompt: int, positions: torch.Tensor, masked: bool,
                         by_head: bool) -> torch.Tensor:
        """The prompt at its own length (the prefill step, its length dynamic); its last position's scores."""
        from transformers import DynamicCache

        if slot.uncapturable is not None:
            slot.reset_cache()
        else:
            slot.prepare_write(prompt)  # the prompt's keys and values are copied over [0, prompt)
        st = slot.state
        tokens = st["seq"][:, :prompt]
        cache_position = torch.arange(prompt, device=tokens.device)
        if self.compiled:
            for t in (tokens, positions):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 1)
            torch._dynamo.maybe_mark_dynamic(cache_position, 0)
        if slot.uncapturable is not None:
            return self._prefill(tokens, positions, cache_position, slot.mask if masked else None, slot.cache, by_head,
                                 None)
        prompt_cache = DynamicCache(config=self.model.config)
        mask = slot.mask[:, :prompt] if masked else None
        if mask is not None and self.compiled:
            torch._dynamo.maybe_mark_dynamic(mask, 0)
            torch._dynamo.maybe_mark_dynamic(mask, 1)
        logits = self._prefill(tokens, positions, cache_position, mask, prompt_cache, by_head, None)
        for static, dynamic in zip(slot.cache.layers, prompt_cache.layers):
            static.keys[:, :, :prompt].copy_(dynamic.keys)
            static.values[:, :, :prompt].copy_(dynamic.values)
            static.cumulative_length.fill_(prompt)
        return logits

    def _decode_tokens(self, slot: Slot, request: Request, logits: torch.Tensor, form: SamplingParams, masked: bool,
                       by_head: bool, graphs: bool, stand_in: bool) -> int:
        """Decode until `max_new_tokens` or every row finished (read one step late); the tokens produced. `logits`
        are the prefill's, whose token is already picked."""
        st = slot.state
        batch, prompt = request.input_ids.shape
        # one token: nothing to stop (the flag of step 0 is never read), so no pinned flags are made
        stopper = LateStop(request.input_ids.device, enabled=(bool(request.eos) or bool(request.criteria))
                           and request.max_new_tokens > 1)
        graph, graph_logits = (self._graph(slot, form, masked, by_head) if graphs and request.max_new_tokens > 1
                               else (None, None))
        tried = slot.graphs.get((form, masked, by_head))  # (None, None) when its capture was refused
        as_graph = stand_in and slot.uncapturable is None and (tried is None or tried[0] is not None)
        for step in range(request.max_new_tokens):
            if step > 0:
                if graph is not None:
                    graph.replay()
                    logits = graph_logits
                else:
                    with as_captured(as_graph):
                        logits = self._step(slot, form, masked, by_head)
            if request.logits_out is not None:
                request.logits_out.append(logits[:batch].clone())
            if request.criteria:
                self._apply_criteria(slot, request.criteria, batch, prompt + step + 1, logits)
            if stopper.finished_before(step, st["done"]):
                return step
        return request.max_new_tokens

    def _step(self, slot: Slot, form: SamplingParams, masked: bool, by_head: bool) -> torch.Tensor:
        """One decode step: the forward over the last tokens, then the sampler."""
        st = slot.state
        scores = self._decode(st["tokens"], st["position_ids"], st["cache_position"],
                              slot.mask if masked else None, slot.cache, by_head, None)
        self._pick(scores, st, form, by_head)
        return scores

    def _graph(self, slot: Slot, form: SamplingParams, masked: bool,
               by_head: bool) -> tuple[Any, torch.Tensor | None]:
        """The captured step for this params form (captured on first use), or (None, None) to run it directly."""
        key = (form, masked, by_head)
        if key not in slot.graphs:
            slot.graphs[key] = self._capture(slot, form, masked, by_head)
        return slot.graphs[key]

    def _capture(self, slot: Slot, form: SamplingParams, masked: bool,
                 by_head: bool) -> tuple[Any, torch.Tensor | None]:
        if slot.uncapturable is not None:
            return self._uncaptured(slot, slot.uncapturable)
        progress.info("capturing the decode step for batch %d (cache length %d)...", slot.batch, slot.max_len)
        start = time.perf_counter()
        # The warm-ups compile the functions and advance the state; the state and each layer's write position are
        # put back afterwards. The KV rows they wrote sit at positions the real steps overwrite, or past the
        # request's last one: the next request's prefill zeroes them (`Slot.prepare_write`).
        slot.written = slot.max_len
        saved = {k: v.clone() for k, v in slot.state.items()}
        lengths = [layer.cumulative_length.clone() for layer in slot.cache.layers]

        def restore() -> None:
            for name, value in saved.items():
                slot.state[name].copy_(value)
            for layer, length in zip(slot.cache.layers, lengths):
                layer.cumulative_length.copy_(length)

        captured = self.graphs.capture("decode", slot.state["seq"].device,
                                       lambda: self._step(slot, form, masked, by_head), restore, keep=slot)
        if captured.graph is None:
            return self._uncaptured(slot, f"its step {captured.why}")
        self.stats.captures += 1
        progress.info("decode step for batch %d captured in %.1f s", slot.batch, time.perf_counter() - start)
        return captured.graph, captured.out

    def _uncaptured(self, slot: Slot, why: str) -> tuple[None, None]:
        self.graphs.uncaptured(f"batch {slot.batch} decodes without a CUDA graph: {why}")
        return None, None

    @staticmethod
    def _apply_criteria(slot: Slot, criteria: Sequence[Callable[..., Any]], batch: int, length: int,
                        logits: torch.Tensor) -> None:
        st = slot.state
        so_far = st["seq"][:batch, :length]
        for criterion in criteria:
            hit = criterion(so_far, logits[:batch].float())
            hit = torch.as_tensor(hit, device=so_far.device).to(torch.bool).expand(batch)
            st["finished"][:batch] |= hit
        st["done"].copy_(st["finished"].all())
