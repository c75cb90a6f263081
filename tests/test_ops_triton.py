"""Triton quant and GEMM kernels against the reference, under TRITON_INTERPRET=1 on CPU (tiny shapes) or on
the GPU when present. Bound: scales within 1e-6 relative; q identical except rare last-bit differences
(here < 1% of elements on these tiny shapes: numpy's exp / the variance sum order differ from torch's by ulps)."""

from __future__ import annotations

import pytest
import torch

import moefx.ops  # noqa: F401
from moefx.kernels import act_quant as T
from moefx.kernels import fp8_gemm
from moefx.ops import block_gemm
from moefx.ops.fused_quant import _outputs
from moefx.ops.quant import SCALINGS, QuantScheme, check_scheme, quant_weight_fp8_block, quant_weight_int8_channel

ops = torch.ops.moefx
# All-zero padding groups take log2(0) = -inf in the UE8M0 scale, as torch.log2 does in the reference.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SCHEMES = [
    QuantScheme("fp8_group", 128),
    QuantScheme("fp8_group", 64, eps=0.0, min_scale=1 / (448 * 512), scale_ue8m0=True, column_major_scales=True),
    QuantScheme("fp8_token", 0),
    QuantScheme("int8_token", 0),
    QuantScheme("int8_group", 128, tma_aligned_scales=True),
]


def _assert_close_quant(q, s, q_ref, s_ref, max_frac=0.01):
    assert q.dtype == q_ref.dtype and s.stride() == s_ref.stride()
    rel = ((s - s_ref).abs() / s_ref.abs().clamp_min(1e-30)).max().item()
    assert rel <= 1e-6, f"scales differ by {rel:.2e} relative"
    a = q.float() if q.dtype == torch.int8 else q.view(torch.uint8).float()
    b = q_ref.float() if q.dtype == torch.int8 else q_ref.view(torch.uint8).float()
    diff = (a - b).abs()
    assert diff.max().item() <= 1, "a q element differs by more than its last bit"
    assert (diff > 0).float().mean().item() <= max_frac


def _launch(mode, x, scheme, u=None, h=None, **kw):
    q, s = _outputs(x.shape[:-1], h or x.shape[-1], x.device, scheme.args())
    T.launch(mode, q, s, scheme.args(), check_scheme(*scheme.args()), x, u, **kw)
    return q, s


def test_the_kernel_has_a_code_for_every_scaling():
    assert set(T.SCALING_CODES) == set(SCALINGS) and len(set(T.SCALING_CODES.values())) == len(SCALINGS)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.kind}{s.group_size}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plain_and_silu_kernels(scheme, dtype):
    x = torch.randn(6, 2 * 320, dtype=dtype, device=DEV) * 3
    q, s = _launch(T.MODE_PLAIN, x[:, :320], scheme)
    _assert_close_quant(q, s, *ops.quant(x[:, :320], *scheme.args()))
    q, s = _launch(T.MODE_SILU, x[:, :320], scheme, x[:, 320:])
    _assert_close_quant(q, s, *ops.silu_mul_quant(x, *scheme.args()))


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.kind}{s.group_size}")
@pytest.mark.parametrize("weight_in_fp32", [False, True])
@pytest.mark.parametrize("fp32_sum", [False, True])
def test_norm_kernels(scheme, weight_in_fp32, fp32_sum):
    x = torch.randn(5, 256, dtype=torch.bfloat16, device=DEV)
    r = torch.randn_like(x)
    w = torch.randn(256, dtype=torch.bfloat16, device=DEV)
    nr = torch.empty_like(x)
    q, s = _launch(T.MODE_ADD_NORM, x, scheme, r, weight=w, norm_eps=1e-6, weight_in_fp32=weight_in_fp32,
                   y_dtype=torch.bfloat16, fp32_residual_sum=fp32_sum, new_residual=nr)
    q_ref, s_ref, nr_ref = ops.add_rms_norm_quant(x, r, w, 1e-6, weight_in_fp32, fp32_sum, *scheme.args())
    _assert_close_quant(q, s, q_ref, s_ref)
    assert torch.equal(nr, nr_ref)
    if not fp32_sum:
        q, s = _launch(T.MODE_NORM, x, scheme, weight=w, norm_eps=1e-6, weight_in_fp32=weight_in_fp32,
                       y_dtype=torch.bfloat16)
        _assert_close_quant(q, s, *ops.rms_norm_quant(x, w, 1e-6, weight_in_fp32, *scheme.args()))


