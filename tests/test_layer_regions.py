"""Decoder layers compiled as one nested region (moefx/engine/layers/regions.py): compile work that does not grow with
depth, and the engine's tokens and logits unchanged.

Compile work is counted on the post-grad graphs inductor would generate code for (moefx's passes run on each;
`post_grad_only` skips the code generation): the graphs, and the matmuls in them. With regions the layer body is
one subgraph whatever the depth; inlined, every layer adds its matmuls again.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import moefx
from moefx.compile import backend as moefx_backend
from moefx.compile import post_grad_only
from moefx.engine.engine import DecodeLoop
from moefx.engine.layers.layer_body import kv_buffers
from moefx.engine.layers.regions import install_layer_regions, layer_frames, why_no_regions
from moefx.models import build_model, tiny_qwen3_moe_config
from moefx.sampling.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0)
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _all_graphs(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    subs = [m for _, m in gm.named_children() if isinstance(m, torch.fx.GraphModule)]
    return [gm, *(g for sub in subs for g in _all_graphs(sub))]


class _Recorder:
    """A backend: moefx's inductor config and passes, post-grad graphs recorded, no code generation."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.inner = moefx_backend({"mode": "compile"})

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        def inner(graph: torch.fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
            compiled = post_grad_only(graph, inputs, **kwargs)
            self.graphs.extend(_all_graphs(graph))
            return compiled

        patches = {"post_grad_custom_post_pass": self.inner.pass_manager, "fx_graph_cache": False}
        return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)

    def work(self) -> tuple[int, int]:
        """(graphs, matmul nodes) over every post-grad graph and subgraph."""
        mms = sum(1 for g in self.graphs for n in g.graph.nodes if n.op == "call_function" and n.target in MATMULS)
        return len(self.graphs), mms

    def cache_copies(self, shape: torch.Size) -> int:
        """copy_ nodes that write a whole KV-cache-shaped tensor from another value (a self-copy lowers to nothing)."""
        return sum(1 for g in self.graphs for n in g.graph.nodes
                   if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
                   and n.args[0] is not n.args[1] and tuple(n.args[0].meta["val"].shape) == tuple(shape))


