"""moefx's host expert kernel (moefx/offload/csrc/moe_cpu.cpp) against the torch path and `reference`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from moefx.backends.reference import ReferenceBackend
from moefx.offload import cpu_kernel
from moefx.offload.cpu_experts import (
    KERNEL_MAX_ROWS_PER_EXPERT,
    CpuMath,
    ExpertPool,
    ExpertStore,
    cpu_moe,
    kernel_reason,
    route,
)
from moefx.offload.hw import HostInfo

needs_kernel = pytest.mark.skipif(not cpu_kernel.kernel().ok, reason=cpu_kernel.kernel().detail)


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def problem(e: int, h: int, inter: int, m: int, k: int, dtype: torch.dtype, seed: int, one_expert: bool = False):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=gen) / inter**0.5).to(dtype)
    x = torch.randn(m, h, generator=gen).to(dtype)
    if one_expert:
        ids = torch.zeros(m, 1, dtype=torch.long)
        k = 1
    else:
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)])
    w = torch.rand(m, k, generator=gen)
    return x, ids, w / w.sum(-1, keepdim=True), w13, w2


def dequantized(store: ExpertStore) -> tuple[torch.Tensor, torch.Tensor]:
    return store.w13.float() * store.w13_scale[..., None], store.w2.float() * store.w2_scale[..., None]


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """Counts host kernel calls, so a test proves the kernel (not the torch path) produced its result."""
    calls: list[int] = []
    real = cpu_kernel.moe_small_m

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernel, "moe_small_m", spy)
    return calls


# (dtype, int8 weights) -> bound on ||kernel - reference|| / ||reference||. fp32 follows fp32 math (summation order
# only); bf16 rounds where the bf16 module rounds; int8 compares with the dequantized weights in fp32.
CASES = {(torch.float32, False): 1e-5, (torch.bfloat16, False): 1e-2, (torch.bfloat16, True): 1.5e-2,
         (torch.float32, True): 1e-5}


@needs_kernel
@pytest.mark.parametrize("dtype,int8", list(CASES))
@pytest.mark.parametrize("m", [1, 3, 8])
def test_kernel_matches_reference(dtype, int8, m, kernel_calls):
    # H and I not multiples of 16 exercise the scalar tails; M=8 with k=4 of 6 experts gives >4 rows per expert.
    x, ids, w, w13, w2 = problem(6, 72, 40, m, 4, dtype, seed=m)
    store = ExpertStore.from_weights(w13, w2, int8)
    out = cpu_moe(store, x, ids, w, math=CpuMath(host_kernel=True))
    assert kernel_calls == [1]
    if int8:
        d13, d2 = dequantized(store)
        ref = ReferenceBackend()(x.float(), ids, w, d13, d2)
    else:
        ref = ReferenceBackend()(x, ids, w, w13, w2)
    assert out.dtype == dtype
    assert relerr(out, ref) <= CASES[(dtype, int8)]
    torch_path = cpu_moe(store, x, ids, w, math=CpuMath(host_kernel=False))
    assert relerr(out, torch_path) <= CASES[(dtype, int8)]
    prefetched = cpu_moe(store, x, ids, w, math=CpuMath(prefetch_bytes=1024))  # prefetch never changes values
    assert torch.equal(prefetched, out)


@needs_kernel
def test_bf16_rounds_like_the_module(kernel_calls):
    """bf16 rounding at the module's points: far closer to torch's bf16 path than bf16 noise (~4e-3)."""
    x, ids, w, w13, w2 = problem(8, 64, 32, 1, 4, torch.bfloat16, seed=5)
    store = ExpertStore.from_weights(w13, w2, False)
    a = cpu_moe(store, x, ids, w, math=CpuMath(host_kernel=True))
    b = cpu_moe(store, x, ids, w, math=CpuMath(host_kernel=False))
    assert kernel_calls == [1]
    assert relerr(a, b) <= 1e-3


@needs_kernel
def test_all_tokens_on_one_expert_and_partial_sums():
    x, ids, w, w13, w2 = problem(4, 48, 24, 5, 1, torch.float32, seed=2, one_expert=True)
    store = ExpertStore.from_weights(w13, w2, False)
    out = cpu_moe(store, x, ids, w, math=CpuMath(host_kernel=True))
    assert relerr(out, ReferenceBackend()(x, ids, w, w13, w2)) <= 1e-5
    x, ids, w, w13, w2 = problem(6, 48, 24, 3, 3, torch.float32, seed=3)
    store = ExpertStore.from_weights(w13, w2, False)
    routed = route(ids, 6)
    half = set(routed[1][: len(routed[1]) // 2])
    part = cpu_moe(store, x, ids, w, routed=routed, experts=half, math=CpuMath(host_kernel=True))
    rest = cpu_moe(store, x, ids, w, routed=routed, experts=set(routed[1]) - half, math=CpuMath(host_kernel=True))
    assert relerr(part + rest, ReferenceBackend()(x, ids, w, w13, w2)) <= 1e-5
    assert relerr(part, ReferenceBackend()(x, ids, w, w13, w2)) > 1e-2  # a real partial sum, not everything


@needs_kernel
def test_numa_nodes_each_compute_their_block():
    x, ids, w, w13, w2 = problem(8, 64, 32, 2, 4, torch.float32, seed=4)
    store = ExpertStore.from_weights(w13, w2, False)
    host = HostInfo(isa=(), numa_cpus=((0,), (0,)), source="test")
    pool = ExpertPool(host, workers_per_node=1)
    try:
        out = cpu_moe(store, x, ids, w, pool, CpuMath(host_kernel=True))
    finally:
        pool.shutdown()
    assert not pool.inline
    assert relerr(out, ReferenceBackend()(x, ids, w, w13, w2)) <= 1e-5


def test_kernel_reason_fails_closed():
    x, ids, w, w13, w2 = problem(4, 32, 16, 2, 2, torch.float16, seed=6)
    store = ExpertStore.from_weights(w13, w2, False)
    assert "float16" in kernel_reason(store, torch.float16, CpuMath(), [(0, 0, 2)])
    assert "INT8 activation" in kernel_reason(store, torch.bfloat16, CpuMath(int8_activations=True), [(0, 0, 2)])
    assert kernel_reason(store, torch.bfloat16, CpuMath(host_kernel=False), [(0, 0, 2)]) is not None
    many = [(0, 0, 10 * KERNEL_MAX_ROWS_PER_EXPERT)]
    assert "compute-bound" in kernel_reason(store, torch.bfloat16, CpuMath(), many)
    # fp16 falls back to torch ops and is still right
    out = cpu_moe(store, x, ids, w, math=CpuMath(host_kernel=True))
    assert relerr(out, ReferenceBackend()(x.float(), ids, w, w13.float(), w2.float())) <= 2e-3


def test_non_contiguous_weights_take_the_torch_path(kernel_calls):
    """Transposed-layout views (what the `cpu` backend gets for transformers' is_transposed experts) are not
    the row-major layout the kernel reads: the torch path computes them."""
    x, ids, w, w13, w2 = problem(5, 48, 24, 3, 2, torch.float32, seed=8)
    column_major = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (w13, w2)]
    store = ExpertStore(*column_major)
    assert "contiguous" in kernel_reason(store, torch.float32, CpuMath(), [(0, 0, 2)])
    out = cpu_moe(store, x, ids, w, math=CpuMath(host_kernel=True))
    assert kernel_calls == []
    assert relerr(out, ReferenceBackend()(x, ids, w, w13, w2)) <= 1e-5


def test_no_compiler_is_reported(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "_compiler", lambda: None)
    cpu_kernel.kernel.cache_clear()
    try:
        status = cpu_kernel.kernel()
        assert not status.ok and "no C++ compiler" in status.detail
        assert "no C++ compiler" in cpu_kernel.unsupported(torch.bfloat16, torch.bfloat16)
    finally:
        monkeypatch.undo()
        cpu_kernel.kernel.cache_clear()


@needs_kernel
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"])
def test_other_vector_paths(tmp_path: Path, march: str):
    """The scalar (-march=x86-64) and AVX2 (x86-64-v3) builds agree with the torch path too."""
    if march == "x86-64-v3" and "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no AVX2 on this CPU")
    cxx = cpu_kernel._compiler()
    flags = tuple(f if not f.startswith("-march") else f"-march={march}" for f in cpu_kernel.FLAGS)
    target = tmp_path / "lib.so"
    cpu_kernel.build(cxx, target, flags)
    lib = cpu_kernel.load(target)
    assert lib.moefx_cpu_lanes() == (1 if march == "x86-64" else 8)
    x, ids, w, w13, w2 = problem(5, 40, 24, 3, 2, torch.bfloat16, seed=7)
    k = ids.shape[1]
    order, hit, counts = route(ids, 5)
    out = torch.zeros(3, 40)
    cpu_kernel.moe_small_m(x.float(), w13, w2, None, None, hit, counts, (order // k).to(torch.int32),
                           w.reshape(-1)[order].float().contiguous(), out, torch.bfloat16, 2, lib=lib)
    ref = ReferenceBackend()(x, ids, w, w13, w2)
    assert relerr(out, ref) <= 1e-2
    shutil.rmtree(tmp_path, ignore_errors=True)
