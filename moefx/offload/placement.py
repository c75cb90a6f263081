"""Put expert weights in host memory: one copy, NUMA-local per expert block, pinned in place for async H2D."""

from __future__ import annotations

import ctypes
import math
import platform
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from moefx.offload.cpu_experts import _pin_worker, numa_blocks
from moefx.offload.hw import HostInfo

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """An uninitialised host tensor on 2 MiB-aligned memory advised for transparent huge pages (before any page
    is touched), and whether the advice was taken. Huge pages spare the DMA engine and the CPU's page walks
    over tens of GiB of experts; where THP is off or madvise fails this is a plain allocation."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or platform.system() != "Linux":
        return torch.empty(shape, dtype=dtype), False
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    body = nbytes - nbytes % HUGE_PAGE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        advised = libc.madvise(ctypes.c_void_p(raw.data_ptr() + offset), ctypes.c_size_t(body), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        advised = False
    return raw[offset : offset + nbytes].view(dtype).view(shape), advised


def _first_touch_copy(src: torch.Tensor, host: HostInfo) -> torch.Tensor:
    """Copy into fresh (huge-page advised) host pages; with several NUMA nodes each node's threads write (first
    touch) its block."""
    out, _ = huge_page_empty(tuple(src.shape), src.dtype)
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
    needs_copy = t.device.type != "cpu" or not t.is_contiguous() or host.numa_nodes > 1 or pin  # pin: huge pages
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
