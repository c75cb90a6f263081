"""Tensor parallelism on CPUs: 2 and 4 gloo ranks spawned once per world size (tests/tp_workers.py).

The models are sharded by their own transformers TP plan with `moefx.parallel.shard_model` (transformers'
`tp_plan="auto"` loader needs accelerate, not a dependency here; where accelerate is installed the same checks
also run on transformers' own sharding).
"""

from __future__ import annotations

import pytest
import torch
from tp_workers import COMPILE_ENV, NEW_TOKENS, PROMPT, spawn

from moefx.models import tiny_deepseek_v3_config, tiny_qwen3_moe_config

WORLDS = (2, 4)
FAMILIES = ("qwen3_moe", "deepseek_v3")
B, S = PROMPT
H = 64
FP32 = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache: dict[int, list[dict]] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            cache[world] = spawn(world, tmp_path_factory.mktemp(f"tp{world}"))
        return cache[world]

    return get


def _config(family: str):
    return tiny_qwen3_moe_config() if family == "qwen3_moe" else tiny_deepseek_v3_config()


def _all_reduces_per_forward(family: str) -> int:
    """Embedding + per layer: attention o_proj (qwen3; DeepSeek's MLA where its TP plan has it: transformers 5.25
    and later), the experts and the shared experts' down_proj (DeepSeek), or the dense MLP's down_proj (DeepSeek's
    first layers)."""
    cfg = _config(family)
    if family == "qwen3_moe":
        return 1 + 2 * cfg.num_hidden_layers
    from transformers import DeepseekV3Config

    attention = int("layers.*.self_attn.o_proj" in DeepseekV3Config.base_model_tp_plan)
    dense = cfg.first_k_dense_replace
    return 1 + dense + 2 * (cfg.num_hidden_layers - dense) + attention * cfg.num_hidden_layers


def _same_on_every_rank(results: list[dict], *path: str) -> object:
    values = []
    for res in results:
        for key in path:
            res = res[key]
        values.append(res)
    for v in values[1:]:
        assert _equal(v, values[0])
    return values[0]


def _equal(a: object, b: object) -> bool:
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


