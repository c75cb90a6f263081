"""Experts computed on the CPU: only routed experts are touched, their tokens gathered, results summed in fp32.

Small M (few rows per routed expert) runs moefx's host kernel (`cpu_kernel`: one pass over each routed expert's
rows on every core, DRAM-bound). Otherwise, and wherever that kernel is unavailable, the kernels torch ships
for the CPU: oneDNN `linear` for bf16/fp16/fp32, `_weight_int8pack_mm` for int8 weights with bf16
activations, `_int_mm` for the INT8 activation path. Experts run on a pool of worker threads, one group per
NUMA node pinned to that node's CPUs, each expert on the node that holds it.
"""

from __future__ import annotations

import bisect
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moefx.log import warn_once
from moefx.offload import cpu_kernel
from moefx.offload.hw import HostInfo, host_info

KERNEL_MAX_ROWS_PER_EXPERT = 8  # above this many rows per routed expert the GEMM is compute-bound: oneDNN


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel (last-but-one dim): w ~= q * scale[..., None]."""
    amax = w.float().abs().amax(dim=-1).clamp_min(1e-8)
    scale = amax / 127.0
    q = torch.round(w.float() / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per row: x ~= q * scale[:, None] (scale = amax / 127)."""
    scale = x.float().abs().amax(dim=-1).clamp_min(1e-8) / 127.0
    q = torch.round(x.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


@dataclass
class ExpertStore:
    """One layer's expert weights in host memory: float, or int8 with per-output-channel fp32 scales."""

    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    w13_scale: torch.Tensor | None = None  # [E, 2I]
    w2_scale: torch.Tensor | None = None  # [E, H]

    @property
    def int8(self) -> bool:
        return self.w13_scale is not None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def expert_bytes(self) -> int:
        scales = 0 if self.w13_scale is None else (self.w13_scale[0].nbytes + self.w2_scale[0].nbytes)
        return self.w13[0].nbytes + self.w2[0].nbytes + scales

    @classmethod
    def from_weights(cls, w13: torch.Tensor, w2: torch.Tensor, int8: bool) -> ExpertStore:
        if not int8:
            return cls(w13, w2)
        q13, s13 = quantize_per_channel(w13)
        q2, s2 = quantize_per_channel(w2)
        return cls(q13, q2, s13, s2)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.w13, self.w2, self.w13_scale, self.w2_scale) if t is not None]


def int8_impl(align: bool, vnni: bool) -> str:
    """Which int8 GEMM the INT8 activation path uses (MOEFX_OFFLOAD_INT8_VNNI and _INT8_ALIGN: docs/OFFLOAD.md)."""
    if vnni:
        return "vnni"  # torch._int_mm on the rows as they are
    if align:
        return "align"  # torch._int_mm on rows padded to a multiple of 8
    return "reference"  # integer-valued fp32 matmul: exact, slower; chosen only when both knobs are off


def _int8_gemm(q: torch.Tensor, wq: torch.Tensor, impl: str) -> torch.Tensor:
    """int8 [m, K] x int8 [N, K]^T -> int32-exact values as float32 [m, N]."""
    if impl == "reference":
        return q.float() @ wq.float().t()
    m = q.shape[0]
    if impl == "align" and m % 8:
        q = F.pad(q, (0, 0, 0, 8 - m % 8))
    try:
        return torch._int_mm(q, wq.t())[:m].float()
    except RuntimeError as exc:
        warn_once(f"moefx offload: torch._int_mm refused shape {tuple(q.shape)}x{tuple(wq.shape)} ({exc}); "
                  "using the exact integer-valued fp32 matmul for such shapes")
        return q[:m].float() @ wq.float().t()


def _int8_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, impl: str) -> torch.Tensor:
    """Per-token int8 activations x per-channel int8 weights, fp32 result."""
    q, s = quantize_per_token(x)
    return _int8_gemm(q, wq, impl) * s[:, None] * ws[None, :]


def _weight_only_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """Activations in their float dtype x int8 weights (decode with int8 weights)."""
    n, k = wq.shape
    if x.dtype in (torch.bfloat16, torch.float16, torch.float32) and n % 16 == 0 and k % 32 == 0:
        # _weight_int8pack_mm computes wrong results for K not a multiple of 16 (torch 2.13 CPU); guarded above.
        return torch.ops.aten._weight_int8pack_mm(x.contiguous(), wq, ws.to(x.dtype))
    return F.linear(x, (wq.to(torch.float32) * ws[:, None]).to(x.dtype))


