"""Put expert weights in host memory: one copy, NUMA-local per expert block, pinned in place for async H2D."""

from __future__ import annotations

import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from moefx.offload.cpu_experts import _pin_worker, numa_blocks
from moefx.offload.hw import HostInfo


def _first_touch_copy(src: torch.Tensor, host: HostInfo) -> torch.Tensor:
    """Copy into fresh host pages; with several NUMA nodes each node's threads write (first touch) its block."""
    out = torch.empty(src.shape, dtype=src.dtype, device="cpu")
    nodes = host.numa_nodes
    if nodes == 1 or src.shape[0] < nodes:
        out.copy_(src)
        return out
    bounds = numa_blocks(src.shape[0], nodes)
    blocks = list(zip(bounds[:-1], bounds[1:], strict=True))
    pools = [ThreadPoolExecutor(1, initializer=_pin_worker, initargs=(cpus, len(cpus))) for cpus in host.numa_cpus]
    try:
        futures = [p.submit(out[lo:hi].copy_, src[lo:hi]) for p, (lo, hi) in zip(pools, blocks, strict=True)]
        for f in futures:
            f.result()
    finally:
        for p in pools:
            p.shutdown()
    return out


def _register(t: torch.Tensor) -> str | None:
    """Page-lock `t` in place (cudaHostRegister) so copies from it are asynchronous; None on success."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        return f"cudaHostRegister failed with error {int(err)}"
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return None


def to_host(t: torch.Tensor, host: HostInfo, pin: bool) -> tuple[torch.Tensor, str]:
    """Host copy of expert tensor `t` ([E, ...]); returns (tensor, how it is held) for the plan."""
    needs_copy = t.device.type != "cpu" or not t.is_contiguous() or host.numa_nodes > 1
    out = _first_touch_copy(t.detach(), host) if needs_copy else t.detach()
    placement = f"NUMA blocks over {host.numa_nodes} nodes" if host.numa_nodes > 1 else "single NUMA node"
    if not pin:
        return out, f"pageable host memory, {placement}"
    if out.is_pinned():
        return out, f"pinned host memory, {placement}"
    reason = _register(out)
    if reason is None:
        return out, f"pinned in place (cudaHostRegister), {placement}"
    try:
        return out.pin_memory(), f"pinned copy ({reason}); NUMA placement not kept"
    except RuntimeError as exc:
        return out, f"pageable host memory ({reason}; pin_memory failed: {exc}); H2D copies are synchronous"
