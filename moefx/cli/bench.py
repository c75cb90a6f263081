"""`moefx bench`: A/B two configs on the same model, with the noise measured.

Each arm runs in fresh processes with its own inductor cache; the processes are interleaved (A, B, A, B, ...)
and each times `--repeats` greedy runs after warming up. Medians over all runs of an arm are compared. The
noise is the wider arm's spread (interquartile range of its decode tok/s over its median). Verdict on B's decode
tok/s against A's: "REGRESSION" (exit 1) when B is slower by more than the red line and the change is measured
(larger than the noise, or the noise within the red line); "ok" (exit 0) when no such slowdown is there (a change
within the red line with the noise within it too, or B faster beyond the noise); "inconclusive" (exit 3) when the
noise is wider than the red line and the change is within the noise. `-cc.KEY=VALUE` overrides apply to both arms.
`--json` is strict JSON: a spread that is not known (one sample) is null.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from moefx.cli.common import add_model_args, format_table, progress
from moefx.config import CompilationConfig

METRICS = ("prefill_ms", "itl_ms", "decode_tok_s")
EXIT_OK, EXIT_REGRESSION, EXIT_INCONCLUSIVE = 0, 1, 3
MIN_MEASURED = 2  # measured samples an arm needs (and at least half of its samples) for a verdict


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p, "tiny-qwen3-moe", positional=False)
    p.add_argument("--a", default="{}", help="baseline config (path or JSON); default: moefx defaults")
    p.add_argument("--b", required=True, help="candidate config (path or JSON)")
    p.add_argument("--runs", type=int, default=3, help="processes per arm, interleaved A, B, A, B, ...")
    p.add_argument("--repeats", type=int, default=5, help="timed greedy runs per process")
    p.add_argument("--red-line", type=float, default=3.0, help="max allowed decode tok/s regression of B, in %%")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both arms run")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per row")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per run, at least 2")
    p.add_argument("--batch", type=int, default=1, help="rows per request")
    p.add_argument("--json", default=None, help="write all runs, medians, spreads and the verdict to this file")


def _arm_command(args: argparse.Namespace, config: str) -> list[str]:
    cmd = [
        sys.executable, "-m", "moefx.cli.bench_arm", "--config", config, "--device", args.device,
        "--model", args.model, "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
        "--batch", str(args.batch), "--repeats", str(args.repeats),
    ]  # fmt: skip
    return cmd + (["--layers", str(args.layers)] if args.layers is not None else [])


def spread_pct(samples: list[float]) -> float:
    """Interquartile range over the median, in %: the run-to-run noise of one arm (inf with one sample)."""
    if len(samples) < 2:
        return float("inf")
    q1, q2, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return 100.0 * (q3 - q1) / q2 if q2 > 0 else float("inf")


def outside_noise(change_pct: float, noise_pct: float) -> bool:
    """Whether a change of `change_pct` (either sign, in %) can be told from run-to-run noise of `noise_pct` (the
    wider arm's `spread_pct`): only a change larger than the spread is a measured difference. `moefx bench` asks it
    of its red line, `moefx demo` of its speed ratio, so neither claims a difference inside its own noise."""
    return abs(change_pct) > noise_pct


def verdict(a: list[float], b: list[float], red_line: float) -> tuple[str, int, float, float]:
    """(verdict line, exit code, change of B vs A in %, noise in %) from each arm's decode tok/s samples."""
    change = 100.0 * (statistics.median(b) / statistics.median(a) - 1.0)
    noise = max(spread_pct(a), spread_pct(b))
    head = f"decode tok/s B vs A: {change:+.1f}% (red line -{red_line:.1f}%, noise {noise:.1f}%)"
    if not (outside_noise(red_line, noise) or outside_noise(change, noise)):
        return (f"{head}: inconclusive: the change is within the arms' spread ({noise:.1f}%), which is wider than "
                f"the red line; use a quieter machine, more --runs/--repeats or a wider --red-line"), \
            EXIT_INCONCLUSIVE, change, noise
    if change < -red_line:
        return f"{head}: REGRESSION", EXIT_REGRESSION, change, noise
    return f"{head}: ok", EXIT_OK, change, noise


def summarize(results: dict[str, list[list[dict]]], red_line: float) -> dict:
    """Medians, spreads and the verdict from each arm's per-process samples, over the measured samples only.

    A sample with `decode_measured` false carries a decode rate the noise made up (t(n) <= t(1)), so it enters
    no aggregate, of any metric; with too few measured samples in either arm the verdict is inconclusive."""
    measured = {arm: [s for run in runs for s in run if s.get("decode_measured", True)]
                for arm, runs in results.items()}
    counts = {arm: (len(measured[arm]), sum(len(run) for run in runs)) for arm, runs in results.items()}
    pooled = {arm: {m: [s[m] for s in kept] for m in METRICS} for arm, kept in measured.items()}
    medians = {arm: {m: statistics.median(v) if v else None for m, v in p.items()} for arm, p in pooled.items()}
    spreads = {arm: {m: spread_pct(v) if v else None for m, v in p.items()} for arm, p in pooled.items()}
    short = [(arm, n, total) for arm, (n, total) in counts.items() if n < max(MIN_MEASURED, (total + 1) // 2)]
    if short and all(n == total for _, n, total in short):  # every sample measured, too few of them
        line = "decode tok/s B vs A: inconclusive: " + "; ".join(
            f"{n} sample{'s' if n != 1 else ''} in arm {arm.upper()}" for arm, n, _ in short
        ) + f" (a spread, so a verdict, needs at least {MIN_MEASURED} per arm: more --runs or --repeats)"
        code, change, noise = EXIT_INCONCLUSIVE, None, None
    elif short:
        line = "decode tok/s B vs A: inconclusive: " + "; ".join(
            f"{n} of {total} samples measured in arm {arm.upper()}" for arm, n, total in short
        ) + " (the machine's noise swallowed the decode steps: use a quieter machine or more --new-tokens)"
        code, change, noise = EXIT_INCONCLUSIVE, None, None
    else:
        line, code, change, noise = verdict(pooled["a"]["decode_tok_s"], pooled["b"]["decode_tok_s"], red_line)
    return {"medians": medians, "spread_pct": spreads, "measured": counts, "verdict": line, "exit_code": code,
            "change_pct": change, "noise_pct": noise}


def _configs(args: argparse.Namespace) -> dict[str, str]:
    """Both arms' configs, validated (with the -cc overrides applied) before any time is spent."""
    overrides = getattr(args, "config_overrides", [])
    configs = {}
    for arm in ("a", "b"):
        cfg = CompilationConfig.from_any(getattr(args, arm))
        configs[arm] = json.dumps((cfg.with_overrides(overrides) if overrides else cfg).to_dict())
    return configs


def run(args: argparse.Namespace) -> int:
    for name in ("runs", "repeats", "batch", "prompt_len", "new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (decode speed needs two tokens), got {args.new_tokens}")
    if not 0 < args.red_line < float("inf"):  # above 100 no slowdown crosses it: a verdict however noisy the machine
        raise ValueError(f"--red-line must be a percentage > 0, got {args.red_line}")
    from moefx.models.spec import model_config

    model_config(args.model)  # a bad name or path fails here, not in every arm
    configs = _configs(args)
    results: dict[str, list[list[dict[str, float]]]] = {"a": [], "b": []}
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
                results[arm].append(json.loads(proc.stdout.strip().splitlines()[-1])["samples"])
    summary = summarize(results, args.red_line)
    medians, spreads = summary["medians"], summary["spread_pct"]

    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None or not math.isfinite(value) else fmt.format(value)  # "-": not known

    rows = [(m, cell(medians["a"][m], "{:.3f}"), cell(spreads["a"][m], "{:.1f}%"), cell(medians["b"][m], "{:.3f}"),
             cell(spreads["b"][m], "{:.1f}%")) for m in METRICS]
    counts = summary["measured"]
    head = " / ".join(f"{arm.upper()} {n} of {total}" for arm, (n, total) in counts.items())
    print(format_table([f"median of measured samples ({head})", "A", "A spread", "B", "B spread"], rows))
    line, code, change, noise = summary["verdict"], summary["exit_code"], summary["change_pct"], summary["noise_pct"]
    print(f"\n{line}")
    if args.json:
        Path(args.json).write_text(json.dumps(strict_json({
            "model": args.model, "configs": {k: json.loads(v) for k, v in configs.items()}, "runs": results,
            "medians": medians, "spread_pct": spreads, "change_pct": change, "noise_pct": noise,
            "measured": {arm: {"measured": n, "samples": total} for arm, (n, total) in counts.items()},
            "red_line_pct": args.red_line, "verdict": line, "exit_code": code,
        }), indent=1, allow_nan=False))
    return code


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float (a spread of one sample is inf) as None, so the file is JSON any strict
    parser reads: null means "not known", never a number."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value
