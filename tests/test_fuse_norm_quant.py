"""fuse_norm_quant at the FX level: capture the post-grad graph of real RMSNorm (+ residual add) + quant code,
run the pass, count ops, and compare the rewritten graph with eager on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_fuse_act_quant import (
    FP8,
    _assert_close_quant,
    _casts_to_quant,
    deepseek_act_quant,
    fp8_token_quant,
    int8_group_quant,
    int8_token_quant,
    moefx_quant,
    run_graph,
    vllm_group_quant,
)

from moefx.passes.fuse_norm_quant import FuseNormQuant
from moefx.passes.quant_fusion import _TORCH_BELOW_2_13
from moefx.passes.quant_patterns import post_grad_graph
from moefx.testing import count_ops, run_passes

aten, ops = torch.ops.aten, torch.ops.moefx
M, H = 48, 256


def hf_rms_norm(x, w, eps=1e-6):
    """transformers LlamaRMSNorm / Qwen3MoeRMSNorm.forward."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return w * h.to(input_dtype)


def f_rms_norm(x, w, eps=1e-5):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def vllm_rms_norm(x, w, eps=1e-6, residual=None):
    """vLLM RMSNorm.forward_native."""
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    if residual is not None:
        x = x + residual.to(torch.float32)
        residual = x.to(orig_dtype)
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    x = x.to(orig_dtype) * w
    return x if residual is None else (x, residual)


def _vllm_add(quant):
    def fn(x, r, w):
        y, s = vllm_rms_norm(x, w, residual=r)
        return (*quant(y), s)

    return fn


def _inputs(dtype, residual, rows=M):
    x = [torch.randn(rows, H, dtype=dtype) * 2]
    if residual:
        x.append(torch.randn(rows, H, dtype=dtype))
    return [*x, (torch.rand(H) + 0.5).to(dtype)]


def _run_pass(fn, args, dynamic=False):
    graph = post_grad_graph(fn, args, dynamic_rows=dynamic)
    run = run_passes(graph, FuseNormQuant)
    return graph, run.rewrites, run


def _check(fn, dtype, residual, fused_op, dynamic=False):
    graph, n, run = _run_pass(fn, _inputs(dtype, residual), dynamic)
    assert n == 1, run.skipped
    assert count_ops(graph, fused_op) == 1
    assert count_ops(graph, aten.rsqrt.default, aten.mean.dim, aten.amax.default, aten.max.dim, aten.add.Tensor,
                         ops.quant.default, ops.rms_norm.default, ops.add_rms_norm.default) == 0
    assert _casts_to_quant(graph) == 0
    fresh = _inputs(dtype, residual, rows=M - 16 if dynamic else M)
    out, ref = run_graph(graph, fresh), fn(*fresh)
    _assert_close_quant(out, ref)
    if residual:
        assert torch.equal(out[2], ref[2])  # the new residual, bit for bit
    return graph


def _add(norm, quant):
    def fn(x, r, w):
        s = r + x
        return (*quant(norm(s, w)), s)

    return fn


CASES = [
    ("hf_norm+vllm_group128", lambda x, w: vllm_group_quant(hf_rms_norm(x, w)), torch.bfloat16, False),
    ("f_rms_norm+deepseek_group128", lambda x, w: deepseek_act_quant(f_rms_norm(x, w)), torch.float16, False),
    ("hf_norm+fp8_token", lambda x, w: fp8_token_quant(hf_rms_norm(x, w, 1e-5)), torch.float32, False),
    ("f_rms_norm+int8_token", lambda x, w: int8_token_quant(f_rms_norm(x, w)), torch.bfloat16, False),
    ("hf_norm+moefx_quant", lambda x, w: moefx_quant(hf_rms_norm(x, w)), torch.bfloat16, False),
    ("hf_norm+int8_group128", lambda x, w: int8_group_quant(hf_rms_norm(x, w)), torch.float16, False),
    ("moefx_rms_norm+vllm_group128", lambda x, w: vllm_group_quant(ops.rms_norm(x, w, 1e-6, False)),
     torch.bfloat16, False),
    ("add+hf_norm+moefx_quant", _add(hf_rms_norm, moefx_quant), torch.bfloat16, True),
    ("add+hf_norm+vllm_group64", _add(hf_rms_norm, lambda y: vllm_group_quant(y, 64)), torch.float16, True),
    ("add+f_rms_norm+int8_token", _add(f_rms_norm, int8_token_quant), torch.float32, True),
    ("vllm_rms_norm+vllm_group128", lambda x, w: vllm_group_quant(vllm_rms_norm(x, w)), torch.bfloat16, False),
    ("vllm_add_rms_norm+vllm_group128", _vllm_add(vllm_group_quant), torch.bfloat16, True),
    ("vllm_add_rms_norm+moefx_quant", _vllm_add(moefx_quant), torch.float16, True),
    ("moefx_add_rms_norm+moefx_quant", lambda x, r, w: _moefx_add_norm_quant(x, r, w), torch.bfloat16, True),
]


