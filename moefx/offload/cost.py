"""Cost model for offloaded experts: which routed experts the CPU computes and which are streamed to the GPU.

Per expert with t routed rows:  CPU cost = max(expert bytes / CPU expert bandwidth, t x row FLOPs / CPU rate),
GPU cost = max(expert bytes / H2D bandwidth, t x row FLOPs / GPU rate). Both sides run at once: the GPU side's
copies are in flight while the host computes its share, so a call costs the larger of the two sides (the CPU side
also pays for moving the activations down and the result up). `split_experts` gives the GPU the experts whose
CPU cost is highest until that stops shortening the call; the switch point is the smallest M (uniform routing)
from which every expert streams. Rates are measured once per machine and expert geometry and cached as JSON
under $XDG_CACHE_HOME/moefx (default ~/.cache/moefx).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from moefx.log import get_logger
from moefx.machine import cache_dir, cpu_model
from moefx.offload import cpu_kernel
from moefx.offload.cpu_experts import CpuMath, ExpertPool, ExpertStore, cpu_moe
from moefx.offload.hw import HostInfo

log = get_logger("moefx.offload.cost")

MAX_SWITCH_TOKENS = 1 << 20
RATES_VERSION = 2  # bump when what measure_* measures changes, so cached rates are measured again
PREFETCH_CANDIDATES = (0, 1024, 4096)  # host kernel software prefetch distances tried per machine (bytes)


@dataclass(frozen=True)
class Geometry:
    num_experts: int
    top_k: int
    hidden: int
    inter: int
    expert_bytes: int
    act_bytes: int = 2  # bytes per activation element moved between host and GPU

    @property
    def row_flops(self) -> float:
        return 2.0 * 3 * self.hidden * self.inter

    def touched(self, m: int) -> float:
        """Expected distinct experts hit by m tokens under uniform routing."""
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** m)


@dataclass(frozen=True)
class MachineRates:
    cpu_gbps: float  # GB/s the CPU expert path streams weights at small M (DRAM-bound)
    cpu_tflops: float  # expert GEMM rate of the CPU path at large M
    h2d_gbps: float | None  # pinned host -> GPU copy; None without a GPU
    gpu_tflops: float | None
    decode_workers: int = 1  # expert worker threads per NUMA node that decode fastest (tuned with the rates)
    source: str = "measured"
    shared_gbps: float | None = None  # host memory read rate with both running: H2D copies and the CPU path share DRAM
    prefetch_bytes: int = 0  # host kernel software prefetch distance that decoded fastest (0 = none)
    stream_overhead_s: float = 0.0  # fixed cost of a call that streams any expert (ring launches, index copies)

    @property
    def has_gpu(self) -> bool:
        return self.h2d_gbps is not None and self.gpu_tflops is not None


# Below this share of the experts on the CPU, a split is not taken where every expert can stream without a routing
# sync (H200, Qwen3-30B-A3B geometry: a split giving the CPU 5% of the experts at M=2048 ran at 73-87% of the
# H2D floor; streaming all of them without the sync at M=8192 ran at 100%).
SPLIT_MIN_CPU_SHARE = 0.10


def hits_every_expert(m: int, top_k: int, num_experts: int) -> bool:
    """Uniform routing of m rows to top_k of num_experts leaves fewer than half an expert unhit, expected."""
    return num_experts * (1 - min(top_k, num_experts) / num_experts) ** m < 0.5


def cpu_cost(rows: float, g: Geometry, r: MachineRates) -> float:
    return max(g.expert_bytes / (r.cpu_gbps * 1e9), rows * g.row_flops / (r.cpu_tflops * 1e12))


def gpu_cost(rows: float, g: Geometry, r: MachineRates) -> float:
    return max(g.expert_bytes / (r.h2d_gbps * 1e9), rows * g.row_flops / (r.gpu_tflops * 1e12))


def split_experts(rows: list[float], m: int, g: Geometry, r: MachineRates) -> tuple[list[bool], float]:
    """(on_gpu flag per hit expert, modelled seconds) for experts with these routed row counts in an M-row call."""
    n = len(rows)
    if not r.has_gpu or n == 0:
        return [False] * n, sum(cpu_cost(t, g, r) for t in rows) if n else 0.0
    c = [cpu_cost(t, g, r) for t in rows]
    gg = [gpu_cost(t, g, r) for t in rows]
    on_gpu = [False] * n
    transfer = 2 * m * g.hidden * g.act_bytes / (r.h2d_gbps * 1e9)
    cpu_t = transfer + sum(c)
    gpu_t = 0.0
    # Both sides at once read every hit expert's bytes from the same DRAM: a floor on any real split.
    shared = transfer + n * g.expert_bytes / (r.shared_gbps * 1e9) if r.shared_gbps else 0.0
    moved = 0
    for i in sorted(range(n), key=lambda i: (-c[i], i)):
        after = max(cpu_t - c[i], gpu_t + gg[i], shared if moved + 1 < n else 0.0)
        if after >= (1 - 1e-9) * max(cpu_t, gpu_t, shared if moved else 0.0):  # ties (to rounding) stay put
            break
        on_gpu[i] = True
        moved += 1
        cpu_t -= c[i]
        gpu_t += gg[i]
    # Streaming anything costs a fixed host-side time on the thread that also runs the CPU share (ring set-up,
    # tile launches): it adds to the call rather than overlapping it, so the split must beat both pure options.
    # Streaming every expert once routing hits them all needs no routing sync and no host work (the ring's
    # fixed tiles): no fixed cost, and its copies queue behind the previous layer's.
    every = hits_every_expert(m, g.top_k, g.num_experts)
    options = [([False] * n, transfer + sum(c)), ([True] * n, (0.0 if every else r.stream_overhead_s) + sum(gg))]
    # A split also waits for the router before any copy starts, so the copy engine idles through the layer's
    # attention: not in the model above. Where streaming everything needs no such wait, a split that leaves the
    # CPU only a sliver of the experts is not worth that wait.
    if 0 < moved < n and not (every and n - moved < SPLIT_MIN_CPU_SHARE * n):
        options.append((on_gpu, r.stream_overhead_s + max(cpu_t, gpu_t, shared)))
    return min(options, key=lambda o: o[1])


def _uniform_rows(m: int, g: Geometry) -> list[float]:
    touched = max(1, round(g.touched(m)))
    return [m * g.top_k / touched] * touched


def cpu_seconds(m: int, g: Geometry, r: MachineRates) -> float:
    """Modelled time with every expert on the CPU (uniform routing)."""
    return sum(cpu_cost(t, g, r) for t in _uniform_rows(m, g))


def modelled_seconds(m: int, g: Geometry, r: MachineRates) -> tuple[float, float]:
    """(modelled seconds, share of experts on the GPU) for an M-row call under uniform routing."""
    flags, secs = split_experts(_uniform_rows(m, g), m, g, r)
    return secs, sum(flags) / len(flags)


def switch_point(g: Geometry, r: MachineRates) -> int | None:
    """Smallest M from which every expert is streamed to the GPU; None when that never happens (up to 2^20)."""
    if not r.has_gpu or modelled_seconds(MAX_SWITCH_TOKENS, g, r)[1] < 1.0:
        return None
    if modelled_seconds(1, g, r)[1] == 1.0:
        return 1
    lo, hi = 1, 2
    while modelled_seconds(hi, g, r)[1] < 1.0:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # share is 1 at hi, below 1 at lo
        mid = (lo + hi) // 2
        if modelled_seconds(mid, g, r)[1] == 1.0:
            hi = mid
        else:
            lo = mid
    return hi


def cache_key(store: ExpertStore, dtype: torch.dtype, device: torch.device | None, host: HostInfo) -> str:
    gpu = torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else None
    return key_for(gpu, dtype, tuple(store.w13.shape[1:]), tuple(store.w2.shape[1:]), store.int8, host)


def key_for(gpu: str | None, dtype: torch.dtype | str, w13: tuple, w2: tuple, int8: bool, host: HostInfo) -> str:
    """Cache key: this host's CPU and threads, the GPU, torch, dtype and one expert's shapes."""
    dtype_s = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    return "|".join(
        [f"v{RATES_VERSION}", cpu_model(), f"cpus={host.cpus}", f"numa={host.numa_nodes}",
         f"threads={torch.get_num_threads()}",
         gpu or "none", f"torch={torch.__version__}", dtype_s, f"{tuple(w13)}x{tuple(w2)}",
         "int8" if int8 else "float", f"host_kernel={cpu_kernel.kernel().tag}"]
    )


def _read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def cached_rates(key: str, path: Path | None = None) -> MachineRates | None:
    path = path or cache_dir() / "offload_rates.json"
    row = _read_cache(path).get(key)
    if not row:
        return None
    row["source"] = f"cache {path}"
    return MachineRates(**row)


def store_rates(key: str, rates: MachineRates, path: Path | None = None) -> Path:
    path = path or cache_dir() / "offload_rates.json"
    data = _read_cache(path)
    row = asdict(rates)
    row.pop("source")
    data[key] = row
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not write the offload rate cache %s: %s", path, exc)
    return path


def median_seconds(fn, reps: int) -> float:
    """Median wall time of `fn()` over `reps` calls after one warm-up (`fn` syncs itself where it queues GPU work)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def worker_candidates(host: HostInfo) -> list[int]:
    per_node = max(1, min(len(c) for c in host.numa_cpus))
    return [w for w in (1, 2, 4, 8, 16) if w <= per_node]


