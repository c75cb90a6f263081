"""The decode engine's slots: one batch bucket's static KV cache at one cache length, the buffers and CUDA graphs over
it, kept in a pool, least recently used first, under the engine's memory budget (`moefx/engine/memory.py`).

Cache lengths grow geometrically (256, 384, 512, 768, 1024, 1536, ...: each power of two and 1.5x it), so a context
that grows to L allocates and re-captures O(log L) times. When fitting the exact bucket would evict, a longer slot of
the same batch bucket that is alive serves the request instead.
"""

from __future__ import annotations

import gc
import types
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from moefx.engine.layers.layer_body import KV_BUFFERS, kv_buffers
from moefx.engine.memory import MemoryBudget
from moefx.engine.request import MAX_EOS_IDS
from moefx.log import get_logger

log = get_logger("moefx.engine")

MIN_CACHE_LEN = 256  # the shortest cache length bucket
_MIB = 2**20


def cache_len(needed: int, min_len: int = MIN_CACHE_LEN, limit: int | None = None) -> int:
    """The cache length bucket for `needed` positions: the smallest of min_len x (1, 1.5, 2, 3, 4, 6, ...) that
    holds it; `limit` (the model's max positions) caps the bucket when `needed` fits under it."""
    size = min_len
    while size < needed:
        if size * 3 // 2 >= needed:
            size = size * 3 // 2
            break
        size *= 2
    if limit is not None and needed <= limit < size:
        return limit
    return size


def _uncapturable_cache(cache: Any) -> str | None:
    """Why replaying a captured step could go wrong with this cache (None: every layer keeps its state on
    the device, like transformers' StaticLayer; sliding-window layers keep a host-side length)."""
    kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", None) or []})
    if kinds != ["StaticLayer"]:
        return f"cache layers {kinds or 'unknown'} (only StaticLayer keeps all its state on the device)"
    return None


def stack_cache_layers(cache: Any) -> str | None:
    """Make the cache's StaticLayers' keys, values and write positions views of one buffer per kind ([layers, rows,
    KV heads, length, head dim], and [layers]), kept on the cache (`layer_body.KV_BUFFERS`): the decoder stack op
    then takes three cache tensors whatever the depth (`moefx/engine/layers/frames.py`; the engine makes them
    where those frames are bound, `Steps.cache_buffers`), and a reset is three launches. Everything else reads
    each layer's own view as before. The layers' tensors are dropped before the buffers are allocated (zeros, as
    the layers' were), so the cache is not held twice. None when done, else why the layers keep their own tensors
    (they are left as they were)."""
    layers = list(getattr(cache, "layers", None) or [])
    kinds = sorted({type(layer).__name__ for layer in layers})
    if kinds != ["StaticLayer"] or not all(getattr(layer, "is_initialized", False) for layer in layers):
        return f"cache layers {kinds or 'unknown'} (only initialized StaticLayers share buffers)"
    first = layers[0]
    like = [(t.shape, t.dtype, t.device) for t in (first.keys, first.values, first.cumulative_length)]
    if any([(t.shape, t.dtype, t.device) for t in (layer.keys, layer.values, layer.cumulative_length)] != like
           for layer in layers[1:]):
        return "cache layers of different shapes, dtypes or devices"
    for layer in layers:
        layer.keys = layer.values = None
    (k_shape, k_dtype, device), (v_shape, v_dtype, _), (_, n_dtype, _) = like
    n = len(layers)
    buffers = (torch.zeros((n, *k_shape), dtype=k_dtype, device=device),
               torch.zeros((n, *v_shape), dtype=v_dtype, device=device), torch.zeros(n, dtype=n_dtype, device=device))
    for i, layer in enumerate(layers):
        layer.keys, layer.values, layer.cumulative_length = (t[i] for t in buffers)
    # static addresses, as transformers' StaticLayer marks its own tensors (the captured steps read them in place)
    for t in (*buffers, *(t for layer in layers for t in (layer.keys, layer.values, layer.cumulative_length))):
        torch._dynamo.mark_static_address(t)
    setattr(cache, KV_BUFFERS, buffers)
    cache.get_seq_length = types.MethodType(get_seq_length, cache)
    cache.get_mask_sizes = types.MethodType(get_mask_sizes, cache)
    return None