def _dynamic_caches(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every transformers DynamicCache made from now on (the padded prefill's prompt caches among them)."""
    from transformers import DynamicCache

    made: list[Any] = []
    init = DynamicCache.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(DynamicCache, "__init__", spy)
    return made


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def _run(layers: int, regions: str, stack_off: str | None = None,
         steps: list[list[str]] | None = None) -> tuple[tuple[int, int], torch.Tensor, list[torch.Tensor],
                                                        torch.Tensor, list[torch.Tensor], dict[str, int]]:
    """One engine request with the layers compiled as `regions` ("all": one nested region, "frames", "none");
    `stack_off` keeps the frames one op per layer call; `steps` gets the ops of one decode step run again after."""
    torch._dynamo.reset()
    stock = build_model(tiny_qwen3_moe_config(num_hidden_layers=layers), seed=3).eval()
    model = copy.deepcopy(stock)
    if regions != "none":
        said = install_layer_regions(model, frames=regions == "frames")[0]
        assert ("frames of their own" if regions == "frames" else "one nested region") in said, said
    if stack_off is not None:
        layer_frames(model).stack_off = stack_off
    recorder = _Recorder()
    engine = DecodeLoop(model, compile_kwargs={"backend": recorder})
    ids = _ids(2, 7, layers)
    got_logits: list[torch.Tensor] = []
    want_logits: list[torch.Tensor] = []
    got = engine.generate(ids, 4, GREEDY, logits_out=got_logits)
    # Each layer's keys and values are written in place: no whole-cache copy per layer and step, nor of the buffers
    # the layers are views of (the frames' caches only: elsewhere the step reads the layers' own tensors).
    cache = engine.slots.latest(2).cache
    assert recorder.cache_copies(cache.layers[0].keys.shape) == 0
    assert (kv_buffers(cache) is not None) is (regions == "frames")
    if regions == "frames":
        assert recorder.cache_copies(kv_buffers(cache)[0].shape) == 0
    want = DecodeLoop(stock).generate(ids, 4, GREEDY, logits_out=want_logits)
    if steps is not None:
        steps.append(_step_ops(engine, ids))
    torch._dynamo.reset()
    return recorder.work(), got, got_logits, want, want_logits, dict(engine.stats.compiles)


def _step_ops(engine: DecodeLoop, ids: torch.Tensor) -> list[str]:
    """The ops, in order, one more request's decode steps run (the profiler's CPU events, the frame ops themselves
    left out: what runs inside them and around them is compared), views and size reads left out too: the stack op
    takes a layer's cache tensors from the buffers inside it, one op per layer in the graph before it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.generate(ids, 2, GREEDY)
    views = ("aten::select", "aten::as_strided", "aten::sym_")
    return [e.name for e in prof.events() if not e.name.startswith(("moefx::", *views))]


@pytest.mark.compile
def test_compile_work_does_not_grow_with_depth_and_tokens_equal_eager():
    work = {}
    for layers in (2, 8):
        work[layers], got, got_logits, want, want_logits, _ = _run(layers, "all")
        assert torch.equal(got, want), layers
        for a, b in zip(got_logits, want_logits):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert work[8] == work[2], work
    inline, *_ = _run(4, "none")
    assert inline[1] > work[2][1], (inline, work)  # the count sees per-layer work when layers are inlined


@pytest.mark.parametrize("reuses", [True, False])
def test_the_plan_says_when_this_torch_traces_every_layer_again(monkeypatch, reuses):
    """A torch without region reuse (before 2.12, the H200's 2.11) still compiles one body but traces each layer:
    the plan says so, so a slow first call is explained, not a surprise."""
    from moefx.engine.layers import regions

    monkeypatch.setattr(regions, "_reuses_regions", lambda: reuses)
    model = build_model(tiny_qwen3_moe_config(num_hidden_layers=2), seed=3)
    notes = install_layer_regions(model)
    assert "one nested region" in notes[0]
    assert any("traces every layer's region call again" in n for n in notes) is not reuses, notes


def test_prefill_only_regions_leave_the_decode_step_inlined():
    """`decode=False` (config layer_regions: prefill): the prefill's dynamo graph calls the one region per layer,
    the decode step's has no region call; tokens equal eager (dynamo graphs run as traced, no inductor)."""
    torch._dynamo.reset()
    stock = build_model(tiny_qwen3_moe_config(num_hidden_layers=3), seed=6).eval()
    model = copy.deepcopy(stock)
    assert "prefill only" in install_layer_regions(model, decode=False)[0]
    graphs: dict[str, list[torch.fx.GraphModule]] = {}

    def record(name: str) -> Any:
        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            graphs.setdefault(name, []).append(gm)
            return gm.forward
        return backend

    engine = DecodeLoop(model, compile_kwargs={"backend": record("step")})
    engine._prefill = torch.compile(engine._run, backend=record("prefill"))
    ids = _ids(2, 6, 7)
    got = engine.generate(ids, 4, GREEDY)
    assert torch.equal(got, DecodeLoop(stock).generate(ids, 4, GREEDY))
    calls = {name: sum(1 for g in gms for n in g.graph.nodes if n.op == "call_function"
                       and n.target is torch.ops.higher_order.invoke_subgraph) for name, gms in graphs.items()}
    assert calls == {"prefill": 3, "step": 0}, calls
    torch._dynamo.reset()


def test_a_compiled_direct_forward_through_the_regions_equals_eager():
    """`model(ids)` compiled (transformers makes its DynamicCache inside the forward): the prefill path of the
    regions, the cache it returns holds the same keys and values as eager's."""
    torch._dynamo.reset()
    stock = build_model(tiny_qwen3_moe_config(num_hidden_layers=3), seed=8).eval()
    model = copy.deepcopy(stock)
    install_layer_regions(model)
    ids = _ids(2, 6, 9)
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        got = torch.compile(model.forward, backend=record, fullgraph=True)(ids, use_cache=True)
        want = stock(ids, use_cache=True)
    assert sum(1 for n in graphs[0].graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph) == 3
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    cache = getattr(got, "past_key_values", None) or got.cache
    ref = getattr(want, "past_key_values", None) or want.cache
    for a, b in zip(cache.layers, ref.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_regions_are_a_no_op_outside_compile():
    stock = build_model(tiny_qwen3_moe_config(num_hidden_layers=3), seed=4).eval()
    model = copy.deepcopy(stock)
    install_layer_regions(model)
    ids = _ids(2, 6, 1)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, stock(ids).logits)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False),
                       stock.generate(ids, max_new_tokens=4, do_sample=False))


def test_optimize_says_whether_layers_share_a_region():
    stock = build_model(tiny_qwen3_moe_config(), seed=2)
    on = moefx.optimize(copy.deepcopy(stock), config={"mode": "compile"})
    assert any("layer_regions: decoder layers (2 x" in line for line in on.moefx_plan.provenance)
    assert any("(prefill and decode step)" in line for line in on.moefx_plan.provenance)
    pre = moefx.optimize(copy.deepcopy(stock), config={"mode": "compile", "layer_regions": "prefill"})
    assert any("(prefill only;" in line for line in pre.moefx_plan.provenance)
    off = moefx.optimize(copy.deepcopy(stock), config={"mode": "compile", "layer_regions": "none"})
    assert any("layer_regions: decoder layers compiled inline (config" in line for line in off.moefx_plan.provenance)
    eager = moefx.optimize(copy.deepcopy(stock), config={"mode": "eager"})
    assert any("layer_regions: decoder layers: no compiled regions (mode eager)" in line
               for line in eager.moefx_plan.provenance)
    with pytest.raises(ValueError, match="layer_regions"):
        moefx.optimize(copy.deepcopy(stock), config={"layer_regions": "yes please"})


def test_models_without_the_known_layer_stack_stay_inline():
    assert "no decoder layer stack" in why_no_regions(torch.nn.Linear(2, 2))
    one = build_model(tiny_qwen3_moe_config(num_hidden_layers=1), seed=2)
    assert "one decoder layer" in why_no_regions(one)
    odd = build_model(tiny_qwen3_moe_config(), seed=2)
    odd.model.layers[1].self_attn.layer_idx = 0
    assert "layer 1 has no self_attn.layer_idx == 1" in why_no_regions(odd)


@pytest.mark.gpu
@pytest.mark.compile
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_regions_on_cuda_keep_one_captured_decode_graph_and_the_tokens():
    """fp32, 4 layers, mode capture: with the layers as one region, or as compiled frames over the slot's cache
    buffers, the decode step is still captured once (no graph break, no host sync) and the tokens equal
    transformers' eager ones, as with the layers inlined."""
    stock = build_model(tiny_qwen3_moe_config(num_hidden_layers=4), seed=2, device="cuda")
    ids = _ids(2, 7, 5).cuda()
    want = stock.generate(ids, max_new_tokens=10, do_sample=False)
    for regions in ("all", "none", "frames"):
        torch._dynamo.reset()
        model = moefx.optimize(copy.deepcopy(stock), config={"max_batch_size": 2, "moe_backend": "gemv",
                                                             "layer_regions": regions})
        assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False), want), regions
        stats = model.moefx_generate.engine.stats
        assert stats.captures == 1 and not stats.uncaptured, (regions, stats)
        assert stats.compiles["decode"] == 1, (regions, stats)


