"""Rank processes for tests/test_parallel.py: `spawn(world, out_dir)` runs every scenario once per rank over gloo.

Each rank writes what it saw (tokens, plans, counted collectives) to `out_dir/rank{r}.pt`; the tests assert on
those. One spawn per world size keeps the cost to one torch import per rank.
"""

from __future__ import annotations

import copy
import os
import socket
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

PROMPT = (2, 5)  # batch, prompt length
NEW_TOKENS = 5
SAMPLE_SEED = 1234
COMPILE_ENV = "MOEFX_TEST_TP_COMPILE"  # =1: also compile the sharded model with inductor (about 60 s of CPU)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, out_dir: Path) -> list[dict[str, Any]]:
    """Run `_rank` on `world` processes; the per-rank results, or RuntimeError with the failing rank's traceback."""
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(world, free_port(), str(out_dir)), nprocs=world, join=True, start_method="spawn")
    results = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        if "error" in res:
            raise RuntimeError(f"rank {r} of {world} failed:\n{res['error']}")
    return results


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # world processes share 2 cores; also fixes the CPU calibration key's thread count
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out: dict[str, Any] = {}
    try:
        out["ties"] = ties(rank, world)
        for family in ("qwen3_moe", "deepseek_v3"):
            out[family] = family_run(family, rank, world, Path(out_dir))
        if world == 2:
            out["ep"] = family_run("qwen3_moe", rank, world, Path(out_dir), experts="ep")
            out["traced"] = traced_step(rank, world)
            out["transformers_tp"] = transformers_tp(rank, world, Path(out_dir))
            if os.environ.get(COMPILE_ENV) == "1":
                out["compiled"] = compiled_generate(world)
    except Exception:
        out["error"] = traceback.format_exc()
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


# --- distributed greedy on crafted logits and on an integer-valued head ---------------------------------------

def tie_logits(vocab: int, step: int) -> torch.Tensor:
    """Rows built to break a distributed argmax: ties across and inside slices, +-inf, NaN, constant rows."""
    g = torch.Generator().manual_seed(7)
    rows = torch.randint(-50, 50, (10, vocab), generator=g).float()
    rows[1, step - 1] = rows[1, step] = 99  # last column of rank 0 = first column of rank 1
    rows[2, [step + 2, step + 5, vocab - 1]] = 99  # twice inside rank 1, once in the last rank
    rows[3] = 4.0  # every logit equal
    rows[4, [5, vocab - 2]] = float("inf")
    rows[5, 2], rows[5, step + 1] = float("inf"), float("nan")  # NaN beats +inf, as in torch.argmax
    rows[6] = float("-inf")
    rows[7, [vocab - 3, step + 1]] = float("nan")
    rows[8, vocab - 1] = 99  # the very last column
    rows[9, 0] = 99
    return rows


def ties(rank: int, world: int) -> dict[str, Any]:
    from moefx.parallel import VocabParallelLMHead, distributed_argmax
    from moefx.parallel.comm import group_name
    from moefx.parallel.shard import chunk_bounds

    group = group_name()
    vocab = 16 * world - 1  # uneven: the last rank holds 15 columns
    step = 16
    start, size = chunk_bounds(vocab, world, rank)
    out: dict[str, Any] = {"vocab": vocab}
    logits = tie_logits(vocab, step)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        full = logits.to(dtype)
        got = distributed_argmax(full[:, start:start + size], start, world, group)
        out[f"crafted_{dtype}"] = (got, full.argmax(-1))
    # A head with integer-valued weights and inputs: every logit is exact, so rows 3 and `step` tie exactly.
    g = torch.Generator().manual_seed(3)
    weight = torch.randint(-3, 4, (vocab, 8), generator=g).float()
    weight[3] = weight[step] = 5.0
    hidden = torch.randint(-2, 3, (6, 8), generator=g).float()
    hidden[:3] = torch.randint(1, 3, (3, 8), generator=g).float()  # positive rows: rows 3 and `step` win, tied
    head = VocabParallelLMHead(weight[start:start + size].clone(), vocab, rank, world, group)
    with torch.no_grad():
        logits_tp = head(hidden)
        out["head"] = dict(logits_equal=torch.equal(logits_tp, hidden @ weight.T), greedy=head.greedy(hidden),
                           argmax_full=(hidden @ weight.T).argmax(-1), argmax_tp=logits_tp.argmax(-1),
                           batched=head.greedy(hidden.view(2, 3, 8)))
    return out


# --- whole models: sharded by the model's own TP plan, through moefx.optimize ---------------------------------

def _config(family: str, world: int) -> Any:
    from moefx.models import tiny_deepseek_v3_config, tiny_qwen3_moe_config

    if family == "qwen3_moe":
        return tiny_qwen3_moe_config(num_key_value_heads=4)  # 4 kv heads split over up to 4 ranks
    return tiny_deepseek_v3_config()


