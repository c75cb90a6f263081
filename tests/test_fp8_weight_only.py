"""The FP8 weight-only form: the dense kernel (kernels/dense_gemm.py) with FP8 weights and a float X under
TRITON_INTERPRET=1 against the float reference (x @ dequant(W)^T in fp32, one rounding), with and without the
norm/residual prologues and split-K; and the fp8_weight_only pass on an FP8 decode layer's graph (op counts before
and after: at M <= 4 no activation quant is left, at M > 4 the W8A8 form stays).

Bound: fp32 X and outputs, relative Frobenius error < 1e-5 (the kernel sums each quant block's products, then
scales the partial sums; the reference scales the weights first: summation order and one fp32 rounding of each
product's scale only). bf16 outputs on the GPU: 5e-3 (one bf16 rounding, <= 2^-8 relative per element)."""

from __future__ import annotations

import pytest
import torch
from torch.func import functionalize
from torch.fx.experimental.proxy_tensor import make_fx

import moefx.ops  # noqa: F401  (moefx::quant, moefx::fp8_block_gemm)
from moefx.backends.dense import ref_fp8_weight_only, reference
from moefx.kernels import dense_gemm as K
from moefx.ops.quant import PRESETS, quant_weight_fp8_block, ref_rms_norm
from moefx.passes.fuse_norm_linear import ADD_NORM_DENSE, NORM_DENSE
from moefx.passes.linear_forms import DENSE
from moefx.testing import count_ops, run_passes