@pytest.mark.compile
def test_layers_as_compiled_frames_compile_once_whatever_the_depth():
    """`layer_regions: frames`: the prefill and the decode step each stay one graph (a layer call is one op, no graph
    break) and their layer calls each compile one body (traced once, every other layer reusing it), so the compiles
    and the matmuls compiled are the same at 6 layers as at 2; tokens equal eager and logits within fp32 rounding.
    The decode body may compile twice: dynamo guards its input's dispatch keys, and the first layer's hidden states
    are an inductor buffer (allocated without autograd keys) where the others' are op outputs."""
    runs = {layers: _run(layers, "frames") for layers in (2, 6)}
    for layers, (_, got, got_logits, want, want_logits, compiles) in runs.items():
        assert compiles.get("prefill") == 1 and compiles.get("decode") == 1, (layers, compiles)
        assert compiles.get("layer[prefill]") == 1 and compiles.get("layer[decode]") in (1, 2), (layers, compiles)
        assert torch.equal(got, want), layers
        for a, b in zip(got_logits, want_logits):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    (work2, *_, compiles2), (work6, *_, compiles6) = runs[2], runs[6]
    assert compiles6 == compiles2 and work6[1] == work2[1], (compiles2, work2, compiles6, work6)


@pytest.mark.compile
def test_the_layer_stack_op_runs_what_the_per_layer_ops_ran():
    """The stack form against one op per layer call, both compiled (post-grad graphs run as their ops): the same
    tokens and bit-equal logits, and a request runs the same ops in the same order around and inside the frame ops
    (on a GPU: the kernels the PDL chain and the CUDA graph see)."""
    steps: list[list[str]] = []
    _, got, got_logits, *_ = _run(3, "frames", steps=steps)
    _, per_layer, per_layer_logits, *_ = _run(3, "frames", stack_off="one op per layer, for the comparison",
                                              steps=steps)
    assert torch.equal(got, per_layer)
    assert all(torch.equal(a, b) for a, b in zip(got_logits, per_layer_logits))
    assert steps[0] == steps[1], [(i, a, b) for i, (a, b) in enumerate(zip(*steps)) if a != b][:5]


