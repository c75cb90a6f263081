"""GPU prefill staging ring: tile planning, ping-pong slots, only routed experts copied (CPU logic; GPU copies)."""

import pytest
import torch

from moefx.backends import BACKENDS
from moefx.offload.cost import hits_every_expert
from moefx.offload.cpu_experts import ExpertStore, cpu_moe
from moefx.offload.staging import StagingRing, plan_tiles


def _case(m, e=10, h=32, i=16, k=2, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    ids = torch.randint(0, e - 2, (m, k), generator=g)  # the last two experts are never routed
    wts = torch.softmax(torch.randn(m, k, generator=g), -1)
    return x.to(device), ids.to(device), wts.to(device), w13, w2


def test_runs_coalesce_consecutive_experts():
    from moefx.offload.staging import runs

    assert runs([0, 1, 2, 5, 7, 8]) == [(0, 0, 3), (3, 5, 1), (4, 7, 2)]
    assert runs([]) == []


def test_plan_tiles_covers_pairs_in_order():
    tiles = plan_tiles([0, 2, 3, 7, 9], [4, 1, 2, 5, 3], tile_e=2)
    assert tiles == [([0, 2], 0, 5), ([3, 7], 5, 12), ([9], 12, 15)]


@pytest.mark.parametrize("tile_e", [1, 3, 96])
def test_ring_matches_cpu_path_and_copies_only_routed(tile_e):
    x, ids, wts, w13, w2 = _case(23, seed=tile_e)
    store = ExpertStore(w13, w2)
    ring = StagingRing(store, tile_e, torch.device("cpu"))
    assert ring.tile_e == min(tile_e, 10) and ring.nbytes == 2 * ring.tile_e * store.expert_bytes
    out = ring.run(store, x, ids, wts, BACKENDS["reference"])
    want = cpu_moe(store, x, ids, wts)
    assert ((out - want).norm() / want.norm()).item() <= 1e-6
    hit = torch.unique(ids).numel()
    assert ring.stats["experts_copied"] == hit <= 8
    assert ring.stats["tiles"] == -(-hit // ring.tile_e)
    assert ring.turn == ring.stats["tiles"]  # slots keep alternating across calls (layers)
    ring.run(store, x, ids, wts, BACKENDS["reference"])
    assert ring.turn == 2 * ring.stats["tiles"] // 2 and ring.stats["calls"] == 2


def test_hits_every_expert_from_the_uniform_routing_bound():
    assert not hits_every_expert(64, 8, 128) and hits_every_expert(100, 8, 128)  # 128 * (15/16)^M < 0.5 from M=86
    assert not hits_every_expert(85, 8, 128) and hits_every_expert(86, 8, 128)
    assert hits_every_expert(1, 8, 8)  # top_k = E: every expert is hit by any row


@pytest.mark.parametrize("tile_e", [1, 3, 96])
def test_every_expert_tiles_mask_other_pairs(tile_e):
    """The no-routing-sync path: all experts copied in fixed tiles, pairs of other tiles weighted 0; the sum is
    the reference's, and the experts copied with no routed token are counted."""
    x, ids, wts, w13, w2 = _case(23, seed=20 + tile_e)
    store = ExpertStore(w13, w2)
    ring = StagingRing(store, tile_e, torch.device("cpu"))
    out = ring._run_every_expert(store, x, ids, wts, BACKENDS["reference"])
    want = cpu_moe(store, x, ids, wts, out_dtype=torch.float32)
    assert ((out - want).norm() / want.norm()).item() <= 1e-6
    assert ring.stats["experts_copied"] == 10 and ring.stats["tiles"] == -(-10 // ring.tile_e)
    assert ring.unrouted_copies() == 10 - torch.unique(ids).numel() >= 2


def test_ring_int8_store_dequantizes_tiles():
    x, ids, wts, w13, w2 = _case(9, seed=5)
    store = ExpertStore.from_weights(w13, w2, int8=True)
    ring = StagingRing(store, 4, torch.device("cpu"))
    out = ring.run(store, x, ids, wts, BACKENDS["reference"])
    want = BACKENDS["reference"](x, ids, wts, w13, w2)
    assert ((out - want).norm() / want.norm()).item() <= 3e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real H2D copies on a copy stream need a GPU")
def test_ring_real_copies_on_gpu():
    x, ids, wts, w13, w2 = _case(300, e=40, seed=7, device="cuda")
    store = ExpertStore(w13.pin_memory(), w2.pin_memory())
    ring = StagingRing(store, 8, torch.device("cuda"))
    want = BACKENDS["reference"](x, ids, wts, w13.cuda(), w2.cuda())
    for _ in range(3):  # several calls chain the slot events across "layers"
        out = ring.run(store, x, ids, wts, BACKENDS["reference"])
    torch.cuda.synchronize()
    assert ((out - want).norm() / want.norm()).item() <= 1e-5
    assert ring.stats["calls_without_routing"] == 3 and ring.unrouted_copies() == 3 * 2  # 300 rows hit all 40
    few = x[:8], ids[:8], wts[:8]  # 8 rows do not: routed experts only, after a routing sync
    out = ring.run(store, *few, BACKENDS["reference"])
    want = BACKENDS["reference"](*few, w13.cuda(), w2.cuda())
    assert ring.stats["calls_without_routing"] == 3 and ((out - want).norm() / want.norm()).item() <= 1e-5


def _hybrid_experts(w13: torch.Tensor, w2: torch.Tensor):
    """An offloaded layer on CPU tensors with a ring and rates that make the cost model split calls."""
    from moefx.backends import BACKENDS
    from moefx.offload.cost import Geometry, MachineRates
    from moefx.offload.transform import OffloadedExperts, OffloadRuntime

    store = ExpertStore(w13, w2)
    rt = OffloadRuntime(torch.device("cpu"), torch.float32, False, 160, "align", BACKENDS)
    rt.ring = StagingRing(store, 2, torch.device("cpu"))
    rt.geom = Geometry(w13.shape[0], 2, w13.shape[2], w2.shape[2], store.expert_bytes, act_bytes=4)
    rt.rates = MachineRates(cpu_gbps=50.0, cpu_tflops=1.0, h2d_gbps=50.0, gpu_tflops=100.0)
    rt.switch_tokens = 100
    return OffloadedExperts(store, rt)


def test_hybrid_split_cpu_and_ring_sum_to_reference():
    """Below the switch point one call is split: some experts streamed through the ring, the rest on the CPU."""
    x, ids, wts, w13, w2 = _case(6, e=10, seed=11)
    experts = _hybrid_experts(w13, w2)
    rt = experts.rt
    want = BACKENDS["reference"](x, ids, wts, w13, w2)
    out = experts(x, ids, wts)
    hit = torch.unique(ids).numel()
    assert 0 < rt.ring.stats["experts_copied"] < hit  # both sides got work
    assert ((out - want).norm() / want.norm()).item() <= 1e-6
    rt.switch_tokens = 6  # from the switch point every routed expert streams
    copied = rt.ring.stats["experts_copied"]
    out = experts(x, ids, wts)
    assert rt.ring.stats["experts_copied"] - copied == hit
    assert ((out - want).norm() / want.norm()).item() <= 1e-6


def test_to_host_numa_blocks_copy_and_keep_values():
    from moefx.offload.hw import HostInfo
    from moefx.offload.placement import to_host

    w = torch.randn(6, 4, 8)
    two_nodes = HostInfo(isa=(), numa_cpus=((0,), (0,)), source="test")
    out, how = to_host(w, two_nodes, pin=False)
    assert torch.equal(out, w) and out.data_ptr() != w.data_ptr() and "NUMA blocks over 2 nodes" in how
    one_node = HostInfo(isa=(), numa_cpus=((0,),), source="test")
    same, how = to_host(w, one_node, pin=False)
    assert same.data_ptr() == w.data_ptr() and "single NUMA node" in how  # one copy: no duplicate made


def test_measured_split_start_keeps_small_calls_on_the_cpu():
    """The split start is measured end to end; below it a call never touches the ring and is still exact."""
    from moefx.offload.transform import SPLIT_PROBE_TOKENS, measure_split_start

    x, ids, wts, w13, w2 = _case(6, e=10, seed=12)
    experts = _hybrid_experts(w13, w2)
    rt = experts.rt
    start, note = measure_split_start(experts, 2)
    assert start in (*SPLIT_PROBE_TOKENS, 2 * SPLIT_PROBE_TOKENS[-1]) and f"CPU alone below M={start}" in note
    assert rt.split_min_tokens == 1  # measuring leaves the runtime as it was
    rt.split_min_tokens = 7
    copied = rt.ring.stats["experts_copied"]
    out = experts(x, ids, wts)
    assert rt.ring.stats["experts_copied"] == copied
    want = BACKENDS["reference"](x, ids, wts, w13, w2)
    assert ((out - want).norm() / want.norm()).item() <= 1e-6
    rt.split_min_tokens = 6
    experts(x, ids, wts)
    assert rt.ring.stats["experts_copied"] > copied  # from the start on, the model splits again