def test_norm_kernel_fp32_weight_no_weight_and_3d_input():
    x = torch.randn(2, 3, 192, dtype=torch.float16, device=DEV)
    w = torch.randn(192, dtype=torch.float32, device=DEV)
    sc = QuantScheme("fp8_group", 64, column_major_scales=True)
    q, s = _launch(T.MODE_NORM, x, sc, weight=w, norm_eps=1e-5, weight_in_fp32=False, y_dtype=torch.float32)
    _assert_close_quant(q, s, *ops.rms_norm_quant(x, w, 1e-5, False, *sc.args()))
    q, s = _launch(T.MODE_NORM, x, sc, norm_eps=1e-5, y_dtype=torch.float16)
    _assert_close_quant(q, s, *ops.rms_norm_quant(x, None, 1e-5, False, *sc.args()))


@pytest.mark.parametrize("m, n, k, bn, bk", [(5, 96, 256, 128, 128), (20, 160, 192, 64, 64), (3, 64, 200, 128, 128)])
def test_fp8_block_gemm_kernel(m, n, k, bn, bk):
    x = torch.randn(m, k, device=DEV)
    a, a_s = ops.quant(x, *QuantScheme("fp8_group", bk, column_major_scales=True).args())
    w, w_s = quant_weight_fp8_block(torch.randn(n, k, device=DEV) * 0.05, bn, bk)
    bias = torch.randn(n, device=DEV)
    ref = block_gemm.ref_fp8_block_gemm(a, a_s, w, w_s, bn, bk, bias, torch.float32)
    out = fp8_gemm.fp8_block_gemm(a, a_s, w, w_s, bn, bk, bias, torch.float32)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    # And the whole w8a8 path stays near the unquantized product (block quant error ~ a few %).
    exact = x @ (w.float() * w_s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]).t() + bias
    assert ((out - exact).norm() / exact.norm()).item() < 0.06


def test_int8_gemm_matches_int_product():
    x = torch.randn(2, 3, 64, device=DEV)
    a, a_s = ops.quant(x, *QuantScheme("int8_token", 0).args())
    w, w_s = quant_weight_int8_channel(torch.randn(48, 64, device=DEV))
    out = ops.int8_gemm(a, a_s, w, w_s, None, torch.float32)
    ref = (a.double() @ w.double().t()).float() * a_s * w_s
    assert out.shape == (2, 3, 48) and ((out - ref).norm() / ref.norm()).item() < 1e-6
    with pytest.raises(ValueError, match="int8_gemm"):
        ops.int8_gemm(a.float(), a_s, w, w_s, None, torch.float32)


@pytest.mark.parametrize("scheme", [QuantScheme("fp8_group", 128), QuantScheme("int8_token", 0)],
                         ids=["fp8_group", "int8_token"])
