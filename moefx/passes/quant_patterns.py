"""What fuse_act_quant and fuse_norm_quant share: the quant forms they recognise and the three-stage rewrite.

A fusion pass rewrites "producer -> dynamic quant" into one fused op in three stages, each exact:
1. quant: a native quant expression (vLLM `QuantFP8` group path, DeepSeek-style amax quant, per-token
   FP8/INT8) whose input comes from a producer this pass fuses becomes `moefx::quant` with the scheme read
   from the match (qmax, eps, min scale); forms the op cannot reproduce bit for bit are left alone with
   the reason recorded.
2. producer: a native producer (SiLU-mul, RMSNorm, add + RMSNorm) whose output feeds only `moefx::quant`
   nodes with one scheme becomes moefx's unfused op (`moefx::silu_mul`, `moefx::rms_norm`, ...).
3. fuse: unfused op + `moefx::quant` -> the fused op (`moefx::silu_mul_quant`, `moefx::rms_norm_quant`, ...).
Splitting it this way keeps the pattern count at producers + quant forms instead of their product.

Stages 1 and 2 use inductor's `register_replacement`: the pattern is traced from a plain function through
the same decompositions user code goes through, and every match is re-traced with the real shapes and
the constants found in the graph (eps, qmax, min scale are bound through `scalar_workaround`), so a
match computes exactly what the search function computes with those constants.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.fx
from torch._inductor import pattern_matcher as pm

from moefx.ops import fused_quant  # noqa: F401  (registers the moefx ops used below)
from moefx.ops.quant import FP8_MAX, INT8_MAX, QuantScheme
from moefx.passes.base import MoefxPass, PassContext, log

moefx_ops = torch.ops.moefx
FP8 = torch.float8_e4m3fn
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# fp16 traces to the same pattern as bf16 (dtype literals are checked per match), so two traces suffice.
TRACE_DTYPES = (torch.bfloat16, torch.float32)
GROUP_SIZES = (128, 64)
QUANT = moefx_ops.quant.default
_OPS_DIR = Path(__file__).resolve().parent.parent / "ops"
DEPENDENCY_FILES = (
    str(Path(__file__).resolve()),
    str(_OPS_DIR / "fused_quant.py"),
    str(_OPS_DIR / "quant.py"),
    str(_OPS_DIR / "triton_quant.py"),
)

# Placeholder constants traced into the patterns and bound from the graph (scalar_workaround). Each is
# exactly representable in fp32 and distinct from every other literal in the patterns.
MAGIC_QMAX = 448.0
MAGIC_IQMAX = 127.0
MAGIC_MIN_SCALE = 2.0**-18
MAGIC_EPS = 2.0**-30
MAGIC_NORM_EPS = 2.0**-20


# --------------------------------------------------------------------------------------------- quant forms


@dataclass(frozen=True)
class QuantForm:
    """One way real code writes a dynamic quant of `y`; `search(y, *scalars) -> (q, scale)`."""

    name: str
    search: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    scalars: dict[str, float]
    # bound scalars -> the scheme that reproduces the form exactly, or the reason none does
    scheme: Callable[[dict[str, float]], QuantScheme | str]
    # (y, q, scale) from moefx::quant -> the layout the form's outputs have in the graph
    layout: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _fp8_scheme(kind: str, group: int, eps_key: str | None, min_key: str | None, ue8m0: bool = False):
    def scheme(sc: dict[str, float]) -> QuantScheme | str:
        qmax = float(sc["qmax"])
        if not 0 < qmax <= FP8_MAX:
            return f"fp8 max {qmax} is outside (0, {FP8_MAX}]"
        eps = float(sc[eps_key]) if eps_key else 0.0
        min_scale = float(sc[min_key]) if min_key else 0.0
        if eps < 0 or min_scale < 0:
            return f"negative eps {eps} / min scale {min_scale}"
        return QuantScheme(kind, group, eps, min_scale, qmax, ue8m0)

    return scheme


def _int8_scheme(kind: str, group: int):
    def scheme(sc: dict[str, float]) -> QuantScheme | str:
        qmax = float(sc["qmax"])
        # clamp(-128, 127) after rounding equals the op's clamp(-qmax, qmax) only when qmax <= 127.
        if not 0 < qmax <= INT8_MAX:
            return f"int8 max {qmax} is outside (0, {INT8_MAX}]"
        return QuantScheme(kind, group, 0.0, 0.0, qmax)

    return scheme


def _never(reason: str):
    return lambda sc: reason


def _group_layout_3d(g: int):
    def layout(y, q, s):
        ng = y.shape[-1] // g
        return q.reshape(-1, ng, g), s.reshape(-1, ng, 1)

    return layout


def _group_layout_2d(g: int):
    def layout(y, q, s):
        return q.reshape(-1, g), s.reshape(-1, 1)

    return layout


def _token_layout(y, q, s):
    return q, s


def _vllm_group(g: int, ue8m0: bool):
    """vLLM `QuantFP8._quantize_group_native` (hidden size a multiple of the group)."""

    def search(y, qmax, min_scale):
        xg = y.view(-1, y.shape[-1] // g, g)
        absmax = xg.abs().max(dim=-1, keepdim=True)[0].float()
        scale = absmax / qmax
        if ue8m0:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        scale = scale.clamp(min=min_scale)
        q = (xg / scale).clamp(-qmax, qmax).to(FP8)
        return q, scale

    return search


def _amax_group(g: int, clamps: bool):
    """DeepSeek-style group quant in fp32: amax per group / qmax, divide, cast (SGLang's eps and clamp
    when `clamps`, DeepSeek-V3's `act_quant` without them)."""

    if clamps:

        def search(y, qmax, eps):
            xg = y.reshape(-1, g).float()
            scale = xg.abs().amax(dim=-1, keepdim=True).clamp(min=eps) / qmax
            q = (xg / scale).clamp(-qmax, qmax).to(FP8)
            return q, scale

    else:

        def search(y, qmax):
            xg = y.reshape(-1, g).float()
            scale = xg.abs().amax(dim=-1, keepdim=True) / qmax
            q = (xg / scale).to(FP8)
            return q, scale

    return search


def _fp8_token(y, qmax, eps):
    """Per-token FP8, dividing by the scale (SGLang `per_token_quant_fp8` reference form)."""
    yf = y.float()
    scale = yf.abs().amax(dim=-1, keepdim=True).clamp(min=eps) / qmax
    q = (yf / scale).clamp(-qmax, qmax).to(FP8)
    return q, scale


def _fp8_token_reciprocal(y, qmax, min_scale):
    """vLLM `QuantFP8.forward_native` per-token path: multiplies by the reciprocal of the scale."""
    x_max = y.abs().max(dim=-1)[0].unsqueeze(-1).to(torch.float32)
    scale = (x_max / qmax).clamp(min=min_scale)
    q = (y.to(torch.float32) * scale.reciprocal()).clamp(-qmax, qmax).to(FP8)
    return q, scale


def _int8_token(y, qmax):
    """Per-token INT8: scale = amax / 127, round half to even, clamp, cast."""
    yf = y.float()
    scale = yf.abs().amax(dim=-1, keepdim=True) / qmax
    q = (yf / scale).round().clamp(-128, 127).to(torch.int8)
    return q, scale


def _int8_group(g: int):
    def search(y, qmax):
        yf = y.reshape(-1, g).float()
        scale = yf.abs().amax(dim=-1, keepdim=True) / qmax
        q = (yf / scale).round().clamp(-128, 127).to(torch.int8)
        return q, scale

    return search


def quant_forms() -> list[QuantForm]:
    """Every native quant form the passes recognise (one entry per group size where it has one)."""
    qm = {"qmax": MAGIC_QMAX}
    forms = [
        QuantForm("fp8_token", _fp8_token, {**qm, "eps": MAGIC_EPS}, _fp8_scheme("fp8_token", 0, "eps", None),
                  _token_layout),
        QuantForm("fp8_token_reciprocal", _fp8_token_reciprocal, {**qm, "min_scale": MAGIC_MIN_SCALE},
                  _never("multiplies by the reciprocal of the scale; the fused op divides (different rounding)"),
                  _token_layout),
        QuantForm("int8_token", _int8_token, {"qmax": MAGIC_IQMAX}, _int8_scheme("int8_token", 0), _token_layout),
    ]
    for g in GROUP_SIZES:
        forms += [
            QuantForm(f"vllm_fp8_group{g}", _vllm_group(g, False), {**qm, "min_scale": MAGIC_MIN_SCALE},
                      _fp8_scheme("fp8_group", g, None, "min_scale"), _group_layout_3d(g)),
            QuantForm(f"vllm_fp8_group{g}_ue8m0", _vllm_group(g, True), {**qm, "min_scale": MAGIC_MIN_SCALE},
                      _fp8_scheme("fp8_group", g, None, "min_scale", ue8m0=True), _group_layout_3d(g)),
            QuantForm(f"amax_fp8_group{g}", _amax_group(g, True), {**qm, "eps": MAGIC_EPS},
                      _fp8_scheme("fp8_group", g, "eps", None), _group_layout_2d(g)),
            QuantForm(f"amax_fp8_group{g}_noclamp", _amax_group(g, False), dict(qm),
                      _fp8_scheme("fp8_group", g, None, None), _group_layout_2d(g)),
            QuantForm(f"int8_group{g}", _int8_group(g), {"qmax": MAGIC_IQMAX}, _int8_scheme("int8_group", g),
                      _group_layout_2d(g)),
        ]
    return forms


# ------------------------------------------------------------------------------------------------ producers


@dataclass(frozen=True)
class Producer:
    """A native producer: `search(*tensors, *scalars)` returns y (or (y, new_residual)); `replace` has the
    same signature and returns moefx's unfused op for it."""

    name: str
    search: Callable[..., Any]
    replace: Callable[..., Any]
    # example tensor shapes, one per tensor argument (the dtype is the traced dtype)
    shapes: tuple[tuple[int, ...], ...]
    scalars: dict[str, float] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------- pass machinery


class _Captured(Exception):
    pass


def post_grad_graph(fn: Callable[..., Any], args: list[Any], dynamic_rows: bool = False) -> torch.fx.Graph:
    """The post-grad graph inductor would hand to moefx's passes for `fn(*args)` (dynamo + AOT + inductor's
    own post-grad passes), captured and returned before code generation. For tests and for looking at what
    a pass sees. `dynamic_rows` makes dim 0 of every input with 2+ dims symbolic (the token count of a
    serving graph; hidden sizes stay static as they are in models)."""
    from torch._inductor.compile_fx import compile_fx

    box: dict[str, torch.fx.Graph] = {}

    def grab(graph: torch.fx.Graph) -> None:
        box["graph"] = graph
        raise _Captured

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": grab})

    torch._dynamo.reset()
    if dynamic_rows:
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() >= 2:
                torch._dynamo.mark_dynamic(a, 0)
    try:
        torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)(*args)
    except Exception:
        if "graph" not in box:
            raise
    return box["graph"]