def measure_cpu(
    store: ExpertStore, dtype: torch.dtype, host: HostInfo, top_k: int
) -> tuple[float, float, int, int]:
    """(GB/s at decode-like M=1 over random experts, TFLOP/s at M=512, best workers per node, best host kernel
    prefetch distance), on the layer's weights.

    Each worker count in `worker_candidates` is tried for decode; the large-M rate uses one worker per node.
    """
    e, h = store.num_experts, store.w13.shape[2]
    inter = store.w2.shape[2]
    gen = torch.Generator().manual_seed(0)
    k = min(top_k, e)
    x1 = torch.randn(1, h, generator=gen).to(dtype)
    w1 = torch.full((1, k), 1.0 / k)
    best = (0.0, 1, 0)
    # The host kernel runs on the caller's thread whatever the pool, so for it the prefetch distance is tuned;
    # worker counts only matter for torch's ops.
    kernel = cpu_kernel.unsupported(store.w13.dtype, dtype) is None
    trials = [(1, pf) for pf in PREFETCH_CANDIDATES] if kernel else [(w, 0) for w in worker_candidates(host)]
    for workers, pf in trials:
        pool = ExpertPool(host, workers)

        def decode(pool: ExpertPool = pool, pf: int = pf) -> None:
            ids = torch.randperm(e, generator=gen)[:k].view(1, k)  # fresh experts: DRAM, not cache
            cpu_moe(store, x1, ids, w1, pool, CpuMath(prefetch_bytes=pf))

        gbps = k * store.expert_bytes / median_seconds(decode, 9) / 1e9
        pool.shutdown()
        best = max(best, (gbps, workers, pf))
    # Large M as prefill chunks see it: uniform routing over every expert (32 rows each for E=128, top-8), the
    # whole call timed (gathers, activation, scatter-add included), since that is what a CPU share costs.
    m = 512
    xm = torch.randn(m, h, generator=gen).to(dtype)
    ids_m = torch.rand(m, e, generator=gen).topk(k, dim=-1).indices
    wm = torch.full((m, k), 1.0 / k)
    pool = ExpertPool(host, 1)
    secs = median_seconds(lambda: cpu_moe(store, xm, ids_m, wm, pool, CpuMath()), 3)
    pool.shutdown()
    return best[0], 2.0 * m * k * 3 * h * inter / secs / 1e12, best[1], best[2]


