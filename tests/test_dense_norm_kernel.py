"""The dense-linear Triton kernel's RMSNorm prologue (NORM, kernels/dense_gemm.py) against the norm then the fp32
product (`ref_rms_norm` + dense.py's `reference`): under TRITON_INTERPRET=1 on the CPU with fp32 inputs (the interpreter
gets bf16 dots and bf16 rounding wrong), on the GPU in bf16 (marked gpu). Bounds: fp32 rtol = atol = 1e-5 per
element (only the summation order differs: the variance's and the products'); bf16 outputs 5e-3 relative (one
rounding of the normed input, <= 2^-8 relative per element, and one of each output)."""

from __future__ import annotations

import pytest
import torch

from moefx.backends.dense import add_rms_norm_dense_linear, reference, rms_norm_dense_linear
from moefx.kernels import dense_gemm as K
from moefx.ops.quant import ref_rms_norm

EPS = 1e-6


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def _case(m, ns, k, dtype, device, norm_w=True, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device, dtype=dtype) * 4  # not unit RMS: the norm changes it
    nw = (1 + 0.5 * torch.randn(k, generator=g, device=device)).to(dtype) if norm_w else None
    ws = [torch.randn(n, k, generator=g, device=device, dtype=dtype) * k**-0.5 for n in ns]
    bs = [torch.randn(n, generator=g, device=device, dtype=dtype) if i != 1 else None for i, n in enumerate(ns)]
    return x, nw, ws, bs


def _expected(x, nw, ws, bs):
    return reference(ref_rms_norm(x, nw, EPS, False), ws, bs, None, [], None, None)


# (M, N per weight, K, config): K a multiple of no BLOCK_K (nor of the prologue's NORM_BLOCK); the CUDA-core sum
# (DOT=False) at one and several K slices (forced, and chosen by the SM count), the tensor-core dot as the existing
# kernel tests run it; the prologue in one load of the rows and in several
CASES = [
    (1, (40, 24, 8), 200, None),  # default tile: one slice, K < BLOCK_K
    (3, (12, 6, 2), 200, K.DenseConfig(block_n=2, block_k=32, split_k=3)),  # each slice needs the whole rows
    (1, (8,), 5000, K.DenseConfig(block_n=4, block_k=256)),  # automatic split-K (4 slices), the rows in 2 loads
    (3, (33, 17), 72, K.DenseConfig(block_k=16, split_k=1)),  # several K steps in one slice
    (5, (33, 17), 72, None),  # the default tensor-core tile
    (17, (48,), 300, K.DenseConfig(dot=True, block_n=16, block_k=32, split_k=2)),  # the rows in 10 loads
]


@pytest.mark.parametrize("norm_w", [True, False])
@pytest.mark.parametrize("m,ns,k,cfg", CASES)
def test_norm_prologue_matches_norm_then_fp32_product(m, ns, k, cfg, norm_w):
    x, nw, ws, bs = _case(m, ns, k, torch.float32, "cpu", norm_w)
    if cfg is not None and cfg.split_k == 0:
        assert K.plan_launch(cfg, m, ns, k, None, K._sm_count(x.device)).split_k > 1
    outs = K.dense_gemv(x, ws, bs, config=cfg, norm_weight=nw, norm_eps=EPS)
    for o, r in zip(outs, _expected(x, nw, ws, bs)):
        assert o.shape == r.shape and o.dtype == torch.float32
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,ns,k,cfg", CASES)
def test_add_norm_prologue_matches_add_norm_then_fp32_product(m, ns, k, cfg, dtype):
    """The residual form: H = X + R exact in X's dtype (fp16 checks its rounding: the interpreter casts fp16 right), the
    normed H within the variance's summation order of the norm on H, the products as the plain prologue's."""
    x, nw, ws, bs = _case(m, ns, k, dtype, "cpu")
    r = torch.randn(m, k, generator=torch.Generator().manual_seed(9), dtype=dtype) * 3
    *outs, h, xn = K.dense_gemv(x, ws, bs, config=cfg, norm_weight=nw, norm_eps=EPS, residual=r)
    assert len(outs) == len(ws) and h.shape == xn.shape == x.shape and h.dtype == xn.dtype == dtype
    torch.testing.assert_close(h, x + r, rtol=0, atol=0)
    ref_xn = ref_rms_norm(x + r, nw, EPS, False)
    bound = 1e-5 if dtype == torch.float32 else 1e-3  # fp16: one rounding step where the rstd's last bit differs
    torch.testing.assert_close(xn, ref_xn, rtol=bound, atol=bound)
    for o, ref in zip(outs, reference(ref_xn, ws, bs, None, [], None, None)):
        torch.testing.assert_close(o.float(), ref.float(), rtol=10 * bound, atol=10 * bound)


