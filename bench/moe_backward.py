"""MoE experts backward: `moefx::moe_experts`'s autograd next to transformers' grouped_mm experts autograd, one run.

Qwen3-30B-A3B geometry (E=128, H=2048, I=768, top-8), bf16, M in {1024, 4096}. First checks every arm's gradients
(hidden, routing weights, w13, w2) against the fp32 reference backward on fresh inputs; then times, with CUDA events
over eager calls (medians of trials), `torch.autograd.grad` through each arm's forward graph, cycling 4 forward
graphs built on different inputs (routing differs per call; the 1.2 GB of expert weights never fit the L2):
- `full`: gradients of hidden, routing weights and both expert weights (training the experts);
- `frozen`: hidden and routing weights only (LoRA on attention, router training: expert weights frozen);
- `fwd+bwd`: the forward (moefx: the grouped Triton kernels) and the full backward of one call.
Floors: max(FLOPs / bf16 matmul rate, bytes / copy bandwidth) of a backward without recompute (full: dA, dW2, dX,
dW13 = 12 H I FLOPs per (token, expert) pair, reading both weights and writing both weight gradients once; frozen:
dA and dX, 8 H I per pair, reading the weights once), with the rates measured in the same run (bench/moe.py).
moefx's backward recomputes GEMM 1 (its forward saves only its inputs): 16 H I per pair in full, 12 in frozen.
Prints a table last; JSON to $OUT/moe_backward.json. `--quick`: tiny CPU smoke run, no timing claims.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import ceilings, relerr, routing, time_eager, write_json
from bench.sections.moe_backward import BackwardRow
from moefx.backends import moe_experts
from moefx.backends.backward import backward_path, backward_reference
from moefx.backends.registry import MoeCall

MS = (1024, 4096)
BOUND = 3e-2  # bf16 gradients vs the fp32 reference: ||g - ref|| / ||ref||


class HFExperts(torch.nn.Module):
    """The attributes transformers' grouped_mm experts forward reads (a Qwen3-MoE experts module's)."""

    has_gate, has_bias, is_transposed, has_post_expert_norm, _is_expert_parallel = True, False, False, False, False

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.num_experts = w13.shape[0]
        self.gate_up_proj, self.down_proj = torch.nn.Parameter(w13), torch.nn.Parameter(w2)
        self.act_fn = torch.nn.functional.silu

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def arms(w13: torch.Tensor, w2: torch.Tensor) -> dict:
    """Each arm's forward over these expert weights (trainable leaves, or frozen: requires_grad=False)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    hf = HFExperts(w13.data, w2.data)
    hf.gate_up_proj.requires_grad_(w13.requires_grad)
    hf.down_proj.requires_grad_(w2.requires_grad)
    if w13.requires_grad:
        hf.gate_up_proj, hf.down_proj = w13, w2  # the same leaves in both arms
    return {
        "moefx": lambda x, ids, w: moe_experts(x, ids, w, w13, w2, backend="grouped"),
        "grouped_mm": lambda x, ids, w: grouped_mm_experts_forward(hf, x, ids, w),
    }


def check(fwd, sets: list[tuple], w13, w2) -> list[float]:
    """Relative errors of (d hidden, d routing weights, d w13, d w2) vs the fp32 reference, worst over the sets."""
    worst = [0.0] * 4
    for x, ids, w, grad in sets:
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        got = torch.autograd.grad(fwd(xs, ids, ws), (xs, ws, w13, w2), grad)
        want = backward_reference(grad.float(), MoeCall(x.float(), ids, w.float(), w13.detach().float(),
                                                        w2.detach().float()), [True] * 4)
        worst = [max(a, relerr(g, r)) for a, g, r in zip(worst, got, want)]
    return worst


def time_backward(fwd, sets: list[tuple], leaves: tuple, reps: int, trials: int) -> float:
    """Median µs of one backward: `torch.autograd.grad` (hidden, routing weights and `leaves`) through forward graphs
    built on each set, cycled."""
    graphs = []
    for x, ids, w, grad in sets:
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        graphs.append((fwd(xs, ids, ws), (xs, ws, *leaves), grad))

    def one(i: int) -> None:
        out, inputs, grad = graphs[i % len(graphs)]
        torch.autograd.grad(out, inputs, grad, retain_graph=True)

    return time_eager(one, reps, trials)


def time_fwd_bwd(fwd, sets: list[tuple], leaves: tuple, reps: int, trials: int) -> float:
    def one(i: int) -> None:
        x, ids, w, grad = sets[i % len(sets)]
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch.autograd.grad(fwd(xs, ids, ws), (xs, ws, *leaves), grad)

    return time_eager(one, reps, trials)