def _traced_steps(layers: int, change: Any = None) -> tuple[dict[str, torch.fx.GraphModule], Any, bool]:
    """The dynamo graphs of one request's prefill and decode step with the layers as compiled frames (no AOTAutograd,
    no inductor: the graphs run as traced), the frames, and whether the tokens equal eager's. `change(model)` may
    alter the model after the frames are installed."""
    torch._dynamo.reset()
    stock = build_model(tiny_qwen3_moe_config(num_hidden_layers=layers), seed=3).eval()
    model = copy.deepcopy(stock)
    install_layer_regions(model, frames=True)
    if change is not None:
        change(model)
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    engine = DecodeLoop(model, compile_kwargs={"backend": record})
    ids = _ids(2, 7, layers)
    got = engine.generate(ids, 3, GREEDY)
    same = torch.equal(got, DecodeLoop(stock).generate(ids, 3, GREEDY))
    torch._dynamo.reset()
    steps = {}
    for gm in graphs:
        targets = {str(n.target) for n in gm.graph.nodes}
        for kind in ("prefill", "decode"):
            if any(kind in t and "moefx" in t for t in targets):
                steps.setdefault(kind, gm)
    return steps, layer_frames(model), same


def _nodes(gm: torch.fx.GraphModule, leave_out: tuple[str, ...] = ()) -> int:
    return sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output")
               and not any(name in str(n.target) for name in leave_out))


def _frame_ops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target).removesuffix(".default") for n in gm.graph.nodes
            if n.op == "call_function" and "moefx.layer" in str(n.target)]


def test_the_traced_steps_call_one_op_for_the_layer_stack_whatever_the_depth():
    """`layer_regions: frames`: the decode step's dynamo graph holds as many nodes at 6 layers as at 2 (one
    `layer_stack_decode` call, one write-position advance over every layer), so AOTAutograd functionalizes the
    cache writes once, not per layer; the prefill's one `layer_stack_prefill` call, with only each layer's outputs
    stored in the cache added per layer (their getitems and transformers' cache update). Tokens equal eager."""
    runs = {layers: _traced_steps(layers) for layers in (2, 6)}
    for layers, (steps, frames, same) in runs.items():
        assert same and frames.unstacked == {}, (layers, frames.unstacked)
        assert _frame_ops(steps["decode"]) == ["moefx.layer_stack_decode"], layers
        assert _frame_ops(steps["prefill"]) == ["moefx.layer_stack_prefill"], layers
    assert _nodes(runs[6][0]["decode"]) == _nodes(runs[2][0]["decode"])
    stored = ("getitem", "method cat", "method tensor")
    assert _nodes(runs[6][0]["prefill"], stored) == _nodes(runs[2][0]["prefill"], stored)
    grows = _nodes(runs[6][0]["prefill"]) - _nodes(runs[2][0]["prefill"])
    assert grows == 4 * 6, grows  # per layer: 2 getitems, and the cache's empty start and cat for keys and values


