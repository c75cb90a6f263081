"""FX-level tests of fuse_moe_routing on transformers' own routers and MoE blocks, tiny sizes, fresh inputs.

Each family's router (and two full sparse-MoE blocks) is traced to a post-grad-like graph (functionalized,
inductor's decompositions), the pass runs, the top-k / softmax ops are counted before and after and the
rewritten graph is compared with eager on fresh random inputs. Eager routers whose top-k is sorted are
compared position by position, `sorted=False` ones (DeepSeek-V3, GLM4-MoE) after sorting by expert id.
Bounds: ids identical (fp32 inputs: no ties); fp32 weights rtol 1e-5 / atol 1e-6; weights the model casts to
bf16 within one bf16 ulp.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch._inductor.config as inductor_config
from torch.func import functional_call, functionalize
from torch.fx.experimental.proxy_tensor import make_fx

import moefx.integrations.transformers  # noqa: F401  (registers experts_implementation="moefx")
from moefx.passes.fuse_moe_routing import FUSED_TOPK, FuseMoeRouting
from moefx.testing import count_ops, decomposed_graph, run_passes

aten = torch.ops.aten
prims = torch.ops.prims
HID, T = 32, 9
SOFTMAX_OPS = (aten.amax.default, aten.exp.default, aten._softmax.default, prims.prepare_softmax_online.default)
UNSORTED = ("deepseek_v2", "deepseek_v3", "glm4_moe")
GROUPED = ("deepseek_v3", "glm4_moe")


def _families():
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        Glm4MoeConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

    small = dict(hidden_size=HID, moe_intermediate_size=16)
    return {
        # name: (config, router class, block class or None)
        "qwen3": (Qwen3MoeConfig(**small, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True),
                  Qwen3MoeTopKRouter, Qwen3MoeSparseMoeBlock),
        # E=12 (not a power of two), no renormalization
        "qwen2_moe": (Qwen2MoeConfig(**small, num_experts=12, num_experts_per_tok=4, norm_topk_prob=False,
                                     shared_expert_intermediate_size=16), Qwen2MoeTopKRouter, None),
        # k=3 (not a power of two)
        "olmoe": (OlmoeConfig(hidden_size=HID, num_experts=16, num_experts_per_tok=3, norm_topk_prob=False),
                  OlmoeTopKRouter, None),
        "mixtral": (MixtralConfig(hidden_size=HID, num_local_experts=8, num_experts_per_tok=2),
                    MixtralTopKRouter, None),
        "deepseek_v3": (DeepseekV3Config(**small, n_routed_experts=32, num_experts_per_tok=4, n_group=4,
                                         topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                                         n_shared_experts=1), DeepseekV3TopkRouter, DeepseekV3MoE),
        # DeepSeek-V2-Lite's "greedy": softmax -> unsorted top-6 -> * routed_scaling_factor
        "deepseek_v2": (DeepseekV2Config(**small, n_routed_experts=16, num_experts_per_tok=6, topk_method="greedy",
                                         n_group=1, topk_group=1, routed_scaling_factor=1.5),
                        DeepseekV2TopkRouter, None),
        # one group (GLM-4.5's n_group=1), no renormalization: the scale is still folded
        "glm4_moe": (Glm4MoeConfig(**small, n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1,
                                   norm_topk_prob=False, routed_scaling_factor=1.5), Glm4MoeTopkRouter, None),
    }


def _init(module: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.5)
    for name, b in module.named_buffers():
        if "e_score_correction_bias" in name:
            b.normal_(0, 0.3)
    return module


def post_grad(module: torch.nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    """The module's graph as inductor's post-grad pass sees it: functional, inductor-decomposed aten."""
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}

    def fn(state, *xs):
        return functional_call(module, state, xs)

    with torch.no_grad():
        gm = decomposed_graph(fn, state, *args)
    gm.state = state
    return gm


def run_pass(gm: torch.fx.GraphModule) -> tuple[int, list[str]]:
    run = run_passes(gm, FuseMoeRouting, config={"pass_config": {"fuse_moe_routing": True}})
    return run.rewrites, run.skipped


def fn_graph(fn, *args: torch.Tensor) -> torch.fx.GraphModule:
    return decomposed_graph(fn, *args)


def _sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def _check_router_outputs(ref: tuple, got: tuple, unsorted: bool) -> None:
    (ref_logits, ref_w, ref_ids), (logits, w, ids) = ref, got
    assert torch.equal(logits, ref_logits)
    assert w.dtype == ref_w.dtype and ids.dtype == ref_ids.dtype == torch.int64
    if unsorted:
        ref_w, ref_ids = _sorted_by_id(ref_w, ref_ids)
        w, ids = _sorted_by_id(w, ids)
    assert torch.equal(ids, ref_ids)
    if w.dtype == torch.float32:
        torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    else:  # one ulp of the model's dtype
        torch.testing.assert_close(w.float(), ref_w.float(), rtol=2**-7, atol=0)


def _tie_free_rows(router: torch.nn.Module, x: torch.Tensor, rows: int) -> torch.Tensor:
    """The first `rows` rows of x whose router logits are all distinct (bf16 logits tie often; ties are
    tested on their own below, where eager's choice is unspecified)."""
    with torch.no_grad():
        logits = router(x)[0]
    distinct = torch.tensor([row.unique().numel() == row.numel() for row in logits])
    assert int(distinct.sum()) >= rows
    return x[distinct][:rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3", "qwen2_moe", "olmoe", "mixtral", "deepseek_v2", "deepseek_v3",
                                    "glm4_moe"])
