"""Fused routing: same experts and weights as transformers' routers; Triton kernel (interpreter) vs PyTorch."""

from __future__ import annotations

import pytest
import torch
from backends_util import compile_sm90, kernel_device

from moefx.backends.routing import fused_topk, fused_topk_torch

T, HID = 7, 32


def _router(cls, cfg):
    r = cls(cfg)
    torch.nn.init.normal_(r.weight)
    if hasattr(r, "e_score_correction_bias"):
        r.e_score_correction_bias.normal_(0, 0.5)
    return r


def _cases():
    from transformers import DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return {
        "qwen3": (Qwen3MoeTopKRouter, Qwen3MoeConfig(hidden_size=HID, num_experts=16, num_experts_per_tok=4,
                                                    norm_topk_prob=True), dict(kind="softmax", renormalize=True)),
        "olmoe": (OlmoeTopKRouter, OlmoeConfig(hidden_size=HID, num_experts=16, num_experts_per_tok=4,
                                               norm_topk_prob=False), dict(kind="softmax", renormalize=False)),
        "mixtral": (MixtralTopKRouter, MixtralConfig(hidden_size=HID, num_local_experts=8, num_experts_per_tok=2),
                    dict(kind="topk_softmax", renormalize=True)),
        "deepseek_v3": (DeepseekV3TopkRouter, DeepseekV3Config(
            hidden_size=HID, n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2,
            norm_topk_prob=True, routed_scaling_factor=2.5), None),
    }


@pytest.mark.parametrize("model", ["qwen3", "olmoe", "mixtral", "deepseek_v3"])
def test_matches_transformers_router(model: str) -> None:
    cls, cfg, kw = _cases()[model]
    router = _router(cls, cfg)
    x = torch.randn(T, HID)
    with torch.no_grad():
        logits, ref_w, ref_ids = router(x)
    if kw is None:
        kw = dict(kind="sigmoid", renormalize=True, correction_bias=router.e_score_correction_bias,
                  n_group=cfg.n_group, topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor)
    w, ids = fused_topk(logits, router.top_k, **kw)
    # DeepSeek's topk(sorted=False) leaves the order open: compare per row after sorting by expert id
    ref_ids, order = ref_ids.sort(dim=-1)
    ref_w = ref_w.gather(1, order)
    ids, order = ids.sort(dim=-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w.gather(1, order), ref_w.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kw",
    [dict(kind="softmax", renormalize=True), dict(kind="softmax", renormalize=False), dict(kind="topk_softmax"),
     dict(kind="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5),
     dict(kind="sigmoid", renormalize=False, n_group=1)],
)
def test_triton_kernel_matches_torch_path(kw: dict) -> None:
    from moefx.kernels.moe_routing import fused_topk_triton

    dev = kernel_device()
    # distinct bf16 values per row: with ties the kernel's lower-id rule and torch.topk may legally differ
    logits = (torch.stack([torch.randperm(32) for _ in range(9)]).float() * 0.1 - 1.6).to(dev, torch.bfloat16)
    bias = torch.randn(32, device=dev) * 0.3 if kw["kind"] == "sigmoid" else None
    full = dict(renormalize=True, n_group=1, topk_group=None, routed_scaling_factor=1.0) | kw
    full["topk_group"] = full["topk_group"] or full["n_group"]
    w, ids = fused_topk_triton(logits, 4, full["kind"], full["renormalize"], bias, full["n_group"],
                               full["topk_group"], full["routed_scaling_factor"])
    rw, rids = fused_topk_torch(logits.cpu(), 4, correction_bias=None if bias is None else bias.cpu(), **kw)
    assert torch.equal(ids.cpu(), rids)
    torch.testing.assert_close(w.cpu(), rw, rtol=1e-5, atol=1e-6)


def test_bad_arguments_raise() -> None:
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="kind"):
        fused_topk(logits, 2, kind="softmin")
    with pytest.raises(ValueError, match="top_k"):
        fused_topk(logits, 9)
    with pytest.raises(ValueError, match="n_group"):
        fused_topk(logits, 2, kind="sigmoid", n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="n_group"):
        fused_topk(logits, 2, kind="softmax", n_group=2, topk_group=1)


