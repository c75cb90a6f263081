"""What every benchmark shares: the timers, the one copy ceiling, the matmul and host ceilings, input rotation, and
where results are written.

Kernel timers (µs, medians; each warms its function up before timing, so compiles stay out):
- `time_graph(fn)`: one replay of a CUDA graph of `fn()`, CUDA events around `reps` replays, median of trials
  (`time_graph_calls` says how often it runs `fn`, for a step that advances state of its own, e.g. a decode step);
- `time_rotated(fn, arg_sets, calls)`: one graph of `calls` calls cycling through `arg_sets` (inputs rotate, so a
  call's weights or activations do not stay in L2), µs per call;
- `time_eager(fn, reps)`: CUDA events around eager calls `fn(i)`, for work a graph cannot hold (autograd);
- `time_wall(fn, arg_sets, calls)`: the wall clock (the GPU synchronized around each trial), for the `--quick` /
  `--tiny` smoke runs and steps that cannot be captured;
- `time_host(fn, calls)`: the host's share of one call (the GPU idle before each), for dispatch overhead.
Whole-call timers (seconds, the GPU synchronized before and after each call): `wall_s(fn)` for one call (a first
call, a request, a prefill), `timed_call(fn)` for one call and its result, `median_wall_s(fn, runs)` for the median
of `runs` calls and `timed_calls(fn, runs)` for that median and the last call's result; `sync()` is their barrier,
and `synced_now(device)` the wall clock once the device's queued work has finished, for one-shot spans that include
their compiles (a cold start's first call: `bench/coldstart.py`).

Ceilings: `copy_ceiling_Bps` is the copy rate every floor divides bytes by: an SM copy kernel
(`torch.mul(src, 1, out=dst)` over 1 GiB), as moefx's kernels stream. A `copy_` of the same bytes inside a CUDA
graph becomes a memcpy node that the copy engines run, which reads slower, so a floor taken from it would sit under
the kernels' reach. `ceilings()` adds the bf16 and FP8 matmul rates (measured first: they bring the clocks up).
`host_copy_Bps` and `h2d_Bps` are the host memory and pinned host-to-device rates of the expert-offload floors.

Results: `write_json(name, data)` writes `$OUT/name` (`./out/name` without `$OUT`), the one way every benchmark
writes its JSON; `results_dir()` is that folder.

Inputs: `routing` / `input_sets` draw random top-k routings and hidden states (Qwen3-MoE style; FP8 expert weights
come from moefx's own `quant_weight_fp8_block`), `relerr` compares outputs, `kernel_times` splits a call into its
kernels.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

COPY_BYTES = 1 << 30  # the GPU copy ceiling's buffer: far above any L2
CPU_COPY_BYTES = 1 << 24  # smoke runs on the CPU: nominal numbers, the floors mean nothing there
PROFILE_REPS = 10  # eager calls per rotating set under the profiler (`kernel_times`)
GRAPH_WARMUPS = 3  # replays `time_graph` runs before it times
HOST_BATCH = 20  # calls per batch of `time_host` on the CPU
T = TypeVar("T")


# ------------------------------------------------------------------------------------------------- timers


def time_graph(fn: Callable[[], object], reps: int = 20, trials: int = 5) -> float:
    """Median µs of one replay of a CUDA graph of `fn()` (warmed up eagerly and on a side stream first)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(GRAPH_WARMUPS):
        g.replay()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def time_graph_calls(reps: int = 20, trials: int = 5) -> int:
    """How many times `time_graph(fn, reps, trials)` runs `fn`: two eager warm-ups, then graph replays."""
    return 2 + GRAPH_WARMUPS + reps * trials


def time_rotated(fn: Callable[..., object], arg_sets: Sequence[tuple], calls: int, trials: int = 7) -> float:
    """Median µs per call from CUDA-graph replays of `calls` calls cycling through `arg_sets`."""
    for a in arg_sets[:2]:
        fn(*a)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(trials):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return statistics.median(times)