def test_router_is_fused_and_matches_eager(family: str, dtype: torch.dtype) -> None:
    cfg, router_cls, _ = _families()[family]
    router = _init(router_cls(cfg)).to(dtype)
    if family in GROUPED:
        router.e_score_correction_bias.data = router.e_score_correction_bias.float()  # fp32, as transformers keeps it
    x = torch.randn(T, HID, dtype=dtype)
    gm = post_grad(router, x)
    topks = count_ops(gm.graph, aten.topk.default)
    assert topks == (3 if family in GROUPED else 1)
    assert count_ops(gm.graph, *SOFTMAX_OPS) == (0 if family in GROUPED else 2)
    n, skipped = run_pass(gm)
    assert (n, skipped) == (1, [])
    assert count_ops(gm.graph, aten.topk.default) == 0 and count_ops(gm.graph, *SOFTMAX_OPS) == 0
    assert count_ops(gm.graph, FUSED_TOPK) == 1
    for _ in range(3):  # fresh inputs, including more rows than traced
        x = _tie_free_rows(router, torch.randn(64, HID, dtype=dtype) * 2, T + 4)
        with torch.no_grad():
            _check_router_outputs(router(x), gm(gm.state, x), family in UNSORTED)


def test_fused_op_arguments_carry_the_config() -> None:
    cfg, router_cls, _ = _families()["deepseek_v3"]
    gm = post_grad(_init(router_cls(cfg)), torch.randn(T, HID))
    run_pass(gm)
    (node,) = [n for n in gm.graph.nodes if n.target is FUSED_TOPK]
    _, k, kind, renorm, bias, n_group, topk_group, scale, weights_dtype = node.args
    assert (k, kind, renorm, n_group, topk_group, scale, weights_dtype) == (4, "sigmoid", True, 4, 2, 2.5, None)
    assert bias.op == "placeholder"


