"""The engine's CUDA graphs: one memory pool, one capture routine for the decode step and the padded prefill.

A capture (`Graphs.capture`) runs the step twice first on a side stream, deciding kernels as the capture
will (`moefx/backends/capture_mode.py`), and each run is needed:
1. the first run does what a capture cannot: dynamo's trace (or a saved trace's load) and the backend's compile (or
   its load from the compile cache), the first launch of each Triton kernel (a compile, or a load from Triton's cache
   folder), and the lazy state kernels build on first use (the dense gemv's split-K counters). It may sync the host
   while it does, so it runs unchecked;
2. the second runs with host syncs turned into errors: a sync inside a capture fails it half-way and leaves the RNG
   and the graph pool unusable, so a step that syncs is found here and runs without a graph instead. It cannot be
   the first run: that one's compiles and first launches may sync legitimately.
What the warm-ups changed is put back (the caller's `restore`, and the CUDA RNG: a warm-up must not shift a
request's random stream), then the step is captured into the engine's pool. Nothing is compiled after the first run:
the check run and the capture call the entries it compiled or loaded (the same shapes, the same `as_captured`
decisions), so a capture's seconds beyond its first run are two runs of the step and the recording
(`Captured.seconds`, kept per capture in the engine's stats). What the pool grew by counts against the engine's
memory budget (`moefx/engine/memory.py`), which may free least-recently-used slots for it. A step that cannot be
captured runs without a graph, said once.
"""

from __future__ import annotations

import time
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

    def capture(self, run: Callable[[], Any], device: torch.device, restore: Callable[[], None] = lambda: None,
                seconds: dict[str, float] | None = None) -> tuple[Any, Any, str | None]:
        """`run()` captured into this pool after its two warm-up runs (see the module docstring): (graph, what the
        captured call returned, None), or (None, None, why not). `seconds` gets each part's wall time: the first
        run, the check run, the capture."""
        clock = _Clock(seconds)
        rng = torch.cuda.get_rng_state(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        syncs = None
        with torch.cuda.stream(side), as_captured():
            run()  # 1: compiles or loads, first launches, lazy state; may sync
            clock.lap("first_run", side)
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                run()  # 2: the same calls with host syncs as errors, so a capture never fails half-way on one
            except RuntimeError as exc:
                syncs = str(exc).splitlines()[0]
            finally:
                torch.cuda.set_sync_debug_mode(mode)
            clock.lap("check_run", side)
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
        clock.lap("capture", None)
        return graph, out, None


class _Clock:
    """Wall seconds per part of a capture, each part's GPU work included (its stream synchronized at the lap)."""

    def __init__(self, seconds: dict[str, float] | None) -> None:
        self.seconds, self.last = seconds, time.perf_counter()

    def lap(self, part: str, stream: Any) -> None:
        if stream is not None:
            stream.synchronize()
        now = time.perf_counter()
        if self.seconds is not None:
            self.seconds[part] = round(now - self.last, 3)
        self.last = now


@dataclass
class Captured:
    """One capture's result: the graph and what the captured call returned (None, None: `why` it has no graph), the
    bytes the capture added to torch's reserved CUDA memory (counted in the budget), and the wall seconds of its
    parts (`GraphPool.capture`: first_run, check_run, capture)."""

    graph: Any
    out: Any
    why: str | None
    nbytes: int
    seconds: dict[str, float]


class Graphs:
    """An engine's graph pool and its capture routine, the pool's growth counted in `budget` (the engine's slots)."""

    def __init__(self, budget: MemoryBudget, stats: Any) -> None:
        self.pool = GraphPool()
        self.budget = budget
        self.stats = stats

    def capture(self, what: str, device: torch.device, run: Callable[[], Any],
                restore: Callable[[], None] = lambda: None, keep: Any = None) -> Captured:
        """`run()` captured into the pool on `device`; its memory is counted under `what` ("decode", "prefill",
        "forward") and may evict slots, never `keep` (the slot the step runs over, if any); its parts' seconds go to
        the stats (`capture_seconds`)."""
        reserved = torch.cuda.memory_reserved(device)
        rng = torch.cuda.get_rng_state(device)
        seconds: dict[str, float] = {}
        try:
            graph, out, why = self.pool.capture(run, device, restore, seconds)
        finally:
            grown = max(0, torch.cuda.memory_reserved(device) - reserved)
            self.budget.record_graph_bytes(what, grown, device, keep=keep)
        torch.cuda.set_rng_state(rng, device)
        self.stats.capture_seconds.append({"what": what, "batch": getattr(keep, "batch", None),
                                           "cache": getattr(keep, "max_len", None),
                                           "captured": graph is not None, **seconds})
        return Captured(graph, out, why, grown, seconds)

    def uncaptured(self, message: str) -> None:
        """A step that runs without a CUDA graph: said once, and kept in the engine's stats."""
        self.stats.uncaptured.append(message)
        warn_once(f"moefx generate(): {message}")