def test_a_layer_call_with_other_arguments_runs_the_layers_one_op_each():
    """A layer whose call differs from the first layer's (here: other rotary tensors of equal values) ends the
    stack at that layer: the layers held so far run their own ops, then the rest; tokens equal eager and the
    reason is kept."""
    def other_rotary_for_layer_2(model: Any) -> None:
        layer = model.model.layers[2]
        forward = layer.forward

        def changed(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            cos, sin = kwargs["position_embeddings"]
            return forward(hidden_states, *args, **{**kwargs, "position_embeddings": (cos * 1, sin * 1)})
        layer.forward = changed

    steps, frames, same = _traced_steps(4, other_rotary_for_layer_2)
    assert same
    assert frames.unstacked == {kind: "decoder layer 2 got other arguments than layer 0"
                                for kind in ("prefill", "decode")}
    assert _frame_ops(steps["decode"]) == ["moefx.layer_decode"] * 4
    assert _frame_ops(steps["prefill"]) == ["moefx.layer_prefill"] * 4


def test_forward_hooks_on_a_layer_keep_one_op_per_layer_call():
    """A forward hook on a decoder layer (transformers' output capture installs them) must see that layer's own
    output, so the layers run one op each; the reason names the layer."""
    seen: list[torch.Size] = []

    def hook(model: Any) -> None:
        model.model.layers[1].register_forward_hook(lambda module, args, out: seen.append(out.shape))

    steps, frames, same = _traced_steps(3, hook)
    assert same and seen
    assert frames.unstacked["decode"].startswith("forward hooks on decoder layers [1]"), frames.unstacked
    assert _frame_ops(steps["decode"]) == ["moefx.layer_decode"] * 3


def test_models_whose_loop_skips_layers_or_masks_per_type_never_stack():
    """What the model's config says rules the stack out for good (the plan says why): a loop over fewer layers
    than the stack holds, or layers of different attention types with masks of their own."""
    short = build_model(tiny_qwen3_moe_config(num_hidden_layers=3), seed=3)
    short.config.num_hidden_layers = 2
    assert "one op per layer call (the model calls 2 of its 3 decoder layers)" in install_layer_regions(
        short, frames=True)[0]
    mixed = build_model(tiny_qwen3_moe_config(num_hidden_layers=2), seed=3)
    mixed.config.layer_types = ["full_attention", "sliding_attention"]
    said = install_layer_regions(mixed, frames=True)[0]
    assert "layers of different attention types (full_attention, sliding_attention)" in said
    assert layer_frames(mixed).stack_off is not None
    plain = build_model(tiny_qwen3_moe_config(num_hidden_layers=2), seed=3)
    assert "one op for the whole stack" in install_layer_regions(plain, frames=True)[0]


def test_frames_no_engine_bound_trace_the_nested_region():
    """Until a compiled engine binds the frames (an eager engine binds nothing), a compiled forward traces the
    layers through the nested region: one dynamo graph, no break at the layer calls."""
    from transformers import DynamicCache

    from moefx.engine.layers.regions import layer_frames

    model = build_model(tiny_qwen3_moe_config(num_hidden_layers=2), seed=3).eval()
    install_layer_regions(model, frames=True)
    DecodeLoop(model)
    assert layer_frames(model) is not None and not layer_frames(model).bound
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=record)(_ids(1, 5, 0), past_key_values=DynamicCache(config=model.config),
                                             use_cache=True)
    torch._dynamo.reset()
    assert len(graphs) == 1, len(graphs)
    assert sum("invoke_subgraph" in str(n.target) for n in graphs[0].graph.nodes) == 2


@pytest.mark.parametrize("reuses", [True, False])
def test_layer_regions_auto_takes_frames_where_torch_traces_every_region_call(monkeypatch, reuses):
    """The default (`auto`): one nested region where torch reuses a traced body (>= 2.12), compiled frames where
    it traces every call again (the H200's 2.11); the plan says which and why."""
    from moefx.engine.layers import regions
    from moefx.engine.layers.regions import layer_frames

    monkeypatch.setattr(regions, "_reuses_regions", lambda: reuses)
    model = moefx.optimize(build_model(tiny_qwen3_moe_config(num_hidden_layers=2), seed=3).eval(),
                           config={"mode": "compile"})
    said = model.moefx_plan.explain()
    assert f"layer_regions auto = {'all' if reuses else 'frames'}" in said
    assert ("frames of their own" in said) is not reuses
    assert (layer_frames(model) is not None) is not reuses


def test_config_layer_regions_frames_reaches_the_engine():
    """`optimize(config={"layer_regions": "frames"})`: the plan says so and the generate() engine has bound the
    frames (its compiled steps then break at every layer call)."""
    from moefx.engine.layers.regions import layer_frames

    model = moefx.optimize(build_model(tiny_qwen3_moe_config(num_hidden_layers=2), seed=3).eval(),
                           config={"layer_regions": "frames"})
    assert layer_frames(model) is not None and layer_frames(model).bound
    assert "frames of their own" in model.moefx_plan.explain()


def test_frames_hand_calls_they_cannot_carry_to_the_nested_region():
    """A layer call with a tensor argument the frame ops have no slot for, or a positional extra, goes through the
    region (fail closed), not through an op that would drop it."""
    from moefx.engine.layers.frames import LayerFrames

    class Region:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def decode(self, *args: Any) -> str:
            self.calls.append("decode")
            return "region"

    region = Region()
    frames = LayerFrames([], region)
    hidden, cos = torch.zeros(1, 1, 4), torch.zeros(1, 1, 2)
    static = (torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), torch.zeros((), dtype=torch.long))
    known = {"position_embeddings": (cos, cos), "use_cache": True}
    assert frames.decode(None, 0, None, hidden, "cache", static, (), {**known, "extra_tensor": cos}) == "region"
    assert frames.decode(None, 0, None, hidden, "cache", static, ("positional",), known) == "region"
    assert frames.decode(None, 0, None, hidden, "cache", static, (), {**known, "flag": object()}) == "region"
    assert region.calls == ["decode"] * 3


