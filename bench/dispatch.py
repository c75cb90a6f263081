"""Host time per moefx custom-op call: what the Python side of each op costs before (and around) its launches.

A prefill is host-bound when every op spends longer in Python than its kernels take on the GPU, so each op's
per-call host time is held to TARGET_US (issue 28). Ops and shapes (Qwen3-30B-A3B widths: E=128, H=2048, I=768,
top-8; 32 query heads, 4 KV heads, head_dim 128), M = 1, 16, 256, 4096 token rows:
  moe_experts   auto (the calibrated policy; its upstream is transformers' grouped_mm, as for HF models), gemv and
                grouped forced
  dense_linear  q/k/v (N = 4096, 512, 512; K = 2048) and the router (N = 128), auto and gemv forced
  fused_topk    softmax top-8 over 128 experts
  decode_attention  B=1, a 256-position cache (CUDA only)
Every call goes through `torch.ops.moefx.<op>.default`, as a compiled graph calls it, under no_grad.

    python bench/dispatch.py              # CUDA (the H200 stage `dispatch`): real launches, JSON to $OUT/dispatch.json
    python bench/dispatch.py --device cpu # this CPU: the same Python with every Triton launch a no-op
    python bench/dispatch.py --device cpu --cprofile grouped:256   # where one case's host time goes

CUDA: host µs per call = bench/harness.py's `time_host`: perf_counter around one call with the GPU synchronized
before it (the launch queue is empty, so the call returns when its launches are queued), median of CALLS; plus
torch.profiler's CPU self time per call of each moefx:: op (the issue's measure; the profiler adds its own cost)
and the kernel launches per call, next to one `aten::mm`. Floors, measured the same way: a no-op op defined as the
moefx ops are (torch.library.custom_op with an autograd formula), the same no-op through torch.library.Library, and
(CUDA) one launch of an empty Triton kernel with GEMM 1's argument count (bench/probes/triton_floor.py): the part of
an op's host time that no moefx-side memo removes. CPU: `time_host`'s fastest batch of 20 calls, per call.
CPU: the ops' CUDA paths run on CPU tensors of the same shapes with each Triton kernel object replaced by one whose
launch does nothing, upstream linears returning empty outputs (CUDA: one mm launch each), and the calibration
tables replaced by a temporary one with rows for this CPU (so `auto` finds a row as on the H200); CUDA-only queries
(capture state, device capability, the device context) are skipped there, and Triton's own launcher is not
measured: the CUDA run measures both.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import time_host, write_json

E, H, I, TOP_K = 128, 2048, 768, 8
QKV = (4096, 512, 512)
MS = (1, 16, 256, 4096)
TARGET_US = 15.0
CALLS = 200


def make_weights(device: str) -> dict[str, torch.Tensor]:
    """Expert and projection weights (values only matter on CUDA, where kernels read them)."""
    dt = torch.bfloat16
    shapes = dict(w13=(E, 2 * I, H), w2=(E, H, I), wq=(QKV[0], H), wk=(QKV[1], H), wv=(QKV[2], H), wr=(E, H))
    if device == "cpu":
        return {k: torch.empty(s, dtype=dt) for k, s in shapes.items()}
    return {k: torch.randn(s, device=device, dtype=dt) * 0.02 for k, s in shapes.items()}


def make_inputs(m: int, device: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(m)
    return dict(
        weights,
        hidden=torch.randn(m, H, generator=g, device=device).to(torch.bfloat16),
        ids=torch.rand(m, E, generator=g, device=device).argsort(-1)[:, :TOP_K].contiguous(),
        tw=torch.rand(m, TOP_K, generator=g, device=device),
        logits=torch.randn(m, E, generator=g, device=device),
    )


def cases(inp: dict[str, torch.Tensor], m: int, cuda: bool) -> dict[str, Callable[[], object]]:
    """name -> one op call, as a compiled graph makes it."""
    ops = torch.ops.moefx
    hidden, ids, tw, w13, w2 = inp["hidden"], inp["ids"], inp["tw"], inp["w13"], inp["w2"]
    out: dict[str, Callable[[], object]] = {}
    for backend in ("auto", "gemv", "grouped"):
        if backend == "gemv" and m > 256:
            continue  # weights touched grow with M*k: gemv is a decode backend
        out[f"moe_experts/{backend}"] = (
            lambda b=backend: ops.moe_experts.default(hidden, ids, tw, w13, w2, None, None, None, b, "transformers",
                                                      "silu", None))
    for backend in ("auto", "gemv"):
        out[f"dense_linear/qkv/{backend}"] = (
            lambda b=backend: ops.dense_linear.default(hidden, [inp["wq"], inp["wk"], inp["wv"]], [None] * 3, None, [],
                                                       None, None, b))
        out[f"dense_linear/router/{backend}"] = (
            lambda b=backend: ops.dense_linear.default(hidden, [inp["wr"]], [None], None, [], None, None, b))
    out["fused_topk"] = lambda: ops.fused_topk.default(inp["logits"], TOP_K, "softmax", True, None, 1, 1, 1.0)
    if cuda and m == 1:
        q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16)
        mask = torch.ones(1, 256, dtype=torch.bool, device="cuda")
        out["decode_attention"] = lambda: ops.decode_attention.default(q, k, k, mask, 128**-0.5)
        out["aten::mm (one launch)"] = lambda: torch.mm(hidden, inp["wr"].t())
    return out


_FLOOR_LIB = None


def floor_cases(inp: dict[str, torch.Tensor], cuda: bool) -> dict[str, Callable[[], object]]:
    """What a call costs before any moefx code runs: a no-op op defined as the moefx ops are (torch.library.custom_op
    with an autograd formula), the same op defined through torch.library.Library directly, and (CUDA) one launch
    of an empty Triton kernel with as many arguments as the grouped GEMMs take."""
    global _FLOOR_LIB
    if _FLOOR_LIB is None:
        @torch.library.custom_op("moefx_bench::noop", mutates_args=())
        def noop(x: torch.Tensor, ws: list[torch.Tensor], backend: str) -> torch.Tensor:
            return x.new_empty(0)

        noop.register_fake(lambda x, ws, backend: x.new_empty(0))
        noop.register_autograd(lambda ctx, grad: (None, None, None))
        lib = torch.library.Library("moefx_bench_lib", "DEF")
        lib.define("noop(Tensor x, Tensor[] ws, str backend) -> Tensor")
        lib.impl("noop", lambda x, ws, backend: x.new_empty(0), "CompositeExplicitAutograd")
        _FLOOR_LIB = lib
    x, ws = inp["hidden"], [inp["wr"]]
    out: dict[str, Callable[[], object]] = {
        "floor/custom_op no-op": lambda: torch.ops.moefx_bench.noop.default(x, ws, "auto"),
        "floor/Library op no-op": lambda: torch.ops.moefx_bench_lib.noop.default(x, ws, "auto"),
    }
    if cuda:
        from bench.probes.triton_floor import empty_launch

        out["floor/Triton launch (30 args)"] = lambda: empty_launch(x)
    return out


def profiler_self_us(fn: Callable[[], object], calls: int) -> dict[str, float]:
    """torch.profiler CPU self time per call of each moefx:: / aten::mm event the calls record."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    out = {e.key: e.self_cpu_time_total / e.count for e in events if e.key.startswith("moefx::") or e.key == "aten::mm"}
    out["launches per call"] = sum(e.count for e in events if e.key.startswith(("cuLaunchKernel", "cudaLaunchKernel"))
                                   ) / calls
    return out


