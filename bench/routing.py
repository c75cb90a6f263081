"""MoE routing on the GPU: transformers' routers compiled by inductor vs the same with `fuse_moe_routing`
(one `moefx::fused_topk` launch) vs the op called directly.

Routers (transformers' own classes at real widths, bf16 hidden states, random weights):
  qwen3  Qwen3-30B-A3B: H=2048, E=128, k=8, softmax -> top-k -> renormalize -> cast to bf16
  dsv3   DeepSeek-V3: H=7168, E=256, k=8, fp32 gate, sigmoid + bias, 8 groups keep 4, renorm (+1e-20), x2.5
Correctness first, on this GPU, for every M: the op and the compiled-with-moefx router against the eager
router (ids identical on every row without a tie at the k-th place -- eager's choice among equal values is
unspecified, the op takes the lower id --, weights rtol 1e-5 / atol 1e-6 in fp32, one ulp after a bf16 cast),
and the compile report must show the rewrite. Then, per M in 1, 16, 64, 1024, 4096, CUDA-graph replay medians
(7 replays of 64 calls) of:
  routing only (the logits given): inductor's torch routing | the fused op | its kernel at one row a program over
    4 warps (the launch shape before `launch_shape`, for the before/after in one process)
  whole router (gate linear + routing): inductor | inductor + fuse_moe_routing | the gate GEMM alone
Gate weights rotate through copies larger than the L2 (as in decode, where 48 layers evict them); logits of
the routing-only rows rotate through 8 sets and sit in L2, as they do straight after the gate GEMM.
floor = max(one graph-replayed launch, bytes / the SM copy ceiling of bench/harness.py) (bytes: gate weights +
hidden + logits + outputs). Compiles: M=1 static, then one graph dynamic in M (automatic dynamic), float constants kept.

    python bench/routing.py          # on the H200: ~60 s; table last, JSON to $OUT/routing.json
    python bench/routing.py --quick  # CPU smoke run of the same checks and arms (M = 1, 16; wall clock)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch._inductor.config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moefx
from bench.harness import copy_ceiling_Bps, time_rotated, time_wall, write_json
from moefx.backends.routing import fused_topk
from moefx.kernels.moe_routing import fused_topk_triton

MS = (1, 16, 64, 1024, 4096)
L2_BYTES = 60 << 20
CALLS = 64
DEVICE = "cuda"


def make_router(case: str) -> tuple[torch.nn.Module, dict]:
    if case == "qwen3":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        cfg = Qwen3MoeConfig(hidden_size=2048, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
        router = Qwen3MoeTopKRouter(cfg).to(DEVICE, torch.bfloat16)
        torch.nn.init.normal_(router.weight, std=2048**-0.5 * 4)
        return router, dict(kind="softmax", renormalize=True)
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=7168, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                           norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg).to(DEVICE, torch.float32)  # gate and bias fp32, as transformers keeps them
    torch.nn.init.normal_(router.weight, std=7168**-0.5 * 4)
    router.e_score_correction_bias.normal_(0, 0.05)
    return router, dict(kind="sigmoid", renormalize=True, correction_bias=router.e_score_correction_bias,
                        n_group=8, topk_group=4, routed_scaling_factor=2.5)


def route_from_logits(case: str, router: torch.nn.Module) -> Callable:
    if case == "qwen3":
        def run(logits):
            p = torch.softmax(logits, dtype=torch.float, dim=-1)
            v, i = torch.topk(p, 8, dim=-1)
            return (v / v.sum(dim=-1, keepdim=True)).to(logits.dtype), i
        return run
    bias = router.e_score_correction_bias

    def run(logits):
        s = logits.sigmoid()
        c = s + bias
        g = c.view(-1, 8, 32).topk(2, dim=-1)[0].sum(dim=-1)
        mask = torch.zeros_like(g).scatter_(1, torch.topk(g, 4, dim=-1, sorted=False)[1], 1)
        c = c.masked_fill(~mask.unsqueeze(-1).expand(-1, 8, 32).reshape(-1, 256).bool(), float("-inf"))
        ids = torch.topk(c, 8, dim=-1, sorted=False)[1]
        w = s.gather(1, ids)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * 2.5, ids
    return run


def compiled(fn: Callable, fused: bool) -> Callable:
    # no inductor CUDA graphs (mode capture's default on CUDA): time_gpu captures the calls in a graph of its own
    backend = moefx.backend({"pass_config": {"fuse_moe_routing": True}}, cudagraphs=False) if fused else "inductor"
    c = torch.compile(fn, backend=backend)  # automatic dynamic: M=1 static, then one graph dynamic in M only
    return torch._dynamo.config.patch(specialize_float=True)(c)


def time_gpu(fn: Callable, arg_sets: list[tuple]) -> float:
    """Median µs per call from CUDA-graph replays of CALLS calls cycling through arg_sets (CPU: wall clock)."""
    if DEVICE == "cpu":
        return time_wall(fn, arg_sets, 4, trials=1)
    return time_rotated(fn, arg_sets, CALLS)


def launch_us() -> float:
    x = torch.zeros(1, device=DEVICE)
    return time_gpu(lambda: x.add_(1), [()])


def check(name: str, ref: tuple, got: tuple, key: torch.Tensor, unsorted: bool) -> dict:
    """ids: the same set on every row whose k-th and (k+1)-th ranked keys differ, the same order too where
    the top k+1 keys are all distinct (sorted routers); weights within the bound where the ids agree."""
    (rw, rids), (w, ids) = ref, got
    k = ids.shape[1]
    top = key.float().topk(k + 1, dim=-1)[0]
    defined = top[:, k - 1] != top[:, k]
    distinct = (top[:, :-1] != top[:, 1:]).all(-1)
    if unsorted:
        rids, o = rids.sort(-1)
        rw = rw.gather(1, o)
        ids, o = ids.sort(-1)
        w = w.gather(1, o)
    sets_ok = torch.equal(ids[defined].sort(-1)[0], rids[defined].sort(-1)[0])
    order_ok = torch.equal(ids[distinct], rids[distinct])
    same = ids.eq(rids).all(-1)
    tol = dict(rtol=1e-5, atol=1e-6) if rw.dtype == torch.float32 else dict(rtol=2**-7, atol=0)
    try:
        torch.testing.assert_close(w[same].float(), rw[same].float(), **tol)
        w_ok = True
    except AssertionError:
        w_ok = False
    diff = (w[same].float() - rw[same].float()).abs()
    return {"check": name, "rows": int(ids.shape[0]), "rows_defined": int(defined.sum()),
            "rows_distinct": int(distinct.sum()), "ids_equal": bool(sets_ok and order_ok), "weights_ok": w_ok,
            "dtype_ok": w.dtype == rw.dtype and ids.dtype == rids.dtype,
            "max_abs_w_diff": float(diff.max()) if diff.numel() else 0.0}


def run_case(case: str, bw: float, launch: float) -> tuple[list[dict], list[dict], list]:
    """Checks and timings of one router. Each compiled arm runs alone after a dynamo reset (one code object
    compiled with two backends would recompile on every switch)."""
    router, kw = make_router(case)
    e, h = router.weight.shape
    k = 8
    unsorted = case == "dsv3"
    ms = MS if DEVICE == "cuda" else MS[:2]

    def op(logits):
        return fused_topk(logits, k, **kw)

    full = dict(renormalize=True, correction_bias=None, n_group=1, topk_group=1, routed_scaling_factor=1.0) | kw

    def one_row(logits):  # the kernel at one row a program over 4 warps, its launch shape before launch_shape
        return fused_topk_triton(logits, k, **full, shape=(1, 4))

    def functional_router(x, w):
        return torch.func.functional_call(router, {"weight": w}, (x,))

    copies = max(2, -(-2 * L2_BYTES // router.weight.nbytes)) if DEVICE == "cuda" else 2
    weights = [router.weight.detach().clone() for _ in range(copies)]
    torch.manual_seed(0)
    xs = {m: torch.randn(m, h, device=DEVICE, dtype=torch.bfloat16) for m in ms}
    with torch.no_grad():
        refs = {m: router(xs[m]) for m in ms}
        logit_sets = {m: [(torch.randn_like(refs[m][0]) * refs[m][0].std(),) for _ in range(8)] for m in ms}
        router_sets = {m: [(torch.randn(m, h, device=DEVICE, dtype=torch.bfloat16), w) for w in weights] for m in ms}
    keys = {m: refs[m][0] if case == "qwen3" else refs[m][0].sigmoid() + router.e_score_correction_bias for m in ms}
    checks, rows = [], {m: {"case": case, "M": m, "E": e, "k": k} for m in ms}
    moefx.clear_compile_reports()
    with torch.no_grad():
        for m in ms:
            w, ids = op(refs[m][0])
            checks.append(check(f"{case} op M={m}", refs[m][1:], (w.to(refs[m][1].dtype), ids), keys[m], unsorted))
            rows[m]["route_op_us"] = time_gpu(op, logit_sets[m])
            if DEVICE == "cuda":
                checks.append(check(f"{case} kernel one row a program M={m}", refs[m][1:],
                                    tuple(v.to(r.dtype) for v, r in zip(one_row(refs[m][0]), refs[m][1:])), keys[m],
                                    unsorted))
                rows[m]["route_one_row_us"] = time_gpu(one_row, logit_sets[m])
            rows[m]["gate_gemm_us"] = time_gpu(lambda xx, w: torch.nn.functional.linear(xx.to(w.dtype), w),
                                               router_sets[m])
        for arm, fn, sets, fused in (("route_inductor_us", route_from_logits(case, router), logit_sets, False),
                                     ("route_fused_compiled_us", route_from_logits(case, router), logit_sets, True),
                                     ("router_inductor_us", functional_router, router_sets, False),
                                     ("router_fused_us", functional_router, router_sets, True)):
            torch._dynamo.reset()
            c = compiled(fn, fused)
            for m in ms:
                if arm == "router_fused_us":
                    got = tuple(c(xs[m], router.weight)[1:])
                    checks.append(check(f"{case} compiled+moefx M={m}", refs[m][1:], got, keys[m], unsorted))
                rows[m][arm] = time_gpu(c, sets[m])
    torch._dynamo.reset()
    for m, row in rows.items():
        out_bytes = m * k * (4 + 8)
        logit_bytes = m * e * refs[m][0].element_size()
        row["route_floor_us"] = max(launch, (logit_bytes + out_bytes) / bw * 1e6)
        row["router_floor_us"] = max(launch, (router.weight.nbytes + xs[m].nbytes + logit_bytes + out_bytes) / bw
                                     * 1e6)
        print(f"  {case} M={m}: route {row['route_inductor_us']:.1f} -> op {row['route_op_us']:.1f} µs "
              f"(one row a program {row.get('route_one_row_us', float('nan')):.1f}); "
              f"router {row['router_inductor_us']:.1f} -> {row['router_fused_us']:.1f} µs "
              f"(gate GEMM {row['gate_gemm_us']:.1f})", flush=True)
    rewrites = [r.matches.get("fuse_moe_routing") for r in moefx.compile_reports()]
    return checks, list(rows.values()), rewrites


def main() -> None:
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run (M = 1, 16; wall clock, no graphs)")
    args = ap.parse_args()
    # a warm FX graph cache would skip the passes, and with them the compile reports checked below
    torch._inductor.config.fx_graph_cache = False
    if args.quick:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        sys.exit("bench/routing.py needs a CUDA device (or --quick for the CPU smoke run)")
    t0 = time.time()
    bw, launch = copy_ceiling_Bps(DEVICE), launch_us()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, one graph-replayed launch {launch:.2f} µs", flush=True)
    checks, rows, rewrites = [], [], {}
    for case in ("qwen3", "dsv3"):
        c, r, rewrites[case] = run_case(case, bw, launch)
        checks += c
        rows += r
    bad = [c for c in checks if not (c["ids_equal"] and c["weights_ok"] and c["dtype_ok"])]
    bad += [f"{case}: compiled graphs with fuse_moe_routing rewrites {n} (want 1 in each)"
            for case, n in rewrites.items() if not n or any(v != 1 for v in n)]
    meta = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
            "copy_bw_Bps": bw, "launch_us": launch, "seconds": time.time() - t0, "date": time.strftime("%Y-%m-%d")}
    import transformers
    import triton

    meta |= {"transformers": transformers.__version__, "triton": triton.__version__}
    write_json("routing.json", {"meta": meta, "checks": checks, "rewrites": rewrites, "rows": rows})
    print(f"\nchecks: {len(checks)} op/compiled comparisons, fx rewrites per compiled graph {rewrites}; "
          f"{'all pass' if not bad else 'FAILURES:'}" + "".join(f"\n  FAIL {c}" for c in bad))
    print(f"\nMoE routing on {meta['device']} (torch {meta['torch']}, transformers {meta['transformers']}), "
          f"µs per call, {'CUDA-graph replay medians' if DEVICE == 'cuda' else 'CPU wall clock'}; "
          f"{meta['seconds']:.0f} s")
    print(f"{'case':<6} {'M':>5} | {'route:inductor':>14} {'fused':>6} {'op':>6} {'1 row':>6} {'floor':>6} | "
          f"{'router:inductor':>15} {'+moefx':>7} {'gate mm':>7} {'floor':>6} {'gain':>6}")
    for r in rows:
        print(f"{r['case']:<6} {r['M']:>5} | {r['route_inductor_us']:>14.1f} {r['route_fused_compiled_us']:>6.1f} "
              f"{r['route_op_us']:>6.1f} {r.get('route_one_row_us', float('nan')):>6.1f} {r['route_floor_us']:>6.1f} | "
              f"{r['router_inductor_us']:>15.1f} "
              f"{r['router_fused_us']:>7.1f} {r['gate_gemm_us']:>7.1f} {r['router_floor_us']:>6.1f} "
              f"{r['router_inductor_us'] / r['router_fused_us']:>5.2f}x")


if __name__ == "__main__":
    main()
