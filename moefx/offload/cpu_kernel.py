"""The host expert kernel (csrc/moe_cpu.cpp): built once per machine with the system C++ compiler, loaded by ctypes.

Small-M calls are DRAM-bound; torch's per-expert `linear` calls leave most of the host's bandwidth unused (one
oneDNN GEMV per matrix, each too small to fill every core). The kernel reads each routed expert's rows once for
all of its tokens with every core at once. It is built with `-march=native` into
$XDG_CACHE_HOME/moefx/cpu_kernels/<hash of source, compiler, flags and CPU> and linked against the OpenMP runtime
torch already loaded, so both share one thread pool. No compiler, a failed build or an unsupported dtype → the
torch path, with the reason in the plan.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from moefx.log import get_logger
from moefx.machine import cache_dir, cpu_flags, cpu_model

log = get_logger("moefx.offload.cpu_kernel")

SOURCE = Path(__file__).parent / "csrc" / "moe_cpu.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
WEIGHT_FORMATS = {torch.bfloat16: 0, torch.float32: 1, torch.int8: 2}
ROUNDING = {torch.bfloat16: True, torch.float32: False}  # activation dtype -> round like bf16 PyTorch ops
_build_lock = threading.Lock()


@dataclass(frozen=True)
class KernelStatus:
    lib: ctypes.CDLL | None
    detail: str  # what was built (lanes, path) or why not
    tag: str = "none"  # build hash: part of the offload rate cache key, so a new kernel is measured again

    @property
    def ok(self) -> bool:
        return self.lib is not None


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(cxx: str, target: Path, flags: tuple[str, ...] = FLAGS) -> None:
    """Compile the kernel into `target` (tests build other -march variants to cover every vector path)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_so = Path(tmp) / target.name
        proc = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(tmp_so)], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[-800:]}")
        os.replace(tmp_so, target)  # atomic: a concurrent loader sees the whole file or none


def load(path: Path) -> ctypes.CDLL:
    """Open a built kernel and declare its C signatures."""
    lib = ctypes.CDLL(str(path))
    lib.moefx_cpu_lanes.restype = ctypes.c_int32
    fn = lib.moefx_moe_small_m
    fn.restype = ctypes.c_int32
    fn.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 4,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int64]
    return lib


@lru_cache(maxsize=1)
def kernel() -> KernelStatus:
    """Build (first use on a machine) and load the kernel; the status says why when it is not available."""
    if platform.system() != "Linux":
        return KernelStatus(None, f"host kernel is built on Linux only (this is {platform.system()})")
    cxx = _compiler()
    if cxx is None:
        return KernelStatus(None, "no C++ compiler (g++/c++/clang++ or $CXX) to build the host kernel")
    cpu = cpu_model() + " ".join(sorted(cpu_flags()))  # -march=native code is only valid for this CPU
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _version(cxx).encode() + cpu.encode())
    key = key.hexdigest()[:16]
    target = cache_dir() / "cpu_kernels" / key / "libmoefx_cpu.so"
    try:
        with _build_lock:
            if not target.is_file():
                log.info("building the host expert kernel with %s into %s", cxx, target)
                build(cxx, target)
        lib = load(target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return KernelStatus(None, f"host kernel build/load failed: {exc}")
    lanes = lib.moefx_cpu_lanes()
    return KernelStatus(lib, f"{lanes}-lane fp32 FMA ({'scalar' if lanes == 1 else f'{lanes * 32}-bit'}), "
                             f"built at {target}", key)


def unsupported(weight_dtype: torch.dtype, act_dtype: torch.dtype) -> str | None:
    """Why the kernel cannot compute these weights/activations, or None."""
    if weight_dtype not in WEIGHT_FORMATS:
        return f"weights in {weight_dtype} (the host kernel reads bf16, fp32 or int8)"
    if act_dtype not in ROUNDING:
        return f"activations in {act_dtype} (the host kernel follows bf16 or fp32 numerics)"
    if weight_dtype == torch.float32 and act_dtype != torch.float32:
        return "fp32 weights with lower-precision activations"
    status = kernel()
    return None if status.ok else status.detail


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def moe_small_m(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    s13: torch.Tensor | None,
    s2: torch.Tensor | None,
    experts: list[int],
    counts: list[int],
    pair_token: torch.Tensor,
    pair_weight: torch.Tensor,
    out: torch.Tensor,
    act_dtype: torch.dtype,
    threads: int,
    prefetch_bytes: int = 0,
    lib: ctypes.CDLL | None = None,
) -> None:
    """out [M, H] fp32 += the expert sum over the given pairs (grouped by expert, `counts` per expert).

    x is fp32 [M, H] contiguous; pair_token int32 and pair_weight fp32 have sum(counts) entries; weights are the
    full stores (w13 [E, 2I, H], w2 [E, H, I], contiguous) so no expert is copied. `prefetch_bytes` > 0: software
    prefetch that far ahead of the weight stream (the best distance is measured per machine with the offload rates).
    """
    lib = lib or kernel().lib
    assert lib is not None and x.dtype == torch.float32 and out.dtype == torch.float32
    if not experts:
        return
    _, two_i, h = w13.shape
    inter = two_i // 2
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    experts_t = torch.tensor(experts, dtype=torch.int32)
    starts_t = torch.tensor(starts, dtype=torch.int32)
    act = torch.empty(starts[-1], inter, dtype=torch.float32)
    rc = lib.moefx_moe_small_m(
        WEIGHT_FORMATS[w13.dtype], x.data_ptr(), h, inter, w13.data_ptr(), w2.data_ptr(), _ptr(s13), _ptr(s2),
        experts_t.data_ptr(), starts_t.data_ptr(), len(experts), pair_token.data_ptr(), pair_weight.data_ptr(),
        act.data_ptr(), out.data_ptr(), int(ROUNDING[act_dtype]), max(1, threads), prefetch_bytes,
    )
    if rc != 0:
        raise RuntimeError(f"moefx host kernel returned {rc} for weights in {w13.dtype}")