# ------------------------------------------------------------------------------------------ CPU stand-ins


class _NoLaunch:
    """A Triton kernel whose `kernel[grid](...)` only evaluates a callable grid (as Triton does) and returns."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def launch(*args: object, **kwargs: object) -> None:
            if callable(grid):
                grid(kwargs)

        return launch


@contextlib.contextmanager
def cpu_stand_ins() -> Iterator[None]:
    """The CUDA launchers on CPU tensors: Triton launches are no-ops, the backends take their CUDA path, and a
    temporary calibration table gives this CPU the rows the H200 has (gemv@1-16,grouped@17- for the experts;
    gemv up to M=64 for the projections), so `auto` costs a row lookup as it does there."""
    import yaml

    from moefx.backends import calibration, dense, dense_policy
    from moefx.backends import routing as routing_op
    from moefx.backends.policy import UPSTREAM
    from moefx.backends.registry import BACKENDS
    from moefx.kernels import availability, dense_gemm, moe_align, moe_gemv, moe_grouped, moe_routing

    saved: list[tuple[object, str, object]] = []

    def patch(obj: object, name: str, value: object) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    for mod in (moe_align, moe_grouped, moe_gemv, dense_gemm, moe_routing):
        for name in dir(mod):
            if name.startswith("_") and name.endswith("_kernel"):
                patch(mod, name, _NoLaunch())
    for name in ("gemv", "grouped"):
        patch(BACKENDS[name], "torch_path", BACKENDS[name].cuda_kernel)
    patch(availability, "triton_available", lambda: True)

    def gemv_launch(x, weights, biases, x_scale, weight_scales, block_shape, out_dtype):
        k = x.shape[-1]
        outs = dense_gemm.dense_gemv(x.reshape(-1, k), list(weights), list(biases), None, None, None, out_dtype)
        return [o.reshape(*x.shape[:-1], o.shape[-1]) for o in outs]

    def no_linears(x, weights, biases, x_scale, weight_scales, block_shape, out_dtype):  # CUDA: one mm launch each
        return [x.new_empty(*x.shape[:-1], w.shape[0]) for w in weights]

    patch(dense, "RUNNERS", {dense_policy.GEMV: gemv_launch, UPSTREAM: no_linears})
    patch(routing_op, "fused_topk_torch", moe_routing.fused_topk_triton)
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "moefx" / "calibration" / "cpu.yaml"
        table.parent.mkdir(parents=True)
        name, cap, sms = calibration.device_identity("cpu")
        prov = {"date": "bench/dispatch.py stand-in"}
        ident = {"device": name, "capability": cap, "multiprocessor_count": sms}
        rows = [{"key": {**ident, "E": E, "N": 2 * I, "K": H, "top_k": TOP_K, "dtype": "bfloat16",
                         "quant_block": None, "mode": mode},
                 "ranges": [{"backend": "gemv", "min_m": 1, "max_m": 16},
                            {"backend": "grouped", "min_m": 17, "max_m": None}], "provenance": prov}
                for mode in calibration.MODES]
        dense_rows = [{"key": {**ident, "N": list(ns), "K": H, "dtype": "bfloat16", "quant_block": None, "mode": mode},
                       "ranges": [{"backend": "gemv", "min_m": 1, "max_m": None}], "provenance": prov,
                       "timings_us": {"gemv": {1: 1.0, 64: 1.0}}}
                      for ns in (QKV, (E,)) for mode in calibration.MODES]
        table.write_text(yaml.safe_dump({"rows": rows, "dense_rows": dense_rows}))
        old = os.environ.get("XDG_CONFIG_HOME")
        os.environ["XDG_CONFIG_HOME"] = tmp
        calibration.invalidate()
        try:
            yield
        finally:
            if old is None:
                del os.environ["XDG_CONFIG_HOME"]
            else:
                os.environ["XDG_CONFIG_HOME"] = old
            calibration.invalidate()
            for obj, attr, value in reversed(saved):
                setattr(obj, attr, value)


# ------------------------------------------------------------------------------------------------ main


def run(device: str, ms: tuple[int, ...], calls: int, profile_calls: int) -> dict:
    """Every case at every M; the JSON is rewritten after each row, so a run stopped at its limit keeps what it has
    (the first call of each shape compiles its Triton kernels)."""
    cuda = device == "cuda"
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu (Triton launches stubbed)",
              "torch": torch.__version__, "target_us": TARGET_US, "calls": calls, "rows": []}
    weights = make_weights(device)
    for m in ms:
        inp = make_inputs(m, device, weights)
        every = {**(floor_cases(inp, cuda) if m == ms[0] else {}), **cases(inp, m, cuda)}
        for name, fn in every.items():
            row = {"op": name, "M": m, "host_us": round(time_host(fn, calls, cuda), 2)}
            if cuda and profile_calls:
                row["profiler_self_us"] = {k: round(v, 2) for k, v in profiler_self_us(fn, profile_calls).items()}
            row["ok"] = name.startswith(("aten::", "floor/")) or row["host_us"] <= TARGET_US
            result["rows"].append(row)
            write_json("dispatch.json", result)
            extra = "  ".join(f"{k} {v}" for k, v in row.get("profiler_self_us", {}).items())
            print(f"{name:28s} M={m:5d}  host {row['host_us']:8.2f} us  {'ok' if row['ok'] else 'OVER'}  {extra}",
                  flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="token rows per call, comma-separated")
    ap.add_argument("--calls", type=int, default=CALLS)
    ap.add_argument("--profile-calls", type=int, default=50, help="CUDA: calls under torch.profiler (0: none)")
    ap.add_argument("--cprofile", metavar="OP:M", help="cProfile one case (OP: a case name or its last part)")
    args = ap.parse_args()
    ms = tuple(int(v) for v in args.ms.split(","))
    import moefx.backends
    import moefx.ops.decode_attention  # noqa: F401

    stand_ins = cpu_stand_ins() if args.device == "cpu" else contextlib.nullcontext()
    with torch.no_grad(), stand_ins:
        if args.cprofile:
            op, _, m = args.cprofile.rpartition(":")
            inp = make_inputs(int(m), args.device, make_weights(args.device))
            found = {k: f for k, f in cases(inp, int(m), args.device == "cuda").items()
                     if k == op or k.endswith("/" + op)}
            if len(found) != 1:
                raise SystemExit(f"--cprofile {args.cprofile!r} matches {sorted(found) or 'no case'}")
            (name, fn), = found.items()
            fn()
            prof = cProfile.Profile()
            prof.runcall(lambda: [fn() for _ in range(args.calls)])
            print(f"{name} M={m}: {args.calls} calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            return
        result = run(args.device, ms, args.calls, args.profile_calls)
    over = [f"{r['op']} M={r['M']}" for r in result["rows"] if not r["ok"]]
    print(f"target {TARGET_US} us per call: {'all within' if not over else 'over: ' + ', '.join(over)}")


if __name__ == "__main__":
    main()