def reference_model(family: str, world: int) -> torch.nn.Module:
    """The unsharded fp32 model, expert and head weights scaled up so tokens are far from ties."""
    from moefx.models import build_model
    from moefx.offload.transform import experts_modules

    model = build_model(_config(family, world), seed=11)
    with torch.no_grad():
        for _, module in experts_modules(model):
            module.gate_up_proj.mul_(10.0)
            module.down_proj.mul_(10.0)
        model.lm_head.weight.mul_(20.0)
    return model


def calibration_table(path: Path, ms: Any, tp: int, ep: int) -> Path:
    """A table whose only row is keyed at one rank's expert shape (the same on every rank) and picks `reference` for
    every M; rank 0 writes it."""
    from moefx.backends.calibration import (
        CalibrationKey,
        CalibrationRow,
        MRange,
        device_identity,
        invalidate,
        write_row,
    )

    name, cap, sms = device_identity("cpu")
    key = CalibrationKey(device=name, capability=cap, multiprocessor_count=sms, E=ms.num_experts // ep,
                         N=2 * ms.moe_intermediate_size // tp, K=ms.hidden_size, top_k=ms.top_k, dtype="float32",
                         quant_block=None, mode="eager")
    if dist.get_rank() == 0:
        write_row(path, CalibrationRow(key, (MRange("reference", 1, None),), {"date": "test"}, ""))
    dist.barrier()
    invalidate()
    return path


class _MoeCalls(TorchDispatchMode):
    """Records the expert weight shape of every `moefx::moe_experts` call."""

    def __init__(self) -> None:
        super().__init__()
        self.w13_shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if "moe_experts" in str(func):
            self.w13_shapes.add(tuple(args[3].shape))
        return func(*args, **(kwargs or {}))


def greedy_loop(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, list, list]:
    """A test-side decode loop on `greedy_step`: (tokens [B, steps], collectives of decode step 2 via greedy,
    collectives of the same step run through the full-logits forward)."""
    from transformers import DynamicCache

    from moefx.parallel import CommCounter, greedy_step

    cache = DynamicCache()
    nxt = greedy_step(model, input_ids=ids, past_key_values=cache)
    tokens, greedy_comm, full_comm = [nxt], [], []
    for i in range(1, steps):
        if i == 1:
            probe = copy.deepcopy(cache)
            with CommCounter() as c:
                model(input_ids=nxt[:, None], past_key_values=probe, use_cache=True, logits_to_keep=1)
            full_comm = c.collectives
            with CommCounter() as c:
                nxt = greedy_step(model, input_ids=nxt[:, None], past_key_values=cache)
            greedy_comm = c.collectives
        else:
            nxt = greedy_step(model, input_ids=nxt[:, None], past_key_values=cache)
        tokens.append(nxt)
    return torch.stack(tokens, dim=1), greedy_comm, full_comm


def _plan_facts(model: torch.nn.Module) -> dict[str, Any]:
    plan = model.moefx_plan
    return dict(explain=plan.explain(), tp=plan.execution.tp_size, ep=plan.execution.ep_size,
                source=plan.execution.parallel.source, experts=plan.execution.parallel.experts,
                key=plan.moe.key, eager_source=plan.moe.policy("eager").source, fingerprint=plan.fingerprint(),
                provenance=list(plan.provenance), head=type(model.get_output_embeddings()).__name__)


def _generate(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy tokens, sampled tokens with a fixed seed) from transformers' generate() (full logits)."""
    greedy = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    torch.manual_seed(SAMPLE_SEED)
    sampled = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=0)
    return greedy[:, ids.shape[1]:], sampled[:, ids.shape[1]:]


