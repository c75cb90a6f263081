"""The work of `moefx calibrate` (moefx/cli/calibrate.py holds its arguments, so `--help` needs no torch)."""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from moefx.backends import available_backends
from moefx.backends.calibration import (
    CalibrationRow,
    MRange,
    crossover_ranges,
    device_identity,
    dtype_name,
    key_for_tensors,
    user_table_dir,
    write_problem,
    write_row,
)
from moefx.backends.dense_policy import DenseRow, dense_key, model_projections, write_dense_row
from moefx.calibrate import PARTS, QUANTS
from moefx.calibrate import dense as dense_cal
from moefx.calibrate import moe as moe_cal
from moefx.calibrate.plot import plot
from moefx.calibrate.sweep import RETIME_ROUNDS, UPSTREAM, Sweep, sweep
from moefx.cli.common import ProgressBar, format_table

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FP8_CAPABILITY = (8, 9)


def _shape(args: argparse.Namespace) -> tuple[str, int, int, int, int]:
    """(label, E, H, I per device, top_k) from --model or the explicit sizes."""
    explicit = [args.experts, args.hidden, args.intermediate, args.topk]
    if args.model and any(v is not None for v in explicit):
        raise ValueError("give either --model or --experts/--hidden/--intermediate/--topk, not both")
    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}")
    if args.model:
        label, (e, h, i, k) = args.model, _model_shape(args.model)
    elif all(v is not None for v in explicit):
        if min(explicit) < 1:
            raise ValueError(f"--experts/--hidden/--intermediate/--topk must be >= 1, got {explicit}")
        label, (e, h, i, k) = f"E{args.experts}-H{args.hidden}-I{args.intermediate}-k{args.topk}", explicit
    else:
        raise ValueError("give --model NAME|config or all of --experts, --hidden, --intermediate, --topk")
    if i % args.tp:
        raise ValueError(f"intermediate size {i} is not divisible by --tp {args.tp}")
    if k > e:
        raise ValueError(f"top_k {k} exceeds the number of experts {e}")
    return (f"{label}-tp{args.tp}" if args.tp > 1 else label), e, h, i // args.tp, k


def _model_shape(spec: str) -> tuple[int, int, int, int]:
    from moefx.facts import ModelSignature
    from moefx.models.spec import model_config

    ms = ModelSignature.from_config(model_config(spec))
    values = (ms.num_experts, ms.hidden_size, ms.moe_intermediate_size, ms.top_k)
    if not all(values):
        raise ValueError(f"--model {spec!r}: not an MoE config (experts, hidden, moe intermediate, top_k = {values})")
    return values  # type: ignore[return-value]


def _choices(value: str | None, option: str, valid: tuple[str, ...], default: list[str]) -> list[str]:
    if value is None:
        return default
    picked = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in picked if v not in valid]
    if bad or not picked:
        raise ValueError(f"{option} {value!r}: invalid {bad}; valid choices: {list(valid)}")
    return picked


