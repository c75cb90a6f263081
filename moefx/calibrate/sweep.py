"""The timing core of calibration: interleaved samples of every contender per M, pruning, close calls re-timed
until decided or called uncertain. The same core serves MoE experts (moefx.calibrate.moe) and dense linears
(moefx.calibrate.dense): a problem gives inputs per M, a callable per contender, the contenders a mode never runs
and the default path (what runs without a calibration row).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

UPSTREAM = "upstream"
INPUT_SETS = 4  # distinct random inputs (routings) rotated through the timed calls
PRUNE_FACTOR = 4.0  # stop timing a contender at larger M once it is this many times slower than the fastest
RETIME_ROUNDS = 3  # re-timings of a close call (the two fastest within the noise) before it is called uncertain
TOLERANCE, MAX_TOLERANCE = 0.03, 0.25  # crossover hysteresis: at least 3%, at most 25%, else the measured noise


class Problem(Protocol):
    """What `sweep` times: `call(name)(*inputs(m))` is one timed call of contender `name` at M, which runs
    `calls` kernel calls (more than one where weight copies rotate past the L2 cache): samples are per call."""

    device: torch.device
    calls: int

    def inputs(self, m: int) -> tuple[torch.Tensor, ...]: ...

    def call(self, name: str) -> Callable[..., object]: ...

    def excluded(self, mode: str, names: list[str]) -> dict[str, str]:
        """Contenders never timed in `mode`, with why."""
        ...

    def default(self, live: list[str]) -> str | None:
        """The contender that runs without a row (close calls keep it)."""
        ...


def match_reference(names: list[str], cases: Iterable[tuple[int, Sequence[torch.Tensor], Callable[[str], Any]]],
                    bound: float, reference: str, rejected: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The contenders whose outputs stay within `bound` (relative error) of the reference in every case — each case
    is (M, the reference's outputs, a call giving a contender's outputs) — and the rest in `rejected` with why."""
    for m, refs, run in cases:
        for name in names:
            if name in rejected:
                continue
            try:
                outs = run(name)
                outs = [outs] if isinstance(outs, torch.Tensor) else outs
                rel = max(((o.float() - r.float()).norm() / r.float().norm().clamp(min=1e-30)).item()
                          for o, r in zip(outs, refs))
            except Exception as exc:  # a contender that crashes is reported, not timed
                rejected[name] = f"failed: {type(exc).__name__}: {exc}"
                continue
            if not rel <= bound:
                rejected[name] = f"rel err {rel:.2e} > {bound:.0e} vs {reference} at M={m}"
    return [n for n in names if n not in rejected], rejected


Timer = Callable[[int], float]  # round r -> µs of one call on the r-th input set


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


def sweep(problem: Problem, names: list[str], mode: str, grid: tuple[int, ...], reps: int,
          step: Callable[[str], None] = lambda label: None) -> Sweep:
    """µs per (contender, M) in one mode, M ascending; contenders that cannot run are reported. `step(label)` is
    called once per grid point, before it is timed, and once before the close calls are re-timed (progress).

    A contender more than PRUNE_FACTOR times slower than the fastest at two M in a row is not timed at larger M
    (latency grows with M, so it cannot win there): a GEMV at M=4096 would otherwise cost minutes. Close calls
    are re-timed (resolve_close_calls).
    """
    cpu = problem.device.type == "cpu"
    make_timer = _cpu_timer if cpu else (_cuda_eager_timer if mode == "eager" else _cuda_capture_timer)
    result = Sweep()
    skipped = result.skipped
    skipped.update(problem.excluded(mode, names))
    live = [n for n in names if n not in skipped]
    default = problem.default(live)
    calls = {n: problem.call(n) for n in live}

    def timed(contenders: list[str], m: int) -> dict[str, list[float]]:
        """`reps` interleaved samples of each contender at M on fresh inputs; failures are skipped for good."""
        sets = [problem.inputs(m) for _ in range(INPUT_SETS)]
        failed: dict[str, str] = {}
        timers = {}
        for name in contenders:
            try:
                timers[name] = make_timer(calls[name], sets)
            except Exception as exc:  # e.g. a path that syncs the host inside capture
                failed[name] = _reason(exc)
        samples = {n: [t / problem.calls for t in ts] for n, ts in interleave(timers, reps, failed).items()}
        for name, why in failed.items():
            skipped[name] = why
            result.timings.pop(name, None)
            result.samples.pop(name, None)
            if name in live:
                live.remove(name)
        return samples

    strikes: dict[str, int] = {}
    for idx, m in enumerate(grid):
        step(f"{mode} M={m} ({idx + 1}/{len(grid)}): {', '.join(live)}")
        for name, samples in timed(list(live), m).items():
            result.add(name, m, samples)
        fastest = min((result.timings[n][m] for n in live), default=0.0)
        for name in list(live):
            slow = result.timings[name][m] > PRUNE_FACTOR * fastest
            strikes[name] = strikes.get(name, 0) + 1 if slow else 0
            if strikes[name] >= 2 and len(live) > 1:  # two grid points in a row: not a noise spike
                skipped[name] = f"not timed above M={m}: over {PRUNE_FACTOR:.0f}x the fastest at two M in a row"
                live.remove(name)

    step(f"{mode}: re-timing close calls")
    resolve_close_calls(result, timed, default if default in result.timings else None)
    return result


