"""Cold start: what a user waits for before the first token, in fresh processes (issues 29 and 51).

Qwen3-MoE at Qwen3-30B-A3B widths, `--layers` deep, seeded random weights, bf16 (`--tiny`: the embedded tiny
model, fp32, a CPU smoke run), a `--prompt`-token prompt, greedy, `--new-tokens` tokens, the README path
(`moefx.optimize(model)` with no config: on CUDA the capture cap comes from free memory; `--max-batch-size` pins it).
Each arm is a new Python process with its own empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, so only what the
arm is meant to reuse is reused:
  moefx_cold   the saving process, as a server that runs other compiled code: transformers'
               generate(cache_implementation="static") first (it compiles its own decode step; on the CPU told to, as
               transformers compiles on CUDA only), then moefx.optimize(model) + generate(), moefx's compile cache
               empty (the process writes it). transformers' first call is this process's first compile on empty
               caches, so it is the peer: its row (`hf_static`, `in_process` moefx_cold) is written from this process,
               which spares a process of its own (`--no-hf-first` runs moefx alone)
  moefx_warm   a "new machine": a new process with only the file moefx_cold wrote (inductor's and Triton's own caches
               empty: every hit comes from moefx's compile cache)
  moefx_restart  as moefx_warm, with the Triton cache moefx_cold left (a restart on the same machine, where
               ~/.triton/cache survives)
  moefx_restart_serial  as moefx_restart, with TORCHINDUCTOR_COMPILE_THREADS=1: inductor loads its kernels in the
               process instead of through its worker pool (not in the default arms: on the H100 at 48 layers it
               took 3.6 s after optimize against moefx_restart's 3.3, so the pool is not where the restart goes)
  hf_static    transformers' static-cache generate alone in a process of its own (not in the default arms)
First call = optimize (moefx arms) + the first generate() (compiles and captures included); ready = from the
process's start (imports, model build) to the first call's return, less transformers' run in the saving process.
Counted per arm (in the saving process, moefx's part apart from transformers'): dynamo's traces (`dynamo_graphs`,
the graphs it traced; `dynamo_frames`, the frames it was asked to trace), compiles (inductor's
`fxgraph_cache_miss`, and AOTAutograd's misses, which are the only count where a saved-trace compile bundles
inductor's output into AOTAutograd's cache entry), Triton compiles (`inductor_triton_compiles`, the kernels
inductor's generated code sent to compile, and `moefx_triton_compiles`, first-launch compiles of moefx's own
kernels: their entries that appeared in the arm's Triton folder and were not written there from moefx's file; None
off CUDA), and each capture's seconds (first run, check run, capture: `moefx/engine/graphs.py`; the warm-ups
counted as the runs it timed before each). A new machine with moefx's file should show 0 dynamo graphs, 0 inductor
and AOTAutograd misses and 0 Triton compiles. The warm arms' tokens must equal the cold arm's. Spans are read with
`bench.harness.synced_now` (the wall clock once the device is done).
Writes JSON to $OUT/coldstart_<layers>l<tag>.json and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
ARMS = ("hf_static", "moefx_cold", "moefx_warm", "moefx_restart", "moefx_restart_serial")
DEFAULT_ARMS = ("moefx_cold", "moefx_warm", "moefx_restart")
RESTARTS = ("moefx_restart", "moefx_restart_serial")  # the arms that find the Triton folder moefx_cold left


def child(args: argparse.Namespace) -> dict:
    """One arm in this process; its row."""
    import torch
    from torch._dynamo.utils import counters

    sys.path.insert(0, str(ROOT))
    import moefx
    from bench.harness import synced_now
    from moefx.kernels import triton_cache
    from moefx.models import build_model, qwen3_moe_config, tiny_qwen3_moe_config

    triton_before = _TritonEntries(triton_cache) if args.device == "cuda" else None
    triton_times = _TritonTimes.install() if args.device == "cuda" else None
    cfg = tiny_qwen3_moe_config(num_hidden_layers=args.layers) if args.tiny else qwen3_moe_config(args.layers)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(cfg, seed=0, dtype=dtype, device=args.device, routing="balanced").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, cfg.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False)
    built = synced_now(args.device)
    row: dict = {"arm": args.child}
    hf_s = 0.0
    if args.child == "hf_static" or (args.child == "moefx_cold" and args.hf_first):
        out = model.generate(ids, cache_implementation="static", **_hf_compile(args.device), **kwargs)
        hf_s = synced_now(args.device) - built
        hf = {"first_call_s": round(hf_s, 2), "ready_s": round(time.perf_counter() - START, 2),
              "tokens": out[:, args.prompt:].tolist(), **_compile_counts(counters)}
        if args.child == "hf_static":
            row.update(hf)
        else:
            row["hf_static"] = hf
            built = time.perf_counter()
    before = _compile_counts(counters)
    phases_before = _phase_totals()
    if triton_times is not None:
        triton_times.mark()
    if args.child != "hf_static":
        config: dict = {}
        if args.max_batch_size:
            config["max_batch_size"] = args.max_batch_size
        if args.layer_regions != "auto":  # the default: left out, so the default run has the README's config
            config["layer_regions"] = args.layer_regions
        model = moefx.optimize(model, config=config or None)
        row["optimize_s"] = round(time.perf_counter() - built, 2)
        out = model.generate(ids, **kwargs)
        synced_now(args.device)
        engine = model.moefx_generate.engine
        cache = getattr(engine, "compile_cache", None)
        warmups = max((sum(k.endswith("_run") for k in entry) for entry in engine.stats.capture_seconds), default=0)
        row.update(compiles=engine.stats.compiles, backend_s=engine.stats.compile_s, captures=engine.stats.captures,
                   capture_s=engine.stats.capture_seconds, capture_warmups=warmups,
                   cache_loaded=cache.loaded if cache else None, cache_file=str(cache.path) if cache else None,
                   traces_loaded=engine.aot_steps.loaded() if engine.aot_steps is not None else None)
        if triton_before is not None:
            row.update(triton_before.since(triton_cache))
        if triton_times is not None:
            row.update(triton_times.of(triton_cache.moefx_kernel_names()))
        row["tokens"] = out[:, args.prompt:].tolist()
    done = time.perf_counter()
    counts = _compile_counts(counters)
    row.update(first_call_s=round(done - built, 2), ready_s=round(done - START - hf_s, 2),
               build_s=round(built - START - hf_s, 2),
               **{k: counts[k] - before[k] for k in counts}, phase_s=_phases(phases_before))
    return row


def _hf_compile(device: str) -> dict:
    """transformers compiles its static-cache decode step on CUDA only unless its CompileConfig says otherwise (a
    private flag, for its tests): set on the CPU, so the smoke run has the same protocol and a peer."""
    if device == "cuda":
        return {}
    from transformers import CompileConfig

    config = CompileConfig()
    config._compile_all_devices = True
    return {"compile_config": config}


def _compile_counts(counters: Any) -> dict[str, int]:
    """Compiles inductor and AOTAutograd did (misses) or served from their caches (hits), graphs dynamo traced and
    the frames it was asked to trace, and the Triton kernels inductor's generated code sent to compile (Triton's own
    cache folder may still serve them: on an empty folder each is a compile), so far in this process (a row holds
    its own part: the saving process's moefx row less transformers')."""
    return {"fxgraph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
            "fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
            "aot_autograd_cache_miss": int(counters["aot_autograd"]["autograd_cache_miss"]),
            "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
            "dynamo_frames": int(counters["frames"]["total"]),
            "inductor_triton_compiles": int(counters["inductor"]["async_compile_cache_miss"])}


class _TritonEntries:
    """moefx's Triton kernels compiled at their first launch in this process: their entries in the arm's Triton
    folder that were neither there at the start nor written there from moefx's compile-cache file (whose `restore`
    is wrapped to record what it writes). Triton writes an entry only when it compiles (a hit reads it)."""

    def __init__(self, triton_cache: Any) -> None:
        folder = triton_cache.cache_dir()
        self.at_start = {e.name for e in folder.iterdir()} if folder is not None and folder.is_dir() else set()
        self.restored: set[str] = set()
        restore = triton_cache.restore

        def recording(entries: dict) -> int:
            here = triton_cache.cache_dir()
            self.restored.update(k for k in entries if here is None or not (here / k).is_dir())
            return restore(entries)

        triton_cache.restore = recording

    def since(self, triton_cache: Any) -> dict[str, int]:
        found = triton_cache.entries()
        new = {name: kind for name, kind in found.items() if name not in self.at_start | self.restored}
        return {"moefx_triton_compiles": sum(kind == "kernel" for kind in new.values()),
                "triton_launchers_built": sum(kind == "launcher" for kind in new.values()),
                "triton_entries_restored": len(self.restored)}


def _phase_totals() -> dict[str, float]:
    """Seconds per compile phase so far in this process (dynamo's own timers, summed over its compiles)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # a torch without dynamo's timers
        return {}
    return {name: sum(times) for name, times in compilation_time_metrics.items()}


def _phases(before: dict[str, float], top: int = 16) -> dict[str, float]:
    """The longest compile phases since `before` (the saving process's moefx row less transformers' compile):
    where the first call's seconds went."""
    total = {name: s - before.get(name, 0.0) for name, s in _phase_totals().items()}
    return {name: round(s, 2) for name, s in sorted(total.items(), key=lambda kv: -kv[1])[:top]}


class _TritonTimes:
    """Seconds Triton spent compiling in this process: `compile` per kernel name (its compilation listener, where
    this Triton has one), compiles (cache misses) apart from loads of a binary its cache folder holds (hits), and
    the C builds of its launcher stubs (`triton.runtime.build._build`, where it builds them). Inductor's kernels
    compiled in its worker processes are not seen here; moefx's own kernels compile in this process, at their first
    launch."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, bool], float] = {}
        self.builds: list[float] = []
        self.builds_from = 0  # `mark`: the C builds before it are not the row's (transformers' compile ran first)

    def mark(self) -> None:
        self.builds_from = len(self.builds)

    @classmethod
    def install(cls) -> _TritonTimes | None:
        try:
            from triton import knobs
            from triton.runtime import build
        except ImportError:  # no Triton, or one without knobs
            return None
        compilation = getattr(knobs, "compilation", None)
        if compilation is None or not hasattr(compilation, "listener"):
            return None
        record = cls()
        chained = compilation.listener

        def listener(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
            name = getattr(getattr(src, "fn", None), "__name__", None) or getattr(src, "name", "?")
            key = (name, bool(cache_hit))
            spent = getattr(times, "total", None)  # microseconds
            if isinstance(spent, (int, float)):
                record.seconds[key] = record.seconds.get(key, 0.0) + spent / 1e6
            if chained is not None:
                chained(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

        compilation.listener = listener
        c_build = getattr(build, "_build", None)
        if c_build is not None:
            def timed_build(*args: Any, **kwargs: Any) -> Any:
                t = time.perf_counter()
                try:
                    return c_build(*args, **kwargs)
                finally:
                    record.builds.append(time.perf_counter() - t)

            build._build = timed_build
        return record

    def of(self, names: set[str]) -> dict[str, Any]:
        """moefx's kernels (`names`): compile and cache-load seconds, the five slowest compiles, and the launcher
        stubs' C builds since `mark` (count, seconds)."""
        mine = {key: s for key, s in self.seconds.items() if key[0] in names}
        slowest = sorted(((k[0], round(s, 2)) for k, s in mine.items() if not k[1]), key=lambda x: -x[1])[:5]
        return {"moefx_triton_compile_s": round(sum(s for k, s in mine.items() if not k[1]), 2),
                "moefx_triton_load_s": round(sum(s for k, s in mine.items() if k[1]), 2),
                "moefx_triton_slowest": slowest,
                "triton_c_builds": len(self.builds) - self.builds_from,
                "triton_c_build_s": round(sum(self.builds[self.builds_from:]), 2)}


def _run_arm(arm: str, args: argparse.Namespace, tmp: Path) -> dict:
    triton = "moefx_cold" if arm in RESTARTS else arm
    serial = {"TORCHINDUCTOR_COMPILE_THREADS": "1"} if arm == "moefx_restart_serial" else {}
    env = {**os.environ, **serial, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"inductor-{arm}"), "TRITON_CACHE_DIR": str(tmp / f"triton-{triton}"),
           "MOEFX_COMPILE_CACHE": str(tmp / "moefx-compile")}
    cmd = [sys.executable, __file__, "--child", arm, "--layers", str(args.layers), "--batch", str(args.batch),
           "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens), "--device", args.device,
           "--layer-regions", args.layer_regions, "--max-batch-size", str(args.max_batch_size),
           *(["--tiny"] if args.tiny else []), *([] if args.hf_first else ["--no-hf-first"])]
    print(f"{arm}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        return {"arm": arm, "error": f"exit {proc.returncode}", "process_s": round(time.perf_counter() - start, 1)}
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["process_s"] = round(time.perf_counter() - start, 1)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"any of {', '.join(ARMS)}")
    ap.add_argument("--max-batch-size", type=int, default=0,
                    help="moefx config max_batch_size (0: unset, the README path: on CUDA the cap comes from memory)")
    ap.add_argument("--no-hf-first", dest="hf_first", action="store_false",
                    help="the saving process (moefx_cold) runs moefx alone, without transformers' compile first")
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny model in fp32 (a CPU smoke run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tag", default="")
    ap.add_argument("--layer-regions", choices=("auto", "all", "prefill", "none", "frames"), default="auto",
                    help="moefx config layer_regions (frames: each layer call a compiled frame of its own)")
    ap.add_argument("--child", default=None, choices=ARMS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; valid: {list(ARMS)}")
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="moefx-coldstart-") as tmp:
        for arm in arms:
            rows.append(_run_arm(arm, args, Path(tmp)))
    by_arm = {r["arm"]: r for r in rows}
    cold = by_arm.get("moefx_cold", {})
    if "hf_static" not in by_arm and "hf_static" in cold:  # the peer, from the saving process
        rows.insert(0, {"arm": "hf_static", "in_process": "moefx_cold", **cold.pop("hf_static")})
    for warm in (by_arm.get(arm, {}) for arm in ("moefx_warm", *RESTARTS)):
        if "tokens" in cold and "tokens" in warm:
            warm["same_tokens_as_cold"] = warm["tokens"] == cold["tokens"]
    import torch

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke run)"
    result = {"stage": "coldstart", "date": datetime.date.today().isoformat(), "device": device,
              "versions": {"torch": torch.__version__}, "command": " ".join(["python3", *sys.argv]),
              "layers": args.layers, "batch": args.batch, "prompt": args.prompt, "layer_regions": args.layer_regions,
              "max_batch_size": args.max_batch_size or None, "hf_first": args.hf_first, "rows": rows}
    path = out_dir / f"coldstart_{args.layers}l{args.tag}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path}\n| arm | first call s | ready s | dynamo graphs | compiles: inductor fx miss / hit, "
          "AOTAutograd miss | Triton compiles: inductor's, moefx's first-launch | decode capture s (first run + check "
          "run + capture) x warm-ups | notes |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        notes = r.get("error") or (f"compiles {r.get('compiles')}, loaded {r.get('cache_loaded')} (traces "
                                   f"{r.get('traces_loaded')}), dynamo graphs {r.get('dynamo_graphs')}, same tokens "
                                   f"{r.get('same_tokens_as_cold', '-')}" if r["arm"] != "hf_static" else
                                   f"in the process of {r['in_process']}" if r.get("in_process") else "")
        print(f"| {r['arm']} | {r.get('first_call_s')} | {r.get('ready_s')} | {r.get('dynamo_graphs', '-')} | "
              f"{r.get('fxgraph_cache_miss')} / {r.get('fxgraph_cache_hit')}, "
              f"{r.get('aot_autograd_cache_miss', '-')} | {r.get('inductor_triton_compiles', '-')}, "
              f"{r.get('moefx_triton_compiles', '-')} | {_captures(r)} | {notes} |")
    return 0 if all("error" not in r for r in rows) else 1


def _captures(row: dict) -> str:
    """Each decode capture's seconds, by batch: total (first run + check run + capture), and the warm-up count."""
    parts = [f"b{c['batch']}: {c.get('first_run', 0) + c.get('check_run', 0) + c.get('capture', 0):.2f} "
             f"({c.get('first_run', 0):.2f} + {c.get('check_run', 0):.2f} + {c.get('capture', 0):.2f})"
             for c in row.get("capture_s") or [] if c["what"] == "decode"]
    return f"{'; '.join(parts)} x {row.get('capture_warmups')}" if parts else "-"


if __name__ == "__main__":
    sys.exit(main())
