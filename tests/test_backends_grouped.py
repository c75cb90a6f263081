"""grouped backend: on-GPU align, Triton fused GEMMs (interpreter without a GPU) and the CPU path vs reference."""

from __future__ import annotations

import pytest
import torch
from backends_util import (
    BS,
    E,
    H,
    I,
    K,
    compile_sm90,
    kernel_device,
    make_inputs,
    moe_call,
    reference_ref,
    relerr,
    unsupported,
)

from moefx.backends import BACKENDS
from moefx.backends.common import qdq_rows
from moefx.kernels.moe_align_ref import max_padded_len, moe_align_torch
from moefx.kernels.moe_call import MoeCall

# bf16: both sides round intermediates to bf16 at different points. fp8 w8a8 vs the oracle (dequantized
# weights, unquantized activations): two activation quantizations (e4m3, 3 mantissa bits) at tiny K.
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
FP8_VS_REFERENCE = 0.1
CASES = [(1, "random"), (5, "random"), (9, "zero_experts"), (7, "one_expert")]


@pytest.mark.parametrize("m,case", [(1, "random"), (9, "zero_experts"), (33, "one_expert"), (300, "random")])
@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize("one_program", [None, True, False])
def test_align_triton_matches_torch_exactly(m: int, case: str, block_m: int, one_program: bool | None) -> None:
    """Both Triton paths (one program, two launches) give exactly the PyTorch layout: ascending pairs per expert."""
    from moefx.kernels.moe_align import moe_align

    ids = make_inputs(m, torch.float32, case, device=kernel_device())["topk_ids"]
    got = moe_align(ids, E, block_m, one_program=one_program)
    assert got[0].numel() == max_padded_len(m * K, E, block_m)
    for g, want in zip(got, moe_align_torch(ids.cpu(), E, block_m)):
        assert torch.equal(g.cpu(), want)


@pytest.mark.parametrize("m,k,experts,block_m,chunk", [(1, 8, 128, 16, 0), (16, 8, 128, 16, 0), (5, 2, 8, 4, 0),
                                                       (3, 6, 64, 64, 0), (40, 8, 128, 64, 0), (70, 8, 256, 128, 0),
                                                       (40, 8, 128, 16, 16), (1100, 2, 16, 4, 16)])
def test_align_at_model_expert_counts(m: int, k: int, experts: int, block_m: int, chunk: int) -> None:
    """Real expert counts (Qwen3 128, DeepSeek-V3 256): the default path against the PyTorch layout; from 40 x 8
    pairs the two-launch path, with several programs (and, at chunk 16 and 2200 pairs, two chunks each)."""
    from moefx.kernels.moe_align import moe_align

    gen = torch.Generator().manual_seed(m)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(m)]).to(kernel_device())
    for got, want in zip(moe_align(ids, experts, block_m, chunk=chunk), moe_align_torch(ids.cpu(), experts, block_m)):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("m,k,h", [(3, 8, 2048), (5, 6, 100), (1, 1, 64), (0, 8, 64)])