# (M, E, K, config, routing: top_k, kind, renormalize, groups, topk_group, scale): the router at decode (one K
# slice, automatic split-K), several M tiles on the tensor cores, sigmoid with a bias and groups (DeepSeek-V3's form)
ROUTE_CASES = [
    (1, 64, 200, None, (4, "softmax", True, 1, 1, 1.0)),
    (3, 64, 5000, K.DenseConfig(block_n=4, block_k=256), (8, "softmax", False, 1, 1, 1.0)),
    (2, 40, 72, K.DenseConfig(block_n=2, block_k=16, split_k=3), (3, "topk_softmax", True, 1, 1, 1.0)),
    (17, 48, 300, K.DenseConfig(dot=True, block_n=16, block_k=32, split_k=2), (2, "softmax", True, 1, 1, 1.0)),
    (3, 64, 96, K.DenseConfig(block_n=8, block_k=32, split_k=2), (6, "sigmoid", True, 8, 4, 2.5)),
]


@pytest.mark.parametrize("m,e,k,cfg,spec", ROUTE_CASES)
def test_route_epilogue_routes_the_logits_as_fused_topk(m, e, k, cfg, spec):
    """The last program to write a logits tile routes the M tile's rows (the ROUTE epilogue): the ids fused_topk's
    PyTorch path picks from the same logits, weights within fp32 rounding; the counters are left at zero."""
    from moefx.backends.routing import fused_topk_torch

    top_k, kind, renorm, groups, kept, scale = spec
    x, nw, (w,), _ = _case(m, (e,), k, torch.float32, "cpu")
    r = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(e, generator=torch.Generator().manual_seed(6)) if kind == "sigmoid" else None
    route = (top_k, kind, renorm, bias, groups, kept, scale, torch.float16)
    logits, h, xn, weights, ids = K.dense_gemv(x, [w], [None], config=cfg, norm_weight=nw, norm_eps=EPS, residual=r,
                                               route=route)
    assert weights.shape == ids.shape == (m, top_k) and weights.dtype == torch.float16 and ids.dtype == torch.int64
    ref_w, ref_ids = fused_topk_torch(logits, top_k, kind, renorm, bias, groups, kept, scale)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w.to(torch.float16), rtol=1e-3, atol=1e-3)
    assert int(K._counters(x.device).count_nonzero()) == 0
    again = K.dense_gemv(x, [w], [None], config=cfg, norm_weight=nw, norm_eps=EPS, residual=r, route=route)
    assert torch.equal(again[4], ids)  # a second call finds the counters at zero