def _fp8_available(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def run(args: argparse.Namespace) -> int:
    label, e, h, i, k = _shape(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available; use --device cpu")
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    modes = _choices(args.modes, "--modes", ("eager", "capture"), ["eager", "capture"] if device.type == "cuda"
                     else ["eager"])
    if "capture" in modes and device.type != "cuda":
        raise ValueError("--modes capture needs a CUDA device (CUDA-graph capture); use --modes eager on CPU")
    parts = _choices(args.parts, "--parts", PARTS, list(PARTS) if args.model else ["moe"])
    if "dense" in parts and not args.model:
        raise ValueError("--parts dense needs --model: the dense shapes come from the model's attention sizes")
    quants = [args.quant] if args.quant else (list(QUANTS) if args.model and _fp8_available(device)
                                                else ["none"])
    if args.max_m < 1:
        raise ValueError(f"--max-m must be >= 1, got {args.max_m}")
    if args.reps is not None and args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    reps = args.reps or (3 if args.quick else (20 if device.type == "cuda" else 5))
    moe_names = [*available_backends(device), UPSTREAM]
    if args.backends:
        wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
        unknown = [b for b in wanted if b not in moe_names]
        if unknown:
            raise ValueError(f"--backends: {unknown} not available on {device.type}; valid choices: {moe_names}")
        moe_names = wanted
    moe_grid = _grid(moe_cal.QUICK_GRID if args.quick else moe_cal.GRID, args.max_m)
    dense_grid = _grid(dense_cal.QUICK_GRID if args.quick else dense_cal.GRID, args.max_m)
    projections = _projections(args) if "dense" in parts else []
    jobs = ([("moe", q, None) for q in quants] if "moe" in parts else []) + [
        ("dense", q, p) for q in quants for p in projections if q == "none" or p[3]]
    steps = sum(len(modes) * (len(moe_grid if part == "moe" else dense_grid) + 1) for part, _, _ in jobs)

    output = Path(args.output) if args.output else user_table_dir() / f"{_slug(device_identity(device)[0])}.yaml"
    unwritable = write_problem(output)
    if unwritable:
        raise ValueError(unwritable)
    print(f"calibrating {label} on {device_identity(device)[0]}: {' and '.join(parts)}, {dtype_name(dtype)}, "
          f"weights {' and '.join(quants)}, modes {modes}; {len(jobs)} shapes, {steps} timing steps -> {output}")
    start = time.perf_counter()
    bar = ProgressBar(steps)
    done: list[str] = []
    for part, quant, proj in jobs:
        if part == "moe":
            problem = moe_cal.MoeProblem(e, h, i, k, dtype, quant, device, args.seed)
            shape = f"{label} E={e} H={h} I={i} top_k={k}"
            done += _calibrate_moe(args, problem, moe_names, modes, moe_grid, reps, shape, label, quant, output, bar)
        else:
            name, ns, kk, _ = proj
            problem = dense_cal.DenseProblem(ns, kk, dtype, quant != "none", device, args.seed)
            shape = f"{label} {name} N={','.join(map(str, ns))} K={kk}"
            done += _calibrate_dense(args, problem, modes, dense_grid, reps, shape, quant, output, bar)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    print(f"\n{len(done)} rows in {time.perf_counter() - start:.0f} s:")
    for line in done:
        print(f"  {line}")
    print(f"\n{where_read(output)}")
    return 0


def _grid(grid: tuple[int, ...], max_m: int) -> tuple[int, ...]:
    return tuple(m for m in grid if m <= max_m) or (1,)


def _projections(args: argparse.Namespace) -> list[tuple[str, tuple[int, ...], int, bool]]:
    """The dense shapes the plan reads for --model at --tp (dense_policy.model_projections)."""
    from moefx.facts import ModelSignature
    from moefx.models.spec import model_config

    ms = ModelSignature.from_config(model_config(args.model))
    found, why = model_projections(ms, argparse.Namespace(tp_size=args.tp))
    if not found:
        print(f"  no dense rows for {args.model}: {why}", file=sys.stderr)
    return found


def _provenance(args: argparse.Namespace, shape: str, grid: tuple[int, ...], reps: int, quant: str, part: str,
                device: torch.device) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device_identity(device)[0],
        "torch": str(torch.__version__),
        "triton": _triton_version(),
        "moefx": _moefx_version(),
        "command": _command(args, grid, reps, quant, part),
        "shape": shape,
        "grid": f"M {', '.join(map(str, grid))} ({len(grid)} points), {reps} reps per point, contenders "
                f"interleaved, median; close calls re-timed up to {RETIME_ROUNDS} times, then uncertain",
    }


def _sweeps(problem: Any, names: list[str], modes: list[str], grid: tuple[int, ...], reps: int, what: str,
            bar: ProgressBar) -> dict[str, Sweep]:
    results = {}
    for mode in modes:
        result = sweep(problem, names, mode, grid, reps, step=lambda text: bar.step(f"{what}: {text}"))
        for name, why in result.skipped.items():
            bar.note(f"  {what} {mode}: {name}: {why}", err=True)
        if not result.timings:
            raise ValueError(f"{what}: no contender could be timed in mode {mode}")
        results[mode] = result
    return results


def _checked(what: str, names: list[str], rejected: dict[str, str], bar: ProgressBar) -> list[str]:
    for name, why in rejected.items():
        bar.note(f"  {what}: excluded {name}: {why}", err=True)
    if not names:
        raise ValueError(f"{what}: no contender matched the reference; nothing to calibrate")
    return names


def _calibrate_moe(args: argparse.Namespace, problem: moe_cal.MoeProblem, names: list[str], modes: list[str],
                   grid: tuple[int, ...], reps: int, shape: str, label: str, quant: str, output: Path,
                   bar: ProgressBar) -> list[str]:
    what = f"moe {dtype_name(problem.dtype)} quant={quant}"
    names = _checked(what, *moe_cal.check(problem, names), bar)
    results = _sweeps(problem, names, modes, grid, reps, what, bar)
    hidden, ids, _ = problem.inputs(1)
    provenance = _provenance(args, label, grid, reps, quant, "moe", problem.device)
    lines, all_ranges = [], {}
    for mode, result in results.items():
        ranges = crossover_ranges(result.timings, tolerance=result.tolerance, pinned=result.pinned)
        key = key_for_tensors(hidden, ids, problem.w13, problem.block, mode)
        notes = dict(provenance, skipped=result.skipped or None, tolerance=round(result.tolerance, 3),
                     uncertain={int(m): why for m, why in result.uncertain.items()} or None)
        source = write_row(output, CalibrationRow(key, ranges, notes, "", result.timings))
        all_ranges[mode] = ranges
        lines.append(f"{what} {mode}: {', '.join(r.text() for r in ranges)}  [{source}]")
        bar.note(_table(f"{shape} {what} {mode}", result, grid, reps, ranges) +
                 f"\n{mode} row {source} in {output}: " + ", ".join(r.text() for r in ranges))
    if (args.plot or "").lower() != "none":
        png = Path(args.plot) if args.plot and quant == (args.quant or "none") else \
            output.with_name(f"{output.stem}-{_slug(label)}-{quant}.png")
        title = f"{label} {dtype_name(problem.dtype)} quant={quant} on {device_identity(problem.device)[0]}"
        if plot(png, title, {mode: r.timings for mode, r in results.items()}, all_ranges):
            bar.note(f"plot: {png}")
        else:
            bar.note("plot skipped: matplotlib is not installed (pip install 'moefx[plot]')", err=True)
    return lines


def _calibrate_dense(args: argparse.Namespace, problem: dense_cal.DenseProblem, modes: list[str],
                     grid: tuple[int, ...], reps: int, shape: str, quant: str, output: Path,
                     bar: ProgressBar) -> list[str]:
    what = f"dense {shape.split(' ', 1)[1]} quant={quant}"
    names = _checked(what, *dense_cal.check(problem, dense_cal.contenders(problem.device)), bar)
    results = _sweeps(problem, names, modes, grid, reps, what, bar)
    provenance = _provenance(args, shape, grid, reps, quant, "dense", problem.device)
    lines = []
    for mode, result in results.items():
        ranges = crossover_ranges(result.timings, tolerance=result.tolerance, pinned=result.pinned)
        key = dense_key(problem.device, problem.ns, problem.k, problem.dtype, problem.block, mode)
        notes = dict(provenance, weight_copies=problem.calls, tolerance=round(result.tolerance, 3),
                     uncertain={int(m): why for m, why in result.uncertain.items()} or None)
        source = write_dense_row(output, DenseRow(key, ranges, notes, "", result.timings))
        lines.append(f"{what} {mode}: {', '.join(r.text() for r in ranges)}  [{source}]")
        bar.note(_table(f"{what} {mode}", result, grid, reps, ranges) +
                 f"\n{mode} row {source} in {output}: " + ", ".join(r.text() for r in ranges))
    return lines


def written_backend(ranges: Sequence[MRange], m: int) -> str:
    """The backend the written row gives at `m`."""
    return next(r.backend for r in ranges if r.contains(m))


def _table(title: str, result: Sweep, grid: tuple[int, ...], reps: int, ranges: Sequence[MRange]) -> str:
    """The timings per M and, as "chosen", the backend the written row gives there; where that is not the fastest,
    the cell names the fastest and a line below states the smoothing rule that kept it."""
    timings, pinned = result.timings, result.pinned
    cols = sorted(timings)
    rows, smoothed = [], False
    for m in grid:
        chosen = written_backend(ranges, m)
        fastest = min(cols, key=lambda c: timings[c].get(m, float("inf")))
        if m in pinned:
            cell = f"{chosen} (uncertain)"
        elif chosen != fastest and m in timings[chosen]:
            gap = 100.0 * (timings[chosen][m] / timings[fastest][m] - 1.0)
            cell, smoothed = f"{chosen} (smoothed: {fastest} {gap:.0f}% faster)", True
        else:
            cell = chosen
        rows.append([m, *(f"{timings[c][m]:.1f}" if m in timings[c] else "-" for c in cols), cell])
    text = f"\n{title} (µs, median of {reps} or more, contenders interleaved):\n" + format_table(["M", *cols, "chosen"],
                                                                                                  rows)
    if smoothed:
        text += (f"\nsmoothing (the row's ranges): an M keeps the previous M's backend while it is within "
                 f"{100 * result.tolerance:.0f}% of the fastest (the measured noise), and a backend that wins one grid "
                 f"point alone, between points another backend wins, loses it to that one")
    for m, why in result.uncertain.items():
        text += f"\ncrossover uncertain at M={m}: {why}"
    return text


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in text).strip("-").lower()