def test_topk_sum_matches_an_fp32_sum_rounded_once(m: int, k: int, h: int) -> None:
    from moefx.kernels.moe_grouped import topk_sum

    x = torch.randn(m * k, h, device=kernel_device()).bfloat16()
    out = topk_sum(x, k)
    ref = x.float().view(m, k, h).sum(1)
    assert out.shape == (m, h) and out.dtype == torch.bfloat16
    # the interpreter truncates fp32 -> bf16 where the GPU rounds: one bf16 step either way
    assert ((out.float().cpu() - ref.cpu()).abs() <= ref.abs().cpu() * 2**-7 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,case", CASES)
@pytest.mark.parametrize("fp8", [False, True])
def test_cpu_path_matches_reference(m: int, case: str, dtype: torch.dtype, fp8: bool) -> None:
    inp = make_inputs(m, dtype, case, fp8=fp8)
    out = BACKENDS["grouped"](inp["hidden"], inp["topk_ids"], inp["topk_weights"], inp["w13"], inp["w2"], **inp["kw"])
    assert out.shape == (m, H) and out.dtype == dtype
    assert relerr(out, reference_ref(inp)) < (FP8_VS_REFERENCE if fp8 else BOUNDS[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,case", [(1, "random"), (9, "zero_experts"), (7, "one_expert")])
@pytest.mark.parametrize("fp8", [False, True])
def test_triton_kernels_match_reference(m: int, case: str, dtype: torch.dtype, fp8: bool) -> None:
    from moefx.backends.grouped import grouped_torch
    from moefx.kernels.moe_grouped import GemmConfig, fused_moe

    dev = kernel_device()
    inp = make_inputs(m, dtype, case, device=dev, fp8=fp8)
    call = moe_call(inp)
    out = fused_moe(call, config=GemmConfig(16, 32, 32, group_m=2, num_stages=2))
    if fp8:
        assert relerr(out, reference_ref(inp)) < FP8_VS_REFERENCE
        # same w8a8 arithmetic in PyTorch; only fp32 summation order (-> rare e4m3 rounding flips) differs
        emul = grouped_torch(moe_call({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inp.items()}
                                      | {"kw": {**{n: inp["kw"][n].cpu() for n in ("w13_scale", "w2_scale")},
                                                "block_shape": BS}}))
        assert relerr(out.cpu(), emul) < 0.06
    else:
        bound = 5e-3 if dev == "cuda" and dtype == torch.float32 else BOUNDS[dtype]
        assert relerr(out, reference_ref(inp)) < bound


def test_triton_kernels_top_k_three() -> None:
    from moefx.kernels.moe_grouped import GemmConfig, fused_moe

    dev = kernel_device()
    inp = make_inputs(5, torch.float32, device=dev, k=3)
    out = fused_moe(moe_call(inp), config=GemmConfig(16, 32, 32, group_m=2, num_stages=2))
    assert relerr(out, reference_ref(inp)) < (5e-3 if dev == "cuda" else 1e-5)


def test_fp8_activation_quant_matches_reference() -> None:
    from moefx.kernels.moe_grouped import quant_rows_fp8

    x = torch.randn(5, H, device=kernel_device()) * 3
    q, s = quant_rows_fp8(x, BS[1])
    deq = (q.float().view(5, -1, BS[1]) * s[:, :, None]).view(5, H)
    assert relerr(deq.cpu(), qdq_rows(x.cpu(), BS[1])) < 1e-6
    assert relerr(deq.cpu(), x.cpu()) < 0.05


def test_unsupported_reasons() -> None:
    be = BACKENDS["grouped"]
    x = torch.randn(2, H)
    assert unsupported(be, x, torch.randn(E, 2 * I, H), torch.randn(E, H, I)) is None
    assert "int" in unsupported(be, x.int(), torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    assert "contiguous" in unsupported(be, x, torch.randn(E, H, 2 * I).transpose(1, 2), torch.randn(E, H, I))


# (GEMM 1 tile, GEMM 2 tile or None for the same) as GemmConfig keyword arguments
TILE_CASES = {
    "own GEMM 2 tile": (dict(block_m=16, block_n=32, block_k=16, group_m=1, num_stages=2),
                        dict(block_m=32, block_n=64, block_k=16, group_m=4, num_stages=2)),  # takes GEMM 1's BLOCK_M
    "pointer loads": (dict(block_m=16, block_n=32, block_k=16, group_m=2, num_stages=2), None),
    "TMA": (dict(block_m=16, block_n=32, block_k=16, group_m=2, num_stages=2, tma=True), None),
    "running-scale FP8 accumulators": (dict(block_m=16, block_n=32, block_k=32, group_m=1, num_stages=2, running=True),
                                       dict(block_m=16, block_n=64, block_k=32, group_m=4, num_stages=2, running=True)),
}


def _fused_relerr_and_bound(m: int, case: str, fp8: bool, config, config2) -> tuple[float, float]:
    """fused_moe at the given tiles vs reference on fresh inputs (block-quantized weights when fp8), and its bound."""
    from backends_util import quant_block

    from moefx.kernels.moe_grouped import fused_moe

    dev = kernel_device()
    inp = make_inputs(m, torch.float32, case, device=dev)
    if fp8:
        inp["w13"], s13 = quant_block(inp["w13"])
        inp["w2"], s2 = quant_block(inp["w2"])
        inp["kw"] = dict(w13_scale=s13, w2_scale=s2, block_shape=BS)
    out = fused_moe(moe_call(inp), config=config, config2=config2)
    return relerr(out, reference_ref(inp)), FP8_VS_REFERENCE if fp8 else (5e-3 if dev == "cuda" else 1e-5)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("case", list(TILE_CASES))
def test_triton_kernels_other_tiles(fp8: bool, case: str) -> None:
    """GEMM 2 with its own tile (BLOCK_N wider than the FP8 block, BLOCK_K dividing it), and weight tiles through TMA
    descriptors or pointer loads: all match reference."""
    from moefx.kernels.moe_grouped import GemmConfig

    tile1, tile2 = TILE_CASES[case]
    err, bound = _fused_relerr_and_bound(9, "zero_experts", fp8, GemmConfig(**tile1),
                                         GemmConfig(**tile2) if tile2 else None)
    assert err < bound


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tile2", [dict(block_m=16), dict(block_m=32, half=True), dict(block_m=32)],
                         ids=["gemm2 sub-blocks", "gemm2 half", "gemm2 full blocks"])
def test_half_tiles_and_gemm2_sub_blocks(fp8: bool, tile2: dict) -> None:
    """GEMM 1 at BLOCK_M 32 with half tiles: expert 1's 40 rows run one full tile and one 16-row tile (8 rows), the
    other experts' ~13 rows half tiles. GEMM 2 either runs 16-row tiles inside the 32-row align blocks (skipping the
    all-padding ones), half tiles too, or full 32-row tiles that read the rows GEMM 1's half tiles never wrote (as
    padding only: their results are not stored). Every variant matches reference."""
    from moefx.kernels.moe_grouped import GemmConfig

    base = dict(block_n=32, block_k=32, group_m=2, num_stages=2)
    err, bound = _fused_relerr_and_bound(40, "one_expert", fp8, GemmConfig(block_m=32, half=True, **base),
                                         GemmConfig(**(base | tile2)))
    assert err < bound


def test_fp8_running_scale_equals_per_step_scaling() -> None:
    """A running-scale accumulator (rescaled by previous / current scale each K step) gives the per-step scaled sum,
    also with a zero weight scale (an all-zero block): GEMM 1 with one scale per tile, GEMM 2 with a tile wider than
    the block (scales per column)."""
    from backends_util import quant_block

    from moefx.kernels.moe_grouped import GemmConfig, fused_moe

    dev = kernel_device()
    inp = make_inputs(9, torch.float32, "zero_experts", device=dev)
    w13, s13 = quant_block(inp["w13"])
    w2, s2 = quant_block(inp["w2"])
    e = int(inp["topk_ids"][0, 0])
    w13[e, : BS[0], : BS[1]] = 0  # zero weights with a zero scale (some quantizers write 0 for an all-zero block)
    s13[e, 0, 0] = 0
    call = MoeCall(inp["hidden"], inp["topk_ids"], inp["topk_weights"], w13, w2, s13, s2, BS)
    outs = [fused_moe(call, config=GemmConfig(16, 32, 32, 1, num_stages=2, running=running),
                      config2=GemmConfig(16, 64, 32, 4, num_stages=2, running=running)) for running in (False, True)]
    assert torch.isfinite(outs[1]).all()
    assert relerr(outs[1], outs[0]) < 1e-2  # fp32 rounding apart, then one e4m3 rounding of the intermediate


def test_default_tiles_cover_every_m_and_fit_fp8_blocks() -> None:
    import math

    from moefx.kernels.moe_grouped import DEFAULT_TILES, default_tiles, normalize_tiles

    for kind, rows in DEFAULT_TILES.items():
        assert rows[-1][0] == math.inf and [r[0] for r in rows] == sorted(r[0] for r in rows)
        for _, cfg1, cfg2 in rows:
            assert cfg1.block_m % cfg2.block_m == 0 and normalize_tiles(cfg1, cfg2, None) == (cfg1, cfg2)
            if kind == "fp8":
                assert cfg1.block_n == 128 and 128 % cfg1.block_k == 0 and 128 % cfg2.block_k == 0
    assert default_tiles(1, 8, 128, fp8=False)[0].block_m == 16
    assert default_tiles(4096, 8, 128, fp8=False) == DEFAULT_TILES["bf16"][-1][1:]
    assert default_tiles(4096, 8, 128, fp8=True) == DEFAULT_TILES["fp8"][-1][1:]


def test_tma_problem_names_the_layout() -> None:
    from moefx.kernels.moe_grouped import tma_problem

    assert tma_problem(torch.randn(E, 2 * I, H), torch.randn(E, H, I)) is None
    assert "contiguous" in tma_problem(torch.randn(E, H, 2 * I).transpose(1, 2), torch.randn(E, H, I))
    assert "16-byte" in tma_problem(torch.randn(E, 2 * I, 3), torch.randn(E, 3, I))


def test_fit_shared_memory_trims_stages_then_block_k() -> None:
    from moefx.kernels.moe_grouped import GemmConfig, fit_shared_memory, tile_smem_bytes

    big = GemmConfig(128, 128, 64, num_stages=3)
    assert tile_smem_bytes(big, 2, 4) == 3 * (128 * 64 + 2 * 64 * 128) * 4  # fp32 weights: 288 KiB
    assert fit_shared_memory(big, 2, 2, 227 * 1024) == big  # bf16: fits the H200 as it is
    fp32 = fit_shared_memory(big, 2, 4, 227 * 1024)
    assert fp32.num_stages == 2 and fp32.block_k == 64 and tile_smem_bytes(fp32, 2, 4) <= 227 * 1024
    small = fit_shared_memory(big, 2, 2, 64 * 1024)  # a GPU with less shared memory: stages, then BLOCK_K
    assert small.num_stages == 2 and small.block_k == 32
    assert fit_shared_memory(big, 2, 1, 1024, min_k=32).block_k == 32  # never below the FP8 dot's K


def test_fp8_at_large_m_takes_the_running_scale_tiles() -> None:
    """FP8 above 128 rows per expert runs the default BLOCK_M 128 running-scale tiles, and matches reference."""
    from moefx.kernels.moe_grouped import default_tiles, fused_moe

    dev = kernel_device()
    inp = make_inputs(300, torch.float32, device=dev, fp8=True)
    assert all(cfg.running and cfg.block_m == 128 for cfg in default_tiles(300, K, E, fp8=True))
    out = fused_moe(moe_call(inp))
    assert relerr(out, reference_ref(inp)) < FP8_VS_REFERENCE


@pytest.mark.parametrize("fp8", [False, True])
def test_default_tiles_between_32_and_128_rows_per_expert(fp8: bool) -> None:
    """~50 rows per expert: GEMM 1 aligns at 128 with half tiles, GEMM 2 runs 64-row tiles inside; matches reference."""
    from moefx.kernels.moe_grouped import default_tiles, fused_moe

    dev = kernel_device()
    cfg1, cfg2 = default_tiles(100, K, E, fp8)
    assert (cfg1.block_m, cfg1.half, cfg2.block_m) == (128, True, 64)
    inp = make_inputs(100, torch.float32, device=dev, fp8=fp8)
    out = fused_moe(moe_call(inp))
    assert relerr(out, reference_ref(inp)) < (FP8_VS_REFERENCE if fp8 else 5e-3 if dev == "cuda" else 1e-5)


def test_fp32_weights_at_large_m_with_default_tiles() -> None:
    """fp32 rows at > 128 rows per expert take the widest default tiles (on a GPU: trimmed to its shared memory)."""
    from moefx.kernels.moe_grouped import fused_moe

    dev = kernel_device()
    inp = make_inputs(300, torch.float32, device=dev)
    out = fused_moe(moe_call(inp))
    assert relerr(out, reference_ref(inp)) < (5e-3 if dev == "cuda" else 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_default_tiles_compile_for_sm90(kind: str) -> None:
    """Every DEFAULT_TILES row's GEMM 1 and GEMM 2 (and the gemv stages at theirs) compile for sm_90a (the H200) as
    fused_moe and gemv_moe launch them, fit its shared memory, spill no registers and keep their wgmmas asynchronous:
    the GPU compiler sees branches the interpreter never runs (tests/compile_sm90.py)."""
    from moefx.kernels import moe_gemv as gemv_kernels
    from moefx.kernels.activation import ACTIVATIONS
    from moefx.kernels.moe_grouped import DEFAULT_TILES

    rows = compile_sm90(kind)
    variants = sum(1 for a in ACTIVATIONS.values() if a.kernel_id) + 1  # the other activations, clamped SwiGLU
    assert len(rows) == len(DEFAULT_TILES[kind]) + len(gemv_kernels.DEFAULT_TILES[kind]) + variants
    h200_shared_memory = 227 * 1024
    kernels = [r[g] for r in rows for g in ("gemm1", "gemm2")]
    assert all(0 < k["smem"] <= h200_shared_memory and k["spill"] == 0 and not k["serialized"] for k in kernels), rows