def test_frames_handle_is_the_layers_kind_not_what_the_process_built_before():
    """The handle is a constant of every traced step (inductor's keys, the compile-cache file's name): a model's frames
    get the same one in a new process as in one that optimized another model first; two alive of one kind differ."""
    import gc

    from moefx.engine.layers.frames import LayerFrames

    model_b = [torch.nn.Linear(4, 8) for _ in range(2)]
    alone = LayerFrames(model_b, None)
    handle = alone.handle
    del alone
    gc.collect()
    first = LayerFrames([torch.nn.Linear(4, 4) for _ in range(2)], None)  # another model, optimized first, alive
    second = LayerFrames(model_b, None)
    assert second.handle == handle != first.handle
    assert LayerFrames(model_b, None).handle != second.handle


def _decode_graph_inputs(layers: int, stack_off: str | None = None) -> tuple[int, int, list[str], list[str]]:
    """The decode step's dynamo graph inputs (the graph run as traced, no compile): how many, how many of its
    tensor inputs share storage with another (AOTAutograd builds synthetic bases for such inputs where one is
    mutated), its layer ops, and the inputs read from a cache layer's own tensors (their sources)."""
    torch._dynamo.reset()
    stock = build_model(tiny_qwen3_moe_config(num_hidden_layers=layers), seed=3).eval()
    model = copy.deepcopy(stock)
    install_layer_regions(model, frames=True)
    if stack_off is not None:
        layer_frames(model).stack_off = stack_off
    seen: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        ops = _frame_ops(gm)
        if any("decode" in op for op in ops):  # the decode step (not a layer body, the prefill or the sampler)
            storages = [x.untyped_storage().data_ptr() for x in example_inputs if isinstance(x, torch.Tensor)]
            sources = [getattr(n.meta.get("grapharg"), "source", None) for n in gm.graph.find_nodes(op="placeholder")]
            layer_reads = [s.name for s in sources if s is not None and ".layers[" in s.name]
            seen["decode"] = (len(example_inputs), len(storages) - len(set(storages)), ops, layer_reads)
        return gm.forward

    ids = _ids(1, 5, layers)
    got = DecodeLoop(model, compile_kwargs={"backend": backend}).generate(ids, 3, GREEDY)
    torch._dynamo.reset()
    assert torch.equal(got, DecodeLoop(stock).generate(ids, 3, GREEDY)), layers
    return seen["decode"]


def test_the_decode_step_takes_the_cache_as_buffers_whatever_the_depth():
    """The slot's cache layers are views of one keys, one values and one write-position buffer, and the decode step
    reads only those (the stack op takes them whole; one op per layer indexes them in the graph): its graph inputs
    are as many at 6 layers as at 2, none aliases another, and AOTAutograd functionalizes two mutated tensors
    whatever the depth (each layer's tensors as inputs were most of the cold decode step's growth with depth,
    docs/FINDINGS.md). Not even a layer's size is read: the mask's length comes from the keys buffer (a layer
    view's size made dynamo fakeify its base with symbols no input carries, and CUDA's guard on one failed
    the decode compile on torch 2.11, `slots.get_mask_sizes`). Tokens equal eager."""
    for stack_off in (None, "one op per layer"):
        (inputs2, shared2, ops2, reads2), (inputs6, shared6, ops6, reads6) = (
            _decode_graph_inputs(n, stack_off) for n in (2, 6))
        assert inputs6 == inputs2 and shared2 == shared6 == 0, (stack_off, inputs2, inputs6, shared2, shared6)
        assert reads2 == reads6 == [], (reads2, reads6)
        assert ops6 == (["moefx.layer_stack_decode"] if stack_off is None else ["moefx.layer_decode"] * 6), ops6