@pytest.mark.parametrize("kind", ["softmax", "topk_softmax", "sigmoid"])
@pytest.mark.parametrize("special", ["ties", "nan", "inf"])
def test_route_epilogue_ties_nan_and_inf_as_the_routing_kernel(kind, special):
    """Three rows routed together in one M tile with a padding row: exact ties (copies of one router row, so equal
    logits), a NaN expert (every row's weights NaN but sigmoid's renormalized ones, ids NaN first) or an infinite one.
    The ids equal the routing kernel's and the torch path's of the same logits, the weights the routing kernel's
    (the sums are integer or in pick order: bit for bit on the GPU; within the interpreter's numpy exp here)."""
    from moefx.backends.routing import fused_topk_torch
    from moefx.kernels.moe_routing import fused_topk_triton

    x, nw, (w,), _ = _case(3, (40,), 64, torch.float32, "cpu")
    w[[7, 12, 30]] = w[3].clone()
    if special == "nan":
        w[20, 5] = float("nan")
    elif special == "inf":
        w[20] = 0.0
        w[20, 5] = float("inf")  # +inf or -inf per row, by the sign of its normed x
    r = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    route = (6, kind, True, None, 1, 1, 1.0, None)
    cfg = K.DenseConfig(block_n=8, block_k=32, split_k=2)
    logits, _, _, weights, ids = K.dense_gemv(x, [w], [None], config=cfg, norm_weight=nw, norm_eps=EPS, residual=r,
                                              route=route)
    assert K.plan_launch(cfg, 3, (40,), 64, None, K._sm_count(x.device)).block_m == 4
    assert torch.equal(logits[:, 7], logits[:, 3]) and torch.equal(logits[:, 30], logits[:, 3])
    ref_w, ref_ids = fused_topk_triton(logits, *route)
    assert torch.equal(ids, ref_ids) and torch.equal(ids, fused_topk_torch(logits, 6, kind)[1])
    assert torch.equal(weights.isnan(), ref_w.isnan())
    torch.testing.assert_close(weights, ref_w, rtol=2e-7, atol=0, equal_nan=True)


def test_a_router_wider_than_the_epilogue_is_routed_by_the_routing_kernel():
    """Past MAX_ROUTE_EXPERTS the launch has no ROUTE epilogue; the routing kernel runs after it, same outputs."""
    from moefx.backends.routing import fused_topk_torch

    e = K.MAX_ROUTE_EXPERTS + 76
    assert not K.route_supported(e, 1)
    x, nw, (w,), _ = _case(2, (e,), 32, torch.float32, "cpu")
    r = torch.randn(2, 32, generator=torch.Generator().manual_seed(5))
    route = (4, "softmax", True, None, 1, 1, 1.0, None)
    logits, _, _, weights, ids = K.dense_gemv(x, [w], [None], norm_weight=nw, norm_eps=EPS, residual=r, route=route)
    ref_w, ref_ids = fused_topk_torch(logits, 4, "softmax", True, None, 1, 1, 1.0)
    assert torch.equal(ids, ref_ids) and weights.dtype == torch.float32
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


def test_norm_prologue_loads_rows_in_wide_steps():
    qkv = K.plan_launch(K.default_config(1, fp8=False), 1, (4096, 512, 512), 2048, None, 132)
    assert K.norm_block(qkv, 2048, False) == 2048  # Qwen3-30B-A3B's rows at decode: one load each
    long_rows = K.plan_launch(K.DenseConfig(block_n=4, block_k=256), 1, (8,), 5000, None, 4)
    assert K.norm_block(long_rows, 5000, False) == 4096  # CASES' K=5000 row: two loads
    dot = K.plan_launch(K.DenseConfig(dot=True, block_n=16, block_k=32), 17, (48,), 300, None, 4)
    assert K.norm_block(dot, 300, True) == 32  # tensor-core tiles: BLOCK_K columns a load


def test_norm_prologue_arguments_are_checked():
    x, nw, ws, bs = _case(2, (8,), 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="norm_weight needs norm_eps"):
        K.dense_gemv(x, ws, bs, norm_weight=nw)
    with pytest.raises(ValueError, match="not an FP8 X with x_scale"):
        K.dense_gemv(x, ws, bs, x, [ws[0]], (32, 32), torch.float32, norm_eps=EPS)
    with pytest.raises(ValueError, match="residual must come with norm_eps"):
        K.dense_gemv(x, ws, bs, residual=x)
    with pytest.raises(ValueError, match="residual must come with norm_eps"):
        K.dense_gemv(x, ws, bs, norm_eps=EPS, residual=x[:1])
    with pytest.raises(ValueError, match="route takes one float weight"):
        K.dense_gemv(x, ws + ws, bs + bs, route=(2, "softmax", True, None, 1, 1, 1.0, None))