def _moefx_add_norm_quant(x, r, w):
    y, s = ops.add_rms_norm(x, r, w, 1e-6, False, False)
    return (*moefx_quant(y), s)


@pytest.mark.parametrize("name,fn,dtype,residual", CASES, ids=[c[0] for c in CASES])
def test_fuses_and_matches_eager(name, fn, dtype, residual):
    fused = ops.add_rms_norm_quant.default if residual else ops.rms_norm_quant.default
    if "f_rms_norm" in name.split("+") and _TORCH_BELOW_2_13:
        graph, n, run = _run_pass(fn, _inputs(dtype, residual))  # fails closed there, with the reason
        assert n == 0 and count_ops(graph, fused) == 0
        assert any("verified exact on torch >= 2.13" in r for r in run.skipped), run.skipped
        return
    _check(fn, dtype, residual, fused)


def test_dynamic_rows_and_eps_from_the_match():
    graph = _check(_add(lambda s, w: hf_rms_norm(s, w, 3e-5), vllm_group_quant), torch.bfloat16, True,
                   ops.add_rms_norm_quant.default, dynamic=True)
    (node,) = graph.find_nodes(op="call_function", target=ops.add_rms_norm_quant.default)
    assert node.args[3] == 3e-5 and node.args[4] is False and node.args[5] is False  # eps, weight_in_fp32, sum


def test_vllm_residual_form_keeps_the_fp32_sum():
    graph = _check(_vllm_add(vllm_group_quant), torch.bfloat16, True, ops.add_rms_norm_quant.default)
    (node,) = graph.find_nodes(op="call_function", target=ops.add_rms_norm_quant.default)
    assert node.args[4] is False and node.args[5] is True  # weight after downcast, fp32 residual sum


def test_qkv_style_quant_users_share_one_fused_op():
    def fn(x, w):
        y = hf_rms_norm(x, w)
        return moefx_quant(y), moefx_quant(y), moefx_quant(y)

    graph, n, run = _run_pass(fn, _inputs(torch.bfloat16, False))
    assert n == 1 and count_ops(graph, ops.rms_norm_quant.default) == 1, run.skipped
    assert count_ops(graph, ops.quant.default) == 0


def test_norm_output_with_other_users_left_alone_with_reason():
    def fn(x, w):
        y = hf_rms_norm(x, w)
        return (*moefx_quant(y), y @ torch.ones(H, 8, dtype=y.dtype))

    graph, n, run = _run_pass(fn, _inputs(torch.bfloat16, False))
    assert n == 0 and count_ops(graph, ops.rms_norm_quant.default, ops.rms_norm.default) == 0
    assert count_ops(graph, ops.quant.default) == 1
    assert any("also feeds" in r for r in run.skipped), run.skipped


def test_low_precision_scale_left_alone():
    """SGLang's bf16 reference computes the scale in bf16: no candidate, graph untouched."""
    def fn(x, w):
        y = hf_rms_norm(x, w).reshape(-1, 128)
        s = y.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 448.0
        return (y / s).clamp(-448.0, 448.0).to(FP8), s

    graph, n, _ = _run_pass(fn, _inputs(torch.bfloat16, False))
    assert n == 0 and _casts_to_quant(graph) == 1 and count_ops(graph, ops.quant.default) == 0


def test_registered_and_toggle_named():
    from moefx.passes import PASS_REGISTRY

    assert PASS_REGISTRY["fuse_norm_quant"] is FuseNormQuant
    assert PASS_REGISTRY["fuse_act_quant"].name == "fuse_act_quant"


def test_producers_in_pipeline_order():
    from moefx.passes.manager import PIPELINE
    from moefx.passes.quant_fusion import PRODUCERS, QuantFusionPass

    quant_passes = [cls for cls in PIPELINE if issubclass(cls, QuantFusionPass)]
    assert [p.pass_name for p in PRODUCERS] == [cls.name for cls in quant_passes]
    assert [cls.producer for cls in quant_passes] == list(PRODUCERS)
