"""CUDA-only checks of moefx::fused_topk and fuse_moe_routing at real router widths (skipped without a GPU).

The Triton kernel against the PyTorch path (same tie rule: ids exact), inside CUDA-graph capture with no host
sync, and transformers' routers compiled by inductor with the pass against the eager router.
"""

from __future__ import annotations

import pytest
import torch

import moefx
from moefx.backends.routing import fused_topk, fused_topk_torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("m", [1, 16, 64, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_torch_path_qwen3_widths(m: int, dtype: torch.dtype) -> None:
    """E=128, k=8 softmax + renorm: the kernel ranks the logits, as the torch path does, ties (frequent in bf16)
    to the lower id on both, so the ids are identical on every row."""
    logits = (torch.randn(m, 128, device="cuda") * 3).to(dtype)
    w, ids = fused_topk(logits, 8)
    rw, rids = fused_topk_torch(logits, 8)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m", [1, 64, 1024])
def test_kernel_matches_torch_path_deepseek_v3_widths(m: int) -> None:
    """E=256, 8 groups keep 4, k=8, sigmoid + bias. The kernel's sigmoid is Triton's, torch's CUDA sigmoid may
    differ by an ulp: ids must agree on rows whose 8th and 9th choices are further apart than 1e-6."""
    logits = torch.randn(m, 256, device="cuda") * 2
    bias = torch.randn(256, device="cuda") * 0.05
    kw = dict(kind="sigmoid", correction_bias=bias, n_group=8, topk_group=4, routed_scaling_factor=2.5)
    w, ids = fused_topk(logits, 8, **kw)
    rw, rids = fused_topk_torch(logits, 8, **kw)
    choice = torch.sort(logits.sigmoid() + bias, dim=-1, descending=True)[0]
    clear = (choice[:, 7] - choice[:, 8]) > 1e-6  # also group choices, whose margins are sums of these
    same = ids.eq(rids).all(-1)
    assert clear.any() and same[clear].float().mean() >= 0.99
    torch.testing.assert_close(w[same], rw[same], rtol=1e-5, atol=1e-6)


def test_op_captures_in_a_cuda_graph_without_host_sync() -> None:
    logits = torch.randn(16, 128, device="cuda", dtype=torch.bfloat16)
    w, ids = fused_topk(logits, 8)  # warm up (compile the kernel) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            gw, gids = fused_topk(logits, 8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for _ in range(2):
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        rw, rids = fused_topk(logits, 8)
        assert torch.equal(gids, rids) and torch.equal(gw, rw)


def _router(family: str):
    if family == "qwen3":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        cfg = Qwen3MoeConfig(hidden_size=2048, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
        r = Qwen3MoeTopKRouter(cfg).to("cuda", torch.bfloat16)
        torch.nn.init.normal_(r.weight, std=0.1)
        return r
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=7168, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                           norm_topk_prob=True, routed_scaling_factor=2.5)
    r = DeepseekV3TopkRouter(cfg).to("cuda", torch.float32)
    torch.nn.init.normal_(r.weight, std=0.05)
    r.e_score_correction_bias.normal_(0, 0.05)
    return r


@pytest.mark.compile
@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_compiled_router_with_the_pass_matches_eager(family: str) -> None:
    """Inductor's CUDA post-grad graph (online softmax) is matched; the k ids equal eager's on every row whose
    k-th and (k+1)-th keys differ; weights rtol 1e-5 in fp32, one ulp in bf16."""
    router = _router(family)
    torch._dynamo.reset()
    moefx.clear_compile_reports()
    compiled = torch.compile(router, backend=moefx.backend({"pass_config": {"fuse_moe_routing": True}}))
    compiled = torch._dynamo.config.patch(specialize_float=True)(compiled)
    x = torch.randn(256, router.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        logits, rw, rids = router(x)
        _, w, ids = compiled(x)
    torch._dynamo.reset()
    assert [r.matches.get("fuse_moe_routing") for r in moefx.compile_reports()] == [1]
    key = logits if family == "qwen3" else logits.sigmoid() + router.e_score_correction_bias
    top = key.float().topk(9, dim=-1)[0]
    # softmax ranks logits exactly; sigmoid values (eager's vs Triton's) may differ by an ulp
    margin = 0.0 if family == "qwen3" else 1e-6
    defined = (top[:, 7] - top[:, 8]) > margin
    if family == "qwen3":  # sorted: the same order wherever the top 9 are distinct
        distinct = ((top[:, :-1] - top[:, 1:]) > 0).all(-1)
        assert torch.equal(ids[distinct], rids[distinct]) and distinct.any()
    rids, o = rids.sort(-1)
    rw = rw.gather(1, o)
    ids, o = ids.sort(-1)
    w = w.gather(1, o)
    same = ids.eq(rids).all(-1)
    assert bool(same[defined].all()) and defined.float().mean() > 0.5
    tol = dict(rtol=1e-5, atol=1e-6) if rw.dtype == torch.float32 else dict(rtol=2**-7, atol=0)
    torch.testing.assert_close(w[same].float(), rw[same].float(), **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_stored_in_a_low_dtype_are_the_cast_fp32_weights(dtype: torch.dtype) -> None:
    """`weights_dtype` (what fuse_moe_routing sets where the model casts the weights): the kernel's one rounding is
    the cast's, bit for bit; the ids do not change."""
    logits = (torch.randn(16, 128, device="cuda") * 3).to(dtype)
    w32, ids32 = torch.ops.moefx.fused_topk(logits, 8, "softmax", True, None, 1, 1, 1.0)
    w, ids = torch.ops.moefx.fused_topk(logits, 8, "softmax", True, None, 1, 1, 1.0, dtype)
    assert w.dtype == dtype and torch.equal(w, w32.to(dtype)) and torch.equal(ids, ids32)