def _functionalize_inplace(gm: torch.fx.GraphModule) -> None:
    """Turn in-place aten ops on intermediates (`add_`, as composite kernels such as rms_norm's emit them
    under make_fx) into their functional overloads, the form functionalized post-grad graphs hold."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        name = target._schema.name.split("::")[-1]
        if not name.endswith("_") or name.startswith("_") or not target._schema.is_mutable:
            continue
        packet = getattr(torch.ops.aten, name[:-1], None)
        functional = getattr(packet, target._overloadname, None) if packet is not None else None
        if functional is None:
            continue
        mutated = node.args[0]
        later = [u for u in mutated.users if u is not node and order[u] > order[node]]
        for user in later:
            user.replace_input_with(mutated, node)
        node.target = functional
    gm.recompile()


def trace(fn: Callable[..., Any], args: list[Any], **kwargs: Any) -> torch.fx.GraphModule:
    """`fwd_only`, made functional, then inductor's view->reshape rewrite, so patterns look like the
    post-grad graphs they are matched against."""
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    gm = pm.fwd_only(fn, args, **kwargs)
    _functionalize_inplace(gm)
    view_to_reshape(gm)
    return gm


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def fake_call(op: Any, args: tuple) -> Any:
    """Run `op` on the fake values of `args` (fx nodes) to get the new node's meta value."""
    vals = torch.fx.map_arg(args, _val)
    fake_mode = torch._guards.detect_fake_mode([v for v in torch.utils._pytree.tree_leaves(vals)])
    if fake_mode is None:
        return op(*vals)
    with fake_mode:
        return op(*vals)


