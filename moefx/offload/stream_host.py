"""Decode-size expert calls queued on the GPU stream as host functions, with no host sync per layer.

The synchronous path waits for the GPU at every layer (the router's choice has to reach the host), so the GPU
idles while the host computes and the host idles while Python queues the next layer's GPU work. Here one call
queues, in stream order: device-to-host copies of (hidden, top-k ids, top-k weights) into pinned buffers, a host
function (the driver's `cuLaunchHostFunc`) that routes and runs the host kernel on them, and the host-to-device
copy of its result. The Python thread returns at once and queues the next layers while the host computes, and a
CUDA graph can capture the sequence (a host function is a graph node). Calls on one stream run one after
another, so one set of buffers serves every layer.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from moefx.offload import cpu_kernel
from moefx.offload.cpu_experts import ExpertStore


class HostJob(ctypes.Structure):
    """Mirror of `HostJob` in csrc/moe_cpu.cpp (its size is checked against the built library)."""

    _fields_ = [
        *[(name, ctypes.c_int32) for name in (
            "weight_format", "act_bf16", "ids_int64", "wts_bf16", "threads", "m", "top_k", "status")],
        *[(name, ctypes.c_int64) for name in ("H", "I", "E", "prefetch")],
        *[(name, ctypes.c_void_p) for name in (
            "w13", "w2", "s13", "s2", "x_in", "ids", "wts", "y_out", "x32", "act", "out32", "pair_weight",
            "experts", "starts", "pair_token")],
    ]


@lru_cache(maxsize=1)
def host_func_launcher() -> tuple[ctypes._CFuncPtr | None, str]:
    """The driver's cuLaunchHostFunc (one per process, so it takes torch's streams as they are), or why not."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        fn = driver.cuLaunchHostFunc
    except (OSError, AttributeError) as exc:
        return None, f"no CUDA driver entry point cuLaunchHostFunc ({exc})"
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return fn, "cuLaunchHostFunc"


def job_library() -> tuple[ctypes.CDLL | None, str]:
    """The host kernel library with its job entry point checked against `HostJob`, or why it cannot be used."""
    status = cpu_kernel.kernel()
    if not status.ok:
        return None, status.detail
    lib = status.lib
    lib.moefx_host_job_size.restype = ctypes.c_int64
    size = lib.moefx_host_job_size()
    if size != ctypes.sizeof(HostJob):
        return None, f"host job layout mismatch (library {size} bytes, Python {ctypes.sizeof(HostJob)})"
    return lib, "ok"


def run_job(lib: ctypes.CDLL, job: HostJob) -> None:
    """Run a job on this thread (what the stream's host function does; tests call it directly)."""
    lib.moefx_host_job(ctypes.byref(job))
    if job.status:
        raise RuntimeError(f"moefx host job failed with status {job.status} (weight format {job.weight_format})")


