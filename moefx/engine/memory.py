"""The decode engine's memory budget: what it is, what counts against it, and what happens when it is full.

- The budget is config key `memory_budget`, else env `MOEFX_MEMORY_BUDGET`, else `DEFAULT_MEMORY_BUDGET` (0.7,
  `moefx/config.py`, which also checks the number): a number <= 1 is a fraction of the device memory free at the
  engine's first allocation (what is left goes to activations and the prefill), a larger one is bytes.
- Every slot's static cache counts (`cache_bytes`, known before it is allocated: rows x length x the KV bytes per
  token of `moefx/facts/sizes.py`, plus the engine's token and mask buffers), and so does every captured CUDA
  graph's memory pool, measured on CUDA around each capture (`graph_memory`, `moefx/engine/graphs.py`); the pool
  keeps what it took, so those bytes stay counted.
- When a new slot would not fit, least-recently-used slots are freed first (`SlotPool`, `moefx/engine/slots.py`);
  a slot that cannot fit even in an empty budget raises `MemoryBudgetError` before anything is allocated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from typing import Any

import torch

from moefx.config import DEFAULT_MEMORY_BUDGET, check_memory_budget
from moefx.facts.sizes import config_kv_shape, kv_bytes_per_token
from moefx.log import get_logger
from moefx.machine import free_memory

log = get_logger("moefx.engine")

_MIB = 2**20


class MemoryBudgetError(ValueError):
    """A request whose slot cannot fit in the engine's memory budget (raised before anything is allocated)."""


def cache_bytes(config: Any, rows: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of a static cache of `rows` x `max_len` for a transformers config, plus the engine's long buffers
    (tokens so far and the attention mask, [rows, max_len] each)."""
    per_token = kv_bytes_per_token(*config_kv_shape(config), torch.empty((), dtype=dtype).element_size())
    if per_token is None:
        raise ValueError("the model's config states no num_hidden_layers or num_attention_heads: the decode engine "
                         "cannot size its static cache")
    return rows * max_len * per_token + 2 * rows * max_len * 8


def budget_setting(config_value: float | None) -> tuple[float, str]:
    """(budget number, where it came from): config key > env MOEFX_MEMORY_BUDGET > default."""
    if config_value is not None:
        return check_memory_budget(config_value, "config key 'memory_budget'"), "config key memory_budget"
    from moefx.env import get_setting

    env = get_setting("MOEFX_MEMORY_BUDGET")
    if env is not None:
        return env, "env MOEFX_MEMORY_BUDGET"
    return DEFAULT_MEMORY_BUDGET, "default"


class MemoryBudget:
    """Bytes held under one limit: the slots' caches (`held`, by slot key) and the graph pools' growth (`graph_bytes`,
    by what captured them). `stats` (an EngineStats) gets the counts and the budget. A subclass frees memory with
    `_evict_oldest(keep)` (the least-recently-used holder other than `keep`; False when there is none)."""

    def __init__(self, stats: Any, memory_budget: float | None = None) -> None:
        self.setting, self.source = budget_setting(memory_budget)
        self.stats = stats
        self.limit: int | None = None  # bytes, fixed at the first allocation
        self.held: dict[Hashable, int] = {}
        self.graph_bytes: dict[str, int] = {}

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
        return sum(self.held.values()) + sum(self.graph_bytes.values())

    def _sync_stats(self) -> None:
        s = self.stats
        s.cache_bytes = sum(self.held.values())
        s.graph_bytes = sum(self.graph_bytes.values())

    def _error(self, what: str, nbytes: int, limit: int) -> MemoryBudgetError:
        pinned = sum(self.graph_bytes.values())
        return MemoryBudgetError(
            f"{what} needs {nbytes / _MIB:.1f} MiB but the decode engine's memory budget is {limit / _MIB:.1f} MiB "
            f"({self.source}; {pinned / _MIB:.1f} MiB of it held by captured graph pools); raise config key "
            f"'memory_budget' or env MOEFX_MEMORY_BUDGET (a fraction of free device memory, or bytes), or send a "
            f"smaller batch or fewer tokens")

    def make_room(self, what: str, nbytes: int, device: torch.device) -> None:
        """Evict least-recently-used holders until `nbytes` more fit; MemoryBudgetError (nothing evicted) when they
        cannot fit even with every one freed."""
        limit = self.budget(device)
        if nbytes + sum(self.graph_bytes.values()) > limit:
            raise self._error(what, nbytes, limit)
        while self.used() + nbytes > limit:
            self._evict_oldest()

    def _evict_oldest(self, keep: Any = None) -> bool:
        raise NotImplementedError

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
