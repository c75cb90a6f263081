"""fuse_qk_norm_rope on a transformers Qwen3-MoE attention's decode-step graph: q/k norm + RoPE + the cache write
become one moefx::qk_norm_rope_cache call, bit for bit the unfused graph (output and cache) on fresh inputs; the
op's kernel against its reference in the Triton interpreter."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

import moefx
from moefx.engine.layers.layer_body import _StaticLayerView
from moefx.integrations import attention as moefx_attention
from moefx.models import build_model, tiny_qwen3_moe_config
from moefx.ops.rope_cache import qk_norm_rope_cache_reference, unsupported_reason
from moefx.passes.fuse_qk_norm_rope import ATTENTION, AUTO_FUNCTIONALIZED, FuseQkNormRope
from moefx.testing import count_ops, functional_graph, run_passes

aten = torch.ops.aten
CACHE = 12  # static cache positions


def _cache_argument(attn: torch.nn.Module) -> str:
    """The attention's cache keyword: `cache` in newer transformers, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(type(attn).forward).parameters else "past_key_values"


class _AttentionHalf(torch.nn.Module):
    """A decoder layer's attention half in a decode step: input norm, attention over a one-layer static cache."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x, cos, sin, keys, values, length):
        attn = self.layer.self_attn
        cache = {_cache_argument(attn): _StaticLayerView(keys, values, length)}
        out, _ = attn(self.layer.input_layernorm(x), (cos, sin), None, **cache)
        return out


def _half(dtype: torch.dtype, monkeypatch) -> _AttentionHalf:
    monkeypatch.setattr(moefx_attention, "call_reason", lambda *a: None)  # the decode op on the CPU too
    moefx_attention.register()
    model = build_model(tiny_qwen3_moe_config(num_hidden_layers=1), seed=0).eval().to(dtype)
    model.set_attn_implementation(moefx_attention.NAME)
    return _AttentionHalf(model.model.layers[0])


def _inputs(half: _AttentionHalf, dtype: torch.dtype, seed: int, batch: int = 1) -> tuple[torch.Tensor, ...]:
    cfg = half.layer.self_attn.config
    g = torch.Generator().manual_seed(seed)
    d, hkv = cfg.head_dim, cfg.num_key_value_heads

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return (r(batch, 1, cfg.hidden_size), r(batch, 1, d), r(batch, 1, d), r(batch, hkv, CACHE, d),
            r(batch, hkv, CACHE, d), torch.tensor([3 + seed]))


def _run(gm: torch.fx.GraphModule, state: dict, inputs: tuple) -> tuple[torch.Tensor, ...]:
    fresh = tuple(t.clone() for t in inputs)
    with torch.no_grad():
        out = gm(state, *fresh)
    return out, fresh[3], fresh[4], fresh[5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_k_norm_rope_and_cache_write_become_one_op(dtype, monkeypatch):
    half = _half(dtype, monkeypatch)
    gm, state = functional_graph(half, *_inputs(half, dtype, 0))
    unfused, _ = functional_graph(half, *_inputs(half, dtype, 0))
    assert count_ops(gm.graph, aten.index_put.default) == 2 and count_ops(gm.graph, ATTENTION) == 1
    rsqrt_before = count_ops(gm.graph, aten.rsqrt.default)
    run = run_passes(gm, FuseQkNormRope)
    assert run.rewrites == 1, run.skipped
    assert count_ops(gm.graph, AUTO_FUNCTIONALIZED) == 1
    assert count_ops(gm.graph, aten.index_put.default) == 0
    assert count_ops(gm.graph, aten.cat.default) == 0
    assert count_ops(gm.graph, torch.ops.prims.iota.default) == 0  # the op reads the write position itself
    assert count_ops(gm.graph, aten.rsqrt.default) == rsqrt_before - 2  # the input norm stays
    assert run.notes and "qk_norm_rope_cache" in run.notes[0]
    assert_same_on_fresh_inputs(gm, unfused, state, half, dtype)


def assert_same_on_fresh_inputs(gm: torch.fx.GraphModule, reference: torch.fx.GraphModule, state: dict,
                                half: _AttentionHalf, dtype: torch.dtype) -> None:
    """`gm` against `reference` on two fresh input sets: output, keys, values and length bit for bit, keys written."""
    for seed in (1, 2):
        inputs = _inputs(half, dtype, seed)
        got, want = _run(gm, state, inputs), _run(reference, state, inputs)
        for g, w in zip(got, want):  # output, keys, values, length
            assert torch.equal(g, w), seed
        assert not torch.equal(got[1], inputs[3])  # the keys were written


def test_an_attention_without_the_pattern_is_left_with_a_reason(monkeypatch):
    """Without the q/k norms (another model family), nothing is rewritten and the report says why."""
    half = _half(torch.float32, monkeypatch)
    attn = half.layer.self_attn
    attn.q_norm, attn.k_norm = torch.nn.Identity(), torch.nn.Identity()
    gm, _ = functional_graph(half, *_inputs(half, torch.float32, 0))
    run = run_passes(gm, FuseQkNormRope)
    assert run.rewrites == 0
    assert count_ops(gm.graph, aten.index_put.default) == 2
    assert any("not a plain RMSNorm" in s or "head norm" in s for s in run.skipped), run.skipped


@pytest.mark.compile
def test_inductor_writes_the_cache_in_place(monkeypatch):
    """Through inductor with the pass: the compiled call equals eager (output and written cache), and the
    functionalized op is re-inplaced (no copy of the cache: a copy would leave the cache unwritten or cost a
    kernel per layer)."""
    code, matches = compiled_like_eager(_half(torch.float32, monkeypatch), {"fuse_qk_norm_rope": True})
    assert matches.get("fuse_qk_norm_rope") == 1
    assert "qk_norm_rope_cache" in code


def compiled_like_eager(half: _AttentionHalf, passes: dict[str, bool]) -> tuple[str, dict[str, int]]:
    """`half` through inductor with these pass toggles against eager on fresh inputs (output and both caches, the
    cache written, not copied): the generated code and the first compile report's matches."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    moefx.clear_compile_reports()
    compiled = torch.compile(half, backend=moefx.backend({"pass_config": passes}), fullgraph=True)
    inputs = _inputs(half, torch.float32, 1)
    eager_in = tuple(t.clone() for t in inputs)
    with torch.no_grad():
        want = half(*eager_in)
        got, (code,) = run_and_get_code(compiled, *inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inputs[3], eager_in[3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inputs[4], eager_in[4], rtol=0, atol=0)
    return code, moefx.compile_reports()[0].matches


def test_the_plan_prefers_it_on_cuda_only():
    from moefx.models.catalog import catalog_config
    from moefx.signatures import ExecutionSignature, ModelSignature, resolve

    ms = ModelSignature.from_config(catalog_config("qwen3-30b-a3b"))
    assert resolve(ms, ExecutionSignature.preset("h200", dtype="bfloat16")).pass_enabled("fuse_qk_norm_rope")
    assert not resolve(ms, ExecutionSignature(device_type="cpu", dtype="bfloat16")).pass_enabled("fuse_qk_norm_rope")


def _rotary(batch: int, seq: int, d: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    angles = torch.rand(batch, seq, d, generator=g) * 6.3
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def _assert_like_eager(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: equal up to the variance's sum order and FMA contraction. fp16/bf16: rounded as the eager code rounds,
    so equal but where the norm's rstd differs in its last bit and moves a rounding (few elements, a rounding step
    of the largest operands at most)."""
    g, w = got.float(), want.float()
    scale = float(w.abs().max())
    if got.dtype == torch.float32:
        torch.testing.assert_close(g, w, rtol=0, atol=4e-6 * scale)
        return
    diff = (g - w).abs()
    assert (diff > 0).float().mean().item() < 0.005
    assert float(diff.max()) <= 2 ** -6 * scale


def _op_inputs(dtype: torch.dtype, batch: int, seq: int, d: int = 64, hq: int = 8, hkv: int = 2,
               length: int = CACHE, with_weight: bool = True, device: str = "cpu") -> list:
    g = torch.Generator().manual_seed(batch * 10 + seq)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    qkv = r(batch, seq, (hq + 2 * hkv) * d)  # q, k, v as views of one projection output, as in the graph
    q = qkv[..., : hq * d].view(batch, seq, hq, d)
    k = qkv[..., hq * d: (hq + hkv) * d].view(batch, seq, hkv, d)
    v = qkv[..., (hq + hkv) * d:].view(batch, seq, hkv, d)
    weights = (r(d), r(d)) if with_weight else (None, None)
    args = [q, k, v, *weights, 1e-6, *_rotary(1, seq, d, dtype, g), r(batch, hkv, length, d),
            r(batch, hkv, length, d), torch.arange(seq) + 4]
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def _both_ways(args: list, launch) -> None:
    """The reference and `launch` on clones of the caches; outputs and written caches compared."""
    ref_args, got_args = list(args), list(args)
    ref_args[8:10] = [t.clone() for t in args[8:10]]
    got_args[8:10] = [t.clone() for t in args[8:10]]
    want = qk_norm_rope_cache_reference(*ref_args)
    got = launch(got_args)
    _assert_like_eager(got, want)
    _assert_like_eager(got_args[8], ref_args[8])
    assert torch.equal(got_args[9], ref_args[9])  # the value rows are copied
    assert not torch.equal(got_args[8], args[8])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the kernel on CPU tensors runs in the Triton interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch,seq,with_weight", [(1, 1, True), (3, 1, True), (2, 2, False)])
def test_kernel_matches_the_reference(dtype, batch, seq, with_weight):
    """In the interpreter (its bf16 casts truncate; the kernel rounds bf16 on the bits, moefx/kernels/
    rounding.py)."""
    from moefx.kernels.norm_rope_cache import qk_norm_rope_cache_triton

    args = _op_inputs(dtype, batch, seq, with_weight=with_weight)
    assert unsupported_reason(*args[:5], *args[6:]) is None

    def launch(a):
        q = a[0]
        out = torch.empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=dtype)
        qk_norm_rope_cache_triton(*a, out)
        return out

    _both_ways(args, launch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [1, 16])
def test_op_on_cuda_matches_the_reference_in_bf16(batch):
    """The op's CUDA path (the kernel) against the reference, bf16, Qwen3-30B-A3B's heads and a 256-position cache."""
    args = _op_inputs(torch.bfloat16, batch, 1, d=128, hq=32, hkv=4, length=256, device="cuda")
    assert unsupported_reason(*args[:5], *args[6:]) is None
    _both_ways(args, lambda a: torch.ops.moefx.qk_norm_rope_cache(*a))