def test_a_bf16_block_gets_its_weights_in_bf16_from_the_op() -> None:
    """Qwen3's `.to(router_logits.dtype)` after the top-k is folded into the op (it stores bf16 weights: the same
    rounding, no cast kernel): the rewritten bf16 block equals the unfused graph bit for bit."""
    cfg, _, block_cls = _families()["qwen3"]
    cfg._experts_implementation = "moefx"
    block = _init(block_cls(cfg)).to(torch.bfloat16)
    x = torch.randn(2, 5, HID, dtype=torch.bfloat16)
    unfused, gm = post_grad(block, x), post_grad(block, x)
    n, skipped = run_pass(gm)
    assert (n, skipped) == (1, [])
    (node,) = [nd for nd in gm.graph.nodes if nd.target is FUSED_TOPK]
    assert node.args[-1] == torch.bfloat16
    (experts,) = [nd for nd in gm.graph.nodes if nd.target is torch.ops.moefx.moe_experts.default]
    assert experts.args[2].args[0] is node  # the weights straight from the op, no cast between
    for seed in (1, 2):
        x = torch.randn(2, 5, HID, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(gm(gm.state, x), unfused(unfused.state, x)), seed


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_sparse_moe_block_with_moefx_experts(family: str) -> None:
    cfg, _, block_cls = _families()[family]
    cfg._experts_implementation = "moefx"
    block = _init(block_cls(cfg))
    x = torch.randn(2, 5, HID)
    gm = post_grad(block, x)
    assert count_ops(gm.graph, torch.ops.moefx.moe_experts.default) == 1
    n, skipped = run_pass(gm)
    assert (n, skipped) == (1, []) and count_ops(gm.graph, aten.topk.default) == 0
    (experts,) = [nd for nd in gm.graph.nodes if nd.target is torch.ops.moefx.moe_experts.default]
    ids, weights = experts.args[1], experts.args[2]
    assert ids.target is operator.getitem and ids.args[0].target is FUSED_TOPK
    assert weights.args[0].target is FUSED_TOPK or weights.args[0].args[0].target is FUSED_TOPK
    for _ in range(2):
        x = torch.randn(2, 5, HID)
        with torch.no_grad():
            torch.testing.assert_close(gm(gm.state, x), block(x), rtol=1e-5, atol=1e-5)


# --- spellings: the same router written other ways -----------------------------------------------------------

def _qwen_style(logits):
    p = torch.softmax(logits, dim=-1, dtype=torch.float)
    v, i = torch.topk(p, 4, dim=-1)
    return (v / v.sum(dim=-1, keepdim=True)).to(logits.dtype), i


def _online_softmax(logits):
    # inductor's CUDA post-grad form of softmax (prepare_softmax_online), unsorted top-k, renorm by reciprocal
    x = logits.float()
    m, s = prims.prepare_softmax_online(x, -1)
    v, i = torch.topk((x - m).exp() / s, 4, dim=-1, sorted=False)
    return v * torch.reciprocal(v.sum(dim=-1, keepdim=True)), i


def _mixtral_topk_then_softmax(logits):
    v, i = torch.topk(logits, 2, dim=-1)
    return torch.softmax(v, dim=-1, dtype=torch.float).to(logits.dtype), i


def _probs_also_read(logits):
    # an aux loss reads the full probabilities: they stay, the top-k chain is still fused
    p = torch.softmax(logits.float(), dim=-1)
    v, i = torch.topk(p, 4, dim=-1)
    return v / v.sum(dim=-1, keepdim=True), i, p.mean(dim=0)


def _values_also_read(logits):
    # the raw top-k probabilities are returned too: the op returns them unnormalized, the graph renormalizes
    v, i = torch.topk(torch.softmax(logits.float(), dim=-1), 4, dim=-1)
    return v / v.sum(dim=-1, keepdim=True), i, v


def _scaled_softmax(logits):
    v, i = torch.topk(torch.softmax(logits.float(), dim=-1), 4, dim=-1)
    return 2.0 * (v / v.sum(dim=-1, keepdim=True)), i


SPELLINGS = {
    "qwen_style": (_qwen_style, 1),
    "online_softmax": (_online_softmax, 1),
    "mixtral_topk_then_softmax": (_mixtral_topk_then_softmax, 1),
    "probs_also_read": (_probs_also_read, 1),
    "values_also_read": (_values_also_read, 1),
    "scaled_softmax": (_scaled_softmax, 1),
}


@pytest.mark.parametrize("trace_decomposed", [True, False])
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spellings_match_eager(name: str, trace_decomposed: bool) -> None:
    fn, rewrites = SPELLINGS[name]
    logits = torch.randn(T, 16)  # fp32: no ties (bf16 routers are covered above)
    if trace_decomposed:
        gm = fn_graph(fn, logits)
    else:  # softmax kept as aten._softmax
        gm = make_fx(functionalize(fn, remove="mutations"), tracing_mode="fake")(logits)
    assert count_ops(gm.graph, aten.topk.default) == 1
    n, skipped = run_pass(gm)
    assert (n, skipped) == (rewrites, [])
    assert count_ops(gm.graph, aten.topk.default) == 0
    unsorted = name == "online_softmax"
    for _ in range(3):
        x = torch.randn(T + 3, 16) * 3
        ref, got = fn(x), gm(x)
        if unsorted:
            ref, got = (*_sorted_by_id(*ref[:2]),), (*_sorted_by_id(*got[:2]),)
            ref, got = (ref[0], ref[1]), (got[0], got[1])
        assert torch.equal(got[1], ref[1])
        tol = dict(rtol=1e-5, atol=1e-6) if ref[0].dtype == torch.float32 else dict(rtol=2**-7, atol=0)
        for a, b in zip(got[:1] + got[2:], ref[:1] + ref[2:]):
            torch.testing.assert_close(a.float(), b.float(), **tol)


def test_probabilities_read_elsewhere_keep_their_softmax() -> None:
    gm = fn_graph(_probs_also_read, torch.randn(T, 16))
    run_pass(gm)
    assert count_ops(gm.graph, FUSED_TOPK) == 1 and count_ops(gm.graph, aten.exp.default) == 1


def test_values_read_elsewhere_leave_the_renormalization_in_the_graph() -> None:
    gm = fn_graph(_values_also_read, torch.randn(T, 16))
    run_pass(gm)
    (node,) = [n for n in gm.graph.nodes if n.target is FUSED_TOPK]
    assert node.args[3] is False and count_ops(gm.graph, aten.div.Tensor) == 1


# --- left alone, with the reason -------------------------------------------------------------------------------

def _bf16_probs(logits):
    p = torch.softmax(logits, dim=-1)  # bf16 probabilities: eager ranks rounded values
    return torch.topk(p, 4, dim=-1)


def _masked_with_zero(logits, bias):
    # older DeepSeek code: masked experts filled with 0.0 (a negative biased score would lose to them)
    s = logits.sigmoid()
    c = s + bias
    g = c.view(-1, 4, 4).topk(2, dim=-1)[0].sum(dim=-1)
    mask = torch.zeros_like(g).scatter_(1, torch.topk(g, 2, dim=-1)[1], 1)
    c = c.masked_fill(~mask.unsqueeze(-1).expand(-1, 4, 4).reshape(-1, 16).bool(), 0.0)
    return s.gather(1, torch.topk(c, 4, dim=-1)[1])


def _group_max(logits, bias):
    s = logits.sigmoid()
    c = s + bias
    g = c.view(-1, 4, 4).amax(dim=-1)
    mask = torch.zeros_like(g).scatter_(1, torch.topk(g, 2, dim=-1)[1], 1)
    c = c.masked_fill(~mask.unsqueeze(-1).expand(-1, 4, 4).reshape(-1, 16).bool(), float("-inf"))
    return s.gather(1, torch.topk(c, 4, dim=-1)[1])


def _too_many_experts(logits):
    return torch.topk(torch.softmax(logits.float(), dim=-1), 4, dim=-1)


@pytest.mark.parametrize(
    "fn, shape, reason",
    [
        (_bf16_probs, (T, 16), "rounded to torch.bfloat16"),
        (_masked_with_zero, (T, 16), "other than -inf"),
        (_group_max, (T, 16), "ranked by their max"),
        (_too_many_experts, (T, 8192), "exceeds"),
    ],
)
def test_unsupported_routers_are_reported(fn, shape: tuple, reason: str) -> None:
    args = [torch.randn(*shape, dtype=torch.bfloat16 if fn is _bf16_probs else torch.float32)]
    if fn in (_masked_with_zero, _group_max):
        args.append(torch.randn(16))
    gm = fn_graph(fn, *args)
    before = count_ops(gm.graph, aten.topk.default)
    n, skipped = run_pass(gm)
    assert n == 0 and count_ops(gm.graph, aten.topk.default) == before
    assert len(skipped) == 1 and reason in skipped[0], skipped


def test_group_limited_greedy_softmax_is_reported() -> None:
    """DeepSeek-V2's group-limited greedy: softmax scores, groups by their max, masked to 0.0."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=HID, n_routed_experts=16, num_experts_per_tok=4,
                           topk_method="group_limited_greedy", n_group=4, topk_group=2)
    gm = post_grad(_init(DeepseekV2TopkRouter(cfg)), torch.randn(T, HID))
    n, skipped = run_pass(gm)
    assert n == 0 and len(skipped) == 1 and "group-limited greedy" in skipped[0], skipped


def test_ties_go_to_the_lower_expert_id() -> None:
    """Experts 2, 5 and 11 have the same gate row: their logits tie exactly on every token. torch.topk promises
    no order among equals; the fused op takes the lower ids, with eager's weights."""
    cfg, router_cls, _ = _families()["qwen3"]
    router = _init(router_cls(cfg))
    with torch.no_grad():
        router.weight[5] = router.weight[2]
        router.weight[11] = router.weight[2]
    gm = post_grad(router, torch.randn(T, HID))
    assert run_pass(gm)[0] == 1
    x = torch.randn(256, HID)
    x[:32] = router.weight[2] * 4  # the tied trio is the top for these rows: k=4 takes all three, in id order
    with torch.no_grad():
        (logits, ref_w, ref_ids), (_, w, ids) = router(x), gm(gm.state, x)
    assert torch.equal(ids[:32, :3], torch.tensor([2, 5, 11]).expand(32, 3))
    # elsewhere the trio also straddles the k-th place: then eager keeps any of them, the op the lowest ids
    canonical = torch.sort(logits, dim=-1, descending=True, stable=True)[1][:, :4]
    straddles = (ids != ref_ids).any(dim=-1)
    assert torch.equal(ids, canonical) and straddles.any()
    assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids))  # the same values, rank by rank
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


