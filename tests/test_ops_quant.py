"""moefx quant ops on CPU (the reference path): each op reproduces, bit for bit, the eager code forms the
fusion passes replace (written out here the way vLLM, SGLang/DeepSeek and transformers write them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

import moefx.ops  # noqa: F401  (registers the ops)
from moefx.ops.quant import QuantScheme

ops = torch.ops.moefx
FP8 = torch.float8_e4m3fn
VLLM_MIN_SCALE = 1.0 / (448.0 * 512.0)


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8) if q.dtype == FP8 else q


def _vllm_group_quant(x, group, ue8m0=False, column_major=False):
    """vLLM QuantFP8's native group path: scale clamped AFTER dividing, pad the last partial group."""
    h = x.shape[-1]
    g = -(-h // group)
    xp = F.pad(x, (0, g * group - h)) if g * group != h else x
    xg = xp.view(-1, g, group)
    amax = xg.abs().max(dim=-1, keepdim=True)[0].float()
    s = amax / 448.0
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    s = torch.clamp(s, min=VLLM_MIN_SCALE)
    q = (xg / s).clamp(-448.0, 448.0).to(FP8).view(-1, g * group)[..., :h].view(x.shape)
    s = s.squeeze(-1).reshape(*x.shape[:-1], g)
    if column_major:
        s = s.transpose(-2, -1).contiguous().transpose(-1, -2)
    return q, s


def _deepseek_group_quant(x, group, eps=1e-10):
    """SGLang / DeepSeek style: amax clamped BEFORE dividing by 448."""
    xg = x.float().view(*x.shape[:-1], -1, group)
    s = xg.abs().amax(-1, keepdim=True).clamp(min=eps) / 448.0
    return (xg / s).clamp(-448.0, 448.0).to(FP8).view(x.shape), s.squeeze(-1)


def _int8_token(x):
    s = x.float().abs().amax(-1, keepdim=True) / 127.0
    return torch.round(x.float() / s).clamp(-128, 127).to(torch.int8), s


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("h", [256, 320])
def test_quant_matches_vllm_group_native(ue8m0, h):
    x = torch.randn(6, h, dtype=torch.bfloat16) * 4
    q_ref, s_ref = _vllm_group_quant(x, 128, ue8m0=ue8m0, column_major=True)
    q, s = ops.quant(x, *QuantScheme("fp8_group", 128, 0.0, VLLM_MIN_SCALE, 448.0, ue8m0, True).args())
    assert torch.equal(_bits(q), _bits(q_ref))
    assert torch.equal(s, s_ref) and s.stride() == s_ref.stride()


@pytest.mark.parametrize("group", [128, 64])
def test_quant_matches_deepseek_eps_form(group):
    x = torch.randn(2, 3, 512, dtype=torch.bfloat16)
    x[0, 0, :group] = 0  # an all-zero group exercises eps
    q_ref, s_ref = _deepseek_group_quant(x, group)
    q, s = ops.quant(x, *QuantScheme("fp8_group", group, eps=1e-10).args())
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, s_ref)


def test_int8_token_matches_torch_round():
    x = torch.randn(9, 200, dtype=torch.float16)
    q_ref, s_ref = _int8_token(x)
    q, s = ops.quant(x, *QuantScheme("int8_token", 0, eps=0.0).args())
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref) and s.shape == (9, 1)


def test_silu_mul_quant_matches_transformers_mlp():
    act = torch.nn.SiLU()  # transformers ACT2FN["silu"]
    g = torch.randn(5, 384, dtype=torch.bfloat16) * 3
    u = torch.randn(5, 384, dtype=torch.bfloat16) * 3
    sc = QuantScheme("fp8_group", 128)
    q_ref, s_ref = ops.quant(act(g) * u, *sc.args())
    q, s = ops.silu_mul_quant_split(g, u, *sc.args())
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, s_ref)
    q2, s2 = ops.silu_mul_quant(torch.cat([g, u], -1), *sc.args())
    assert torch.equal(_bits(q2), _bits(q_ref)) and torch.equal(s2, s_ref)
    # The bf16 rounding of the product matters: quantizing the fp32 product differs somewhere.
    q32, _ = ops.quant((F.silu(g.float()) * u.float()), *sc.args())
    assert not torch.equal(_bits(q32), _bits(q_ref))


@pytest.mark.parametrize("kind", ["fp8_group", "fp8_token", "int8_token", "int8_group"])
def test_rms_norm_quant_matches_qwen3_rmsnorm(kind):
    norm = Qwen3MoeRMSNorm(256, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256) * 0.5 + 1)
    x = torch.randn(7, 256, dtype=torch.bfloat16) * 2
    sc = QuantScheme(kind, 128 if kind.endswith("group") else 0)
    with torch.no_grad():
        q_ref, s_ref = ops.quant(norm(x), *sc.args())
        q, s = ops.rms_norm_quant(x, norm.weight, 1e-6, False, *sc.args())
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, s_ref)


