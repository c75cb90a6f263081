"""Dense-linear calibration: `moefx::dense_linear`'s gemv backend against upstream (cuBLAS through F.linear, or
the blockwise FP8 GEMM) at one projection shape of a model.

The shapes are the plan's own (`dense_policy.model_projections`: q/k/v as one call, o, the router, shared experts'
and dense MLPs' gate/up and down), so every row written is one the plan reads. On CUDA each timed call runs the
projection over several weight copies in turn, enough to span 3x the L2 cache, so weights come from HBM as they do
in a decode step; samples are per projection call. Each contender is checked against an fp32 reference first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moefx.backends import dense as D
from moefx.backends.dense_policy import GEMV
from moefx.calibrate.sweep import UPSTREAM, match_reference
from moefx.ops.quant import QuantScheme, quant_weight_fp8_block

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
QUICK_GRID = (1, 2, 4)
BLOCK = (128, 128)
MAX_COPIES = 64
# relative error bounds against the fp32 reference: one bf16/fp16 rounding of each output (<= 2^-8 relative per
# element), the summation order alone in fp32, and the FP8 forms' bf16 output rounding (both backends read the same
# e4m3 values and scales)
BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 5e-3, torch.float16: 5e-3}


def copies_for(weight_bytes: int, device: torch.device) -> int:
    """Weight copies a timed call rotates through: enough to span 3x the L2 cache (CUDA), else one."""
    if device.type != "cuda":
        return 1
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))
    return max(2, min(MAX_COPIES, -(-3 * l2 // max(weight_bytes, 1))))


class DenseProblem:
    """Random weights of one projection (N per weight, K), bf16/fp16/fp32 or FP8 block-128 w8a8 (a `sweep.Problem`)."""

    def __init__(self, ns: Sequence[int], k: int, dtype: torch.dtype, fp8: bool, device: torch.device, seed: int):
        self.ns, self.k, self.dtype, self.fp8, self.device = tuple(int(n) for n in ns), int(k), dtype, fp8, device
        self.block = BLOCK if fp8 else None
        self.gen = torch.Generator(device=device).manual_seed(seed)
        weight_bytes = sum(self.ns) * self.k * (1 if fp8 else dtype.itemsize)
        self.calls = copies_for(weight_bytes, device)
        self.copies = [self._weights() for _ in range(self.calls)]

    def _weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ws = [torch.randn(n, self.k, generator=self.gen, device=self.device).mul_(self.k**-0.5).to(self.dtype)
              for n in self.ns]
        if not self.fp8:
            return ws, []
        q = [quant_weight_fp8_block(w, *BLOCK) for w in ws]
        return [w for w, _ in q], [s for _, s in q]

    def inputs(self, m: int) -> tuple[torch.Tensor, ...]:
        x = torch.randn(m, self.k, generator=self.gen, device=self.device).to(self.dtype)
        if not self.fp8:
            return (x,)
        return tuple(torch.ops.moefx.quant(x, *QuantScheme("fp8_group", BLOCK[1]).args()))

    def _one(self, backend: str, x: torch.Tensor, xs: torch.Tensor | None, i: int) -> list[torch.Tensor]:
        ws, scales = self.copies[i]
        if self.fp8:
            return D.dense_linear(x, ws, x_scale=xs, weight_scales=scales, block_shape=BLOCK, out_dtype=self.dtype,
                                  backend=backend)
        return D.dense_linear(x, ws, backend=backend)

    def call(self, name: str) -> Callable[..., object]:
        def fn(x: torch.Tensor, xs: torch.Tensor | None = None) -> object:
            for i in range(self.calls):
                out = self._one(name, x, xs, i)
            return out

        return fn

    def excluded(self, mode: str, names: list[str]) -> dict[str, str]:
        return {}

    def default(self, live: list[str]) -> str | None:
        return UPSTREAM if UPSTREAM in live else None

    def reference(self, x: torch.Tensor, xs: torch.Tensor | None) -> list[torch.Tensor]:
        ws, scales = self.copies[0]
        if self.fp8:
            return D.reference(x, ws, [None] * len(ws), xs, scales, list(BLOCK), torch.float32)
        return [x.float() @ w.float().t() for w in ws]


def contenders(device: torch.device) -> list[str]:
    return [GEMV, UPSTREAM]


def check(problem: DenseProblem, names: list[str]) -> tuple[list[str], dict[str, str]]:
    """Contenders whose outputs match the fp32 reference within BOUNDS on fresh inputs; the rest with the reason."""
    def cases():
        for m in (1, 5):
            x, *rest = problem.inputs(m)
            xs = rest[0] if rest else None
            yield m, problem.reference(x, xs), lambda name, x=x, xs=xs: problem._one(name, x, xs, 0)

    return match_reference(names, cases(), BOUNDS[problem.dtype], "the fp32 reference", {})