@pytest.mark.slow  # spawns 2- and 4-rank gloo process groups (tens of CPU-seconds)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_model_generates_the_unsharded_tokens(runs, world, family):
    results = runs(world)
    res = results[0][family]
    assert res["ref_greedy"].shape == (B, NEW_TOKENS)
    for key in ("greedy", "sampled", "loop"):
        _same_on_every_rank(results, family, key)
    assert torch.equal(res["greedy"], res["ref_greedy"])  # generate() on the sharded model == transformers unsharded
    assert torch.equal(res["loop"], res["ref_greedy"])  # greedy_step: the distributed greedy
    assert torch.equal(res["sampled"], res["ref_sampled"])  # sampling, same seed on every rank
    assert res["engine"] == dict(requests=2, fallbacks=[], head=True)  # both on moefx's engine, greedy by the head
    assert not torch.equal(res["sampled"], res["ref_greedy"])  # the sampling run really sampled
    cfg = _config(family)
    experts = cfg.num_experts if family == "qwen3_moe" else cfg.n_routed_experts
    # The moefx op ran, on this rank's slice of every expert.
    assert res["w13_shapes"] == {(experts, 2 * cfg.moe_intermediate_size // world, H)}


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_plan_shows_tp_and_per_rank_calibration_key(runs, world, family):
    results = runs(world)
    plan = results[0][family]["plan"]
    cfg = _config(family)
    experts = cfg.num_experts if family == "qwen3_moe" else cfg.n_routed_experts
    assert (plan["tp"], plan["ep"], plan["source"], plan["experts"]) == (world, 1, "moefx.parallel.shard_model", "tp")
    assert f"tp={world} ep=1" in plan["explain"]
    assert f"parallel tp = {world}, ep = 1  [moefx.parallel.shard_model]" in plan["explain"]
    assert f"E={experts} N={2 * cfg.moe_intermediate_size // world} K={H}" in plan["key"]
    assert f"per rank: E = {experts} / ep 1, N = 2 x {cfg.moe_intermediate_size} / tp {world}" in plan["key"]
    # The lookup found the row keyed at the per-rank shape (and nothing else could match it).
    assert plan["eager_source"] == f"{family}-tp.yaml#1"
    assert plan["head"] == "VocabParallelLMHead"
    assert any(line.startswith(f"vocab_parallel_lm_head: lm_head = vocab-parallel over tp {world}")
               for line in plan["provenance"])
    # The signature keeps the model's geometry, not the shard's; every rank plans alike.
    assert results[0][family]["signature"].moe_intermediate_size == cfg.moe_intermediate_size
    _same_on_every_rank(results, family, "plan", "fingerprint")


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_bytes_sent_per_decode_step(runs, world, family):
    res = runs(world)[0][family]
    vocab = _config(family).vocab_size
    for comm, head_bytes in ((res["greedy_comm"], B * 2 * FP32), (res["full_comm"], B * vocab // world * FP32)):
        reduces = [c for c in comm if c.op in ("all_reduce", "allreduce_")]
        gathers = [c for c in comm if c.op == "all_gather_into_tensor"]
        assert len(reduces) + len(gathers) == len(comm)
        assert len(reduces) == _all_reduces_per_forward(family)
        assert all(c.payload_bytes == B * H * FP32 for c in reduces)
        assert len(gathers) == 1 and gathers[0].payload_bytes == head_bytes
    pair = [c for c in res["greedy_comm"] if c.op == "all_gather_into_tensor"][0]
    assert (pair.shape, pair.dtype) == ((B, 2), "int32")  # 2 values per row


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_distributed_greedy_equals_full_argmax_on_adversarial_ties(runs, world):
    results = runs(world)
    ties = results[0]["ties"]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        got, expected = ties[f"crafted_{dtype}"]
        _same_on_every_rank(results, "ties", f"crafted_{dtype}")
        assert torch.equal(got, expected), dtype
    assert expected[1] == 15 and expected[3] == 0 and expected[5] == 17  # boundary tie, constant row, NaN
    head = ties["head"]
    assert head["logits_equal"]  # the gathered slices are the full logits, bit for bit
    assert torch.equal(head["greedy"], head["argmax_full"]) and torch.equal(head["argmax_tp"], head["argmax_full"])
    assert (head["greedy"][:3] == 3).all()  # rows 3 and 16 tie (two ranks): the lower index wins
    assert torch.equal(head["batched"], head["greedy"].view(2, 3))


@pytest.mark.slow
def test_expert_parallel_placement(runs):
    results = runs(2)
    res = results[0]["ep"]
    cfg = _config("qwen3_moe")
    assert torch.equal(res["greedy"], res["ref_greedy"]) and torch.equal(res["loop"], res["ref_greedy"])
    assert torch.equal(res["sampled"], res["ref_sampled"])
    assert res["w13_shapes"] == {(cfg.num_experts // 2, 2 * cfg.moe_intermediate_size, H)}
    plan = res["plan"]
    assert (plan["tp"], plan["ep"], plan["experts"]) == (2, 2, "ep")
    assert f"E={cfg.num_experts // 2} N={2 * cfg.moe_intermediate_size} K={H}" in plan["key"]
    assert plan["eager_source"] == "qwen3_moe-ep.yaml#1"


@pytest.mark.slow
def test_greedy_step_traces_into_one_graph_and_compiles(runs):
    results = runs(2)
    res = results[0]["traced"]
    assert res["graphs"] == 1 and res["moe_nodes"] == _config("qwen3_moe").num_hidden_layers
    assert torch.equal(res["traced"], res["eager"]) and torch.equal(res["traced"], res["expected"])
    ops = [c.op for c in res["collectives"]]
    assert ops.count("all_reduce") == _all_reduces_per_forward("qwen3_moe")
    assert ops.count("all_gather_into_tensor") == 1 and len(ops) == _all_reduces_per_forward("qwen3_moe") + 1
    gather = [c for c in res["collectives"] if c.op == "all_gather_into_tensor"][0]
    assert (gather.shape, gather.payload_bytes) == ((B, 2), B * 2 * FP32)
    # inductor: the same token as the full logits' argmax, ties included (row 1 is all zeros: index 0)
    assert torch.equal(res["compiled"], res["compiled_expected"]) and res["compiled"][1] == 0
    assert [c.op for c in res["compiled_collectives"]] == ["all_gather_into_tensor"]


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_optimize_on_shards(runs):
    """Opt-in (MOEFX_TEST_TP_COMPILE=1, about 60 s more CPU): compile mode on the sharded model, 2 ranks."""
    res = runs(2)[0].get("compiled")
    if res is None:
        pytest.skip(f"set {COMPILE_ENV}=1 to compile the sharded model with inductor on each rank")
    assert torch.equal(res["greedy"], res["ref_greedy"])
    assert res["graphs"] >= 1 and res["noops"] > 0  # the moefx passes ran on the rank's graphs


@pytest.mark.slow
def test_transformers_tp_plan_auto(runs):
    res = runs(2)[0]["transformers_tp"]
    if isinstance(res, str):
        pytest.skip(res)
    assert torch.equal(res["greedy"], res["ref_greedy"]) and torch.equal(res["loop"], res["ref_greedy"])
    assert torch.equal(res["sampled"], res["ref_sampled"])
    cfg = _config("qwen3_moe")
    assert res["w13_shapes"] == {(cfg.num_experts, cfg.moe_intermediate_size, H)}
    plan = res["plan"]
    assert plan["source"].startswith("transformers:") and (plan["tp"], plan["experts"]) == (2, "tp")
    assert f"N={cfg.moe_intermediate_size} K={H}" in plan["key"] and plan["head"] == "VocabParallelLMHead"
    gathers = [c for c in res["greedy_comm"] if c.op == "all_gather_into_tensor"]
    assert len(gathers) == 1 and gathers[0].payload_bytes == B * 2 * FP32


# --- single process: no process group needed ----------------------------------------------------------------


def test_pick_from_pairs_is_argmax_over_slices_in_one_process():
    from tp_workers import tie_logits

    from moefx.parallel.lm_head import pack_pairs, pick_from_pairs
    from moefx.parallel.shard import chunk_bounds

    world, vocab = 3, 47
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        logits = tie_logits(vocab, 16).to(dtype)
        pieces = []
        for rank in range(world):
            start, size = chunk_bounds(vocab, world, rank)
            pieces.append(pack_pairs(logits[:, start:start + size], start))
        fdtype = torch.float64 if dtype == torch.float64 else torch.float32
        assert torch.equal(pick_from_pairs(torch.cat(pieces), world, fdtype), logits.argmax(-1)), dtype
    assert pieces[0].dtype == torch.int64 and pack_pairs(logits.float(), 0).dtype == torch.int32


def test_chunk_bounds_follow_torch_chunk():
    from moefx.parallel.shard import chunk_bounds

    for n, world in ((256, 4), (255, 4), (31, 2), (151936, 8), (129280, 3)):
        sizes = [t.numel() for t in torch.arange(n).chunk(world)]
        assert [chunk_bounds(n, world, r)[1] for r in range(world)] == sizes
        assert [chunk_bounds(n, world, r)[0] for r in range(world)] == [sum(sizes[:r]) for r in range(world)]


def test_detect_parallel_without_a_process_group():
    from moefx.parallel import detect_parallel

    assert detect_parallel().source == "no torch.distributed process group"
    plain = detect_parallel(torch.nn.Linear(2, 2))
    assert (plain.tp_size, plain.ep_size) == (1, 1) and plain.source.startswith("model is not sharded")
    given = detect_parallel(tp_size=4, ep_size=2)
    assert (given.tp_size, given.ep_size, given.experts, given.source) == (4, 2, "ep", "argument")


class _Mesh:
    """The DeviceMesh surface detect_parallel reads (sizes and this rank's coordinates per named dim)."""

    def __init__(self, names, sizes, coords):
        self.mesh_dim_names, self._sizes, self._coords, self.ndim = names, sizes, coords, len(names)

    def size(self, dim=None):
        return self._sizes[dim]

    def get_local_rank(self, name):
        return self._coords[self.mesh_dim_names.index(name)]


def test_detect_parallel_reads_transformers_mesh_and_expert_layout():
    from types import SimpleNamespace

    from torch.distributed.tensor.placement_types import Replicate, Shard

    from moefx.facts.parallel import _dtensor_layout
    from moefx.parallel import detect_parallel

    model = torch.nn.Module()
    model._device_mesh = _Mesh(("pp", "fsdp", "tp"), (1, 1, 4), (0, 0, 3))
    model.config = SimpleNamespace(distributed_config=SimpleNamespace(ep_size=1))
    info = detect_parallel(model)
    assert (info.tp_size, info.tp_rank, info.ep_size) == (4, 3, 1)
    assert info.source == "transformers: model._device_mesh 'tp' dim"
    model.config.distributed_config.ep_size = 4
    assert detect_parallel(model).ep_size == 4
    assert _dtensor_layout(SimpleNamespace(placements=(Shard(1),))) == "tp"
    assert _dtensor_layout(SimpleNamespace(placements=(Shard(0),))) == "ep"
    assert _dtensor_layout(SimpleNamespace(placements=(Replicate(),))) == "replicated"
    assert _dtensor_layout(torch.zeros(1)) is None


def test_execution_signature_keeps_the_parallel_source_out_of_its_identity():
    from dataclasses import replace

    from moefx.parallel import ParallelInfo
    from moefx.signatures import ExecutionSignature, ModelSignature, resolve

    a = ExecutionSignature(tp_size=2, parallel=ParallelInfo(2, 1, 0, source="x", world_size=2, rank=0))
    b = ExecutionSignature(tp_size=2, parallel=ParallelInfo(2, 1, 1, source="x", world_size=2, rank=1))
    assert a == b and a.key() == b.key() and "parallel" not in a.to_dict()
    assert resolve(ModelSignature(), a).fingerprint() == resolve(ModelSignature(), b).fingerprint()
    assert a.replace(tp_size=4).parallel is None  # sizes set by hand: the detected source no longer applies
    assert replace(a, max_batch_size=8).parallel is a.parallel
    explain = resolve(ModelSignature(), ExecutionSignature.detect(device="cpu")).explain()
    assert "parallel tp = 1, ep = 1  [no torch.distributed process group]" in explain
    assert "parallel tp = 2, ep = 1  [set in the execution signature]" in resolve(
        ModelSignature(), ExecutionSignature(tp_size=2)).explain()


def test_calibration_key_per_rank_for_tp_ep_and_replicated_experts():
    from moefx.backends.policy import moe_plan
    from moefx.config import CompilationConfig
    from moefx.parallel import ParallelInfo
    from moefx.signatures import ExecutionSignature, ModelSignature

    ms = ModelSignature(model_type="qwen3_moe", num_experts=8, hidden_size=64, moe_intermediate_size=32, top_k=2,
                        dtype="float32")

    def key(**es: object) -> str:
        return moe_plan(ms, ExecutionSignature(device_type="cpu", **es), CompilationConfig()).key

    assert "E=8 N=32 K=64" in key(tp_size=2)
    assert "E=4 N=64 K=64" in key(tp_size=2, ep_size=2)  # EP-placed experts are whole
    replicated = key(tp_size=2, parallel=ParallelInfo(2, 1, experts="replicated", world_size=2))
    assert "E=8 N=64 K=64" in replicated and "per rank" not in replicated


def test_signature_of_a_moefx_shard_reports_the_model_geometry():
    from moefx.facts.weights import infer_from_module
    from moefx.parallel.shard import ShardSpec

    model = torch.nn.Module()
    model.experts = torch.nn.Module()
    model.experts.gate_up_proj = torch.nn.Parameter(torch.randn(8, 16, 64))  # [E, 2I/tp, H] with I=32, tp=4
    model.experts.down_proj = torch.nn.Parameter(torch.randn(8, 64, 8))
    assert infer_from_module(model)["moe_intermediate_size"] == 8
    model.experts.moefx_shard = {"gate_up_proj": ShardSpec(1, 0, 16, 64, 0, 4, "g")}
    assert infer_from_module(model)["moe_intermediate_size"] == 32


def test_head_and_sharding_refuse_what_they_cannot_take():
    from moefx.models import build_model, tiny_qwen3_moe_config
    from moefx.parallel import VocabParallelLMHead, model_tp_plan, shard_model
    from moefx.parallel.transform import vocab_shard

    with pytest.raises(ValueError, match="must hold 64 of 255 rows"):
        VocabParallelLMHead(torch.randn(63, 8), 255, 0, 4, "g")
    with pytest.raises(ValueError, match="leaves a rank without rows"):
        VocabParallelLMHead(torch.randn(2, 8), 5, 0, 4, "g")
    assert vocab_shard(torch.nn.Linear(8, 16))[1].startswith("LM head weight is whole on every rank")
    assert vocab_shard(torch.nn.Embedding(8, 16))[0] is None
    model = build_model(tiny_qwen3_moe_config())
    with pytest.raises(ValueError, match="initialized torch.distributed"):
        shard_model(model)
    plan = model_tp_plan(model)
    assert plan["lm_head"] == "colwise_gather_output" and plan["model.layers.*.mlp.experts"] == "moe_tp_experts"


def test_unsharded_model_keeps_its_head():
    import moefx
    from moefx.models import build_model, tiny_qwen3_moe_config

    model = moefx.optimize(build_model(tiny_qwen3_moe_config()), config={"mode": "eager"})
    assert type(model.lm_head) is torch.nn.Linear
    assert model.moefx_plan.serving["vocab_parallel_lm_head"] is False
    assert not any(line.startswith("vocab_parallel_lm_head") for line in model.moefx_plan.provenance)
