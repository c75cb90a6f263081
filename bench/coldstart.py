"""Cold start: what a user waits for before the first token, in fresh processes (issue 29).

Qwen3-MoE at Qwen3-30B-A3B widths, `--layers` deep, seeded random weights, bf16 (`--tiny`: the embedded tiny
model, fp32, a CPU smoke run), a `--prompt`-token prompt, greedy, `--new-tokens` tokens. Each arm is a new
Python process with its own empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, so only what the arm is meant to
reuse is reused:
  hf_static    transformers' generate(cache_implementation="static") (it compiles its own decode step)
  moefx_cold   moefx.optimize(model) + generate(), moefx's compile cache empty (the process writes it)
  moefx_warm   the same in a new process with the file moefx_cold wrote (inductor's and Triton's own caches
               empty: every hit comes from moefx's compile cache)
  moefx_restart  as moefx_warm, with the Triton cache moefx_cold left (a restart on the same machine, where
               ~/.triton/cache survives: kernels Triton builds outside inductor, e.g. moefx's MoE ops, are kept)
First call = optimize (moefx arms) + the first generate() (compiles and captures included); ready = from the
process's start (imports, model build) to the first call's return. The warm arm's tokens must equal the cold
arm's; its inductor cache misses are counted (0 when nothing was compiled anew).
Writes JSON to $OUT/coldstart_<layers>l.json and prints a table last.
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

START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
ARMS = ("hf_static", "moefx_cold", "moefx_warm", "moefx_restart")


def child(args: argparse.Namespace) -> dict:
    """One arm in this process; its row."""
    import torch
    from torch._dynamo.utils import counters

    sys.path.insert(0, str(ROOT))
    import moefx
    from moefx.models import build_model, qwen3_moe_config, tiny_qwen3_moe_config

    cfg = tiny_qwen3_moe_config(num_hidden_layers=args.layers) if args.tiny else qwen3_moe_config(args.layers)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(cfg, seed=0, dtype=dtype, device=args.device, routing="balanced").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, cfg.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False)
    if args.device == "cuda":
        torch.cuda.synchronize()
    built = time.perf_counter()
    row: dict = {"arm": args.child}
    if args.child == "hf_static":
        out = model.generate(ids, cache_implementation="static", **kwargs)
    else:
        config = {"max_batch_size": args.batch}
        if args.layer_regions != "auto":  # the default: left out, so the default run has the README's config
            config["layer_regions"] = args.layer_regions
        model = moefx.optimize(model, config=config)
        row["optimize_s"] = round(time.perf_counter() - built, 2)
        out = model.generate(ids, **kwargs)
        engine = model.moefx_generate.engine
        cache = getattr(engine, "compile_cache", None)
        row.update(compiles=engine.stats.compiles, backend_s=engine.stats.compile_s, captures=engine.stats.captures,
                   cache_loaded=cache.loaded if cache else None, cache_file=str(cache.path) if cache else None,
                   traces_loaded=engine.aot_steps.loaded() if engine.aot_steps is not None else None)
    if args.device == "cuda":
        torch.cuda.synchronize()
    done = time.perf_counter()
    row.update(first_call_s=round(done - built, 2), ready_s=round(done - START, 2),
               build_s=round(built - START, 2), tokens=out[:, args.prompt:].tolist(),
               fxgraph_cache_miss=int(counters["inductor"]["fxgraph_cache_miss"]),
               fxgraph_cache_hit=int(counters["inductor"]["fxgraph_cache_hit"]),
               dynamo_graphs=int(counters["stats"]["unique_graphs"]), phase_s=_phases())
    return row


def _phases(top: int = 16) -> dict[str, float]:
    """The longest compile phases of this process (dynamo's own timers, summed over its compiles): where the
    first call's seconds went."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # a torch without dynamo's timers
        return {}
    total = {name: sum(times) for name, times in compilation_time_metrics.items()}
    return {name: round(s, 2) for name, s in sorted(total.items(), key=lambda kv: -kv[1])[:top]}


def _run_arm(arm: str, args: argparse.Namespace, tmp: Path) -> dict:
    triton = "moefx_cold" if arm == "moefx_restart" else arm
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"inductor-{arm}"), "TRITON_CACHE_DIR": str(tmp / f"triton-{triton}"),
           "MOEFX_COMPILE_CACHE": str(tmp / "moefx-compile")}
    cmd = [sys.executable, __file__, "--child", arm, "--layers", str(args.layers), "--batch", str(args.batch),
           "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens), "--device", args.device,
           "--layer-regions", args.layer_regions, *(["--tiny"] if args.tiny else [])]
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
    ap.add_argument("--arms", default=",".join(ARMS))
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
    for warm in (by_arm.get("moefx_warm", {}), by_arm.get("moefx_restart", {})):
        if "tokens" in cold and "tokens" in warm:
            warm["same_tokens_as_cold"] = warm["tokens"] == cold["tokens"]
    import torch

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke run)"
    result = {"stage": "coldstart", "date": datetime.date.today().isoformat(), "device": device,
              "versions": {"torch": torch.__version__}, "command": " ".join(["python3", *sys.argv]),
              "layers": args.layers, "batch": args.batch, "prompt": args.prompt, "layer_regions": args.layer_regions,
              "rows": rows}
    path = out_dir / f"coldstart_{args.layers}l{args.tag}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {path}\n| arm | first call s | ready s (from process start) | fx cache miss / hit | notes |")
    print("|---|---|---|---|---|")
    for r in rows:
        notes = r.get("error") or (f"compiles {r.get('compiles')}, loaded {r.get('cache_loaded')} (traces "
                                   f"{r.get('traces_loaded')}), dynamo graphs {r.get('dynamo_graphs')}, same tokens "
                                   f"{r.get('same_tokens_as_cold', '-')}" if r["arm"] != "hf_static" else "")
        print(f"| {r['arm']} | {r.get('first_call_s')} | {r.get('ready_s')} | {r.get('fxgraph_cache_miss')} / "
              f"{r.get('fxgraph_cache_hit')} | {notes} |")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
