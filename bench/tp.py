"""Tensor-parallel decode: moefx at TP=1, 2, 4 with the vocab-parallel head's distributed greedy off and on,
and transformers' own `tp_plan="auto"` + static-cache compile as the peer.

Model: Qwen3-MoE at Qwen3-30B-A3B widths, 48 layers (--layers), seeded random weights with balanced routing
(`build_model(..., routing="balanced")`), bf16, built on each GPU
and sharded by its own TP plan (`moefx.parallel.shard_model`), then `moefx.optimize` (eager mode: it picks the
MoE backend from the calibration rows of the per-rank expert shape and installs the vocab-parallel head).
One process per GPU, NCCL; NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are forced for every process).

Arms, per TP size and decode batch B (1, 16, 64):
  full      a decode step is the model forward (full logits: one all-gather of B x V/tp) + argmax
  greedy    the decoder + `greedy()` of the head (one all-gather of B x 2 int32); TP > 1 only
Each step (forward, pick, next-token and position update) is captured in one CUDA graph and replayed by
bench/harness.py's `time_graph`: CUDA events over `--steps` replays, the median of `--runs`. Peak memory is the
allocator's peak above the resident weights while the arm runs (prefill, capture, replays).
Checks first: greedy() equals argmax of the full logits on the prefill's last hidden states (exactly), and
the tokens of every arm are compared with TP=1's (bf16: reported, not required; tests/test_parallel.py proves
them identical in fp32 on CPUs).
Communication per step is timed separately (a CUDA graph of the step's collectives alone): the all-reduces
(embedding + 2 per layer, B x H bf16 each) and the head's gather in both forms.
Floor per GPU: the bytes a step reads on one GPU (its attention and LM-head slices, the distinct experts B
rows hit, the router, the KV cache) / the measured HBM copy rate; the distinct experts per layer are counted on the
unsharded model over two greedy decode steps of the batch's prompts (`experts_hit`).
Peer (--peer): rank 0 of the TP=1 run saves the model (--ckpt, default /dev/shm), each TP run loads it with
`from_pretrained(..., tp_plan="auto")` and times `generate(cache_implementation="static")` (transformers
compiles the step itself): decode tok/s = B (n - 1) / (t(n tokens) - t(1 token)).

  python3 bench/tp.py                      # every TP size the GPUs allow (1, 2, 4), B = 1, 16, 64
  python3 bench/tp.py --tp 1,2 --peer      # also the transformers peer
  python3 bench/tp.py --quick              # CPU smoke run: tiny model, gloo, TP 1 and 2
Prints a table last and writes $OUT/tp.json.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# Before torch (and NCCL) is imported, in this process and every rank it spawns.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (  # noqa: E402
    copy_ceiling_Bps,
    median_wall_s,
    time_graph,
    time_graph_calls,
    time_wall,
    write_json,
)
from bench.sections.markdown import table as markdown_table  # noqa: E402
from moefx.models.routing_stats import expected_distinct  # noqa: E402

BATCHES = (1, 16, 64)
PROMPT = 16
TARGET_TP2_SPEEDUP = 1.6
TARGET_GREEDY_GAIN = 0.03


# --- what a step must read and send (pure functions, tested on the CPU) -------------------------------------

def step_bytes(cfg: Any, tp: int, batch: int, context: int, elem: int = 2, hit: float | None = None) -> float:
    """Bytes one decode step reads on one GPU of a TP group (experts split on their intermediate dim); `hit`: the
    distinct experts per layer the batch routes to (None: the uniform-routing expectation)."""
    h, heads, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attn = h * hd * (2 * heads + 2 * kv) / tp
    if hit is None:
        hit = expected_distinct(cfg.num_experts, cfg.num_experts_per_tok, batch)
    experts = hit * 3 * h * cfg.moe_intermediate_size
    router = h * cfg.num_experts
    kv_cache = batch * context * 2 * kv * hd / tp
    per_layer = attn + experts / tp + router + kv_cache
    return elem * (cfg.num_hidden_layers * per_layer + cfg.vocab_size * h / tp)


def all_reduces_per_step(cfg: Any) -> int:
    """Qwen3-MoE under its TP plan: the embedding, then attention o_proj and the experts in every layer."""
    return 1 + 2 * cfg.num_hidden_layers


def head_gather_bytes(cfg: Any, tp: int, batch: int, greedy: bool, elem: int = 2) -> int:
    """What one rank sends for the LM head per step: B x 2 int32 pairs, or its B x V/tp slice of the logits."""
    return batch * 2 * 4 if greedy else batch * (-(-cfg.vocab_size // tp)) * elem


def speedups(rows: list[dict]) -> dict[str, Any]:
    """The two targets of the run: TP=2 over TP=1 at B=1 (full arm), greedy over full at B=16 per TP."""
    tps = {(r["tp"], r["arm"], r["batch"]): r["tok_s"] for r in rows if r.get("tok_s")}
    mem = {(r["tp"], r["arm"], r["batch"]): r.get("peak_mib") for r in rows}
    out: dict[str, Any] = {}
    if (1, "full", 1) in tps and (2, "full", 1) in tps:
        out["tp2_over_tp1_b1"] = tps[(2, "full", 1)] / tps[(1, "full", 1)]
    for tp in sorted({r["tp"] for r in rows if r["tp"] > 1}):
        if (tp, "greedy", 16) in tps and (tp, "full", 16) in tps:
            out[f"greedy_gain_tp{tp}_b16"] = tps[(tp, "greedy", 16)] / tps[(tp, "full", 16)] - 1
            full_mem, greedy_mem = mem.get((tp, "full", 16)), mem.get((tp, "greedy", 16))
            if full_mem is not None and greedy_mem is not None:
                out[f"greedy_mem_saved_mib_tp{tp}_b16"] = full_mem - greedy_mem
    return out


def table(rows: list[dict]) -> str:
    def fmt(v: Any, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    body = [[r["tp"], r["arm"], r["batch"], fmt(r.get("tok_s"), ".0f"), fmt(r.get("step_ms"), ".3f"),
             fmt(r.get("floor_ms"), ".3f"), fmt(r.get("comm_ms"), ".3f"), fmt(r.get("peak_mib"), ".0f"),
             r.get("tokens_vs_tp1", "n/a"), r.get("note", "")] for r in rows]
    return markdown_table(["TP", "arm", "B", "tok/s", "step ms", "floor ms", "comm ms", "peak MiB", "tokens = TP1",
                           "note"], body)


# --- one rank ----------------------------------------------------------------------------------------------

class DecodeState:
    """Greedy decode of one batch after its prefill, one step per `step()` call: the forward (full logits + argmax,
    or with `greedy` the decoder + the vocab-parallel head's `greedy()`), then the next token and position written
    in place, so that replays of a CUDA graph of `step()` advance the sequence on the device (`max_steps` steps at
    most: the token buffer's length)."""

    def __init__(self, model: Any, ids: torch.Tensor, max_len: int, greedy: bool, max_steps: int) -> None:
        from transformers import StaticCache

        self.model, self.greedy, self.device = model, greedy, ids.device
        batch, prompt = ids.shape
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        pos = torch.arange(prompt, device=self.device).expand(batch, prompt)
        with torch.no_grad():
            first = self._pick(ids, pos)
        self.tok = first[:, None].clone()
        self.pos = torch.full((batch, 1), prompt, dtype=torch.long, device=self.device)
        self.out = torch.zeros(batch, max_steps + 1, dtype=torch.long, device=self.device)
        self.out[:, 0] = first
        self.index = torch.ones(1, dtype=torch.long, device=self.device)

    def _pick(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        from moefx.parallel import greedy_step

        kwargs = dict(input_ids=tok, position_ids=pos, cache_position=pos[0], past_key_values=self.cache,
                      use_cache=True)
        if self.greedy:
            return greedy_step(self.model, **kwargs)
        return self.model(**kwargs, logits_to_keep=1).logits[:, -1].argmax(-1)

    @torch.no_grad()
    def step(self) -> None:
        nxt = self._pick(self.tok, self.pos)
        self.out.index_copy_(1, self.index, nxt[:, None])
        self.tok.copy_(nxt[:, None])
        self.pos.add_(1)
        self.index.add_(1)

    def tokens(self, n: int) -> torch.Tensor:
        """The first `n` tokens decoded (the prefill's pick first)."""
        return self.out[:, :n].clone()


def decode_steps(steps: int, runs: int) -> int:
    """Steps one arm decodes at most: `time_graph`'s calls (its eager warm-ups and replays), which also cover the
    eager fallback (one warm-up, then `steps` x `runs`)."""
    return time_graph_calls(steps, runs)


def step_seconds(state: DecodeState, steps: int, runs: int) -> tuple[float, str]:
    """Seconds per decode step and a note: on CUDA the harness's `time_graph` (a CUDA graph of one step, CUDA
    events over `steps` replays, the median of `runs`); where the step cannot be captured, and on the CPU, the
    harness's wall clock over `steps` eager steps, the median of `runs`, and the note says so."""
    if state.device.type != "cuda":
        return time_wall(state.step, [()], steps, runs) * 1e-6, "eager steps (no CUDA)"
    try:
        return time_graph(state.step, reps=steps, trials=runs) * 1e-6, ""
    except RuntimeError as exc:  # timed eagerly instead, and the row says why
        note = f"not captured ({type(exc).__name__}: {str(exc)[:120]}): eager steps"
        return time_wall(state.step, [()], steps, runs) * 1e-6, note


def comm_seconds(cfg: Any, batch: int, tp: int, greedy: bool, device: torch.device, reps: int,
                 trials: int) -> float | None:
    """One step's collectives alone (all-reduces of B x H bf16, the head's gather), per step: timed as a decode
    step is (`step_seconds`: a CUDA graph of them where they can be captured, else eager launches)."""
    if tp == 1:
        return None
    from moefx.parallel.comm import all_gather, all_reduce, group_name

    group = group_name()
    hidden = torch.randn(batch, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    head = (torch.zeros(batch, 2, dtype=torch.int32, device=device) if greedy else
            torch.randn(batch, -(-cfg.vocab_size // tp), device=device, dtype=torch.bfloat16))

    def step() -> None:
        for _ in range(all_reduces_per_step(cfg)):
            all_reduce(hidden, group)
        all_gather(head, tp, group)

    if device.type == "cuda":
        try:
            return time_graph(step, reps=reps, trials=trials) * 1e-6
        except RuntimeError:  # timed as eager launches instead
            pass
    return time_wall(step, [()], reps, trials) * 1e-6


def model_config(args: argparse.Namespace) -> Any:
    from moefx.models import qwen3_moe_config, tiny_qwen3_moe_config

    if args.quick:
        return tiny_qwen3_moe_config(num_key_value_heads=4)
    return qwen3_moe_config(args.layers)


def moefx_model(cfg: Any, tp: int, device: torch.device, dtype: torch.dtype, config: dict,
                save: str | None = None, hits: dict[int, float] | None = None,
                prompts: dict[int, torch.Tensor] | None = None) -> Any:
    """The seeded balanced-routing model on `device`, saved as the peer's checkpoint first if asked, sharded,
    optimized; with `prompts` (batch -> ids) it first fills `hits` with each batch's mean distinct experts per layer
    over two greedy decode steps of the unsharded model."""
    import moefx
    from moefx.models import build_model
    from moefx.models.routing_stats import decode_distinct_experts
    from moefx.parallel import shard_model

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: the 48-layer model in fp32 would not fit one GPU
    try:
        model = build_model(cfg, seed=0, dtype=dtype, device=device, routing="balanced")
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id = None  # random weights: never stop early
    for batch, ids in (prompts or {}).items():
        per_layer = decode_distinct_experts(model, ids.to(device), steps=2)
        if hits is not None:
            hits[batch] = sum(per_layer.values()) / len(per_layer)
    if save is not None and dist.get_rank() == 0:
        model.save_pretrained(save)
    if tp > 1:
        model = shard_model(model)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return moefx.optimize(model, config=config)


def moefx_arms(args: argparse.Namespace, cfg: Any, tp: int, device: torch.device) -> tuple[list[dict], dict]:
    from moefx.parallel import greedy_head

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = {"mode": "eager", "max_batch_size": max(args.batches)}
    g = torch.Generator().manual_seed(1)  # the same prompts as the peer's
    prompts = {batch: torch.randint(1, cfg.vocab_size, (batch, PROMPT), generator=g) for batch in args.batches}
    hits: dict[int, float] = {}
    model = moefx_model(cfg, tp, device, dtype, config, save=args.ckpt if args.save_ckpt else None, hits=hits,
                        prompts=prompts)
    plan = model.moefx_plan
    facts = {"plan": plan.explain(), "moe_policy": plan.moe.spec(), "weights_gib": sum(
        p.numel() * p.element_size() for p in model.parameters()) / 2**30}
    rate = copy_ceiling_Bps(device)
    facts["hbm_gbs"] = rate / 1e9
    head = greedy_head(model)
    rows = []
    arms = ("full", "greedy") if head is not None else ("full",)
    max_len = PROMPT + decode_steps(args.steps, args.runs) + 4
    for batch in args.batches:
        ids = prompts[batch].to(device)
        if head is not None:
            with torch.no_grad():
                hidden = model.model(input_ids=ids).last_hidden_state[:, -1]
                exact = torch.equal(head.greedy(hidden), head(hidden).argmax(-1))
            if not exact:
                raise SystemExit(f"TP={tp} B={batch}: greedy() differs from argmax of the full logits")
        for arm in arms:
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            state = DecodeState(model, ids, max_len, arm == "greedy", decode_steps(args.steps, args.runs))
            step_s, note = step_seconds(state, args.steps, args.runs)
            peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None
            comm = comm_seconds(cfg, batch, tp, arm == "greedy", device, args.steps, args.runs)
            rows.append(dict(tp=tp, arm=arm, batch=batch, tok_s=batch / step_s, step_ms=1e3 * step_s,
                             floor_ms=1e3 * step_bytes(cfg, tp, batch, max_len, hit=hits[batch]) / rate,
                             experts_hit=round(hits[batch], 1), routing="balanced",
                             comm_ms=None if comm is None else 1e3 * comm, peak_mib=peak,
                             head_bytes=head_gather_bytes(cfg, tp, batch, arm == "greedy") if tp > 1 else 0,
                             tokens=state.tokens(args.check_tokens).cpu(), note=note))
            del state
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows, facts


def peer_arms(args: argparse.Namespace, cfg: Any, tp: int, device: torch.device) -> list[dict]:
    """transformers' own TP loading and static-cache generate() (it compiles the decode step itself)."""
    import warnings

    from transformers import AutoModelForCausalLM

    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {"tp_plan": "auto"} if tp > 1 else {"device_map": {"": device}}
        model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.bfloat16, **kwargs).eval()
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(1)
    for batch in args.batches:
        ids = torch.randint(1, cfg.vocab_size, (batch, PROMPT), generator=g).to(device)

        outs: dict[int, torch.Tensor] = {}

        def gen(n: int, ids: torch.Tensor = ids, outs: dict[int, torch.Tensor] = outs) -> torch.Tensor:
            outs[n] = model.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static",
                                     pad_token_id=0)
            return outs[n]

        try:
            with torch.no_grad():
                gen(args.steps)  # compile + warm-up
                gen(1)
                t = {n: median_wall_s(lambda n=n: gen(n), args.runs, device) for n in (args.steps, 1)}
                tokens = outs[args.steps][:, PROMPT:PROMPT + args.check_tokens].cpu()
            step_s = (t[args.steps] - t[1]) / (args.steps - 1)
            rows.append(dict(tp=tp, arm="transformers", batch=batch, tok_s=batch / step_s, step_ms=1e3 * step_s,
                             tokens=tokens))
        except Exception as exc:  # a peer that cannot run this configuration is reported, not fatal
            rows.append(dict(tp=tp, arm="transformers", batch=batch, note=f"failed: {type(exc).__name__}: {exc}"))
    return rows


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            **({"device_id": device} if device.type == "cuda" else {}))
    result: dict[str, Any] = {}
    try:
        cfg = model_config(args)
        if not args.peer_only:
            result["rows"], result["facts"] = moefx_arms(args, cfg, world, device)
        if args.peer or args.peer_only:
            try:
                peer = peer_arms(args, cfg, world, device)
            except Exception as exc:  # a peer that cannot load is reported, the moefx rows are kept
                peer = [dict(tp=world, arm="transformers", batch=b, note=f"failed: {type(exc).__name__}: {exc}")
                        for b in args.batches]
            result.setdefault("rows", []).extend(peer)
    except BaseException:  # SystemExit from a failed check included: the parent reports it
        result["error"] = traceback.format_exc()
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, args: argparse.Namespace, tmp: Path) -> dict:
    import torch.multiprocessing as mp

    out = tmp / f"tp{world}.pt"
    mp.start_processes(_rank, args=(world, _free_port(), args, str(out)), nprocs=world, join=True,
                       start_method="spawn")
    return torch.load(out, weights_only=False)


def compare_tokens(rows: list[dict]) -> None:
    """Mark each row's tokens as equal to TP=1's (same arm family, same batch) or not."""
    ref = {r["batch"]: r["tokens"] for r in rows if r["tp"] == 1 and r["arm"] == "full" and "tokens" in r}
    for r in rows:
        if "tokens" in r and r["batch"] in ref:
            same = torch.equal(r["tokens"], ref[r["batch"]])
            r["tokens_vs_tp1"] = "yes" if same else f"{(r['tokens'] == ref[r['batch']]).float().mean():.2f}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", default=None, help="comma list of TP sizes (default: 1 and every 2^k <= GPU count)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per timed run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--check-tokens", type=int, default=8, help="tokens compared with TP=1")
    ap.add_argument("--peer", action="store_true", help="also time transformers' tp_plan='auto' (saves a checkpoint)")
    ap.add_argument("--peer-only", action="store_true", help="only the peer (the checkpoint must exist)")
    ap.add_argument("--ckpt", default="/dev/shm/moefx-tp-ckpt", help="checkpoint folder for the peer")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, gloo, TP 1,2, B 1,2")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.quick:
        args.layers, args.steps, args.runs, args.check_tokens = 2, 4, 1, 4
        args.batches = "1,2"
    args.batches = tuple(int(b) for b in args.batches.split(","))
    sizes = [1] + [s for s in (2, 4, 8) if s <= gpus] if args.tp is None else [int(s) for s in args.tp.split(",")]
    if any(s > gpus for s in sizes):
        raise SystemExit(f"--tp {sizes} needs {max(sizes)} devices, {gpus} present")
    args.sizes = sizes
    args.save_ckpt = False
    return args


def main(argv: list[str] | None = None) -> int:
    import tempfile

    args = parse(argv)
    cfg = model_config(args)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}" if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "command": "python3 bench/tp.py " + " ".join(argv or sys.argv[1:]),
        "model": f"Qwen3-MoE {cfg.num_hidden_layers} layers, E={cfg.num_experts}, H={cfg.hidden_size}, "
                 f"I={cfg.moe_intermediate_size}, V={cfg.vocab_size}",
        "env": {k: os.environ.get(k) for k in NO_MULTICAST}, "worlds": {},
    }
    import transformers

    result["transformers"] = transformers.__version__
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.sizes:
            args.save_ckpt = args.peer and world == 1 and not args.peer_only
            print(f"=== TP={world} {time.strftime('%H:%M:%S')}", flush=True)
            res = run_world(world, args, Path(tmp))
            if "error" in res:
                print(f"TP={world} failed:\n{res['error']}", flush=True)
                result["worlds"][world] = {"error": res["error"]}
            else:
                result["worlds"][world] = res.get("facts", {})
            rows.extend(res.get("rows", []))
    compare_tokens(rows)
    result["rows"] = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
    result["targets"] = speedups(rows)
    write_json("tp.json", result)
    print(f"\n{result['model']} on {result['device']}, torch {result['torch']}, transformers "
          f"{result['transformers']}, {result['date']}")
    for world, facts in result["worlds"].items():
        if "hbm_gbs" in facts:
            print(f"TP={world}: weights {facts['weights_gib']:.1f} GiB per GPU, HBM {facts['hbm_gbs']:.0f} GB/s, "
                  f"MoE policy {facts['moe_policy']}")
    t = result["targets"]
    if "tp2_over_tp1_b1" in t:
        x = t["tp2_over_tp1_b1"]
        verdict = "PASS" if x >= TARGET_TP2_SPEEDUP else "FAIL"
        print(f"target: TP=2 B=1 >= {TARGET_TP2_SPEEDUP}x TP=1: {x:.2f}x {verdict}")
    for key, x in t.items():
        if key.startswith("greedy_gain"):
            verdict = "PASS" if x >= TARGET_GREEDY_GAIN else "FAIL"
            print(f"target: {key} >= {TARGET_GREEDY_GAIN:.0%}: {x:+.1%} {verdict}")
        elif key.startswith("greedy_mem_saved"):
            print(f"{key}: {x:.1f} MiB")
    print("\n" + table(rows))
    return 1 if any("error" in w for w in result["worlds"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
