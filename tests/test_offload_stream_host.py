"""Decode calls queued on the GPU stream (moefx/offload/stream_host.py): the host job against the synchronous
kernel path (bit for bit, the job runs directly on the CPU here), the fail-closed reasons, and on a GPU the
queued call, with and without CUDA-graph capture."""

from __future__ import annotations

import ctypes

import pytest
import torch

from moefx.offload import cpu_kernel
from moefx.offload.cpu_experts import ExpertStore, cpu_moe
from moefx.offload.stream_host import HostJob, StreamHost, build_stream_host, job_library, run_job

needs_kernel = pytest.mark.skipif(not cpu_kernel.kernel().ok, reason=cpu_kernel.kernel().detail)
E, H, INTER, K = 16, 64, 48, 4


def store_of(kind: str, seed: int = 0) -> tuple[ExpertStore, torch.dtype]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, INTER, generator=gen) / INTER**0.5
    if kind == "int8":
        return ExpertStore.from_weights(w13, w2, int8=True), torch.bfloat16
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[kind]
    return ExpertStore(w13.to(dtype), w2.to(dtype)), dtype


def host_for(store: ExpertStore, act: torch.dtype, max_tokens: int = 8) -> StreamHost:
    lib, how = job_library()
    assert lib is not None, how
    return StreamHost(lib, None, store, act, K, max_tokens, threads=2, prefetch_bytes=0, pin=False)


@needs_kernel
def test_job_layout_matches_the_library():
    lib, how = job_library()
    assert how == "ok" and lib.moefx_host_job_size() == ctypes.sizeof(HostJob)


@needs_kernel
@pytest.mark.parametrize("kind", ["bf16", "fp32", "int8"])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("index_dtypes", [(torch.int64, torch.bfloat16), (torch.int32, torch.float32)])
def test_job_equals_the_synchronous_kernel_path(kind, m, index_dtypes):
    """Same routing order, same sums: the queued result is bitwise the synchronous one (repeated and padding ids
    included: an id equal to E is ignored on both paths)."""
    store, act = store_of(kind)
    host = host_for(store, act)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, H, generator=gen).to(act)
    ids = torch.randint(0, E, (m, K), generator=gen)
    ids[0, 1] = ids[0, 0]
    ids[-1, -1] = E
    w = torch.rand(m, K, generator=gen)
    ids, w = ids.to(index_dtypes[0]), w.to(index_dtypes[1])
    want = cpu_moe(store, x, ids.long(), w)
    host.x_in[:m].copy_(x)
    host._index_buffer(ids.dtype)[:m].copy_(ids)
    host._index_buffer(w.dtype)[:m].copy_(w)
    run_job(host.lib, host.job(store, m, ids.dtype, w.dtype))
    got = host.y_out[:m]
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    assert got.abs().sum() > 0


@needs_kernel
def test_jobs_are_kept_and_thread_changes_reach_them():
    store, act = store_of("bf16")
    host = host_for(store, act)
    job = host.job(store, 2, torch.int64, torch.float32)
    assert host.job(store, 2, torch.int64, torch.float32) is job
    host.set_threads(1)
    assert job.threads == 1 and host.job(store, 3, torch.int64, torch.float32).threads == 1


@needs_kernel
def test_unsupported_calls_say_why():
    store, act = store_of("bf16")
    host = host_for(store, act, max_tokens=4)
    x, ids, w = torch.zeros(2, H, dtype=act), torch.zeros(2, K, dtype=torch.long), torch.zeros(2, K)
    assert host.unsupported(store, x, ids, w) is None
    assert "rows > 4" in host.unsupported(store, torch.zeros(5, H, dtype=act), ids, w)
    assert "activations torch.float32" in host.unsupported(store, x.float(), ids, w)
    assert "int64|int32" in host.unsupported(store, x, ids.to(torch.int16), w)
    assert "are not (2, 4)" in host.unsupported(store, x, ids[:, :2], w[:, :2])
    other, _ = store_of("fp32")
    assert "fp32 weights with lower-precision activations" in host.unsupported(other, x, ids, w)
    transposed = ExpertStore(store.w13.transpose(1, 2).contiguous().transpose(1, 2), store.w2)
    assert "not contiguous" in host.unsupported(transposed, x, ids, w)


def test_build_fails_closed_with_a_reason():
    store, act = store_of("bf16")
    host, why = build_stream_host(store, act, K, 8, 2, 0, numa_nodes=2)
    assert host is None and "2 NUMA nodes" in why
    host, why = build_stream_host(store, torch.float16, K, 8, 2, 0, numa_nodes=1)
    assert host is None and "float16" in why


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="host functions on a CUDA stream need a GPU")
@needs_kernel
def test_queued_call_on_gpu_matches_and_captures():
    """Queued on the stream = the synchronous kernel path, eager and replayed from a captured CUDA graph."""
    store, act = store_of("bf16")
    store = ExpertStore(store.w13.pin_memory(), store.w2.pin_memory())
    host, why = build_stream_host(store, act, K, 8, 2, 0, numa_nodes=1)
    assert host is not None, why
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, H, generator=gen).to(act)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(4)])
    w = torch.rand(4, K, generator=gen)
    want = cpu_moe(store, x, ids, w)
    xd, idsd, wd = x.cuda(), ids.cuda(), w.cuda()
    got = host(store, xd, idsd, wd)
    assert torch.equal(got.cpu(), want)
    static = [xd.clone(), idsd.clone(), wd.clone()]
    host(store, *static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = host(store, *static) * 2
    x2 = torch.randn(4, H, generator=gen).to(act)
    static[0].copy_(x2.cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.cpu(), cpu_moe(store, x2, ids, w) * 2)
