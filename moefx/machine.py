"""This machine's CPU identity, the memory it has free (host, and a device's for this process) and the folder where
moefx keeps per-machine results (rates, built kernels)."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Published properties of common GPUs, for planning on a machine that does not have them (ExecutionSignature.preset).
DEVICE_PRESETS: dict[str, dict[str, Any]] = {
    "h200": {"device_name": "NVIDIA H200", "capability": (9, 0), "multiprocessor_count": 132},
    "h100": {"device_name": "NVIDIA H100 80GB HBM3", "capability": (9, 0), "multiprocessor_count": 132},
    "a100": {"device_name": "NVIDIA A100-SXM4-80GB", "capability": (8, 0), "multiprocessor_count": 108},
    "l40s": {"device_name": "NVIDIA L40S", "capability": (8, 9), "multiprocessor_count": 142},
    "rtx4090": {"device_name": "NVIDIA GeForce RTX 4090", "capability": (8, 9), "multiprocessor_count": 128},
}


def _cpuinfo_line(prefix: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what `platform` knows."""
    return _cpuinfo_line("model name") or platform.processor() or platform.machine() or "unknown"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty elsewhere."""
    return frozenset((_cpuinfo_line("flags") or "").split())


def host_memory_available() -> int | None:
    """Bytes the host can still give (Linux /proc/meminfo MemAvailable), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def free_memory(device: torch.device | str) -> int:
    """Bytes that new tensors on `device` could still take in this process.

    CUDA: the driver's free memory plus what torch's caching allocator has reserved but holds no tensor in. The
    driver counts the allocator's cache as used, yet this process gets it back on its next allocations, so leaving it
    out would make the figure depend on what ran before (a compile, a freed model) rather than on what is in use.
    Any other device: the host's available memory (`host_memory_available`, else the free pages)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    available = host_memory_available()
    return available if available is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/moefx (default ~/.cache/moefx), read at each call so tests and users can redirect it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moefx"


def unwritable(path: Path) -> str | None:
    """Why a file cannot be written at `path` (None: it can), found by creating its folder and writing and deleting
    a probe beside it: a cache or table write then fails before the work it would keep, not after."""
    probe = path.with_name(f".{path.name}.{os.getpid()}.probe")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
        return f"{type(exc).__name__}: {exc}"
    return None
