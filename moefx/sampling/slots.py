"""The decode engine's slots under one memory budget: cache-length buckets, the fit check, least-recently-used.

A slot is one batch bucket's static KV cache at one cache length, with the buffers and CUDA graphs over it
(`moefx/sampling/decode.py`). Cache lengths grow geometrically (256, 384, 512, 768, 1024, 1536, ...: each power of
two and 1.5x it), so a context that grows to L allocates and re-captures O(log L) times. Every slot's cache and
every captured graph's memory pool count against one budget:
- the budget is config key `memory_budget`, else env `MOEFX_MEMORY_BUDGET`, else `DEFAULT_MEMORY_BUDGET` (0.7): a
  number <= 1 is a fraction of the device memory free at the engine's first allocation (what is left goes to
  activations and the prefill), a larger one is bytes;
- a cache's bytes are known before it is allocated (layers x 2 x rows x KV heads x length x head_dim x dtype
  size, plus the engine's token and mask buffers); graph pools are measured on CUDA around each capture
  (`graph_memory`), and the pool keeps what it took, so those bytes stay counted;
- a new slot first evicts least-recently-used slots until it fits (an evicted slot's memory is free before the
  new one is allocated); a slot that cannot fit even in an empty budget raises `MemoryBudgetError` before anything
  is allocated. When fitting the exact bucket would evict, a longer slot of the same batch bucket that is alive
  serves the request instead.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from moefx.backends.capture_mode import as_captured
from moefx.config import DEFAULT_MEMORY_BUDGET, check_memory_budget
from moefx.log import get_logger

log = get_logger("moefx.sampling")

MIN_CACHE_LEN = 256  # the shortest cache length bucket
_MIB = 2**20


class MemoryBudgetError(ValueError):
    """A request whose slot cannot fit in the engine's memory budget (raised before anything is allocated)."""


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