def floors(m: int, e: int, h: int, inter: int, k: int, ceil: dict) -> dict[str, float]:
    pairs, weight_bytes = m * k, 3 * e * h * inter * 2
    out = {}
    for kind, flops_per_pair, passes in (("full", 12, 2), ("frozen", 8, 1)):
        flops = flops_per_pair * h * inter * pairs
        out[kind] = max(flops / ceil["bf16_flops"], passes * weight_bytes / ceil["copy_Bps"]) * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny CPU smoke run (no timing claims)")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    args = ap.parse_args()
    quick = args.quick or not torch.cuda.is_available()
    dev = "cpu" if quick else "cuda"
    e, h, inter, k = (8, 64, 32, 2) if quick else (128, 2048, 768, 8)
    ms = (9,) if quick else tuple(int(x) for x in args.ms.split(","))
    gen = torch.Generator(device=dev).manual_seed(0)
    t0 = time.time()
    ceil = {"copy_Bps": float("nan"), "bf16_flops": float("nan")} if quick else ceilings()
    w13 = torch.nn.Parameter((torch.randn(e, 2 * inter, h, device=dev, generator=gen) / h**0.5).to(torch.bfloat16))
    w2 = torch.nn.Parameter((torch.randn(e, h, inter, device=dev, generator=gen) / inter**0.5).to(torch.bfloat16))
    fwds, frozen = arms(w13, w2), arms(w13.detach(), w2.detach())
    result: dict = {"device": torch.cuda.get_device_name() if not quick else "cpu", "torch": torch.__version__,
                    "geometry": dict(E=e, H=h, I=inter, top_k=k), "ceilings": ceil, "rows": []}
    failures = []
    for m in ms:
        def new_set(m: int = m) -> tuple:
            x = torch.randn(m, h, device=dev, generator=gen).to(torch.bfloat16)
            ids, w = routing(m, e, k, dev, gen)
            return x, ids, w.to(torch.bfloat16), torch.randn(m, h, device=dev, generator=gen).to(torch.bfloat16)

        check_sets, sets = [new_set() for _ in range(2)], [new_set() for _ in range(4)]
        errs: dict[str, list[float]] = {}
        for name, fwd in fwds.items():
            got = check(fwd, check_sets, w13, w2)
            errs[name] = [round(v, 5) for v in got]
            if max(got) > BOUND:
                failures.append(f"{name} M={m}: gradient errors {got} > {BOUND}")
        floor_us, us = None, {}
        if not quick and not failures:
            reps = max(5, int(2e4 // m))
            floor_us = {kind: round(v, 1) for kind, v in floors(m, e, h, inter, k, ceil).items()}
            for name, fwd in fwds.items():
                us[name] = dict(
                    full=round(time_backward(fwd, sets, (w13, w2), reps, 5), 1),
                    frozen=round(time_backward(frozen[name], sets, (), reps, 5), 1),
                    fwd_bwd=round(time_fwd_bwd(fwd, sets, (w13, w2), reps, 5), 1),
                )
                print(f"M={m} {name}: {us[name]}", flush=True)
        row = BackwardRow(M=m, backward_path=backward_path(check_sets[0][0], w2), moefx_err=errs["moefx"],
                          grouped_mm_err=errs["grouped_mm"], floor_us=floor_us, moefx=us.get("moefx"),
                          grouped_mm=us.get("grouped_mm"))
        result["rows"].append(row.to_json())
    result["failures"], result["seconds"] = failures, round(time.time() - t0, 1)
    write_json("moe_backward.json", result)
    print_table(result, quick)
    if failures:
        raise SystemExit("gradient check failed: " + "; ".join(failures))


def print_table(result: dict, quick: bool) -> None:
    g = result["geometry"]
    print(f"\nMoE backward, {result['device']}, E={g['E']} H={g['H']} I={g['I']} top-{g['top_k']}, bf16 "
          f"({result['seconds']} s)")
    print("grad errors vs fp32 reference (hidden, routing w, w13, w2):")
    for r in result["rows"]:
        print(f"  M={r['M']} path={r['backward_path']}: moefx {r['moefx_err']}  grouped_mm {r['grouped_mm_err']}")
    if quick:
        return
    print(f"{'M':>5} {'kind':>8} {'moefx us':>10} {'grouped_mm us':>14} {'moefx/gmm':>9} {'floor us':>9} "
          f"{'moefx/floor':>11}")
    for r in result["rows"]:
        if "moefx" not in r:
            continue
        for kind in ("full", "frozen", "fwd_bwd"):
            ours, theirs = r["moefx"][kind], r["grouped_mm"][kind]
            floor = r["floor_us"].get(kind)
            fl = f"{floor:9.1f} {ours / floor:11.2f}" if floor else f"{'':9} {'':11}"
            print(f"{r['M']:>5} {kind:>8} {ours:10.1f} {theirs:14.1f} {ours / theirs:9.2f} {fl}")


if __name__ == "__main__":
    main()