# --------------------------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("ns,k", [((4096, 512, 512), 2048), ((128,), 2048), ((1000, 72, 24), 1000)])
@pytest.mark.parametrize("m", [1, 3, 4, 16, 33])
def test_gpu_bf16_norm_prologue_matches_norm_then_fp32_product(ns, k, m):
    x, nw, ws, bs = _case(m, ns, k, torch.bfloat16, "cuda", seed=m)
    for o, r in zip(K.dense_gemv(x, ws, bs, norm_weight=nw, norm_eps=EPS), _expected(x, nw, ws, bs)):
        assert o.dtype == torch.bfloat16 and relerr(o, r) < 5e-3
    fused = rms_norm_dense_linear(x, nw, EPS, ws, bs, backend="gemv")
    upstream = rms_norm_dense_linear(x, nw, EPS, ws, bs, backend="upstream")
    assert all(relerr(f, u) < 1e-2 for f, u in zip(fused, upstream))  # both within 5e-3 of the fp32 product


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("ns,k", [((128,), 2048), ((1000, 72, 24), 1000)])
@pytest.mark.parametrize("m", [1, 3, 4, 16])
def test_gpu_bf16_add_norm_prologue_matches_add_norm_then_fp32_product(ns, k, m):
    """The router's form (N=128 at Qwen3-30B-A3B's K) and one with several weights: the sum exact, the normed rows
    eager's but where the variance's summation order moves a rounding (< 0.5% of elements), the products as the
    plain prologue's."""
    x, nw, ws, bs = _case(m, ns, k, torch.bfloat16, "cuda", seed=m)
    r = torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda").to(x.dtype)
    *outs, h, xn = K.dense_gemv(x, ws, bs, norm_weight=nw, norm_eps=EPS, residual=r)
    assert torch.equal(h, r + x)
    ref_xn = ref_rms_norm(r + x, nw, EPS, False)
    assert (xn != ref_xn).float().mean().item() < 5e-3
    for o, ref in zip(outs, reference(ref_xn, ws, bs, None, [], None, None)):
        assert o.dtype == torch.bfloat16 and relerr(o, ref) < 5e-3
    *fused, fh, fxn = add_rms_norm_dense_linear(x, r, nw, EPS, ws, bs, backend="gemv")
    *upstream, uh, uxn = add_rms_norm_dense_linear(x, r, nw, EPS, ws, bs, backend="upstream")
    assert torch.equal(fh, uh) and (fxn != uxn).float().mean().item() < 5e-3
    assert all(relerr(f, u) < 1e-2 for f, u in zip(fused, upstream))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 4])
def test_gpu_bf16_route_epilogue_matches_fused_topk_of_its_logits(m):
    """Qwen3-30B-A3B's router (128 experts, top-8 softmax, renormalized, weights in bf16) through the op as
    fuse_router_topk writes it: the fused launch's ids and weights are fused_topk's of the same logits, bit for bit,
    and its logits, sum and normed rows add_rms_norm_dense_linear's."""
    from moefx.backends import router  # noqa: F401  (registers moefx::add_rms_norm_route)

    x, nw, (w,), _ = _case(m, (128,), 2048, torch.bfloat16, "cuda", seed=m)
    r = torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(3), device="cuda").to(x.dtype)
    logits, h, xn, weights, ids = torch.ops.moefx.add_rms_norm_route(x, r, nw, EPS, w, 8, "softmax", True, None, 1, 1,
                                                                     1.0, torch.bfloat16, "gemv")
    ref_w, ref_ids = torch.ops.moefx.fused_topk(logits, 8, "softmax", True, None, 1, 1, 1.0, torch.bfloat16)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_w)
    unrouted = add_rms_norm_dense_linear(x, r, nw, EPS, [w], backend="gemv")
    assert all(torch.equal(a, b) for a, b in zip((logits, h, xn), unrouted))
    for _ in range(3):  # the counters are left at zero: every call routes
        again = torch.ops.moefx.add_rms_norm_route(x, r, nw, EPS, w, 8, "softmax", True, None, 1, 1, 1.0,
                                                   torch.bfloat16, "gemv")
        assert torch.equal(again[4], ids)
