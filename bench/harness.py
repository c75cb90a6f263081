"""What every GPU benchmark shares: the timers, the one copy ceiling, the matmul ceilings, input rotation.

Timers (µs, medians; each warms its function up before timing, so compiles stay out):
- `time_graph(fn)`: one replay of a CUDA graph of `fn()`, CUDA events around `reps` replays, median of trials;
- `time_rotated(fn, arg_sets, calls)`: one graph of `calls` calls cycling through `arg_sets` (inputs rotate, so a
  call's weights or activations do not stay in L2), µs per call;
- `time_wall(fn, arg_sets, calls)`: the CPU's wall clock, for the `--quick` / `--tiny` smoke runs;
- `synced_now(device)`: the wall clock once the device's queued work has finished, for one-shot spans that include
  their compiles (a cold start's first call: `bench/coldstart.py`).

Ceilings: `copy_ceiling_Bps` is the copy rate every floor divides bytes by: an SM copy kernel
(`torch.mul(src, 1, out=dst)` over 1 GiB), as moefx's kernels stream. A `copy_` of the same bytes inside a CUDA
graph becomes a memcpy node that the copy engines run, which reads slower, so a floor taken from it would sit under
the kernels' reach. `ceilings()` adds the bf16 and FP8 matmul rates (measured first: they bring the clocks up).

Inputs: `routing` / `input_sets` draw random top-k routings and hidden states (Qwen3-MoE style; FP8 expert weights
come from moefx's own `quant_weight_fp8_block`), `relerr` compares outputs, `kernel_times` splits a call into its
kernels.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

COPY_BYTES = 1 << 30  # the GPU copy ceiling's buffer: far above any L2
CPU_COPY_BYTES = 1 << 24  # smoke runs on the CPU: nominal numbers, the floors mean nothing there
PROFILE_REPS = 10  # eager calls per rotating set under the profiler (`kernel_times`)


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
    for _ in range(3):
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


def time_wall(fn: Callable[..., object], arg_sets: Sequence[tuple], calls: int, trials: int = 5) -> float:
    """Median µs per call on the CPU's wall clock, `calls` calls cycling through `arg_sets` (after one warm-up)."""
    fn(*arg_sets[0])
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])
        times.append((time.perf_counter() - t) * 1e6 / calls)
    return statistics.median(times)


def synced_now(device: torch.device | str) -> float:
    """`time.perf_counter()` once `device`'s queued work has finished: a one-shot span (a first call with its
    compiles and captures) ends when the device is done, not when the CPU queued its last kernel."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
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