def get_seq_length(cache: Any, layer_idx: int = 0) -> Any:
    """StaticCache.get_seq_length (a layer's write position) read from the write-position buffer: transformers'
    mask reads layer 0's, and a traced step that took that layer's view next to the buffer would take two
    aliasing inputs (`layer_body.static_tensors`)."""
    lengths = kv_buffers(cache)[2]
    return lengths[layer_idx] if layer_idx < lengths.shape[0] else 0


def get_mask_sizes(cache: Any, *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """StaticCache.get_mask_sizes (kv length, kv offset), the length read from the keys buffer's (dynamic) shape.
    Reading it from a layer's view would make the traced step fakeify that view and its base apart from the buffer
    input: the base's sizes are symbols no graph input carries, and on CUDA inductor's 32-bit indexing guard on one
    of them fails dynamo's guard building (`sources must not be empty for symbol`; torch 2.11, H100)."""
    return kv_buffers(cache)[0].shape[3], 0


@dataclass
class Slot:
    """A bucket's static cache and buffers, and the graphs captured over them."""

    batch: int
    max_len: int
    cache: Any
    state: dict[str, torch.Tensor]
    mask: torch.Tensor  # [batch, max_len] long: 0 at left padding
    # (params form, masked, by_head) -> (CUDAGraph, its logits output), or (None, None) for a step run without one
    graphs: dict[tuple, tuple[Any, torch.Tensor | None]] = field(default_factory=dict)
    # (prompt bucket, masked, by_head) -> the padded prefill's inputs and graph (moefx/engine/prefill.py)
    prefill: dict[tuple, Any] = field(default_factory=dict)
    uncapturable: str | None = None  # _uncapturable_cache(cache), fixed when the slot is made
    # What the last request left in the buffers (`DecodeLoop._load`): its (EOS ids, pad id, sampling values), and
    # whether it wrote a mask (zeros in `mask`)
    held: tuple | None = None
    masked: bool = False
    # The cache's keys and values are zero at every position from `written` on (`prepare_write`)
    written: int = 0
    row_index: torch.Tensor | None = None  # [batch] long: 0 .. batch-1, to mark padding rows finished in one launch

    @classmethod
    def buffers(cls, rows: int, max_len: int, cache: Any, device: torch.device) -> Slot:
        """A slot over `cache` with its static buffers: the tokens so far, positions, EOS and pad ids, the finished
        flags and the sampling params' values, all read and written in place by the compiled steps."""
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
        return cls(rows, max_len, cache, state, torch.ones(rows, max_len, **long),
                   row_index=torch.arange(rows, **long))

    def reset_cache(self) -> None:
        """Zero the cache before a request in three launches (its buffers, `stack_cache_layers`) or two (a foreach
        per dtype over its layers): transformers' `Cache.reset` launches three kernels per layer (keys, values, write
        position), host work outside the captured prefill that grows with depth."""
        layers = self.cache.layers
        self.written = 0
        buffers = kv_buffers(self.cache)
        if buffers is not None:  # the layers' tensors are views of these
            for t in buffers:
                t.zero_()
            return
        if self.uncapturable is not None or not all(layer.is_initialized for layer in layers):
            self.cache.reset()
            return
        # one list per dtype: a mixed list takes the foreach slow path, a launch per tensor (H200 profile, 48 layers)
        torch._foreach_zero_([t for layer in layers for t in (layer.keys, layer.values)])
        torch._foreach_zero_([layer.cumulative_length for layer in layers])

    def prepare_write(self, n: int) -> None:
        """Before a prefill that writes every position below `n` (the prompt, and zeros after it up to `n`): the
        cache is zeroed only when an earlier request may have written past `n`. A request that fits in what the
        last one wrote costs no reset launches, and the GPU does not zero a whole cache the prefill overwrites."""
        if self.written > n:
            self.reset_cache()
        self.written = n

    def release(self) -> None:
        """Drop what the slot holds (the pool calls it on eviction), so its memory is free at once: the layers'
        `get_mask_sizes` override (`moefx/engine/steps.py`) is a bound method of its layer, a reference cycle that
        would otherwise keep the cache alive until Python's cyclic collector ran (a long request stream's peak
        allocated memory doubled while evicted caches waited for it: docs/FINDINGS.md); likewise the cache's own
        `get_seq_length` and `get_mask_sizes` overrides (`stack_cache_layers`)."""
        for layer in getattr(self.cache, "layers", None) or []:
            vars(layer).pop("get_mask_sizes", None)
        for name in ("get_seq_length", "get_mask_sizes"):
            vars(self.cache).pop(name, None)
        self.graphs.clear()
        self.prefill.clear()


class SlotPool(MemoryBudget):
    """The engine's slots keyed by (rows, cache length, device), least recently used first, under one memory budget
    (`MemoryBudget`: the slots' caches and the graph pools' growth; `moefx/engine/memory.py`).

    `stats` (an EngineStats) gets the counts: slots alive, allocations, evictions, cache and graph bytes, the
    budget. A capture into the engine's graph pool (`moefx/engine/graphs.py`) counts its graphs with
    `record_graph_bytes(what, nbytes, keep=slot)`, or `graph_memory(what, device, keep=slot)` around it; both then
    free least-recently-used slots (never `keep`) if the budget is over."""

    def __init__(self, stats: Any, memory_budget: float | None = None, min_len: int = MIN_CACHE_LEN) -> None:
        super().__init__(stats, memory_budget)
        self.min_len = min_len
        self._slots: OrderedDict[tuple[int, int, str], Any] = OrderedDict()

    def _sync_stats(self) -> None:
        super()._sync_stats()
        self.stats.slots = len(self._slots)

    def cache_len(self, needed: int, limit: int | None = None) -> int:
        return cache_len(needed, self.min_len, limit)

    def keys(self) -> list[tuple[int, int]]:
        """(rows, cache length) of the slots alive, least recently used first."""
        return [(rows, length) for rows, length, _ in self._slots]

    def latest(self, rows: int) -> Any:
        """The most recently used slot alive of batch bucket `rows` (None: none)."""
        return next((slot for key, slot in reversed(self._slots.items()) if key[0] == rows), None)

    def __len__(self) -> int:
        return len(self._slots)

    def find(self, rows: int, max_len: int, device: torch.device, nbytes: int) -> Any:
        """The slot for (rows, max_len) if alive; else, when a new one of `nbytes` would have to evict, the
        shortest alive slot of these rows that is longer; else None. A slot found becomes the most recent."""
        key = (rows, max_len, str(device))
        if key not in self._slots and self.used() + nbytes > self.budget(device):
            longer = sorted(k for k in self._slots if k[0] == rows and k[2] == key[2] and k[1] > max_len)
            key = longer[0] if longer else key
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
        return slot

    def add(self, slot: Any, device: torch.device, nbytes: int) -> None:
        key = (slot.batch, slot.max_len, str(device))
        self._slots[key] = slot
        self.held[key] = nbytes
        self.stats.slot_allocations += 1
        self._sync_stats()

    def drop_graphs(self) -> None:
        """Drop every slot's captured decode and prefill graphs; the next steps capture again. What a kernel decides
        at launch time (kernels/pdl.py's step chain) is recorded by a capture, so a before/after of such a setting
        in one process (bench/e2e.py --step-pdl) recaptures through this."""
        for slot in self._slots.values():
            slot.graphs.clear()
            slot.prefill.clear()

    def _evict_oldest(self, keep: Any = None) -> bool:
        key = next((k for k, slot in self._slots.items() if slot is not keep), None)
        if key is None:
            return False
        # The evicted slot's memory goes now: `release()` drops what it holds, and when a reference cycle still
        # holds its cache (dynamo's tracing state from a compile that ran on it does, until Python's cyclic
        # collector runs), one collection frees it before the new slot is allocated.
        slot = self._slots.pop(key)
        slot.release()
        cache = weakref.ref(slot.cache)
        del slot
        if cache() is not None:
            gc.collect()
        freed = self.held.pop(key)
        self.stats.evictions += 1
        log.info("decode engine: slot batch %d x length %d evicted (%.1f MiB)", key[0], key[1], freed / _MIB)
        self._sync_stats()
        return True
