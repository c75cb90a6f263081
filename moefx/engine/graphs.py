"""The engine's CUDA graphs: one memory pool, one capture routine for the decode step and the padded prefill.

A capture (`Graphs.capture`) runs the step twice first on a side stream, deciding kernels as the capture will
(`moefx/backends/capture_mode.py`): the first compiles and builds the lazy state a capture cannot create (Triton
builds, the dense gemv's split-K counters); the second runs with host syncs turned into errors, since a capture that
fails half-way leaves the RNG and the graph pool unusable. What the warm-ups changed is put back (the caller's
`restore`, and the CUDA RNG: a warm-up must not shift a request's random stream), then the step is captured into the
engine's pool. What the pool grew by counts against the engine's memory budget (`moefx/engine/memory.py`), which may
free least-recently-used slots for it. A step that cannot be captured runs without a graph, said once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moefx.backends.capture_mode import as_captured
from moefx.engine.memory import MemoryBudget
from moefx.log import warn_once


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
        """`run()` captured into this pool after its two warm-ups (see the module docstring): (graph, what the
        captured call returned, None), or (None, None, why not)."""
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


@dataclass
class Captured:
    """One capture's result: the graph and what the captured call returned (None, None: `why` it has no graph), and
    the bytes the capture added to torch's reserved CUDA memory (counted in the budget)."""

    graph: Any
    out: Any
    why: str | None
    nbytes: int


class Graphs:
    """An engine's graph pool and its capture routine, the pool's growth counted in `budget` (the engine's slots)."""

    def __init__(self, budget: MemoryBudget, stats: Any) -> None:
        self.pool = GraphPool()
        self.budget = budget
        self.stats = stats

    def capture(self, what: str, device: torch.device, run: Callable[[], Any],
                restore: Callable[[], None] = lambda: None, keep: Any = None) -> Captured:
        """`run()` captured into the pool on `device`; its memory is counted under `what` ("decode", "prefill",
        "forward") and may evict slots, never `keep` (the slot the step runs over, if any)."""
        reserved = torch.cuda.memory_reserved(device)
        rng = torch.cuda.get_rng_state(device)
        try:
            graph, out, why = self.pool.capture(run, device, restore)
        finally:
            grown = max(0, torch.cuda.memory_reserved(device) - reserved)
            self.budget.record_graph_bytes(what, grown, device, keep=keep)
        torch.cuda.set_rng_state(rng, device)
        return Captured(graph, out, why, grown)

    def uncaptured(self, message: str) -> None:
        """A step that runs without a CUDA graph: said once, and kept in the engine's stats."""
        self.stats.uncaptured.append(message)
        warn_once(f"moefx generate(): {message}")