class StreamHost:
    """Pinned input/output buffers and scratch for calls of up to `max_tokens` rows, and one job per (layer, M,
    index and weight dtypes), kept alive as long as this object because a captured graph may replay them."""

    def __init__(self, lib: ctypes.CDLL, launch, store: ExpertStore, act_dtype: torch.dtype, top_k: int,
                 max_tokens: int, threads: int, prefetch_bytes: int, pin: bool = True) -> None:
        self.lib, self.launch = lib, launch
        self._host_fn = ctypes.cast(lib.moefx_host_job, ctypes.c_void_p)  # the CUhostFn every call queues
        self.act_dtype, self.top_k, self.max_tokens = act_dtype, top_k, max_tokens
        self.threads, self.prefetch_bytes = threads, prefetch_bytes
        self.pin = pin
        e, two_i, h = store.w13.shape
        self.num_experts, self.hidden, self.inter = e, h, two_i // 2
        pairs = max_tokens * top_k
        self.x_in = self._buffer((max_tokens, h), act_dtype)
        self.y_out = self._buffer((max_tokens, h), act_dtype)
        self.index: dict[torch.dtype, torch.Tensor] = {}
        self.scratch = {
            "x32": torch.empty(max_tokens * h), "out32": torch.empty(max_tokens * h),
            "act": torch.empty(pairs * self.inter), "pair_weight": torch.empty(pairs),
            "pair_token": torch.empty(pairs, dtype=torch.int32), "experts": torch.empty(e, dtype=torch.int32),
            "starts": torch.empty(e + 1, dtype=torch.int32),
        }
        self._jobs: dict[tuple, HostJob] = {}
        self._store_reason: dict[int, str | None] = {}
        self._stream: torch.cuda.Stream | None = None

    def set_threads(self, threads: int) -> None:
        """Host kernel threads of every job from now on (jobs are updated in place: a captured graph keeps them)."""
        self.threads = threads
        for job in self._jobs.values():
            job.threads = threads

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin)

    def _index_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """Pinned [max_tokens, top_k] buffer for the ids or weights in their own dtype (no conversion kernel)."""
        if dtype not in self.index:
            self.index[dtype] = self._buffer((self.max_tokens, self.top_k), dtype)
        return self.index[dtype]

    def job(self, store: ExpertStore, m: int, ids_dtype: torch.dtype, wts_dtype: torch.dtype) -> HostJob:
        key = (id(store), m, ids_dtype, wts_dtype)
        job = self._jobs.get(key)
        if job is None:
            job = self._jobs[key] = self._make_job(store, m, ids_dtype, wts_dtype)
        return job

    def _make_job(self, store: ExpertStore, m: int, ids_dtype: torch.dtype, wts_dtype: torch.dtype) -> HostJob:
        ptr = {k: v.data_ptr() for k, v in self.scratch.items()}
        s13, s2 = (None if t is None else t.data_ptr() for t in (store.w13_scale, store.w2_scale))
        return HostJob(
            weight_format=cpu_kernel.WEIGHT_FORMATS[store.w13.dtype], act_bf16=int(self.act_dtype == torch.bfloat16),
            ids_int64=int(ids_dtype == torch.int64), wts_bf16=int(wts_dtype == torch.bfloat16),
            threads=self.threads, m=m, top_k=self.top_k, status=0, H=self.hidden, I=self.inter, E=self.num_experts,
            prefetch=self.prefetch_bytes, w13=store.w13.data_ptr(), w2=store.w2.data_ptr(),
            s13=s13, s2=s2,
            x_in=self.x_in.data_ptr(), ids=self._index_buffer(ids_dtype).data_ptr(),
            wts=self._index_buffer(wts_dtype).data_ptr(), y_out=self.y_out.data_ptr(), **ptr,
        )

    def unsupported(self, store: ExpertStore, hidden: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> str | None:
        """Why this call cannot be queued (None: it can)."""
        if id(store) not in self._store_reason:
            self._store_reason[id(store)] = store_reason(store, self.act_dtype) or (
                None if store.w13.shape == (self.num_experts, 2 * self.inter, self.hidden) else "expert shapes differ")
        if self._store_reason[id(store)]:
            return self._store_reason[id(store)]
        m = hidden.shape[0]
        if m > self.max_tokens:
            return f"{m} rows > {self.max_tokens}"
        if hidden.dtype != self.act_dtype:
            return f"activations {hidden.dtype} (buffers are {self.act_dtype})"
        if ids.dtype not in (torch.int64, torch.int32) or wts.dtype not in (torch.float32, torch.bfloat16):
            return f"top-k ids {ids.dtype} / weights {wts.dtype} (int64|int32 / float32|bfloat16 are queued)"
        if tuple(ids.shape) != (m, self.top_k) or tuple(wts.shape) != (m, self.top_k):
            return f"top-k shapes {tuple(ids.shape)} / {tuple(wts.shape)} are not ({m}, {self.top_k})"
        return None

    def __call__(self, store: ExpertStore, hidden: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        """Queue one call on the current stream; the returned tensor holds the expert sum once the stream gets
        there (stream order: anything queued after this call sees it)."""
        m = hidden.shape[0]
        stream = torch.cuda.current_stream(hidden.device)
        if self._stream is not None and self._stream != stream and not torch.cuda.is_current_stream_capturing():
            stream.wait_stream(self._stream)  # the buffers are shared: the other stream's last call comes first
        self._stream = stream
        job = self.job(store, m, ids.dtype, wts.dtype)
        self.x_in[:m].copy_(hidden, non_blocking=True)
        self._index_buffer(ids.dtype)[:m].copy_(ids, non_blocking=True)
        self._index_buffer(wts.dtype)[:m].copy_(wts, non_blocking=True)
        rc = self.launch(stream.cuda_stream, self._host_fn, ctypes.addressof(job))
        if rc != 0:
            raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {rc}")
        out = torch.empty((m, self.hidden), dtype=hidden.dtype, device=hidden.device)
        out.copy_(self.y_out[:m], non_blocking=True)
        return out


def store_reason(store: ExpertStore, act_dtype: torch.dtype) -> str | None:
    """Why the host kernel cannot run these experts with these activations (None: it can)."""
    if not all(t.is_contiguous() for t in store.tensors()):
        return "expert weights are not contiguous"
    return cpu_kernel.unsupported(store.w13.dtype, act_dtype)


def build_stream_host(store: ExpertStore, act_dtype: torch.dtype, top_k: int, max_tokens: int, threads: int,
                      prefetch_bytes: int, numa_nodes: int) -> tuple[StreamHost | None, str]:
    """A StreamHost for these experts, or None and why the synchronous path stays."""
    if numa_nodes != 1:
        return None, f"{numa_nodes} NUMA nodes (the per-node kernel threads are driven synchronously)"
    reason = store_reason(store, act_dtype)
    if reason is not None:
        return None, reason
    launch, how = host_func_launcher()
    if launch is None:
        return None, how
    lib, how = job_library()
    if lib is None:
        return None, how
    return StreamHost(lib, launch, store, act_dtype, top_k, max_tokens, threads, prefetch_bytes), "ok"