@dataclass(frozen=True)
class CpuMath:
    """How one call computes: whether it takes the INT8 activation path, and with which int8 GEMM."""

    int8_activations: bool = False
    int8_impl: str = "align"
    host_kernel: bool = True  # small M through moefx's host kernel where it is available (False: torch ops only)
    prefetch_bytes: int = 0  # host kernel's software prefetch distance (measured per machine; 0 = none)


def expert_forward(store: ExpertStore, e: int, x: torch.Tensor, math: CpuMath) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for expert `e` on rows x [m, H]; result in x's dtype."""
    if not store.int8:
        gate_up = F.linear(x, store.w13[e])
        gate, up = gate_up.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, store.w2[e])
    if math.int8_activations:
        gate_up = _int8_linear(x, store.w13[e], store.w13_scale[e], math.int8_impl)
        gate, up = gate_up.chunk(2, dim=-1)
        return _int8_linear(F.silu(gate) * up, store.w2[e], store.w2_scale[e], math.int8_impl).to(x.dtype)
    gate_up = _weight_only_linear(x, store.w13[e], store.w13_scale[e])
    gate, up = gate_up.chunk(2, dim=-1)
    return _weight_only_linear(F.silu(gate) * up, store.w2[e], store.w2_scale[e])


def route(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """Pairs (token, slot) sorted by expert: (flat pair order, hit experts, their pair counts), host side."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]  # ids == E (EP padding) sort last, unused
    hit = torch.nonzero(counts).flatten()
    return order, hit.tolist(), counts[hit].tolist()


def numa_blocks(num_experts: int, nodes: int) -> list[int]:
    """Block boundaries: node b holds experts [bounds[b], bounds[b + 1])."""
    return [b * num_experts // nodes for b in range(nodes + 1)]


class ExpertPool:
    """Worker threads grouped per NUMA node, pinned to the node's CPUs, each running torch ops on a few threads.

    `workers_per_node == 1` on a single node runs inline on the caller's thread (no hand-off cost).
    """

    def __init__(self, host: HostInfo | None = None, workers_per_node: int = 1) -> None:
        self.host = host or host_info()
        self.workers_per_node = max(1, workers_per_node)
        self._groups: list[ThreadPoolExecutor] = []
        self._kernel_threads: list[ThreadPoolExecutor] = []
        if self.inline:
            return
        for cpus in self.host.numa_cpus:
            threads = max(1, len(cpus) // self.workers_per_node)
            self._groups.append(
                ThreadPoolExecutor(
                    self.workers_per_node,
                    thread_name_prefix="moefx-experts",
                    initializer=_pin_worker,
                    initargs=(cpus, threads),
                )
            )

    @property
    def inline(self) -> bool:
        return self.workers_per_node == 1 and self.host.numa_nodes == 1

    def describe(self) -> str:
        if self.inline:
            return f"inline, {torch.get_num_threads()} torch threads"
        per = [max(1, len(c) // self.workers_per_node) for c in self.host.numa_cpus]
        return f"{self.host.numa_nodes} node(s) x {self.workers_per_node} workers x {per[0]} threads"

    def home_node(self, expert: int, num_experts: int) -> int:
        """The NUMA node whose block (`numa_blocks`, as placed by `placement.to_host`) holds this expert."""
        return bisect.bisect_right(numa_blocks(num_experts, self.host.numa_nodes), expert) - 1

    def map(self, fn, items: list[tuple[int, int, int]], num_experts: int) -> list:
        """Run fn(item) for (expert, start, count) items; items are balanced by rows within each node."""
        if self.inline:
            return [fn(item) for item in items]
        futures = []
        for node, group in enumerate(self._groups):
            mine = [it for it in items if self.home_node(it[0], num_experts) == node]
            mine.sort(key=lambda it: -it[2])
            buckets: list[list[tuple[int, int, int]]] = [[] for _ in range(self.workers_per_node)]
            loads = [0] * self.workers_per_node
            for it in mine:
                j = loads.index(min(loads))
                buckets[j].append(it)
                loads[j] += it[2] + 1
            futures.extend(group.submit(_run_all, fn, b) for b in buckets if b)
        return [r for f in futures for r in f.result()]

    def per_node(self, fn, items: list[tuple[int, int, int]], num_experts: int, like: torch.Tensor) -> list:
        """fn(node's items, node's CPU count, a zeroed buffer like `like`) on each node's one kernel thread.

        One fixed thread per node calls the host kernel, so each node keeps a single OpenMP team (a team per
        calling thread would leave many teams spinning on the same cores)."""
        if not self._kernel_threads:
            self._kernel_threads = [
                ThreadPoolExecutor(1, thread_name_prefix="moefx-kernel", initializer=_pin_worker,
                                   initargs=(cpus, len(cpus)))
                for cpus in self.host.numa_cpus
            ]
        futures = []
        for node, worker in enumerate(self._kernel_threads):
            mine = [it for it in items if self.home_node(it[0], num_experts) == node]
            if mine:
                futures.append(worker.submit(fn, mine, len(self.host.numa_cpus[node]), torch.zeros_like(like)))
        return [f.result() for f in futures]

    def shutdown(self) -> None:
        for group in self._groups + self._kernel_threads:
            group.shutdown(wait=False)


def _run_all(fn, items: list) -> list:
    return [fn(it) for it in items]


def _pin_worker(cpus: tuple[int, ...], threads: int) -> None:
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)  # 0 = this thread on Linux
        except OSError:
            pass
    torch.set_num_threads(threads)


_local = threading.local()


def cpu_moe(
    store: ExpertStore,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    pool: ExpertPool | None = None,
    math: CpuMath = CpuMath(),
    routed: tuple[torch.Tensor, list[int], list[int]] | None = None,
    experts: set[int] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Expert sum for CPU tensors hidden [M, H], topk_ids/topk_weights [M, k]; [M, H] in out_dtype (hidden's).

    `routed` reuses a `route()` result; `experts` limits the sum to those experts (a partial sum, for splitting
    one call between the CPU and the GPU).
    """
    k = topk_ids.shape[1]
    order, hit, counts = routed if routed is not None else route(topk_ids, store.num_experts)
    tokens = order // k
    weights = topk_weights.reshape(-1)[order].float()
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    items = [it for it in zip(hit, starts, counts, strict=True) if experts is None or it[0] in experts]
    pool = pool or _default_pool()
    if kernel_reason(store, hidden.dtype, math, items) is None:
        out = _kernel_moe(store, hidden, tokens, weights, items, pool, math.prefetch_bytes)
        return out.to(out_dtype or hidden.dtype)

    def one(item: tuple[int, int, int]) -> tuple[int, int, torch.Tensor]:
        e, start, count = item
        tok = tokens[start : start + count]
        y = expert_forward(store, e, hidden[tok], math)
        return start, count, y.float() * weights[start : start + count, None]

    out = torch.zeros(hidden.shape[0], store.w2.shape[1], dtype=torch.float32)
    for start, count, y in pool.map(one, items, store.num_experts):
        out.index_add_(0, tokens[start : start + count], y)
    return out.to(out_dtype or hidden.dtype)


def kernel_reason(store: ExpertStore, act_dtype: torch.dtype, math: CpuMath, items: list) -> str | None:
    """Why this call does not run on the host kernel (None: it does)."""
    if not math.host_kernel:
        return "host kernel switched off for this call"
    if math.int8_activations:
        return "INT8 activation path"
    if not all(t.is_contiguous() for t in store.tensors()):
        return "expert weights are not contiguous (e.g. a transposed layout's views)"
    rows = sum(it[2] for it in items)
    if rows > KERNEL_MAX_ROWS_PER_EXPERT * max(1, len(items)):
        return f"{rows / len(items):.0f} rows per expert: compute-bound, oneDNN GEMMs"
    return cpu_kernel.unsupported(store.w13.dtype, act_dtype)


def _kernel_moe(
    store: ExpertStore,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    weights: torch.Tensor,
    items: list[tuple[int, int, int]],
    pool: ExpertPool,
    prefetch_bytes: int,
) -> torch.Tensor:
    """fp32 [M, H] expert sum of `items` on the host kernel: one call per NUMA node over the node's own experts."""
    x = hidden.float().contiguous()
    out = torch.zeros(hidden.shape[0], store.w2.shape[1], dtype=torch.float32)

    def node_call(node_items: list[tuple[int, int, int]], threads: int, dst: torch.Tensor) -> torch.Tensor:
        every_pair = sum(c for _, _, c in node_items) == len(tokens)  # items keep the expert-sorted pair order
        sel = slice(None) if every_pair else torch.cat([torch.arange(s, s + c) for _, s, c in node_items])
        cpu_kernel.moe_small_m(
            x, store.w13, store.w2, store.w13_scale, store.w2_scale, [it[0] for it in node_items],
            [it[2] for it in node_items], tokens[sel].to(torch.int32), weights[sel].contiguous(), dst,
            hidden.dtype, threads, prefetch_bytes,
        )
        return dst

    if not items:
        return out
    if pool.host.numa_nodes == 1:  # the caller's thread: its OpenMP team is torch's own, no second pool spinning
        return node_call(items, torch.get_num_threads(), out)
    for part in pool.per_node(node_call, items, store.num_experts, like=out):
        out += part
    return out


def _default_pool() -> ExpertPool:
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = ExpertPool(workers_per_node=1)
    return pool