def measure_gpu(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(pinned H2D GB/s on a 256 MiB buffer, dense matmul TFLOP/s at 4096^3)."""
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dst.copy_(src, non_blocking=True)
    start.record()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    h2d = 4 * src.nbytes / (start.elapsed_time(end) / 1e3) / 1e9
    a = torch.randn(4096, 4096, device=device, dtype=dtype)
    a @ a
    start.record()
    for _ in range(4):
        a @ a
    end.record()
    end.synchronize()
    tflops = 4 * 2 * 4096**3 / (start.elapsed_time(end) / 1e3) / 1e12
    return h2d, tflops


def measure_shared(store: ExpertStore, dtype: torch.dtype, device: torch.device, host: HostInfo, top_k: int) -> float:
    """Host memory GB/s read by pinned H2D copies and the CPU decode path running at the same time."""
    e, h = store.num_experts, store.w13.shape[2]
    gen = torch.Generator().manual_seed(1)
    k = min(top_k, e)
    x1 = torch.randn(1, h, generator=gen).to(dtype)
    w1 = torch.full((1, k), 1.0 / k)
    pool = ExpertPool(host, 1)
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    done = torch.cuda.Event()
    cpu_moe(store, x1, torch.arange(k).view(1, k), w1, pool, CpuMath())
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    done.record()
    cpu_bytes = 0
    while not done.query():
        cpu_moe(store, x1, torch.randperm(e, generator=gen)[:k].view(1, k), w1, pool, CpuMath())
        cpu_bytes += k * store.expert_bytes
    elapsed = time.perf_counter() - t0
    pool.shutdown()
    return (4 * src.nbytes + cpu_bytes) / elapsed / 1e9


def measure_stream_overhead(ring, store: ExpertStore, dtype: torch.dtype, rates: MachineRates, compute) -> float:
    """Seconds a one-expert streamed call takes beyond copying that expert: the fixed cost of streaming at all."""
    device = ring.device
    h = store.w13.shape[2]
    x = torch.randn(1, h, device=device).to(dtype)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    w = torch.ones(1, 1, device=device)

    def call() -> None:
        ring.run(store, x, ids, w, compute)
        torch.cuda.synchronize(device)

    secs = median_seconds(call, 7)
    return max(0.0, secs - store.expert_bytes / (rates.h2d_gbps * 1e9))


def machine_rates(
    store: ExpertStore, dtype: torch.dtype, device: torch.device | None, host: HostInfo, top_k: int
) -> MachineRates:
    """Cached rates for this machine and expert geometry, measuring (a few seconds) on first use."""
    key = cache_key(store, dtype, device, host)
    cached = cached_rates(key)
    if cached is not None:
        return cached
    cpu_gbps, cpu_tflops, workers, prefetch = measure_cpu(store, dtype, host, top_k)
    h2d = gpu_tflops = shared = None
    if device is not None and device.type == "cuda":
        h2d, gpu_tflops = measure_gpu(device, dtype)
        shared = measure_shared(store, dtype, device, host, top_k)
    rates = MachineRates(cpu_gbps, cpu_tflops, h2d, gpu_tflops, workers, shared_gbps=shared, prefetch_bytes=prefetch)
    path = store_rates(key, rates)
    return replace(rates, source=f"measured, cached in {path}")
