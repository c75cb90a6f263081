"""MoE experts calibration: `moefx::moe_experts` per backend on random expert weights of one shape.

Each contender is first checked against the reference oracle; the ones that pass are timed through the op (eager:
CUDA events, capture: CUDA-graph replay; CPU: wall clock), on fresh routing for every timed call. `upstream`
(transformers' grouped_mm path, what HF models run without moefx) is a contender too, so a row never sends an M
range to a backend slower than the default.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moefx.backends import moe_experts
from moefx.backends.policy import HOST_SYNCING_BACKENDS
from moefx.backends.registry import BACKENDS, MoeCall
from moefx.calibrate.sweep import UPSTREAM, match_reference
from moefx.ops.quant import quant_weight_fp8_block

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
QUICK_GRID = (1, 2, 4, 8, 16)


class MoeProblem:
    """Random expert weights of one shape and fresh routings for every M (a `sweep.Problem`)."""

    calls = 1

    def __init__(self, e: int, h: int, i: int, k: int, dtype: torch.dtype, quant: str, device: torch.device, seed: int):
        self.gen = torch.Generator(device=device).manual_seed(seed)  # drawn on the device: big shapes stay fast
        self.e, self.h, self.k, self.dtype, self.device = e, h, k, dtype, device
        self.block = (128, 128) if quant == "fp8-block128" else None
        self.s13 = self.s2 = None
        self.w13 = self._weight((e, 2 * i, h))
        self.w2 = self._weight((e, h, i))
        if self.block:
            self.w13, self.s13 = quant_weight_fp8_block(self.w13, *self.block)
            self.w2, self.s2 = quant_weight_fp8_block(self.w2, *self.block)
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

    def excluded(self, mode: str, names: list[str]) -> dict[str, str]:
        out = {n: "syncs the host: never run inside capture" for n in names
               if mode == "capture" and n in HOST_SYNCING_BACKENDS}
        if self.block is not None and UPSTREAM in names and (mode == "capture" or "reference" in names):
            # the plain path for FP8 weights is the reference loop (op.select_backend): timed as reference, never
            # captured
            out[UPSTREAM] = "FP8: upstream runs the reference loop (timed as reference; syncs the host)"
        return out

    def default(self, live: list[str]) -> str | None:
        # what runs without a row: upstream, which for FP8 weights is the reference loop
        if UPSTREAM in live:
            return UPSTREAM
        return "reference" if self.block is not None and "reference" in live else None


def check(problem: MoeProblem, names: list[str]) -> tuple[list[str], dict[str, str]]:
    """Contenders whose output matches the reference oracle on fresh inputs; the rest with the reason."""
    bound = {torch.float32: 1e-4}.get(problem.dtype, 3e-2) if problem.block is None else 6e-2
    rejected: dict[str, str] = {}
    call = MoeCall(*problem.inputs(1), problem.w13, problem.w2, problem.s13, problem.s2, problem.block)
    for name in names:
        if name != UPSTREAM:  # a backend that would fall back must not be timed under its own name
            reason = BACKENDS[name].unsupported_reason(call)
            if reason:
                rejected[name] = f"unsupported: {reason}"

    def cases():
        for m in (1, 37):
            args = problem.inputs(m)
            yield m, [problem.call("reference")(*args)], lambda name, args=args: problem.call(name)(*args)

    return match_reference(names, cases(), bound, "reference", rejected)