def insert_call(graph: torch.fx.Graph, op: Any, args: tuple) -> torch.fx.Node:
    node = graph.call_function(op, args)
    node.meta["val"] = fake_call(op, args)
    return node


def insert_getitem(graph: torch.fx.Graph, node: torch.fx.Node, index: int) -> torch.fx.Node:
    item = graph.call_function(operator.getitem, (node, index))
    item.meta["val"] = node.meta["val"][index]
    return item


def bound_scalars(match: pm.Match, search: Callable[..., Any], names: dict[str, float], example: list[Any]) -> dict:
    """The constants a match bound to the pattern's scalar placeholders (eps, qmax, min scale).

    torch 2.11's `register_replacement` re-traces the search function with the graph's own constants before
    calling `extra_check`, and that specific pattern no longer binds them (only the magic placeholder
    values are bound). Then the generic pattern, which binds them, is matched on the same output node."""
    vals = {k: match.kwargs.get(k) for k in names}
    if all(isinstance(v, (int, float)) for v in vals.values()):
        return vals
    key = (search, tuple(names), example[0].dtype)
    if key not in _GENERIC_PATTERNS:
        _GENERIC_PATTERNS[key] = pm.gen_pattern(search, example, trace, dict(names))
    generic = _GENERIC_PATTERNS[key].match(match.output_nodes()[0])
    if pm.is_match(generic):
        vals.update({k: generic.kwargs.get(k) for k in names if not isinstance(vals[k], (int, float))})
    return vals