def time_eager(fn: Callable[[int], object], reps: int, trials: int = 5) -> float:
    """Median µs per call of eager calls `fn(i)` (i = 0, 1, ...: the call picks its inputs, e.g. a rotating set),
    CUDA events around `reps` calls, median of `trials`, after three warm-up calls: for work a CUDA graph cannot
    hold (autograd's backward)."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(reps):
            fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def time_wall(fn: Callable[..., object], arg_sets: Sequence[tuple], calls: int, trials: int = 5) -> float:
    """Median µs per call on the wall clock, `calls` calls cycling through `arg_sets` (after one warm-up); on a
    CUDA host the GPU is synchronized before and after each trial, so queued work is counted."""
    fn(*arg_sets[0])
    times = []
    for _ in range(trials):
        sync()
        t = time.perf_counter()
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])
        sync()
        times.append((time.perf_counter() - t) * 1e6 / calls)
    return statistics.median(times)


def time_host(fn: Callable[[], object], calls: int, cuda: bool) -> float:
    """µs of host time per call of `fn` (after three warm-up calls). CUDA: the median over `calls` calls of the
    wall clock around one call with the GPU synchronized before it (the launch queue is empty, so the call returns
    once its launches are queued). CPU (no launches to wait for): the fastest of batches of `HOST_BATCH` calls, per
    call (a shared CPU's other work only ever adds time)."""
    for _ in range(3):
        fn()
    if not cuda:
        batches = []
        for _ in range(max(calls // HOST_BATCH, 1)):
            t0 = time.perf_counter()
            for _ in range(HOST_BATCH):
                fn()
            batches.append((time.perf_counter() - t0) * 1e6 / HOST_BATCH)
        return min(batches)
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the GPU: `device` (a CUDA device), or with None the current CUDA device where CUDA is available.
    A CPU device waits for nothing."""
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], T], device: torch.device | str | None = None) -> tuple[float, T]:
    """(seconds, result) of one call of `fn`, the GPU (`sync(device)`) synchronized before and after it."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def wall_s(fn: Callable[[], object], device: torch.device | str | None = None) -> float:
    """Seconds of one call of `fn`, the GPU (`sync(device)`) synchronized before and after it."""
    return timed_call(fn, device)[0]


def timed_calls(fn: Callable[[], T], runs: int, device: torch.device | str | None = None) -> tuple[float, T]:
    """(median seconds, last result) of `runs` calls of `fn`, each timed by `timed_call` (no warm-up: call `fn`
    first if it compiles)."""
    times, out = [], None
    for _ in range(runs):
        seconds, out = timed_call(fn, device)
        times.append(seconds)
    return statistics.median(times), out


def median_wall_s(fn: Callable[[], object], runs: int, device: torch.device | str | None = None) -> float:
    """Median seconds of `runs` calls of `fn` (`timed_calls` without the result)."""
    return timed_calls(fn, runs, device)[0]


def synced_now(device: torch.device | str) -> float:
    """`time.perf_counter()` once `device`'s queued work has finished (`sync(device)`): a one-shot span (a first call
    with its compiles and captures) ends when the device is done, not when the CPU queued its last kernel."""
    sync(device)
    return time.perf_counter()


# ----------------------------------------------------------------------------------------------- ceilings


def copy_ceiling_Bps(device: torch.device | str = "cuda") -> float:
    """Bytes/s (read + write counted) of the SM copy kernel over 1 GiB on a CUDA device, best of three medians.

    The one copy ceiling of the benchmarks' bytes floors. On the CPU (smoke runs) a 16 MiB copy on the wall clock.
    """
    device = torch.device(device)
    if device.type != "cuda":
        src = torch.randn(CPU_COPY_BYTES // 2, device=device).to(torch.bfloat16)
        dst = torch.empty_like(src)
        us = time_wall(lambda: torch.mul(src, 1.0, out=dst), [()], 3)
        return 2 * CPU_COPY_BYTES / (us * 1e-6)
    with torch.cuda.device(device):
        src = torch.randn(COPY_BYTES // 2, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        us = min(time_graph(lambda: torch.mul(src, 1.0, out=dst), reps=20) for _ in range(3))
    return 2 * COPY_BYTES / (us * 1e-6)


def host_copy_Bps(nbytes: int, reps: int = 5) -> float:
    """Bytes/s (read + write counted) of a host memory copy of `nbytes` on all of torch's threads, the best of
    `reps` copies after one warm-up: the host memory rate of the expert-offload decode floor."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(wall_s(lambda: dst.copy_(src), "cpu") for _ in range(reps))
    return 2 * nbytes / best


def h2d_Bps(nbytes: int, reps: int = 5) -> float:
    """Bytes/s of `reps` back-to-back copies of `nbytes` from pinned host memory to the GPU, CUDA events around them
    (after one warm-up copy): the rate of the expert-offload prefill floor."""
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return reps * nbytes / (start.elapsed_time(end) / 1e3)


def ceilings() -> dict[str, float]:
    """`bf16_flops`, `fp8_flops` (an 8192³ matmul; FP8 falls back to 2× bf16 where `_scaled_mm` fails) and
    `copy_Bps` (`copy_ceiling_Bps`). The matmuls run first: they also bring the clocks up."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_us = min(time_graph(lambda: a @ b, reps=10) for _ in range(3))
    res = {"bf16_flops": 2 * 8192**3 / (mm_us * 1e-6)}
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        f8_us = time_graph(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), reps=10)
        res["fp8_flops"] = 2 * 8192**3 / (f8_us * 1e-6)
    except (RuntimeError, TypeError) as exc:
        print(f"fp8 matmul ceiling not measured ({exc}); using 2x bf16", flush=True)
        res["fp8_flops"] = 2 * res["bf16_flops"]
    res["copy_Bps"] = copy_ceiling_Bps("cuda")
    return res


# ------------------------------------------------------------------------------------------------- inputs


def routing(m: int, e: int, k: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing of m tokens over e experts: (ids, renormalized fp32 weights)."""
    logits = torch.randn(m, e, device=device, generator=gen)
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).float()


def input_sets(m: int, h: int, e: int, k: int, dev: str, gen: torch.Generator, n: int) -> list[tuple]:
    """n independent (hidden, topk_ids, topk_weights) sets: each call in a timed graph routes differently."""
    return [(torch.randn(m, h, device=dev, generator=gen, dtype=torch.bfloat16), *routing(m, e, k, dev, gen))
            for _ in range(n)]


def relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32; inf where out is not finite."""
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def kernel_times(call: Callable[..., object], sets: list[tuple], reps: int = PROFILE_REPS) -> dict[str, float]:
    """µs per call of each GPU kernel (torch.profiler over eager calls on the rotating sets), longest first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(2):
        [call(*s) for s in sets]
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            [call(*s) for s in sets]
        torch.cuda.synchronize()
    n = reps * len(sets)
    times: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0)
        if us > 0:
            times[ev.key[:60]] = us / n
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


# ------------------------------------------------------------------------------------------------ results


def results_dir() -> Path:
    """Where results go: `$OUT` (the GPU stages set it), else `./out`; created if missing."""
    out = Path(os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_json(name: str, data: Any) -> Path:
    """Write `data` as indented JSON to `results_dir() / name` (values JSON cannot hold written as strings); its
    path. A benchmark rewrites its file after each row where a run stopped at its limit should keep what it has."""
    path = results_dir() / name
    path.write_text(json.dumps(data, indent=1, default=str))
    return path
