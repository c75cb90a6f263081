"""CPU expert path vs the reference oracle: fp32 exact-ish, bf16, int8 weight-only and int8 activations."""

import pytest
import torch
from backends_util import unsupported

from moefx.backends import BACKENDS
from moefx.offload.cpu_experts import (
    CpuMath,
    ExpertPool,
    ExpertStore,
    cpu_moe,
    int8_impl,
    quantize_per_channel,
    route,
)
from moefx.offload.hw import HostInfo, parse_isa


def _case(m, e=8, h=64, i=32, k=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    wts = torch.softmax(torch.randn(m, k, generator=g), -1).to(dtype)
    return x, ids, wts, w13, w2


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("m", [1, 4, 37])
def test_fp32_matches_reference(m):
    x, ids, wts, w13, w2 = _case(m, seed=m)
    ref = BACKENDS["reference"](x, ids, wts, w13, w2)
    out = cpu_moe(ExpertStore(w13, w2), x, ids, wts)
    assert _rel(out, ref) <= 1e-6


@pytest.mark.parametrize("m", [1, 5, 40])
def test_bf16_matches_reference(m):
    x, ids, wts, w13, w2 = _case(m, dtype=torch.bfloat16, seed=10 + m)
    ref = BACKENDS["reference"](x.float(), ids, wts.float(), w13.float(), w2.float())
    out = cpu_moe(ExpertStore(w13, w2), x, ids, wts)
    assert out.dtype == torch.bfloat16
    assert _rel(out, ref) <= 2e-2  # bf16 inputs, rounded intermediates, fp32 accumulation of the expert sum


def test_multi_worker_pool_matches_inline():
    x, ids, wts, w13, w2 = _case(12, e=16, k=4, seed=3)
    store = ExpertStore(w13, w2)
    two_nodes = HostInfo(isa=(), numa_cpus=((0,), (0,)), source="test")
    pool = ExpertPool(two_nodes, workers_per_node=2)
    try:
        assert not pool.inline and {pool.home_node(e, 16) for e in range(16)} == {0, 1}
        out = cpu_moe(store, x, ids, wts, pool)
    finally:
        pool.shutdown()
    assert _rel(out, cpu_moe(store, x, ids, wts)) <= 1e-6


def test_route_skips_padding_sentinel():
    ids = torch.tensor([[0, 8], [3, 0]])  # 8 == E marks an expert-parallel padding slot
    order, hit, counts = route(ids, 8)
    assert hit == [0, 3] and counts == [2, 1]
    x, _, wts, w13, w2 = _case(2, seed=4)
    out = cpu_moe(ExpertStore(w13, w2), x, ids, wts)
    ref = BACKENDS["reference"](x, torch.tensor([[0, 3], [3, 0]]), wts * torch.tensor([[1.0, 0.0], [1.0, 1.0]]), w13,
                                w2)
    assert _rel(out, ref) <= 1e-6


def test_quantize_per_channel_roundtrip():
    w = torch.randn(3, 16, 64)
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (3, 16)
    assert _rel(q.float() * s[..., None], w) <= 1e-2


@pytest.mark.parametrize("impl", ["align", "vnni", "reference"])
@pytest.mark.parametrize("m", [3, 64])
def test_int8_activation_path(impl, m):
    """INT8: per-token int8 activations x per-channel int8 weights; bound 4e-2 relative vs the fp32 oracle."""
    x, ids, wts, w13, w2 = _case(m, seed=20 + m)
    store = ExpertStore.from_weights(w13, w2, int8=True)
    ref = BACKENDS["reference"](x, ids, wts, w13, w2)
    out = cpu_moe(store, x, ids, wts, math=CpuMath(int8_activations=True, int8_impl=impl))
    assert _rel(out, ref) <= 4e-2
    # The int8 GEMM itself is exact: every implementation gives the same numbers.
    same = cpu_moe(store, x, ids, wts, math=CpuMath(int8_activations=True, int8_impl="reference"))
    assert _rel(out, same) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weight_only_decode(dtype):
    """Int8 weights with float activations (M below INT8_VNNI_MIN_TOKENS); bound 3e-2 vs the fp32 oracle."""
    x, ids, wts, w13, w2 = _case(4, h=128, i=64, dtype=dtype, seed=7)
    store = ExpertStore.from_weights(w13, w2, int8=True)
    ref = BACKENDS["reference"](x.float(), ids, wts.float(), w13.float(), w2.float())
    assert _rel(cpu_moe(store, x, ids, wts), ref) <= 3e-2
    odd = ExpertStore.from_weights(*_case(4, h=40, i=24, seed=8)[3:], int8=True)  # K % 32 != 0: dequant path
    x2, ids2, wts2, w13b, w2b = _case(4, h=40, i=24, seed=8)
    assert _rel(cpu_moe(odd, x2, ids2, wts2), BACKENDS["reference"](x2, ids2, wts2, w13b, w2b)) <= 3e-2


def test_int8_impl_knobs():
    assert int8_impl(align=True, vnni=False) == "align"
    assert int8_impl(align=True, vnni=True) == "vnni"
    assert int8_impl(align=False, vnni=False) == "reference"


def test_cpu_backend_contract():
    x, ids, wts, w13, w2 = _case(6, seed=5)
    backend = BACKENDS["cpu"]
    assert unsupported(backend, x, w13, w2) is None
    assert "FP8" in unsupported(backend, x, w13, w2, w13_scale=torch.ones(1))
    assert _rel(backend(x, ids, wts, w13, w2), BACKENDS["reference"](x, ids, wts, w13, w2)) <= 1e-6


def test_isa_parsing():
    assert parse_isa({"avx2", "fma"}) == ("avx2",)
    isa = parse_isa({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"})
    host = HostInfo(isa=isa, numa_cpus=((0, 1), (2, 3)), source="test")
    assert host.has_bf16_dot and host.has_int8_dot and host.numa_nodes == 2 and host.cpus == 4
    assert "amx_int8" in host.describe() and "numa_nodes=2" in host.describe()
    assert not HostInfo(isa=("avx2",), numa_cpus=((0,),), source="t").has_bf16_dot


def test_home_node_matches_placement_blocks():
    from moefx.offload.cpu_experts import numa_blocks

    for e, nodes in ((6, 4), (128, 3), (8, 2), (5, 5)):
        host = HostInfo(isa=(), numa_cpus=tuple((0,) for _ in range(nodes)), source="t")
        pool = ExpertPool(host, 1)
        bounds = numa_blocks(e, nodes)
        for x in range(e):
            node = pool.home_node(x, e)
            assert bounds[node] <= x < bounds[node + 1]
        pool.shutdown()