_GENERIC_PATTERNS: dict[tuple, Any] = {}


def runtime_scalars(vals: dict[str, Any]) -> str | None:
    """Constants the fused op needs at compile time but the graph computes at run time (e.g. an eps that
    `torch.compile(dynamic=True)` turned into a graph input)."""
    dynamic = [k for k, v in vals.items() if not isinstance(v, (int, float))]
    if not dynamic:
        return None
    return (
        f"{', '.join(dynamic)} is a runtime value, not a constant (dynamo did not specialize this float: "
        f"moefx.optimize compiles with torch._dynamo.config.specialize_float=True; with plain torch.compile set it "
        f"yourself or write the constant as a literal)"
    )


def dedupe_casts(graph: torch.fx.Graph) -> None:
    """Merge repeated identical dtype casts of one tensor (`y.float()` written twice is not CSE'd in
    inference graphs), so the quant forms see one cast as their search functions do. Casts are pure."""
    seen: dict[tuple[torch.fx.Node, Any], torch.fx.Node] = {}
    cast = torch.ops.prims.convert_element_type.default
    for node in list(graph.find_nodes(op="call_function", target=cast)):
        if node.kwargs or not isinstance(node.args[0], torch.fx.Node):
            continue
        key = (node.args[0], node.args[1])
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            graph.erase_node(node)