def test_rms_norm_quant_matches_functional_rms_norm():
    x = torch.randn(7, 256, dtype=torch.bfloat16)
    w = torch.randn(256, dtype=torch.bfloat16)
    sc = QuantScheme("fp8_group", 128)
    q_ref, s_ref = ops.quant(F.rms_norm(x, (256,), w, 1e-5), *sc.args())
    q, s = ops.rms_norm_quant(x, w, 1e-5, True, *sc.args())
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, s_ref)
    q_other, _ = ops.rms_norm_quant(x, w, 1e-5, False, *sc.args())
    assert not torch.equal(_bits(q_other), _bits(q_ref))  # the two weight conventions really differ


def test_add_rms_norm_quant_transformers_and_vllm_forms():
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    r = torch.randn(4, 256, dtype=torch.bfloat16)
    w = torch.randn(256, dtype=torch.bfloat16)
    sc = QuantScheme("fp8_group", 128)
    norm = Qwen3MoeRMSNorm(256, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(w)
        s_hf = r + x  # transformers decoder layer: residual add in bf16, norm reads the rounded sum
        q_ref, sc_ref = ops.quant(norm(s_hf), *sc.args())
    q, s, new_r = ops.add_rms_norm_quant(x, r, w, 1e-6, False, False, *sc.args())
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, sc_ref) and torch.equal(new_r, s_hf)
    # vLLM RMSNorm.forward_native(x, residual): fp32 add, the norm reads the fp32 sum.
    x32 = x.float() + r.float()
    res_v = x32.to(torch.bfloat16)
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * w
    q_ref, sc_ref = ops.quant(y, *sc.args())
    q, s, new_r = ops.add_rms_norm_quant(x, r, w, 1e-6, False, True, *sc.args())
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, sc_ref) and torch.equal(new_r, res_v)


def test_unfused_ops_compose_to_fused():
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    r = torch.randn(3, 256, dtype=torch.bfloat16)
    w = torch.randn(256, dtype=torch.bfloat16)
    args = QuantScheme("int8_group", 64).args()
    a = ops.quant(ops.silu_mul(x), *args)
    b = ops.silu_mul_quant(x, *args)
    assert all(torch.equal(i, j) for i, j in zip(a, b))
    y, nr = ops.add_rms_norm(x[:, :256], r, w, 1e-6, True, False)
    q, s, nr2 = ops.add_rms_norm_quant(x[:, :256], r, w, 1e-6, True, False, *args)
    qa, sa = ops.quant(y, *args)
    assert torch.equal(q, qa) and torch.equal(s, sa) and torch.equal(nr, nr2)
    assert torch.equal(ops.rms_norm(x, None, 1e-6, False), F.rms_norm(x.float(), (512,), None, 1e-6).to(x.dtype))


@pytest.mark.parametrize(
    "scheme",
    [QuantScheme(), QuantScheme(column_major_scales=True), QuantScheme(tma_aligned_scales=True),
     QuantScheme("fp8_token", 0), QuantScheme("int8_group", 64)],
)
def test_fake_impls_match_real_layouts(scheme):
    x = torch.randn(6, 256, dtype=torch.bfloat16)
    w = torch.ones(256, dtype=torch.bfloat16)
    real = [ops.quant(x, *scheme.args()), ops.silu_mul_quant(x, *scheme.args()),
            ops.rms_norm_quant(x, w, 1e-6, False, *scheme.args()),
            ops.add_rms_norm_quant(x, x, w, 1e-6, False, False, *scheme.args())]
    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        fake = [ops.quant(fx, *scheme.args()), ops.silu_mul_quant(fx, *scheme.args()),
                ops.rms_norm_quant(fx, fw, 1e-6, False, *scheme.args()),
                ops.add_rms_norm_quant(fx, fx, fw, 1e-6, False, False, *scheme.args())]
    for r_out, f_out in zip(real, fake):
        for r_t, f_t in zip(r_out, f_out):
            assert (r_t.shape, r_t.dtype, r_t.stride()) == (f_t.shape, f_t.dtype, f_t.stride())
    if scheme.tma_aligned_scales:
        assert real[0][1].stride() == (1, 8)  # 6 rows padded to 8


def test_ops_trace_into_fx():
    from torch.fx.experimental.proxy_tensor import make_fx

    args = QuantScheme().args()
    gm = make_fx(lambda x: ops.silu_mul_quant(x, *args))(torch.randn(2, 512, dtype=torch.bfloat16))
    assert any(n.target is ops.silu_mul_quant.default for n in gm.graph.nodes)


@pytest.mark.parametrize(
    "bad, match",
    [(dict(kind="fp4"), "kind"), (dict(group_size=0), "group_size"), (dict(eps=-1.0), "eps"),
     (dict(kind="fp8_token", column_major_scales=True), "column_major"), (dict(qmax=500.0), "qmax")],
)
def test_bad_scheme_raises(bad, match):
    with pytest.raises(ValueError, match=match):
        ops.quant(torch.randn(2, 128), *QuantScheme(**bad).args())


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="even"):
        ops.silu_mul_quant(torch.randn(2, 127), *QuantScheme().args())
    with pytest.raises(ValueError, match="weight shape"):
        ops.rms_norm_quant(torch.randn(2, 128), torch.ones(64), 1e-6, False, *QuantScheme().args())
    with pytest.raises(ValueError, match="dtype"):
        ops.quant(torch.randn(2, 128).to(torch.float64), *QuantScheme().args())