ops = torch.ops.moefx
EPS = 1e-6
BLOCK = (128, 128)


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def _case(m, ns, k, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    qs = [quant_weight_fp8_block(torch.randn(n, k, generator=g, device=device) * 0.05, *BLOCK) for n in ns]
    bs = [torch.randn(ns[0], generator=g, device=device).to(dtype)] + [None] * (len(ns) - 1)
    return x, [q for q, _ in qs], [s for _, s in qs], bs


def _expected(x, ws, ss, bs, dtype):
    return [ref_fp8_weight_only(x, w, s, *BLOCK, b, dtype) for w, s, b in zip(ws, ss, bs)]


# (M, N per weight, K, config): the default tiles (all of K in one step, rows counted in FP8 bytes), fixed tiles with
# forced split-K, a step narrower than a quant block, and the tensor-core tile (weights converted before the dot).
# N=4096 with wider rows than the default's 8, so the interpreter runs 64 programs, not 512.
CASES = [
    (1, (4096, 512), 2048, K.DenseConfig(block_n=64, block_k=0)),
    (1, (512, 128), 2048, None),  # M = 1's own row: 8 warps, 64 weight bytes a thread (8 rows a program here)
    (2, (128,), 4096, None),
    (3, (512, 128), 2048, K.DenseConfig(block_n=64, block_k=256, split_k=4)),
    (4, (128,), 4096, K.DenseConfig(block_n=32, block_k=64, split_k=2)),
    (4, (128, 72), 2048, None),
    (6, (128,), 2048, None),  # past M=4: the tensor-core tile
]


@pytest.mark.parametrize("m,ns,k,cfg", CASES)
def test_weight_only_kernel_matches_the_float_reference(m, ns, k, cfg):
    x, ws, ss, bs = _case(m, ns, k, seed=m)
    outs = K.dense_gemv(x, ws, bs, None, ss, BLOCK, None, cfg)
    for o, r in zip(outs, _expected(x, ws, ss, bs, torch.float32)):
        assert o.shape == r.shape and o.dtype == torch.float32
        assert relerr(o, r) < 1e-5
    # the op's CPU path (and upstream) is the same reference
    for o, r in zip(outs, reference(x, ws, bs, None, ss, list(BLOCK), None)):
        assert relerr(o, r) < 1e-5


@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("m,k", [(1, 2048), (2, 4096), (4, 2048)])
def test_weight_only_with_the_norm_prologue(m, k, split):
    x, ws, ss, bs = _case(m, (256, 128), k, seed=10 + m)
    nw = torch.randn(k, generator=torch.Generator().manual_seed(m)) * 0.1 + 1
    cfg = K.DenseConfig(block_n=0, block_k=0, split_k=split)
    outs = K.dense_gemv(x, ws, bs, None, ss, BLOCK, None, cfg, norm_weight=nw, norm_eps=EPS)
    normed = ref_rms_norm(x, nw, EPS, False)
    for o, r in zip(outs, _expected(normed, ws, ss, bs, torch.float32)):
        assert relerr(o, r) < 1e-5


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("m,k", [(1, 4096), (3, 2048)])
def test_weight_only_with_the_residual_and_norm_prologue(m, k, split):
    x, ws, ss, bs = _case(m, (128,), k, seed=20 + m)
    r = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    nw = torch.randn(k, generator=torch.Generator().manual_seed(m + 1)) * 0.1 + 1
    cfg = K.DenseConfig(block_n=0, block_k=0, split_k=split)
    *outs, h, xn = K.dense_gemv(x, ws, bs, None, ss, BLOCK, None, cfg, norm_weight=nw, norm_eps=EPS, residual=r)
    want_h = r + x
    want_xn = ref_rms_norm(want_h, nw, EPS, False)
    assert relerr(h, want_h) < 1e-6 and relerr(xn, want_xn) < 1e-5
    for o, ref in zip(outs, _expected(want_xn, ws, ss, bs, torch.float32)):
        assert relerr(o, ref) < 1e-5


def test_w8a8_keeps_matching_after_the_block_partial_sums():
    """The W8A8 CUDA-core path now scales each block's partial sum by (x scale x weight scale): ref_fp8_block_gemm
    within the same bound, at a step wider than a block and one narrower."""
    x, ws, ss, bs = _case(3, (128,), 2048, seed=3)
    a, a_s = ops.quant(x, *PRESETS["fp8_group128"].args())
    for cfg in (K.DenseConfig(block_n=0, block_k=0), K.DenseConfig(block_n=32, block_k=64, split_k=2)):
        outs = K.dense_gemv(a, ws, bs, a_s, ss, BLOCK, torch.float32, cfg)
        for o, r in zip(outs, reference(a, ws, bs, a_s, ss, list(BLOCK), torch.float32)):
            assert relerr(o, r) < 1e-5


def test_weight_only_arguments_are_checked():
    x, ws, ss, bs = _case(2, (128,), 256)
    with pytest.raises(ValueError, match="weight-only"):
        K.dense_gemv(x.to(torch.float8_e4m3fn), ws, bs, None, ss, BLOCK)
    a, a_s = ops.quant(x, *PRESETS["fp8_group128"].args())
    with pytest.raises(ValueError, match="not an FP8 X with x_scale"):
        K.dense_gemv(a, ws, bs, a_s, ss, BLOCK, torch.float32, norm_eps=EPS)


# ------------------------------------------------------------------------------------------------------- the pass

class _Layer:
    """An FP8 decode layer's dense part as Fp8BlockLinear writes it: input norm -> quant -> q/k/v FP8 GEMMs; o_proj
    (quant of the attention output -> FP8 GEMM); residual add -> post-attention norm -> quant -> gate/up FP8 GEMMs.
    The norm weights, FP8 weights and scales are the function's inputs (a traced model's parameters)."""

    def __init__(self, h: int = 256) -> None:
        torch.manual_seed(0)
        self.h = h
        self.norm1 = torch.randn(h) * 0.1 + 1
        self.norm2 = torch.randn(h) * 0.1 + 1
        self.qw = [quant_weight_fp8_block(torch.randn(n, h) * 0.05, *BLOCK) for n in (256, 128, 128, h, 256, 256)]

    def params(self) -> list[torch.Tensor]:
        return [self.norm1, self.norm2, *(t for pair in self.qw for t in pair)]

    @staticmethod
    def forward(x, r, norm1, norm2, *qw):
        scheme = PRESETS["fp8_group128"].args()

        def lin(t, i):
            q, s = ops.quant(t, *scheme)
            return ops.fp8_block_gemm(q, s, qw[2 * i], qw[2 * i + 1], *BLOCK, None, t.dtype)

        h = ref_rms_norm(x, norm1, EPS, False)
        qkv = [lin(h, i) for i in range(3)]
        o = lin(qkv[0] * 0.5, 3)
        total = r + o
        h2 = ref_rms_norm(total, norm2, EPS, False)
        return (*qkv, total, lin(h2, 4), lin(h2, 5))


PIPE = ("fp8_weight_only", "fuse_norm_quant", "fuse_act_quant", "fuse_sibling_linears", "dense_linears",
        "fuse_norm_linear")
CONFIG = {"dense_backend": "gemv", "pass_config": {"fuse_norm_quant": True, "fuse_act_quant": True}}


def _trace(m: int):
    layer = _Layer()
    x, r = torch.randn(m, layer.h), torch.randn(m, layer.h)
    gm = make_fx(functionalize(_Layer.forward, remove="mutations"), tracing_mode="fake")(x, r, *layer.params())
    return layer, gm, (x, r)


@pytest.mark.parametrize("m", [1, 4])
def test_pass_leaves_no_activation_quant_at_decode_m(m):
    layer, gm, args = _trace(m)
    assert count_ops(gm.graph, ops.quant.default) == 6 and count_ops(gm.graph, ops.fp8_block_gemm.default) == 6
    run = run_passes(gm, *PIPE, config=CONFIG)
    assert run.matches["fp8_weight_only"] == 6 and not any("fp8_weight_only" in s for s in run.skipped)
    assert count_ops(gm.graph, ops.quant.default) == 0 and count_ops(gm.graph, ops.fp8_block_gemm.default) == 0
    assert count_ops(gm.graph, ops.rms_norm_quant.default) == 0
    # q/k/v with the input norm in the prologue, gate/up with the residual add and norm after the weight-only o_proj
    # (its output carries a fake value, so the add is seen as the residual sum), o_proj a weight-only call of its own
    (qkv,) = gm.graph.find_nodes(op="call_function", target=NORM_DENSE)
    (gate_up,) = gm.graph.find_nodes(op="call_function", target=ADD_NORM_DENSE)
    (o,) = gm.graph.find_nodes(op="call_function", target=DENSE)
    assert len(qkv.args[3]) == 3 and len(qkv.args[6]) == 3 and qkv.args[7] == list(BLOCK)
    assert len(gate_up.args[4]) == 2 and len(gate_up.args[7]) == 2
    assert o.args[3] is None and len(o.args[4]) == 1
    assert sum("weight-only form at M=" in n for n in run.notes) == 6
    # fresh inputs: the rewritten graph is the float reference of the same layer
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        x, r = torch.randn(m, layer.h, generator=g), torch.randn(m, layer.h, generator=g)
        got = gm(x, r, *layer.params())
        h = ref_rms_norm(x, layer.norm1, EPS, False)
        want = [ref_fp8_weight_only(h, *layer.qw[i], *BLOCK, None, torch.float32) for i in range(3)]
        total = r + ref_fp8_weight_only(want[0] * 0.5, *layer.qw[3], *BLOCK, None, torch.float32)
        h2 = ref_rms_norm(total, layer.norm2, EPS, False)
        want += [total] + [ref_fp8_weight_only(h2, *layer.qw[i], *BLOCK, None, torch.float32) for i in (4, 5)]
        for a, b in zip(got, want):
            assert relerr(a, b) < 1e-5


def test_pass_keeps_w8a8_past_m4_and_when_off():
    _, gm, _ = _trace(8)
    run = run_passes(gm, *PIPE, config=CONFIG)
    assert run.matches["fp8_weight_only"] == 0
    assert sum("keeps the W8A8 form: M=8 runs the tensor-core tiles" in s for s in run.skipped) == 6
    assert count_ops(gm.graph, ops.rms_norm_quant.default) == 1  # the input norm + quant, as before
    assert all(n.args[3] is not None for n in gm.graph.find_nodes(op="call_function", target=DENSE))
    _, gm, _ = _trace(1)
    run = run_passes(gm, *PIPE[1:], config=CONFIG)  # the toggle off: the pass does not run
    assert count_ops(gm.graph, NORM_DENSE) == 0 and count_ops(gm.graph, ops.rms_norm_quant.default) == 1


def test_pass_asks_the_policy_about_q_k_v_as_the_one_call_they_become(monkeypatch):
    """Calibration rows are per fused shape: a policy with a row for q/k/v together and none for q alone (the H100's
    tables) takes the weight-only form for all three when fuse_sibling_linears will fuse them, and for none when
    it is off; o_proj and gate/up, which this policy runs upstream, keep W8A8 either way."""
    from moefx.backends.dense_policy import GEMV, UPSTREAM
    from moefx.passes import fp8_weight_only as P

    asked = []

    def policy(x, weights, scales, block, out_dtype, backend, capturing=None):
        asked.append([int(w.shape[0]) for w in weights])
        return GEMV if asked[-1] == [256, 128, 128] else UPSTREAM

    monkeypatch.setattr(P, "select_backend", policy)
    _, gm, _ = _trace(1)
    run = run_passes(gm, *PIPE, config=CONFIG)
    assert run.matches["fp8_weight_only"] == 3 and asked.count([256, 128, 128]) == 3, asked
    assert sum("runs M=1 N=[256] upstream" in r for r in run.skipped) == 1, run.skipped  # o_proj
    assert sum("runs M=1 N=[256, 256] upstream" in r for r in run.skipped) == 2, run.skipped  # gate, up
    (qkv,) = gm.graph.find_nodes(op="call_function", target=NORM_DENSE)
    assert len(qkv.args[3]) == 3 and len(qkv.args[6]) == 3  # one weight-only call, the input norm in its prologue
    w8a8 = [n for n in gm.graph.find_nodes(op="call_function", target=DENSE) if n.args[3] is not None]
    assert sorted(len(n.args[1]) for n in w8a8) == [1, 2]  # o_proj, and gate/up as one call, read FP8 activations
    asked.clear()
    _, gm, _ = _trace(1)
    run = run_passes(gm, *(p for p in PIPE if p != "fuse_sibling_linears"), config=CONFIG)
    assert run.matches["fp8_weight_only"] == 0 and all(len(a) == 1 for a in asked), asked


def test_pass_uuid_changes_with_the_toggle():
    from moefx.config import CompilationConfig
    from moefx.passes import PassManager

    names = list(PIPE)
    on = PassManager(CompilationConfig.from_any(CONFIG), names).uuid()
    off = PassManager(CompilationConfig.from_any(CONFIG), names[1:]).uuid()
    assert on != off


# --------------------------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("ns,k", [((4096, 512, 512), 2048), ((2048,), 4096), ((128,), 2048)])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("prologue", ["none", "norm", "resid"])
def test_gpu_weight_only_matches_the_float_reference(ns, k, m, prologue):
    x, ws, ss, bs = _case(m, ns, k, "cuda", torch.bfloat16, seed=m)
    nw = (torch.randn(k, device="cuda") * 0.1 + 1).to(torch.bfloat16)
    r = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    kw = {} if prologue == "none" else dict(norm_weight=nw, norm_eps=EPS)
    if prologue == "resid":
        kw["residual"] = r
    outs = K.dense_gemv(x, ws, bs, None, ss, BLOCK, None, **kw)[:len(ns)]
    xin = x if prologue == "none" else ref_rms_norm(x if prologue == "norm" else (r + x), nw, EPS, False)
    for o, ref in zip(outs, _expected(xin, ws, ss, bs, torch.bfloat16)):
        assert o.dtype == torch.bfloat16 and relerr(o, ref) < 5e-3