def _one_group_kept(logits, bias):
    # what inductor's joint-graph passes make of zeros.scatter_(1, group_idx, 1) when topk_group=1 (GLM4-MoE
    # with n_group=1): a one-hot where() against an iota
    s = logits.sigmoid()
    c = s + bias
    g = c.view(-1, 4, 4).topk(2, dim=-1)[0].sum(dim=-1)
    idx = torch.topk(g, 1, dim=-1, sorted=False)[1]
    mask = torch.where(idx.expand(-1, 4) == torch.arange(4).view(1, 4), 1, 0).float()
    c = c.masked_fill(~mask.unsqueeze(-1).expand(-1, 4, 4).reshape(-1, 16).bool(), float("-inf"))
    ids = torch.topk(c, 4, dim=-1, sorted=False)[1]
    w = s.gather(1, ids)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20), ids


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_one_hot_group_mask_and_a_bf16_bias(bias_dtype: torch.dtype) -> None:
    bias = (torch.randn(16) * 0.3).to(bias_dtype)
    gm = fn_graph(_one_group_kept, torch.randn(T, 16), bias)
    n, skipped = run_pass(gm)
    assert (n, skipped) == (1, []) and count_ops(gm.graph, aten.topk.default) == 0
    (node,) = [nd for nd in gm.graph.nodes if nd.target is FUSED_TOPK]
    assert node.args[2:4] == ("sigmoid", True) and node.args[5:7] == (4, 1)
    for _ in range(3):
        x = torch.randn(T + 3, 16) * 2
        (rw, rids), (w, ids) = _sorted_by_id(*_one_group_kept(x, bias)), _sorted_by_id(*gm(x, bias))
        assert torch.equal(ids, rids)
        torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.compile