def quant_users(node: torch.fx.Node) -> tuple[list[torch.fx.Node], str | None]:
    """The `moefx::quant` nodes reading `node`, or the reason they cannot all be fused with it."""
    users = list(node.users)
    if not users:
        return [], "its output is unused"
    others = [u for u in users if u.target is not QUANT or u.args[0] is not node]
    if others:
        return [], f"its output also feeds {', '.join(sorted({str(u.target) for u in others}))}"
    schemes = {tuple(u.args[1:]) for u in users}
    if len(schemes) != 1:
        return [], f"its output feeds moefx::quant with {len(schemes)} different schemes"
    return users, None


class QuantFusionPass(MoefxPass):
    """Base of fuse_act_quant and fuse_norm_quant: the three stages above; subclasses name their producers,
    their unfused op targets and how to fuse one unfused node with its quant users."""

    uuid_files = DEPENDENCY_FILES
    # per concrete class: (quant stage, producer stage) PatternMatcherPasses, registered on first use
    _stages: ClassVar[tuple[pm.PatternMatcherPass, pm.PatternMatcherPass] | None] = None
    unfused_targets: ClassVar[tuple[Any, ...]] = ()

    # state while `run` is active (passes run one graph at a time, inside one compile)
    _ctx: PassContext | None = None
    _predicate_mode = False

    @classmethod
    def producers(cls) -> list[Producer]:
        raise NotImplementedError

    def fuse(self, graph: torch.fx.Graph, node: torch.fx.Node, ctx: PassContext) -> int:
        """Fuse unfused node `node` (a target in `unfused_targets`) with its quant users; returns 0 or 1."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------- running
    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        quant_stage, producer_stage = self.stages()
        dedupe_casts(graph)
        before = set(graph.nodes)
        cls = type(self)
        cls._ctx = ctx
        try:
            quant_stage.apply(graph)
            producer_stage.apply(graph)
        finally:
            cls._ctx = None
        fused = 0
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in self.unfused_targets and not node._erased:
                desc = f"{node.name} ({node.target})"
                if self.fuse(graph, node, ctx):
                    fused += 1
                    log.debug("%s fused %s with its moefx::quant consumer(s)", self.name, desc)
        for node in graph.nodes:
            if node.target is QUANT and node not in before:
                ctx.skip(f"{node.name}: native quant became moefx::quant but its producer was not fused")
        if fused:
            graph.eliminate_dead_code()
        return fused

    @classmethod
    def stages(cls) -> tuple[pm.PatternMatcherPass, pm.PatternMatcherPass]:
        if cls.__dict__.get("_stages") is None:
            cls._stages = cls._register()
        return cls._stages

    @classmethod
    def _skip(cls, match: pm.Match, reason: str) -> None:
        if cls._ctx is not None and not cls._predicate_mode:
            anchor = match.output_nodes()[0]
            message = f"{getattr(anchor, 'name', anchor)}: {reason}"
            if message not in cls._ctx.skipped:
                cls._ctx.skip(message)

    # -------------------------------------------------------------------------------------- registration
    @classmethod
    def _register(cls) -> tuple[pm.PatternMatcherPass, pm.PatternMatcherPass]:
        quant_stage = pm.PatternMatcherPass(pass_name=f"moefx_{cls.name}_quant")
        producer_stage = pm.PatternMatcherPass(pass_name=f"moefx_{cls.name}_producer")
        for dtype in TRACE_DTYPES:
            for form in quant_forms():
                example = [torch.randn(4, 256, dtype=dtype), *form.scalars.values()]
                pm.register_replacement(
                    form.search, cls._quant_replacement(form), example, trace, quant_stage,
                    extra_check=cls._quant_check(form, producer_stage), scalar_workaround=dict(form.scalars),
                    skip_duplicates=True,
                )
            for prod in cls.producers():
                example = [torch.randn(*shape, dtype=dtype) for shape in prod.shapes]
                example += list(prod.scalars.values())
                pm.register_replacement(
                    prod.search, prod.replace, example, trace, producer_stage,
                    extra_check=cls._producer_check(prod), scalar_workaround=dict(prod.scalars),
                    skip_duplicates=True,
                )
        return quant_stage, producer_stage

    @classmethod
    def _quant_replacement(cls, form: QuantForm) -> Callable[..., Any]:
        names = list(form.scalars)

        def replace(y, *scalars):
            scheme = form.scheme(dict(zip(names, scalars)))
            q, s = moefx_ops.quant(y, *scheme.args())
            return form.layout(y, q, s)

        return replace

    @classmethod
    def _quant_check(cls, form: QuantForm, producer_stage: pm.PatternMatcherPass) -> Callable[[pm.Match], bool]:
        def check(match: pm.Match) -> bool:
            y = match.kwargs["y"]
            if not isinstance(y, torch.fx.Node) or not cls._is_producer(y, producer_stage):
                return False  # not after a producer this pass fuses: not a candidate
            others = sorted({str(u.target) for u in y.users if u not in match.nodes and u.target is not QUANT})
            if others:
                cls._skip(match, f"{form.name} after {y.name} left alone: {y.name} also feeds {', '.join(others)}")
                return False
            yv = _val(y)
            if not isinstance(yv, torch.Tensor) or yv.dtype not in FLOAT_DTYPES:
                cls._skip(match, f"{form.name}: input dtype {getattr(yv, 'dtype', None)} is not fp32/bf16/fp16")
                return False
            example = [torch.randn(4, 256, dtype=yv.dtype), *form.scalars.values()]
            vals = bound_scalars(match, form.search, form.scalars, example)
            reason = runtime_scalars(vals)
            if reason is not None:
                cls._skip(match, f"{form.name} after {y.name} left alone: {reason}")
                return False
            scheme = form.scheme(vals)
            if isinstance(scheme, str):
                cls._skip(match, f"{form.name} after {y.name} left alone: {scheme}")
                return False
            return True

        return check

    @classmethod
    def _is_producer(cls, node: torch.fx.Node, producer_stage: pm.PatternMatcherPass) -> bool:
        """Would stage 2 (or stage 3 directly) take `node` as the producer of a quant? Checks the full
        producer pattern, constants included, ignoring only who consumes it."""
        if node.op != "call_function":
            return False
        if node.target in cls.unfused_targets:
            return True
        if node.target is operator.getitem and node.args[1] == 0 and isinstance(node.args[0], torch.fx.Node):
            if node.args[0].target in cls.unfused_targets:
                return True
        cls._predicate_mode = True
        try:
            for entry in producer_stage.patterns.get(("call_function", node.target), []):
                m = entry.pattern.match(node)
                if pm.is_match(m) and m.output_nodes()[0] is node and entry.extra_check(m):
                    return True
        finally:
            cls._predicate_mode = False
        return False

    @classmethod
    def _producer_check(cls, prod: Producer) -> Callable[[pm.Match], bool]:
        def check(match: pm.Match) -> bool:
            dtype = next((v.dtype for v in map(_val, match.kwargs.values()) if isinstance(v, torch.Tensor)), None)
            example = [torch.randn(*shape, dtype=dtype) for shape in prod.shapes] + list(prod.scalars.values())
            vals = bound_scalars(match, prod.search, prod.scalars, example)
            reason = runtime_scalars(vals) or cls.producer_reason(prod, match)
            if reason is not None:
                cls._skip(match, f"{prod.name} left alone: {reason}")
                return False
            if cls._predicate_mode:
                return True
            y = match.output_nodes()[0]
            _, why = quant_users(y)
            if why is not None and any(u.target is QUANT for u in y.users):
                cls._skip(match, f"{prod.name} ({y.name}) left alone: {why}")
            return why is None  # without a quant consumer it is not a candidate: nothing to report

        return check

    @classmethod
    def producer_reason(cls, prod: Producer, match: pm.Match) -> str | None:
        """Why the unfused op cannot reproduce this producer (dtypes, shapes), or None."""
        return None
