"""gemv backend: CPU path and Triton kernels (interpreter without a GPU) vs the reference oracle."""

from __future__ import annotations

import pytest
import torch
from backends_util import BS, E, H, I, kernel_device, make_inputs, moe_call, reference_ref, relerr, unsupported

from moefx.backends import BACKENDS

# fp32: same math, other summation order; bf16: reference rounds every stage to bf16, gemv keeps fp32 inside;
# fp8 (weights only; gemv keeps activations in fp32, like the oracle): only the input rounding differs.
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CASES = [(1, "random"), (5, "random"), (9, "zero_experts"), (7, "one_expert")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,case", CASES)
@pytest.mark.parametrize("fp8", [False, True])
def test_cpu_path_matches_reference(m: int, case: str, dtype: torch.dtype, fp8: bool) -> None:
    inp = make_inputs(m, dtype, case, fp8=fp8)
    out = BACKENDS["gemv"](inp["hidden"], inp["topk_ids"], inp["topk_weights"], inp["w13"], inp["w2"], **inp["kw"])
    assert out.shape == (m, H) and out.dtype == dtype
    assert relerr(out, reference_ref(inp)) < BOUNDS[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,case", [(1, "random"), (9, "zero_experts"), (3, "one_expert")])
@pytest.mark.parametrize("fp8", [False, True])
def test_triton_kernels_match_reference(m: int, case: str, dtype: torch.dtype, fp8: bool) -> None:
    from moefx.kernels.moe_gemv import gemv_moe

    dev = kernel_device()
    inp = make_inputs(m, dtype, case, device=dev, fp8=fp8)
    out = gemv_moe(moe_call(inp))
    bound = 5e-3 if dev == "cuda" and dtype == torch.float32 else BOUNDS[dtype]
    assert relerr(out, reference_ref(inp)) < bound


@pytest.mark.parametrize("fp8", [False, True])
def test_triton_kernels_top_k_not_power_of_two(fp8: bool) -> None:
    from moefx.kernels.moe_gemv import gemv_moe

    dev = kernel_device()
    inp = make_inputs(5, torch.float32, device=dev, fp8=fp8, k=3)
    out = gemv_moe(moe_call(inp))
    assert relerr(out, reference_ref(inp)) < (5e-3 if dev == "cuda" else 1e-5)


def test_unsupported_reasons_name_the_problem() -> None:
    be = BACKENDS["gemv"]
    x = torch.randn(2, H)
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    assert unsupported(be, x, w13, w2) is None
    assert "dtype" in unsupported(be, x, w13.bfloat16(), w2.bfloat16())
    assert "shape" in unsupported(be, x, w13[:, :, :32], w2)
    q13, s13 = make_inputs(1, torch.float32, fp8=True)["w13"], torch.ones(E, 4, 4)
    assert "block_shape" in unsupported(be, x, q13, w2.to(torch.float8_e4m3fn), s13, None)
    assert "power of two" in unsupported(be, x, q13, w2.to(torch.float8_e4m3fn), s13, (16, 48))
    assert "multiples" in unsupported(be, x, q13, w2.to(torch.float8_e4m3fn), s13, (48, 16))
    assert unsupported(be, x, q13, w2.to(torch.float8_e4m3fn), s13, BS) is None


@pytest.mark.parametrize("fp8", [False, True])
def test_triton_kernels_other_tiles(fp8: bool) -> None:
    """Non-default GemvConfig (wider stage-1 rows than the FP8 block: clamped; small BLOCK_K, 2 warps)."""
    from moefx.kernels.moe_gemv import GemvConfig, gemv_moe

    dev = kernel_device()
    inp = make_inputs(3, torch.float32, device=dev, fp8=fp8)
    cfg = GemvConfig(block_n1=32, rows2=8, block_k1=16, block_k2=32, num_warps1=2, num_warps2=8)
    out = gemv_moe(moe_call(inp), cfg)
    assert relerr(out, reference_ref(inp)) < (5e-3 if dev == "cuda" else 1e-5)
    with pytest.raises(ValueError, match="powers of two"):
        gemv_moe(moe_call(inp), GemvConfig(block_n1=24))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5])
def test_triton_residual_epilogue_is_the_separate_add(m: int, dtype: torch.dtype) -> None:
    """The down kernel's residual add rounds the sum to the output dtype first: bit for bit out + residual."""
    from moefx.kernels.moe_gemv import gemv_moe

    dev = kernel_device()
    if dev != "cuda" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter rounds an fp32 -> bf16 cast other than CUDA does (torch's add rounds "
                    "to nearest): the bf16 case is checked on the GPU")
    inp = make_inputs(m, dtype, "random", device=dev)
    call = moe_call(inp)
    residual = torch.randn(m, H, device=dev).to(dtype)
    fused = gemv_moe(call, residual=residual)
    assert torch.equal(fused, residual + gemv_moe(call))
    assert not torch.equal(fused, gemv_moe(call))


def test_moe_experts_residual_op_is_the_add_on_every_backend() -> None:
    """moefx::moe_experts_residual equals residual + moefx::moe_experts whichever backend runs (CPU: gemv's
    torch path and the reference loop add after the backend)."""
    inp = make_inputs(3, torch.float32, "random", device="cpu")
    args = (inp["hidden"], inp["topk_ids"], inp["topk_weights"], inp["w13"], inp["w2"])
    residual = torch.randn(3, H)
    for backend in ("gemv", "reference"):
        plain = torch.ops.moefx.moe_experts(*args, None, None, None, backend)
        fused = torch.ops.moefx.moe_experts_residual(residual, *args, None, None, None, backend)
        assert torch.equal(fused, residual + plain), backend