def test_a_cache_the_engine_did_not_make_runs_one_op_per_layer_and_says_why():
    """A StaticCache whose layers hold tensors of their own (a user's, not the engine's slot) has no buffers for
    the stack op: the frames say so and keep one op per layer; once its layers are views of buffers
    (`stack_cache_layers`) the stack takes it, and the layers' tensors are the buffers' (written through)."""
    from transformers import StaticCache

    from moefx.engine.layers.frames import LayerFrames
    from moefx.engine.slots import stack_cache_layers

    model = build_model(tiny_qwen3_moe_config(num_hidden_layers=3), seed=3).eval()
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(_ids(2, 1, 0), past_key_values=cache, use_cache=True)
    frames = LayerFrames(list(model.model.layers), None)
    hidden, cos = torch.zeros(2, 1, model.config.hidden_size), torch.zeros(2, 1, 4)
    rest = {"position_embeddings": (cos, cos), "attention_mask": None, "use_cache": True}
    with torch.no_grad():
        assert "not views of one buffer per kind" in frames._why_no_stack("decode", cache, hidden, (), rest)
        assert stack_cache_layers(cache) is None
        assert frames._why_no_stack("decode", cache, hidden, (), rest) is None
    keys, values, lengths = kv_buffers(cache)
    assert keys.shape == (3, *cache.layers[0].keys.shape) and lengths.shape == (3,)
    cache.layers[2].keys.fill_(1.0)
    cache.layers[1].cumulative_length.add_(5)
    assert keys[2].eq(1).all() and keys[:2].eq(0).all() and lengths.tolist() == [0, 5, 0]
    assert "only initialized StaticLayers" in stack_cache_layers(StaticCache(config=model.config, max_cache_len=16))


def _framed_engine(layers: int, seed: int, in_layers: bool) -> tuple[torch.nn.Module, DecodeLoop, DecodeLoop]:
    """A tiny model with its layers as compiled frames on an engine whose padded prefill covers 64 tokens (the
    backend runs each graph as traced), its prompt written in the layers or not, and an eager engine of the same
    weights."""
    stock = build_model(tiny_qwen3_moe_config(num_hidden_layers=layers), seed=seed).eval()
    model = copy.deepcopy(stock)
    install_layer_regions(model, frames=True)
    engine = DecodeLoop(model, compile_kwargs={"backend": lambda gm, example_inputs: gm.forward},
                        prefill_capture_tokens=64)
    engine._bucketed.write_in_layers = in_layers
    return model, engine, DecodeLoop(stock)


@pytest.mark.parametrize("in_layers", [False, True], ids=["copies", "in-layers"])
def test_the_buffered_cache_takes_the_padded_prefill_a_reset_and_another_length(in_layers):
    """The frames' slot cache as buffers through what else reads its layers: the padded prefill's KV handover
    into the layers' views (or its layer bodies' writes, `write_in_layers`), a shorter request after a longer one
    (the cache reset through its buffers) and a longer one after (a second slot); tokens equal eager's each time, and
    the layers stay views of the buffers."""
    torch._dynamo.reset()
    model, engine, eager = _framed_engine(3, 3, in_layers)
    for batch, length, tokens in ((2, 12, 6), (2, 5, 3), (2, 9, 300)):
        ids = _ids(batch, length, length)
        assert torch.equal(engine.generate(ids, tokens, GREEDY), eager.generate(ids, tokens, GREEDY)), length
    padded = "prefill[padded, in layers]" if in_layers else "prefill[padded]"
    assert engine.stats.compiles.get(padded) and layer_frames(model).unstacked == {}, engine.stats.compiles
    assert len(engine.slots) == 2
    for slot in (engine.slots.find(2, 256, torch.device("cpu"), 0), engine.slots.latest(2)):
        keys, values, lengths = kv_buffers(slot.cache)
        for i, layer in enumerate(slot.cache.layers):
            assert layer.keys.data_ptr() == keys[i].data_ptr() and layer.values.data_ptr() == values[i].data_ptr()
            assert layer.cumulative_length.data_ptr() == lengths[i].data_ptr()
        slot.reset_cache()
        assert not keys.any() and not values.any() and not lengths.any()
    torch._dynamo.reset()


def test_buckets_past_the_in_layers_bound_copy_the_prompt_after_the_forward(monkeypatch):
    """`write_in_layers` on: a prompt whose bucket is past IN_LAYERS_MAX_BUCKET takes the copies' prefill, one within
    it the in-layers prefill, and both give eager's tokens."""
    from moefx.engine import prefill as prefill_module

    monkeypatch.setattr(prefill_module, "IN_LAYERS_MAX_BUCKET", 16)
    torch._dynamo.reset()
    _, engine, eager = _framed_engine(2, 4, True)
    for length in (12, 20):  # buckets 16 and 32
        ids = _ids(1, length, length)
        assert torch.equal(engine.generate(ids, 4, GREEDY), eager.generate(ids, 4, GREEDY)), length
    compiles = engine.stats.compiles
    assert compiles.get("prefill[padded, in layers]") == 1 and compiles.get("prefill[padded]") == 1, compiles
    torch._dynamo.reset()