def cache_bytes(config: Any, rows: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of a static cache of `rows` x `max_len` for a transformers config, plus the engine's long buffers
    (tokens so far and the attention mask, [rows, max_len] each)."""
    conf = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = conf.num_hidden_layers
    heads = getattr(conf, "num_attention_heads", None) or 1
    kv_heads = getattr(conf, "num_key_value_heads", None) or heads
    head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // heads
    width = torch.empty((), dtype=dtype).element_size()
    return layers * 2 * rows * kv_heads * max_len * head_dim * width + 2 * rows * max_len * 8


def free_memory(device: torch.device) -> int:
    """Bytes the engine could still take on `device`: free device memory plus what torch's allocator holds unused
    (CUDA), or the host's available memory (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    from moefx.machine import host_memory_available

    available = host_memory_available()
    return available if available is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def budget_setting(config_value: float | None) -> tuple[float, str]:
    """(budget number, where it came from): config key > env MOEFX_MEMORY_BUDGET > default."""
    if config_value is not None:
        return check_memory_budget(config_value, "config key 'memory_budget'"), "config key memory_budget"
    from moefx.env import get_setting

    env = get_setting("MOEFX_MEMORY_BUDGET")
    if env is not None:
        return env, "env MOEFX_MEMORY_BUDGET"
    return DEFAULT_MEMORY_BUDGET, "default"


class GraphPool:
    """The memory pool every CUDA graph of one engine is captured into, kept alive for the engine's life.

    torch's caching allocator keeps a graph pool only while some graph captured into it lives: once every slot
    holding graphs is evicted, a capture into the same handle fails its `use_count > 0` assert, and that failed
    capture leaves the CUDA generator in capture mode, so every later random op in the process raises (H200,
    torch 2.11). A one-kernel graph captured first holds the pool, so later captures reuse what evicted graphs
    freed in it (the budget already counts the pool's growth as kept)."""

    def __init__(self) -> None:
        self._held: tuple[Any, Any, torch.Tensor] | None = None  # (handle, anchor graph, the tensor it writes)

    def handle(self, device: torch.device) -> Any:
        if self._held is None:
            pool, anchor = torch.cuda.graph_pool_handle(), torch.cuda.CUDAGraph()
            target = torch.zeros((), device=device)
            with torch.cuda.graph(anchor, pool=pool):
                target.add_(1)
            self._held = (pool, anchor, target)
        return self._held[0]

    def drop(self) -> None:
        """After a failed capture, which may leave the pool in use: the next capture takes a new one."""
        self._held = None

    def capture(self, run: Callable[[], Any], device: torch.device,
                restore: Callable[[], None] = lambda: None) -> tuple[Any, Any, str | None]:
        """`run()` captured into this pool: (graph, what the captured call returned, None), or (None, None, why not).

        Two warm-ups come first, on a side stream and deciding kernels as the capture will (capture_mode.py): the
        first compiles and builds the lazy state a capture cannot create (Triton builds, the dense gemv's split-K
        counters); the second runs with host syncs turned into errors, since a capture that fails half-way leaves
        the RNG and the graph pool unusable. Then `restore()` puts back what the warm-ups changed, and the CUDA RNG
        is put back too (a warm-up must not shift a request's random stream)."""
        rng = torch.cuda.get_rng_state(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        syncs = None
        with torch.cuda.stream(side), as_captured():
            run()
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                run()
            except RuntimeError as exc:
                syncs = str(exc).splitlines()[0]
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        torch.cuda.current_stream(device).wait_stream(side)
        restore()
        torch.cuda.set_rng_state(rng, device)
        if syncs is not None:
            return None, None, f"syncs the host ({syncs})"
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.handle(device)):
                out = run()
        except RuntimeError as exc:
            self.drop()
            return None, None, f"cannot be captured: {exc}"
        return graph, out, None


class SlotPool:
    """The engine's slots keyed by (rows, cache length, device), least recently used first, under one budget.

    `stats` (an EngineStats) gets the counts: slots alive, allocations, evictions, cache and graph bytes, the
    budget. The prefill (or anything else that captures into the engine's graph pool) counts its graphs with
    `graph_memory(what, device, keep=slot)` around the capture, or `record_graph_bytes(what, nbytes, keep=slot)`
    when it measured them itself; both then free least-recently-used slots (never `keep`) if the budget is over."""

    def __init__(self, stats: Any, memory_budget: float | None = None, min_len: int = MIN_CACHE_LEN) -> None:
        self.setting, self.source = budget_setting(memory_budget)
        self.stats = stats
        self.min_len = min_len
        self.limit: int | None = None  # bytes, fixed at the first allocation
        self._slots: OrderedDict[tuple[int, int, str], Any] = OrderedDict()
        self._bytes: dict[tuple[int, int, str], int] = {}
        self.graph_bytes: dict[str, int] = {}

    # -- the budget ------------------------------------------------------------------------------------------

    def budget(self, device: torch.device) -> int:
        """The budget in bytes (a fraction is taken of the memory free at the first call)."""
        if self.limit is None:
            if self.setting > 1:
                self.limit, how = int(self.setting), f"{self.source}"
            else:
                free = free_memory(device) + self.used()
                self.limit = int(self.setting * free)
                how = f"{self.source}: {self.setting:g} of {free / _MIB:.0f} MiB free on {device.type}"
            self.stats.memory_budget = f"{self.limit / _MIB:.1f} MiB ({how})"
            log.info("decode engine memory budget %s", self.stats.memory_budget)
        return self.limit

    def used(self) -> int:
        return sum(self._bytes.values()) + sum(self.graph_bytes.values())

    def _sync_stats(self) -> None:
        s = self.stats
        s.slots = len(self._slots)
        s.cache_bytes = sum(self._bytes.values())
        s.graph_bytes = sum(self.graph_bytes.values())

    def _error(self, what: str, nbytes: int, limit: int) -> MemoryBudgetError:
        pinned = sum(self.graph_bytes.values())
        return MemoryBudgetError(
            f"{what} needs {nbytes / _MIB:.1f} MiB but the decode engine's memory budget is {limit / _MIB:.1f} MiB "
            f"({self.source}; {pinned / _MIB:.1f} MiB of it held by captured graph pools); raise config key "
            f"'memory_budget' or env MOEFX_MEMORY_BUDGET (a fraction of free device memory, or bytes), or send a "
            f"smaller batch or fewer tokens")

    # -- slots -----------------------------------------------------------------------------------------------

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

    def make_room(self, what: str, nbytes: int, device: torch.device) -> None:
        """Evict least-recently-used slots until `nbytes` more fit; MemoryBudgetError (nothing evicted) when they
        cannot fit even with every slot freed."""
        limit = self.budget(device)
        if nbytes + sum(self.graph_bytes.values()) > limit:
            raise self._error(what, nbytes, limit)
        while self.used() + nbytes > limit:
            self._evict_oldest()

    def add(self, slot: Any, device: torch.device, nbytes: int) -> None:
        key = (slot.batch, slot.max_len, str(device))
        self._slots[key] = slot
        self._bytes[key] = nbytes
        self.stats.slot_allocations += 1
        self._sync_stats()

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
        freed = self._bytes.pop(key)
        self.stats.evictions += 1
        log.info("decode engine: slot batch %d x length %d evicted (%.1f MiB)", key[0], key[1], freed / _MIB)
        self._sync_stats()
        return True

    # -- graph pools -----------------------------------------------------------------------------------------

    def record_graph_bytes(self, what: str, nbytes: int, device: torch.device, keep: Any = None) -> None:
        """Count `nbytes` of captured-graph memory under `what` ("decode", "prefill", ...); then evict
        least-recently-used slots other than `keep` while the budget is over."""
        self.graph_bytes[what] = self.graph_bytes.get(what, 0) + max(0, int(nbytes))
        limit = self.budget(device)
        while self.used() > limit and self._evict_oldest(keep):
            pass
        self._sync_stats()

    @contextlib.contextmanager
    def graph_memory(self, what: str, device: torch.device, keep: Any = None) -> Iterator[None]:
        """Measure what the block adds to torch's reserved CUDA memory (a capture into the graph pool) and count it
        with `record_graph_bytes`; nothing on other devices."""
        if device.type != "cuda":
            yield
            return
        before = torch.cuda.memory_reserved(device)
        try:
            yield
        finally:
            self.record_graph_bytes(what, torch.cuda.memory_reserved(device) - before, device, keep)