def where_read(output: Path) -> str:
    """Where the row went and which later plans read it: the user folder is read by every plan on this device,
    any other file only through a config's `calibration` list."""
    user = user_table_dir()
    if output.resolve().parent == user.resolve():
        return (f"wrote {output}: from now on moefx.optimize and `moefx plan` on this device read it for this shape "
                f"(the user table folder {user}, read before the shipped tables; delete the row or the file to undo)")
    return (f"wrote {output}: plans read it only when a config lists it, e.g. "
            f"config={{'calibration': ['{output}']}} (rows in the user table folder {user} are read without that)")


def _command(args: argparse.Namespace, grid: tuple[int, ...], reps: int, quant: str, part: str) -> str:
    """The calibrate command line that reproduces this row: the options as parsed, with this row's part and weight
    format, the grid's top and the reps actually run (so a --quick row does not claim --max-m 4096)."""
    parts = ["moefx calibrate"]
    chosen = {**vars(args), "max_m": grid[-1], "reps": reps, "quant": quant,
              "parts": part if args.model else args.parts}
    for opt in ("model", "tp", "experts", "hidden", "intermediate", "topk", "dtype", "quant", "parts", "modes",
                "device", "backends", "max_m", "reps", "seed"):
        value = chosen[opt]
        if value is not None:
            parts.append(f"--{opt.replace('_', '-')} {value}")
    return " ".join(parts + (["--quick"] if args.quick else []))


def _triton_version() -> str | None:
    try:
        import triton

        return str(triton.__version__)
    except ImportError:
        return None


def _moefx_version() -> str:
    from moefx import __version__

    return __version__

