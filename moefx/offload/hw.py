"""Host facts the offload path depends on: CPU ISA (which dot-product instructions exist) and NUMA layout."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from moefx.machine import cpu_flags

# cpuinfo flag -> the name we report, in the order explain() shows them.
_ISA_FLAGS = (
    ("avx2", "avx2"),
    ("avx512f", "avx512"),
    ("avx512_vnni", "avx512_vnni"),
    ("avx_vnni", "avx_vnni"),
    ("avx512_bf16", "avx512_bf16"),
    ("avx512vbmi", "avx512_vbmi"),
    ("amx_bf16", "amx_bf16"),
    ("amx_int8", "amx_int8"),
)


@dataclass(frozen=True)
class HostInfo:
    isa: tuple[str, ...]
    numa_cpus: tuple[tuple[int, ...], ...]  # CPUs of each NUMA node this process may run on
    source: str

    @property
    def numa_nodes(self) -> int:
        return len(self.numa_cpus)

    @property
    def cpus(self) -> int:
        return sum(len(c) for c in self.numa_cpus)

    @property
    def has_bf16_dot(self) -> bool:
        """True when the CPU has native bf16 dot products (AVX512-BF16 or AMX), so bf16 GEMMs run at full rate."""
        return "avx512_bf16" in self.isa or "amx_bf16" in self.isa

    @property
    def has_int8_dot(self) -> bool:
        return any(f in self.isa for f in ("avx512_vnni", "avx_vnni", "amx_int8"))

    def describe(self) -> str:
        isa = ",".join(self.isa) if self.isa else "scalar"
        sizes = "+".join(str(len(c)) for c in self.numa_cpus)
        return f"isa={isa} numa_nodes={self.numa_nodes} cpus={sizes}"


def parse_isa(cpuinfo_flags: set[str]) -> tuple[str, ...]:
    return tuple(name for flag, name in _ISA_FLAGS if flag in cpuinfo_flags)


def _parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _numa_cpus(allowed: set[int]) -> tuple[tuple[int, ...], ...]:
    nodes = []
    root = Path("/sys/devices/system/node")
    for node in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = [c for c in _parse_cpulist((node / "cpulist").read_text()) if c in allowed]
        except (OSError, ValueError):
            continue
        if cpus:
            nodes.append(tuple(cpus))
    return tuple(nodes) or (tuple(sorted(allowed)),)


@lru_cache(maxsize=1)
def host_info() -> HostInfo:
    """Detect once per process. Reads ExecutionSignature-style facts from /proc and /sys (Linux)."""
    allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    flags = set(cpu_flags())
    source = "/proc/cpuinfo + /sys/devices/system/node" if flags else f"torch cpu capability only ({_capability()})"
    isa = parse_isa(flags) if flags else _isa_from_capability()
    return HostInfo(isa=isa, numa_cpus=_numa_cpus(allowed), source=source)


def _capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "unknown"


def _isa_from_capability() -> tuple[str, ...]:
    cap = _capability()
    if cap.startswith("AVX512"):
        return ("avx2", "avx512")
    return ("avx2",) if cap == "AVX2" else ()


def host_info_from_signature(es: Any) -> HostInfo:
    """Prefer ISA/NUMA fields on the ExecutionSignature when the signature carries them."""
    detected = host_info()
    isa = getattr(es, "cpu_isa", None)
    if not isa:
        return detected
    isa_t = tuple(isa.split(",")) if isinstance(isa, str) else tuple(isa)
    # The CPU lists per node are needed to place threads, so they always come from this host.
    return HostInfo(isa=isa_t, numa_cpus=detected.numa_cpus, source="ExecutionSignature (cpu_isa)")
