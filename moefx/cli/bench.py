"""`moefx bench`: A/B two configs on the same model. Each arm has its own inductor cache; arms are run
interleaved (A, B, A, B, ...) in fresh processes, medians are compared, and a regression of B beyond the
red line declared up front fails the command (exit 1)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from moefx.cli.common import format_table, progress
from moefx.config import CompilationConfig

METRICS = ("prefill_ms", "itl_ms", "decode_tok_s")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="A/B two configs: separate caches, interleaved runs, median", description=__doc__)
    p.add_argument("--a", default="{}", help="baseline config (path or JSON); default: moefx defaults")
    p.add_argument("--b", required=True, help="candidate config (path or JSON)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--red-line", type=float, default=3.0, help="max allowed decode tok/s regression of B, in %%")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--json", default=None, help="write all runs and medians to this file")
    p.set_defaults(func=run)


def _arm_command(args: argparse.Namespace, config: str) -> list[str]:
    return [
        sys.executable, "-m", "moefx.cli.bench_arm", "--config", config, "--device", args.device,
        "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--batch", str(args.batch),
    ]  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.runs < 1:
        raise ValueError(f"--runs must be >= 1, got {args.runs}")
    configs = {}
    for arm in ("a", "b"):
        cfg = CompilationConfig.from_any(getattr(args, arm))  # validate before spending time
        configs[arm] = json.dumps(cfg.to_dict())
    results: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory(prefix="moefx-bench-") as tmp:
        for i in range(args.runs):
            for arm in ("a", "b"):
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / f"inductor_{arm}"))
                with progress(f"run {i + 1}/{args.runs}, arm {arm.upper()}"):
                    proc = subprocess.run(
                        _arm_command(args, configs[arm]), env=env, capture_output=True, text=True, check=False
                    )
                if proc.returncode != 0:
                    print(proc.stderr[-4000:], file=sys.stderr)
                    raise ValueError(f"arm {arm.upper()} failed (exit {proc.returncode}); its stderr is above")
                results[arm].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    medians = {arm: {m: statistics.median(r[m] for r in runs) for m in METRICS} for arm, runs in results.items()}
    change = 100.0 * (medians["b"]["decode_tok_s"] / medians["a"]["decode_tok_s"] - 1.0)
    rows = [(m, f"{medians['a'][m]:.3f}", f"{medians['b'][m]:.3f}") for m in METRICS]
    print(format_table([f"median of {args.runs} runs", "A", "B"], rows))
    regressed = change < -args.red_line
    verdict = "REGRESSION" if regressed else "ok"
    print(f"\ndecode tok/s B vs A: {change:+.1f}% (red line -{args.red_line:.1f}%): {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "medians": medians, "change_pct": change}, indent=1))
    return 1 if regressed else 0
