"""`moefx calibrate`: time every MoE backend over a log grid of M, find the crossovers, write the table row.

Each contender is first checked against the legacy oracle; the ones that pass are timed through the
`moefx::moe_experts` op (eager: CUDA events, capture: CUDA-graph replay; CPU: wall clock), on fresh routing
for every timed call. `upstream` (transformers' grouped_mm path, what HF models run without moefx) is a
contender too, so a row never sends an M range to a backend slower than the default. The row goes to the
user's table folder (or --output) with its provenance; a latency-vs-M PNG is drawn next to it.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moefx.backends import available_backends, moe_experts
from moefx.backends.calibration import (
    CalibrationRow,
    crossover_ranges,
    device_identity,
    dtype_name,
    key_for_tensors,
    user_table_dir,
    write_problem,
    write_row,
)
from moefx.backends.policy import HOST_SYNCING_BACKENDS
from moefx.backends.registry import BACKENDS
from moefx.cli.common import format_table, progress

FULL_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
QUICK_GRID = (1, 2, 4, 8, 16)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
QUANTS = ("none", "fp8-block128")
UPSTREAM = "upstream"
ROUTING_SETS = 4  # distinct random routings rotated through the timed calls
PRUNE_FACTOR = 4.0  # stop timing a contender at larger M once it is this many times slower than the fastest
RETIME_ROUNDS = 3  # re-timings of a close call (the two fastest within the noise) before it is called uncertain
TOLERANCE, MAX_TOLERANCE = 0.03, 0.25  # crossover hysteresis: at least 3%, at most 25%, else the measured noise


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("shape (either --model or all of --experts/--hidden/--intermediate/--topk)")
    src.add_argument("--model", help="catalog name (e.g. qwen3-30b-a3b) or a config.json / model folder")
    src.add_argument("--tp", type=int, default=1, help="tensor-parallel size: per-GPU experts get intermediate/tp")
    src.add_argument("--experts", type=int)
    src.add_argument("--hidden", type=int)
    src.add_argument("--intermediate", type=int, help="per-expert intermediate size I (w13 has 2I rows)")
    src.add_argument("--topk", type=int)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--quant", default="none", choices=QUANTS, help="expert weight format")
    p.add_argument("--modes", default=None, help="comma list of eager,capture (default: both on CUDA, eager on CPU)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when present")
    p.add_argument("--backends", default=None, help="comma list of contenders (default: every available + upstream)")
    p.add_argument("--max-m", type=int, default=4096)
    p.add_argument("--reps", type=int, default=None, help="timed calls per point (default 20 on CUDA, 5 on CPU)")
    p.add_argument("--quick", action="store_true", help="small grid (M up to 16) and few reps: a smoke run")
    p.add_argument("--output", default=None, help="table YAML to write (default: user table folder)")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the table); 'none' skips it")
    p.add_argument("--seed", type=int, default=0)


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
    from moefx.cli.common import model_config
    from moefx.signatures import ModelSignature

    ms = ModelSignature.from_config(model_config(spec))
    values = (ms.num_experts, ms.hidden_size, ms.moe_intermediate_size, ms.top_k)
    if not all(values):
        raise ValueError(f"--model {spec!r}: not an MoE config (experts, hidden, moe intermediate, top_k = {values})")
    return values  # type: ignore[return-value]


class Problem:
    """Random expert weights of one shape and fresh routings for every M."""

    def __init__(self, e: int, h: int, i: int, k: int, dtype: torch.dtype, quant: str, device: torch.device, seed: int):
        self.gen = torch.Generator(device=device).manual_seed(seed)  # drawn on the device: big shapes stay fast
        self.e, self.h, self.k, self.dtype, self.device = e, h, k, dtype, device
        self.block = (128, 128) if quant == "fp8-block128" else None
        self.s13 = self.s2 = None
        self.w13 = self._weight((e, 2 * i, h))
        self.w2 = self._weight((e, h, i))
        if self.block:
            self.w13, self.s13 = _fp8_blocks(self.w13, self.block)
            self.w2, self.s2 = _fp8_blocks(self.w2, self.block)
        else:
            self.w13, self.w2 = self.w13.to(dtype), self.w2.to(dtype)

    def _weight(self, shape: tuple[int, int, int]) -> torch.Tensor:
        w = torch.randn(shape, generator=self.gen, device=self.device)
        return w.mul_(shape[-1] ** -0.5)

    def inputs(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = torch.randn(m, self.h, generator=self.gen, device=self.device).to(self.dtype)
        scores = torch.rand(m, self.e, generator=self.gen, device=self.device)
        weights, ids = torch.softmax(scores, -1).topk(self.k, dim=-1)
        return hidden, ids, (weights / weights.sum(-1, keepdim=True)).to(self.dtype)

    def call(self, name: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        backend = UPSTREAM if name == UPSTREAM else name
        quant = {"w13_scale": self.s13, "w2_scale": self.s2, "block_shape": self.block} if self.block else {}

        def fn(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            return moe_experts(hidden, ids, weights, self.w13, self.w2, backend, upstream="transformers", **quant)

        return fn


def _fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-128 FP8 with per-block scales (dequantized = fp8 * scale)."""
    e, n, k = w.shape
    bn, bk = block
    pn, pk = -n % bn, -k % bk
    padded = torch.nn.functional.pad(w, (0, pk, 0, pn))
    blocks = padded.reshape(e, (n + pn) // bn, bn, (k + pk) // bk, bk)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, :, None, :, None]).reshape(e, n + pn, k + pk)[:, :n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.float()


def _check(problem: Problem, names: list[str]) -> tuple[list[str], dict[str, str]]:
    """Contenders whose output matches the legacy oracle on fresh inputs; the rest with the reason."""
    bound = {torch.float32: 1e-4}.get(problem.dtype, 3e-2) if problem.block is None else 6e-2
    rejected: dict[str, str] = {}
    hidden, _, _ = problem.inputs(1)
    for name in names:
        if name != UPSTREAM:  # a backend that would fall back must not be timed under its own name
            reason = BACKENDS[name].unsupported_reason(hidden, problem.w13, problem.w2, problem.s13, problem.block)
            if reason:
                rejected[name] = f"unsupported: {reason}"
    for m in (1, 37):
        hidden, ids, weights = problem.inputs(m)
        ref = problem.call("legacy")(hidden, ids, weights).float()
        for name in names:
            if name in rejected:
                continue
            try:
                out = problem.call(name)(hidden, ids, weights).float()
                rel = ((out - ref).norm() / ref.norm()).item()
            except Exception as exc:  # a contender that crashes is reported, not timed
                rejected[name] = f"failed: {type(exc).__name__}: {exc}"
                continue
            if not rel <= bound:
                rejected[name] = f"rel err {rel:.2e} > {bound:.0e} vs legacy at M={m}"
    return [n for n in names if n not in rejected], rejected


Timer = Callable[[int], float]  # round r -> µs of one call on the r-th routing set


def _cpu_timer(fn: Callable, sets: list[tuple]) -> Timer:
    fn(*sets[0])  # warm-up

    def one(r: int) -> float:
        start = time.perf_counter()
        fn(*sets[r % len(sets)])
        return (time.perf_counter() - start) * 1e6

    return one


def _cuda_eager_timer(fn: Callable, sets: list[tuple]) -> Timer:
    for s in sets:
        fn(*s)
    torch.cuda.synchronize()

    def one(r: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        args = sets[r % len(sets)]
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    return one


def _cuda_capture_timer(fn: Callable, sets: list[tuple]) -> Timer:
    static = [t.clone() for t in sets[0]]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*static)  # warm-up (JIT, autotune) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*static)
    for _ in range(2):  # the first replays upload the graph
        graph.replay()
    torch.cuda.synchronize()

    def one(r: int) -> float:
        for dst, src in zip(static, sets[r % len(sets)]):
            dst.copy_(src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    return one


def _reason(exc: BaseException) -> str:
    """A failed contender's one-line reason."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"


def interleave(timers: dict[str, Timer], reps: int, failed: dict[str, str]) -> dict[str, list[float]]:
    """`reps` rounds, each timing every contender once, the order rotated per round: load that the machine takes
    on during a round slows every contender alike instead of one contender's whole sample. A contender whose
    call raises is dropped, with the reason in `failed`."""
    names = list(timers)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            if name in failed:
                continue
            try:
                out[name].append(timers[name](r))
            except Exception as exc:  # e.g. a path that syncs the host inside capture
                failed[name] = _reason(exc)
    return {n: ts for n, ts in out.items() if n not in failed}


@dataclass
class Sweep:
    """One mode's measurements: median µs per (contender, M), the samples behind them, what was not timed, the
    grid points whose fastest the timing noise left undecided (`uncertain`: M -> why) and the backend each of
    them keeps (`pinned`)."""

    timings: dict[str, dict[int, float]] = field(default_factory=dict)
    samples: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    uncertain: dict[int, str] = field(default_factory=dict)
    pinned: dict[int, str] = field(default_factory=dict)  # M -> the backend an uncertain point keeps
    tolerance: float = TOLERANCE

    def add(self, name: str, m: int, samples: list[float]) -> None:
        kept = self.samples.setdefault(name, {}).setdefault(m, [])
        kept.extend(samples)
        self.timings.setdefault(name, {})[m] = statistics.median(kept)

    def noise(self, name: str, m: int) -> float:
        """One point's spread over its median: the interquartile range from 4 samples on, the full range for 2
        or 3 (a --quick run's 3 reps), 0 for a single sample."""
        kept = sorted(self.samples[name][m])
        mid = statistics.median(kept)
        if len(kept) < 2 or mid <= 0:
            return 0.0
        if len(kept) < 4:
            return (kept[-1] - kept[0]) / mid
        q1, _, q3 = statistics.quantiles(kept, n=4, method="inclusive")
        return (q3 - q1) / mid

    def machine_noise(self, m: int) -> float:
        """The widest spread of any contender at M: the machine's noise there. A contender whose few samples all
        landed in a loaded moment has a narrow spread around a wrong median; the others' spread shows it."""
        return max((self.noise(n, m) for n, ts in self.timings.items() if m in ts), default=0.0)

    def tied(self, m: int) -> list[str]:
        """The contenders at M not clearly slower than the fastest (fastest first; one name when the fastest is
        decided). Clearly slower: both its median and its best sample are slower by more than the machine's noise
        there (load only ever adds time, so a contender whose median a busy moment inflated still shows its
        cost in its best sample)."""
        ranked = sorted((ts[m], n) for n, ts in self.timings.items() if m in ts)
        if not ranked:
            return []
        (t0, first), noise = ranked[0], self.machine_noise(m)
        best0 = min(self.samples[first][m])
        return [first] + [n for t, n in ranked[1:]
                          if t / t0 - 1.0 <= noise or min(self.samples[n][m]) / best0 - 1.0 <= noise]


def resolve_close_calls(result: Sweep, retime: Callable[[list[str], int], dict[str, list[float]]],
                        default: str | None = UPSTREAM, rounds: int = RETIME_ROUNDS) -> None:
    """Re-time, interleaved, every contender at each M where some are tied with the fastest (their gap within
    the machine's noise there), pooling the samples, until the fastest is decided or `rounds` re-timings are
    spent (all of them: a contender that looked clearly slow may owe its median to a loaded moment). A point
    still tied is uncertain and pinned: to `default` (what runs without a row) when it is among the tied, so the
    row moves an M off the default only on a difference the noise cannot explain; else to the previous M's
    choice when tied, else the fastest. The crossover tolerance becomes the median noise of the winners
    (3%..25%), so near-ties keep the previous M's winner instead of flipping between runs."""
    ms = sorted({m for ts in result.timings.values() for m in ts})
    previous: str | None = None
    for m in ms:
        for _ in range(rounds):
            tied = result.tied(m)
            if len(tied) < 2:
                break
            for name, samples in retime([n for n, ts in result.timings.items() if m in ts], m).items():
                result.add(name, m, samples)
        tied = result.tied(m)
        if len(tied) >= 2:
            pick = next(n for n in (default, previous, tied[0]) if n in tied)
            if pick == default:
                why = f"kept the default, {default}"
            elif default is not None:
                why = f"each beats the default {default} beyond the noise; kept {pick}"
            else:
                why = f"kept {pick}"
            gap = result.timings[tied[-1]][m] / result.timings[tied[0]][m] - 1.0
            result.pinned[m] = pick
            noise = 100 * result.machine_noise(m)
            result.uncertain[m] = (f"{' vs '.join(tied)} not told apart within the {noise:.1f}% noise after {rounds} "
                                   f"re-timings (medians up to {100 * gap:.1f}% apart); {why}")
        previous = result.pinned.get(m, tied[0] if tied else previous)
    winners = [result.pinned.get(m) or min((ts[m], n) for n, ts in result.timings.items() if m in ts)[1] for m in ms]
    noise = [result.noise(w, m) for w, m in zip(winners, ms)]
    result.tolerance = min(MAX_TOLERANCE, max(TOLERANCE, statistics.median(noise) if noise else 0.0))


def sweep(problem: Problem, names: list[str], mode: str, grid: tuple[int, ...], reps: int) -> Sweep:
    """µs per (contender, M) in one mode, M ascending; contenders that cannot run are reported.

    A contender more than PRUNE_FACTOR times slower than the fastest at two M in a row is not timed at larger M
    (latency grows with M, so it cannot win there): a GEMV at M=4096 would otherwise cost minutes. Close calls
    are re-timed (resolve_close_calls).
    """
    cpu = problem.device.type == "cpu"
    make_timer = _cpu_timer if cpu else (_cuda_eager_timer if mode == "eager" else _cuda_capture_timer)
    result = Sweep()
    skipped = result.skipped
    if mode == "capture":
        skipped.update({n: "syncs the host: never run inside capture" for n in names if n in HOST_SYNCING_BACKENDS})
    if problem.block is not None and UPSTREAM in names and (mode == "capture" or "legacy" in names):
        # the plain path for FP8 weights is the legacy loop (op.select_backend): timed as legacy, never captured
        skipped[UPSTREAM] = "FP8: upstream runs the legacy loop (timed as legacy; syncs the host)"
    live = [n for n in names if n not in skipped]
    # what runs without a row: upstream, which for FP8 weights is the legacy loop
    default = UPSTREAM if UPSTREAM in live else ("legacy" if problem.block is not None and "legacy" in live else None)
    calls = {n: problem.call(n) for n in live}

    def timed(contenders: list[str], m: int) -> dict[str, list[float]]:
        """`reps` interleaved samples of each contender at M on fresh routings; failures are skipped for good."""
        sets = [problem.inputs(m) for _ in range(ROUTING_SETS)]
        failed: dict[str, str] = {}
        timers = {}
        for name in contenders:
            try:
                timers[name] = make_timer(calls[name], sets)
            except Exception as exc:  # e.g. a path that syncs the host inside capture
                failed[name] = _reason(exc)
        samples = interleave(timers, reps, failed)
        for name, why in failed.items():
            skipped[name] = why
            result.timings.pop(name, None)
            result.samples.pop(name, None)
            if name in live:
                live.remove(name)
        return samples

    strikes: dict[str, int] = {}
    for idx, m in enumerate(grid):
        with progress(f"[{mode} M={m} {idx + 1}/{len(grid)}] {', '.join(live)}"):
            for name, samples in timed(list(live), m).items():
                result.add(name, m, samples)
        fastest = min((result.timings[n][m] for n in live), default=0.0)
        for name in list(live):
            slow = result.timings[name][m] > PRUNE_FACTOR * fastest
            strikes[name] = strikes.get(name, 0) + 1 if slow else 0
            if strikes[name] >= 2 and len(live) > 1:  # two grid points in a row: not a noise spike
                skipped[name] = f"not timed above M={m}: over {PRUNE_FACTOR:.0f}x the fastest at two M in a row"
                live.remove(name)

    with progress(f"[{mode}] re-timing close calls"):
        resolve_close_calls(result, timed, default if default in result.timings else None)
    return result


def _plot(path: Path, title: str, results: dict[str, dict[str, dict[int, float]]], ranges: dict[str, Any]) -> bool:
    """Draw the latency-vs-M PNG; False when matplotlib (the `plot` extra) is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, (mode, timings) in zip(axes[0], results.items()):
        for name, ts in sorted(timings.items()):
            ms = sorted(ts)
            ax.plot(ms, [ts[m] for m in ms], marker="o", markersize=3, label=name)
        for r in ranges[mode][:-1]:
            ax.axvline(r.max_m + 0.5, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (token rows per call)")
        ax.set_ylabel("latency, µs (median)")
        ax.set_title(f"{mode}: " + ", ".join(r.text() for r in ranges[mode]), fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in text).strip("-").lower()


def run(args: argparse.Namespace) -> int:
    label, e, h, i, k = _shape(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available; use --device cpu")
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    modes = [m.strip() for m in (args.modes or ("eager,capture" if device.type == "cuda" else "eager")).split(",")]
    bad = [m for m in modes if m not in ("eager", "capture")]
    if bad or not modes:
        raise ValueError(f"--modes {args.modes!r}: invalid {bad}; valid choices: ['eager', 'capture']")
    if "capture" in modes and device.type != "cuda":
        raise ValueError("--modes capture needs a CUDA device (CUDA-graph capture); use --modes eager on CPU")
    if args.max_m < 1:
        raise ValueError(f"--max-m must be >= 1, got {args.max_m}")
    grid = tuple(m for m in (QUICK_GRID if args.quick else FULL_GRID) if m <= args.max_m) or (1,)
    if args.reps is not None and args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    reps = args.reps or (3 if args.quick else (20 if device.type == "cuda" else 5))
    names = [*available_backends(device), UPSTREAM]
    if args.backends:
        wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
        unknown = [b for b in wanted if b not in names]
        if unknown:
            raise ValueError(f"--backends: {unknown} not available on {device.type}; valid choices: {names}")
        names = wanted

    problem = Problem(e, h, i, k, dtype, args.quant, device, args.seed)
    hidden, ids, _ = problem.inputs(1)
    print(f"calibrating {label}: E={e} H={h} I={i} top_k={k} {dtype_name(dtype)} quant={args.quant} "
          f"on {device_identity(device)[0]}; modes {modes}; M grid {grid[0]}..{grid[-1]} ({len(grid)} points)")
    with progress("checking every contender against the legacy oracle"):
        names, rejected = _check(problem, names)
    for name, why in rejected.items():
        print(f"  excluded {name}: {why}", file=sys.stderr)
    if not names:
        raise ValueError("no contender matched the legacy oracle; nothing to calibrate")

    output = Path(args.output) if args.output else user_table_dir() / f"{_slug(device_identity(device)[0])}.yaml"
    unwritable = write_problem(output)
    if unwritable:
        raise ValueError(unwritable)
    provenance = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device_identity(device)[0],
        "torch": str(torch.__version__),
        "triton": _triton_version(),
        "moefx": _moefx_version(),
        "command": _command(args, grid, reps),
        "shape": label,
        "grid": f"M {', '.join(map(str, grid))} ({len(grid)} points), {reps} reps per point, contenders "
                f"interleaved, median; close calls re-timed up to {RETIME_ROUNDS} times, then uncertain",
    }
    results, all_ranges, sources = {}, {}, {}
    for mode in modes:
        result = sweep(problem, names, mode, grid, reps)
        for name, why in result.skipped.items():
            print(f"  {mode}: {name}: {why}", file=sys.stderr)
        if not result.timings:
            raise ValueError(f"no contender could be timed in mode {mode}")
        ranges = crossover_ranges(result.timings, tolerance=result.tolerance, pinned=result.pinned)
        key = key_for_tensors(hidden, ids, problem.w13, problem.block, mode)
        notes = dict(provenance, skipped=result.skipped or None, tolerance=round(result.tolerance, 3),
                     uncertain={int(m): why for m, why in result.uncertain.items()} or None)
        sources[mode] = write_row(output, CalibrationRow(key, ranges, notes, "", result.timings))
        results[mode], all_ranges[mode] = result, ranges
    if (args.plot or "").lower() != "none":
        png = Path(args.plot) if args.plot else output.with_name(f"{output.stem}-{_slug(label)}-{args.quant}.png")
        title = f"{label} {dtype_name(dtype)} quant={args.quant} on {device_identity(device)[0]}"
        if _plot(png, title, {mode: r.timings for mode, r in results.items()}, all_ranges):
            print(f"plot: {png}")
        else:
            print("plot skipped: matplotlib is not installed (pip install 'moefx[plot]')", file=sys.stderr)
    for mode in modes:
        timings, pinned = results[mode].timings, results[mode].pinned
        cols = sorted(timings)
        rows = [[m, *(f"{timings[c][m]:.1f}" if m in timings[c] else "-" for c in cols),
                 f"{pinned[m]} (uncertain)" if m in pinned else
                 min(cols, key=lambda c: timings[c].get(m, float("inf")))] for m in grid]
        print(f"\n{mode} (µs, median of {reps} or more, contenders interleaved):")
        print(format_table(["M", *cols, "chosen"], rows))
        print(f"{mode} row {sources[mode]} in {output}: " + ", ".join(r.text() for r in all_ranges[mode]))
        for m, why in results[mode].uncertain.items():
            print(f"{mode} crossover uncertain at M={m}: {why}")
    print(f"\n{where_read(output)}")
    return 0


def where_read(output: Path) -> str:
    """Where the row went and which later plans read it: the user folder is read by every plan on this device,
    any other file only through a config's `calibration` list."""
    user = user_table_dir()
    if output.resolve().parent == user.resolve():
        return (f"wrote {output}: from now on moefx.optimize and `moefx plan` on this device read it for this shape "
                f"(the user table folder {user}, read before the shipped tables; delete the row or the file to undo)")
    return (f"wrote {output}: plans read it only when a config lists it, e.g. "
            f"config={{'calibration': ['{output}']}} (rows in the user table folder {user} are read without that)")


def _command(args: argparse.Namespace, grid: tuple[int, ...], reps: int) -> str:
    """The calibrate command line that reproduces this row: the options as parsed, with the grid's top and the
    reps actually run (so a --quick row does not claim --max-m 4096)."""
    parts = ["moefx calibrate"]
    chosen = {**vars(args), "max_m": grid[-1], "reps": reps}
    for opt in ("model", "tp", "experts", "hidden", "intermediate", "topk", "dtype", "quant", "modes", "device",
                "backends", "max_m", "reps", "seed"):
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