def family_run(family: str, rank: int, world: int, out_dir: Path, experts: str = "tp") -> dict[str, Any]:
    import moefx
    from moefx.parallel import shard_model
    from moefx.signatures import ModelSignature

    ref = reference_model(family, world)
    ids = torch.randint(0, 256, PROMPT, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref_greedy, _ = _generate(ref, ids)
        # the sharded model samples on moefx's engine (its sampler's random stream): so does the reference
        _, ref_sampled = _generate(moefx.optimize(copy.deepcopy(ref), config={"mode": "eager"}), ids)
    model = shard_model(copy.deepcopy(ref), experts=experts)
    ms = ModelSignature.from_module(model)
    tp, ep = (world, 1) if experts == "tp" else (1, world)
    table = calibration_table(out_dir / f"{family}-{experts}.yaml", ms, tp, ep)
    model = moefx.optimize(model, config={"mode": "eager", "calibration": [str(table)]})
    with torch.no_grad(), _MoeCalls() as calls:
        greedy, sampled = _generate(model, ids)
        loop, greedy_comm, full_comm = greedy_loop(model, ids, NEW_TOKENS)
    front = model.moefx_generate  # generate() ran on moefx's engine: greedy through the head's distributed greedy
    engine = dict(requests=front.engine.stats.requests, fallbacks=list(front.fallbacks),
                  head=front.engine._head is not None)
    return dict(ref_greedy=ref_greedy, ref_sampled=ref_sampled, greedy=greedy, sampled=sampled, loop=loop,
                greedy_comm=greedy_comm, full_comm=full_comm, w13_shapes=calls.w13_shapes, signature=ms,
                plan=_plan_facts(model), engine=engine)


def traced_step(rank: int, world: int) -> dict[str, Any]:
    """One greedy step of the sharded, optimized Qwen3-MoE traced by dynamo in one graph (fullgraph), and the
    head's greedy compiled by inductor."""
    import moefx
    from moefx.parallel import graph_collectives, greedy_head, greedy_step, shard_model

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    ref = reference_model("qwen3_moe", world)
    model = moefx.optimize(shard_model(copy.deepcopy(ref)), config={"mode": "eager", "moe_backend": "reference"})
    ids = torch.randint(0, 256, PROMPT, generator=torch.Generator().manual_seed(5))
    step = torch.compile(lambda x: greedy_step(model, input_ids=x, use_cache=False), backend=keep, fullgraph=True)
    with torch.no_grad():
        traced, eager = step(ids), greedy_step(model, input_ids=ids, use_cache=False)
        expected = ref(ids).logits[:, -1].argmax(-1)
    moe_nodes = [n for n in graphs[0].graph.nodes if "moe_experts" in str(n.target)]
    out = dict(graphs=len(graphs), traced=traced, eager=eager, expected=expected,
               collectives=graph_collectives(graphs[0]), moe_nodes=len(moe_nodes))
    from torch._inductor.compile_fx import compile_fx

    head = greedy_head(model)
    compiled_graphs: list[torch.fx.GraphModule] = []

    def inductor(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        compiled_graphs.append(gm)
        return compile_fx(gm, example_inputs)

    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    hidden[1] = 0.0  # a row whose logits all tie (0): the lowest index wins
    greedy = torch.compile(head.greedy, backend=inductor, fullgraph=True)
    with torch.no_grad():
        out.update(compiled=greedy(hidden), compiled_expected=head(hidden).argmax(-1),
                   compiled_collectives=graph_collectives(compiled_graphs[0]))
    torch._dynamo.reset()
    return out


def compiled_generate(world: int) -> dict[str, Any]:
    """The sharded Qwen3-MoE through `moefx.optimize` in compile mode (inductor, the moefx passes on each rank's
    graph, functional collectives inside it): generate()'s greedy tokens against the unsharded model's."""
    import moefx
    from moefx.parallel import shard_model

    torch._dynamo.reset()
    moefx.clear_compile_reports()
    ref = reference_model("qwen3_moe", world)
    ids = torch.randint(0, 256, PROMPT, generator=torch.Generator().manual_seed(5))
    cfg = {"mode": "compile", "moe_backend": "reference", "pass_config": {"eliminate_noops": True}}
    model = moefx.optimize(shard_model(copy.deepcopy(ref)), config=cfg)
    with torch.no_grad():
        ref_greedy = ref.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        greedy = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    reports = moefx.compile_reports()
    torch._dynamo.reset()
    return dict(ref_greedy=ref_greedy, greedy=greedy, graphs=len(reports),
                noops=sum(r.matches.get("eliminate_noops", 0) for r in reports))


def transformers_tp(rank: int, world: int, out_dir: Path) -> dict[str, Any] | str:
    """transformers' own `tp_plan="auto"` (DTensor weights) through moefx.optimize, where accelerate is installed
    (transformers' loader needs it for a TP plan)."""
    import importlib.util
    import warnings

    if importlib.util.find_spec("accelerate") is None:
        return "skipped: transformers' tp_plan loading needs accelerate, which is not installed"
    from transformers import AutoModelForCausalLM

    import moefx

    ref = reference_model("qwen3_moe", world)
    path = out_dir / "qwen3_moe-checkpoint"
    if rank == 0:
        ref.save_pretrained(path)
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `tp_plan=` is deprecated in favour of distributed_config (5.18+)
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    ids = torch.randint(0, 256, PROMPT, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref_greedy, ref_sampled = _generate(ref, ids)
    from moefx.signatures import ModelSignature

    table = calibration_table(out_dir / "transformers.yaml", ModelSignature.from_module(model), world, 1)
    model = moefx.optimize(model, config={"mode": "eager", "calibration": [str(table)]})
    with torch.no_grad(), _MoeCalls() as calls:
        greedy, sampled = _generate(model, ids)
        loop, greedy_comm, full_comm = greedy_loop(model, ids, NEW_TOKENS)
    return dict(ref_greedy=ref_greedy, ref_sampled=ref_sampled, greedy=greedy, sampled=sampled, loop=loop,
                greedy_comm=greedy_comm, full_comm=full_comm, w13_shapes=calls.w13_shapes, plan=_plan_facts(model))
