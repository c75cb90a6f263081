"""Shared inputs for the MoE backend tests: tiny shapes, fresh random data, the FP8 block quantizer; the sm_90a
build of the kernels (tests/compile_sm90.py) run from a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moefx.kernels.moe_call import MoeCall

E, H, I, K = 4, 64, 32, 2
BS = (32, 32)  # the FP8 tensor-core dot takes K >= 32 per step on a GPU


def kernel_device() -> str:
    """Where the Triton launchers run in this test session: the GPU, else the interpreter on the CPU."""
    if torch.cuda.is_available():
        return "cuda"
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    return "cpu"


def compile_sm90(target: str) -> list[dict]:
    """tests/compile_sm90.py TARGET's rows (each kernel's shared memory, registers, spills): this checkout's kernels
    built for sm_90a without a GPU, in a process of its own without TRITON_INTERPRET. Skips where this Triton has no
    NVIDIA backend."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no NVIDIA backend")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # this checkout's kernels, not those of the checkout the package is installed from
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, str(root / "tests" / "compile_sm90.py"), target], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def quant_block(w: torch.Tensor, bs: tuple[int, int] = BS) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights [E, N, K] -> FP8 codes and one scale per block, at the tests' block size."""
    from moefx.ops.quant import quant_weight_fp8_block

    return quant_weight_fp8_block(w, *bs)


def make_inputs(
    m: int, dtype: torch.dtype, case: str = "random", device: str = "cpu", fp8: bool = False, k: int = K
) -> dict:
    """case: random | zero_experts (only experts 0..k get tokens) | one_expert (all tokens on expert 1)."""
    x = torch.randn(m, H, device=device).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, device=device) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device=device) / I**0.5).to(dtype)
    n_used = {"random": E, "zero_experts": k + 1, "one_expert": E}[case]
    ids = torch.stack([torch.randperm(n_used, device=device)[:k] for _ in range(m)])
    if case == "one_expert":
        ids[:, 0] = 1
        ids[:, 1] = torch.where(ids[:, 1] == 1, 2, ids[:, 1])
    tw = torch.rand(m, k, device=device)
    tw = tw / tw.sum(-1, keepdim=True)
    kw: dict = {}
    if fp8:
        w13, s13 = quant_block(w13)
        w2, s2 = quant_block(w2)
        kw = dict(w13_scale=s13, w2_scale=s2, block_shape=BS)
    return dict(hidden=x, topk_ids=ids, topk_weights=tw, w13=w13, w2=w2, kw=kw)


def relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def reference_ref(inp: dict) -> torch.Tensor:
    from moefx.backends import BACKENDS

    return BACKENDS["reference"](inp["hidden"], inp["topk_ids"], inp["topk_weights"], inp["w13"], inp["w2"],
                                 **inp["kw"])


def moe_call(inp: dict, **gate: object) -> MoeCall:
    """The `MoeCall` of `make_inputs`' dict (the launchers' and PyTorch paths' argument); `gate`: activation and
    gate_limit."""
    return MoeCall(inp["hidden"], inp["topk_ids"], inp["topk_weights"], inp["w13"], inp["w2"], **inp["kw"], **gate)


def unsupported(backend: object, *args: object, **kwargs: object) -> str | None:
    """`backend.unsupported_reason` of the unrouted call of `MoeCall.unrouted(*args, **kwargs)`."""
    return backend.unsupported_reason(MoeCall.unrouted(*args, **kwargs))