def test_kernel_cuda_scale_semantics_and_exact_division(scheme):
    """The CUDA code path (scale = amax * fl32(1/qmax), as eager CUDA computes `amax / 448.0`; q by the
    Markstein-corrected quotient) run in the interpreter against that formula written in torch."""
    x = (torch.randn(8, 256) * 3).to(torch.bfloat16)
    x[0, :7] = 0.0
    q, s = _launch(T.MODE_PLAIN, x, scheme, cuda_semantics=True)
    qmax = 448.0 if scheme.kind.startswith("fp8") else 127.0
    gs = scheme.group_size or 256
    xg = x.float().view(8, -1, gs)
    s_ref = xg.abs().amax(-1, keepdim=True).clamp(min=scheme.eps) * (torch.tensor(1.0) / qmax)
    y = xg / s_ref
    q_ref = (y.clamp(-qmax, qmax).to(torch.float8_e4m3fn) if qmax == 448.0
             else torch.round(y).clamp(-qmax, qmax).to(torch.int8)).view(8, 256)
    assert torch.equal(s, s_ref.squeeze(-1))
    assert torch.equal(q.view(torch.uint8) if qmax == 448.0 else q, q_ref.view(torch.uint8) if qmax == 448.0 else q_ref)


NEW_MODES = [
    QuantScheme("int8_token", 0, 0.0, 1e-5, 127.0, scaling="reciprocal"),  # torchao / vLLM per-token
    QuantScheme("fp8_group", 128, 1e-4, 0.0, 448.0, scaling="qmax_over_amax"),  # DeepGEMM's early cast
    QuantScheme("fp8_group", 64, 0.0, 1 / (448 * 512), 448.0, True, ue8m0_after_min_scale=True),  # vLLM 0.33
]


@pytest.mark.parametrize("scheme", NEW_MODES, ids=["reciprocal", "qmax_over_amax", "ue8m0_after_min"])
def test_scaling_modes_in_every_kernel(scheme):
    x = torch.randn(6, 2 * 256, dtype=torch.bfloat16, device=DEV) * 3
    q, s = _launch(T.MODE_PLAIN, x[:, :256], scheme)
    _assert_close_quant(q, s, *ops.quant(x[:, :256], *scheme.args()))
    q, s = _launch(T.MODE_SILU, x[:, :256], scheme, x[:, 256:])
    _assert_close_quant(q, s, *ops.silu_mul_quant(x, *scheme.args()))
    r, w, nr = torch.randn_like(x[:, :256]), torch.randn(256, dtype=torch.bfloat16, device=DEV), x.new_empty(6, 256)
    q, s = _launch(T.MODE_ADD_NORM, x[:, :256], scheme, r, weight=w, norm_eps=1e-6, y_dtype=torch.bfloat16,
                   fp32_residual_sum=True, new_residual=nr)
    q_ref, s_ref, nr_ref = ops.add_rms_norm_quant(x[:, :256], r, w, 1e-6, False, True, *scheme.args())
    _assert_close_quant(q, s, q_ref, s_ref)
    assert torch.equal(nr, nr_ref)


def test_kernel_cuda_semantics_of_the_reciprocal_forms():
    """CUDA path in the interpreter: scale = amax * fl32(1/qmax), then one IEEE reciprocal and one product."""
    x = (torch.randn(8, 256) * 3).to(torch.bfloat16)
    inv = torch.tensor(1.0) / 448.0
    xg = x.float().view(8, 2, 128)
    amax = xg.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    sc = QuantScheme("fp8_group", 128, 1e-4, 0.0, 448.0, scaling="reciprocal")
    q, s = _launch(T.MODE_PLAIN, x, sc, cuda_semantics=True)
    s_ref = amax * inv
    assert torch.equal(s, s_ref.squeeze(-1))
    assert torch.equal(q.view(torch.uint8), (xg * s_ref.reciprocal()).to(torch.float8_e4m3fn).view(torch.uint8)
                       .view(8, 256))
    sc = QuantScheme("fp8_group", 128, 1e-4, 0.0, 448.0, scaling="qmax_over_amax")
    q, s = _launch(T.MODE_PLAIN, x, sc, cuda_semantics=True)
    assert torch.equal(s, s_ref.squeeze(-1))
    assert torch.equal(q.view(torch.uint8), (xg * (amax.reciprocal() * 448.0)).to(torch.float8_e4m3fn)
                       .view(torch.uint8).view(8, 256))