@pytest.mark.parametrize("family, dynamic", [("qwen3", False), ("glm4_moe", True)])
def test_inductor_compile_reports_the_rewrite(family: str, dynamic: bool) -> None:
    """Real inductor graphs: joint-graph rewrites (GLM4-MoE's one-hot group mask) and, dynamic, the scaling
    factor as a graph input (left as a multiply after the op)."""
    import moefx

    cfg, router_cls, _ = _families()[family]
    router = _init(router_cls(cfg)).to(torch.bfloat16)
    if family in GROUPED:
        router.e_score_correction_bias.data = router.e_score_correction_bias.float()
    moefx.clear_compile_reports()
    torch._dynamo.reset()
    compiled = torch.compile(router, backend=moefx.backend({"pass_config": {"fuse_moe_routing": True}}),
                             dynamic=dynamic)
    x = _tie_free_rows(router, torch.randn(64, HID, dtype=torch.bfloat16), T)
    # a warm FX graph cache would skip the passes, and with them the report
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False):
        got = compiled(x)
        ref = router(x)
    torch._dynamo.reset()
    assert [r.matches.get("fuse_moe_routing") for r in moefx.compile_reports()] == [1]
    _check_router_outputs(ref, got, unsorted=family in UNSORTED)


@pytest.mark.parametrize("model, cuda_preferred", [("qwen3-30b-a3b", True), ("deepseek-v3", True),
                                                   ("mixtral-8x7b", True), ("deepseek-v2", False)])
def test_plan_prefers_the_pass_on_cuda_for_routers_the_kernel_computes(model: str, cuda_preferred: bool) -> None:
    from moefx.models.catalog import catalog_config
    from moefx.signatures import ExecutionSignature, ModelSignature, resolve

    ms = ModelSignature.from_config(catalog_config(model))
    cuda = resolve(ms, ExecutionSignature.preset("h200", dtype="bfloat16")).passes["fuse_moe_routing"]
    cpu = resolve(ms, ExecutionSignature(device_type="cpu", dtype="bfloat16")).passes["fuse_moe_routing"]
    assert cuda.preferred is cuda_preferred and cpu.preferred is False
    assert ms.routing in cuda.reason