def _canonical(key: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest along the last dim, equal values in ascending id order."""
    return torch.sort(key, dim=-1, descending=True, stable=True)[1][:, :k]


@pytest.mark.parametrize("e, k", [(16, 3), (12, 5), (16, 8), (128, 8), (256, 6)])
@pytest.mark.parametrize("kind", ["softmax", "topk_softmax", "sigmoid"])
def test_kernel_breaks_ties_to_the_lower_id_and_never_repeats_an_id(kind: str, e: int, k: int) -> None:
    """Adversarial rows: a handful of distinct values (exact ties everywhere) and -inf logits; non-power-of-two
    E and k. The kernel's ids equal the torch path's exactly, both equal the stable ranking, and stay distinct
    when -inf scores are among the k, up to 256 experts."""
    from moefx.kernels.moe_routing import fused_topk_triton

    dev = kernel_device()
    g = torch.Generator().manual_seed(e * 10 + k)
    logits = torch.randint(-2, 3, (11, e), generator=g).float()
    logits[0] = 1.0  # one value everywhere
    logits[1, : e - 2] = float("-inf")  # fewer finite scores than k
    w, ids = fused_topk_triton(logits.to(dev), k, kind, True, None, 1, 1, 1.0)
    rw, rids = fused_topk_torch(logits, k, kind)
    ids, w = ids.cpu(), w.cpu()
    assert torch.equal(ids, rids)
    key = logits.sigmoid() if kind == "sigmoid" else logits
    assert torch.equal(ids, _canonical(key, k))
    assert all(row.unique().numel() == k for row in ids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.equal(ids[0], torch.arange(k))


@pytest.mark.parametrize("kind", ["softmax", "topk_softmax", "sigmoid"])
def test_kernel_ranks_nan_and_infinities_as_torch(kind: str) -> None:
    """NaN ranks above +inf and ties among NaNs go to the lower id (torch.sort's order); +inf, all -inf and NaN rows
    give NaN weights exactly where the torch path does (softmax's max or its exps not finite), finite rows stay
    finite. The kernel's ids equal the torch path's exactly."""
    from moefx.kernels.moe_routing import fused_topk_triton

    dev = kernel_device()
    e, k = 24, 6
    logits = torch.randint(-2, 3, (6, e), generator=torch.Generator().manual_seed(1)).float()
    logits[0, [17, 3]] = float("nan")  # two NaNs: both first, the lower id first
    logits[1, [9, 5]] = float("inf")
    logits[1, 2] = float("nan")
    logits[2] = float("-inf")
    logits[2, 7] = 1.0  # one finite score, the rest -inf
    logits[3] = float("-inf")  # no finite score
    logits[4, [11, 0]] = float("inf")  # an infinite max
    w, ids = fused_topk_triton(logits.to(dev), k, kind, True, None, 1, 1, 1.0)
    rw, rids = fused_topk_torch(logits, k, kind)
    ids, w = ids.cpu(), w.cpu()
    assert torch.equal(ids, rids)
    assert ids[0, :2].tolist() == [3, 17] and ids[1, 0] == 2 and ids[1, 1:3].tolist() == [5, 9]
    assert torch.equal(w.isnan(), rw.isnan())
    assert not w[5].isnan().any()
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_kernel_reads_strided_logits() -> None:
    from moefx.kernels.moe_routing import fused_topk_triton

    dev = kernel_device()
    base = torch.randn(6, 64)
    w, ids = fused_topk_triton(base.to(dev)[:, ::2], 4, "softmax", True, None, 1, 1, 1.0)
    rw, rids = fused_topk_torch(base[:, ::2].contiguous(), 4)
    assert torch.equal(ids.cpu(), rids)
    torch.testing.assert_close(w.cpu(), rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["softmax", "topk_softmax", "sigmoid"])
def test_op_gradient_is_the_reference_gradient(kind: str) -> None:
    """Autograd through the op: the weights' gradient with respect to the logits at the chosen ids (the
    selection itself is piecewise constant)."""
    logits = torch.randn(5, 16, requires_grad=True)
    upstream = torch.randn(5, 4)
    kw = dict(kind=kind, renormalize=kind != "topk_softmax", routed_scaling_factor=1.5)
    w, ids = fused_topk(logits, 4, **kw)
    (grad,) = torch.autograd.grad((w * upstream).sum(), logits)
    ref_logits = logits.detach().clone().requires_grad_(True)
    rw, rids = fused_topk_torch(ref_logits, 4, **kw)
    (ref,) = torch.autograd.grad((rw * upstream).sum(), ref_logits)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)


def test_op_registration() -> None:
    """Schema, fake impl (shapes, dtypes, strides), autograd registration and dynamic-shape tracing."""
    bias = torch.randn(32)
    torch.library.opcheck(torch.ops.moefx.fused_topk.default,
                          (torch.randn(7, 32), 4, "sigmoid", True, bias, 4, 2, 2.5),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("e, kw", [(128, dict(kind="softmax")), (16, dict(kind="topk_softmax")),
                                   (64, dict(kind="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5))])
def test_every_launch_shape_gives_the_same_bits(e: int, kw: dict) -> None:
    """Rows per program and warps per program (`launch_shape`'s choice, one row over 4 warps, 16 rows on one warp,
    ...) change only how the rows are grouped: the weights and ids of 37 rows (a partial last program) are equal to
    the bit, and equal the torch path's ids."""
    from moefx.kernels.moe_routing import fused_topk_triton, launch_shape

    dev = kernel_device()
    g = torch.Generator().manual_seed(e)
    logits = torch.randn(37, e, generator=g).to(dev, torch.bfloat16)
    bias = torch.randn(e, generator=g).to(dev) * 0.3 if kw["kind"] == "sigmoid" else None
    args = (6, kw["kind"], True, bias, kw.get("n_group", 1), kw.get("topk_group", 1),
            kw.get("routed_scaling_factor", 1.0))
    assert launch_shape(37, e) == (512 // e, 1) and launch_shape(1, e) == (1, 1)
    w, ids = fused_topk_triton(logits, *args)
    for shape in ((1, 4), (16, 1), (2, 2), (64, 1)):
        w2, ids2 = fused_topk_triton(logits, *args, shape=shape)
        assert torch.equal(ids2, ids) and torch.equal(w2, w), shape
    _, rids = fused_topk_torch(logits.cpu(), 6, correction_bias=None if bias is None else bias.cpu(), **kw)
    assert torch.equal(ids.cpu(), rids)
    with pytest.raises(ValueError, match="powers of two"):
        fused_topk_triton(logits, *args, shape=(3, 1))


@pytest.mark.slow
def test_kernel_builds_for_sm90_at_its_launch_shapes() -> None:
    """moefx::fused_topk's kernel at `launch_shape` compiles for sm_90a within shared memory and without spills
    (tests/compile_sm90.py routing: a prefill's and a decode call's shape, three routers)."""
    rows = compile_sm90("routing")
    assert len(rows) == 6 and {r["max_rows"] for r in rows} >= {"4 rows, 1 warps", "1 rows, 4 warps"}
    assert all(0 <= r["gemm1"]["smem"] <= 227 * 1024 and r["gemm1"]["spill"] == 0 for r in rows), rows