@pytest.mark.parametrize("form", ["stack", "per-layer", "copy"])
def test_the_padded_prefill_writes_the_prompt_into_the_buffers_inside_the_layer_bodies(monkeypatch, form):
    """The frames' padded prefill over the buffered cache: the stack op's layer bodies write the prompt's keys and
    values into the slot's buffers (`layer_stack_prefill_into`), in place (no whole-buffer copy in the post-grad
    graphs) and nothing follows the forward: the prompt cache it got stays empty (at 48 layers the copies after it
    were 96 kernels). One op per layer, or the stack with `write_in_layers` off, keeps the copies after the
    forward. Each way the first token's logits and the cache equal the unpadded eager
    prefill's, zeros past the prompt."""
    torch._dynamo.reset()
    stock = build_model(tiny_qwen3_moe_config(num_hidden_layers=3), seed=3).eval()
    model = copy.deepcopy(stock)
    install_layer_regions(model, frames=True)
    if form == "per-layer":
        layer_frames(model).stack_off = "one op per layer"
    recorder = _Recorder()
    engine = DecodeLoop(model, compile_kwargs={"backend": recorder}, prefill_capture_tokens=64)
    engine._bucketed.write_in_layers = form != "copy"  # per-layer: on, and not taken
    eager = DecodeLoop(stock)
    ids = _ids(2, 9, 0)
    got_logits: list[torch.Tensor] = []
    want_logits: list[torch.Tensor] = []
    engine.generate(ids, 1, GREEDY)  # compiles and allocates the slot
    made = _dynamic_caches(monkeypatch)
    engine.generate(ids, 1, GREEDY, logits_out=got_logits)
    monkeypatch.undo()
    eager.generate(ids, 1, GREEDY, logits_out=want_logits)
    torch.testing.assert_close(got_logits[0], want_logits[0], rtol=1e-5, atol=1e-5)
    ops = {str(n.target) for g in recorder.graphs for n in g.graph.nodes if n.op == "call_function"}
    frame_ops = sorted(o for o in ops if "moefx.layer" in o)
    assert ("moefx.layer_stack_prefill_into.default" in ops) is (form == "stack"), frame_ops
    assert [layer.is_initialized for layer in made[0].layers] == [form != "stack"] * 3
    slot, ref = engine.slots.latest(2), eager.slots.latest(2)
    assert recorder.cache_copies(kv_buffers(slot.cache)[0].shape) == 0
    assert recorder.cache_copies(slot.cache.layers[0].keys.shape) == 0
    for layer, other in zip(slot.cache.layers, ref.cache.layers):
        for name in ("keys", "values"):
            mine, theirs = getattr(layer, name), getattr(other, name)
            torch.testing.assert_close(mine[:, :, :9], theirs[:, :, :9], rtol=1e-5, atol=1e-5)
            assert not mine[:, :, 9:].any(), name
        assert int(layer.cumulative_length) == 9
    torch._dynamo.reset()


@pytest.mark.slow
def test_turning_the_layer_bodies_write_on_after_a_prefill_takes_it(monkeypatch):
    """`write_in_layers` changed on a live engine with saved traces (whose entries keep no guard on the cache's
    attributes, so the copies' trace would serve a call that asks for the layer bodies' write): the next padded
    prefill writes in the layer bodies, and turning it off again goes back to the copies; the logits equal the
    eager prefill's each time."""
    from moefx.engine.compile_cache.aot import why_no_aot

    if why_no_aot():
        pytest.skip(f"no saved traces on this torch: {why_no_aot()}")
    torch._dynamo.reset()
    stock = build_model(tiny_qwen3_moe_config(num_hidden_layers=2), seed=3).eval()
    model = copy.deepcopy(stock)
    install_layer_regions(model, frames=True)
    engine = DecodeLoop(model, compile_kwargs={"backend": moefx_backend({"mode": "compile"})},
                        prefill_capture_tokens=64, saved_traces=True)
    eager = DecodeLoop(stock)
    ids = _ids(2, 9, 0)
    want: list[torch.Tensor] = []
    eager.generate(ids, 1, GREEDY, logits_out=want)
    made = _dynamic_caches(monkeypatch)
    for in_layers in (False, True, False):
        engine._bucketed.write_in_layers = in_layers
        made.clear()
        got: list[torch.Tensor] = []
        engine.generate(ids, 1, GREEDY, logits_out=got)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        prompt_caches = [c for c in made if c.layers]
        assert prompt_caches and [layer.is_initialized for layer in prompt_caches[-1].layers] == [not in_layers] * 2
    functions = engine.steps.aot.functions if engine.steps.aot is not None else {}
    assert all(functions[name].entries for name in ("prefill[padded]", "prefill[padded, in layers]")), functions
    torch._dynamo.reset()
