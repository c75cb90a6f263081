"""Helpers for testing passes at the FX level: a post-grad style graph of a function or module, the one runner that
puts moefx passes on it (`run_passes`: the pass manager's own loop, with the graph's op counts before and after) and
the one op counter."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch


def decomposed_graph(fn: Callable[..., Any], *args: Any, tracing_mode: str = "fake",
                     remove: str = "mutations") -> torch.fx.GraphModule:
    """`fn(*args)` as a functional, inductor-decomposed aten graph (what a post-grad pass sees), dead code removed;
    `remove` as for `torch.func.functionalize`, `tracing_mode="symbolic"` for symbolic sizes."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.func import functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(functionalize(fn, remove=remove), decomposition_table=select_decomp_table(),
                 tracing_mode=tracing_mode)(*args)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def functional_graph(module: torch.nn.Module, *inputs: torch.Tensor,
                     tracing_mode: str = "fake") -> tuple[torch.fx.GraphModule, dict]:
    """`module(*inputs)` as a functional, decomposed graph of (parameters, *inputs): what inductor's post-grad passes
    see, without compiling (input mutations become `copy_` back at the end; `tracing_mode="symbolic"`: the inputs'
    sizes symbolic, as under dynamic shapes). Returns it and the parameters."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.func import functional_call, functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    state = dict(module.named_parameters())

    def fn(state: dict, *args: torch.Tensor) -> Any:
        return functional_call(module, state, args)

    with torch.no_grad():
        gm = make_fx(functionalize(fn, remove="mutations"), decomposition_table=select_decomp_table(),
                     tracing_mode=tracing_mode)(state, *inputs)
    return gm, state


def count_ops(graph: torch.fx.GraphModule | torch.fx.Graph, *targets: object) -> int:
    """How many call nodes of `graph` call one of `targets`."""
    graph = graph.graph if isinstance(graph, torch.fx.GraphModule) else graph
    wanted = set(targets)
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target in wanted)


def _op_counts(graph: torch.fx.Graph) -> Counter:
    return Counter(n.target for n in graph.nodes if n.op == "call_function")


@dataclass
class PassRun:
    """What `run_passes` did to a graph: rewrites per pass, every skip reason and rewrite note (in pipeline order),
    and the graph's text and op counts before and after."""

    matches: dict[str, int]
    skipped: list[str]
    notes: list[str]
    graph_before: str
    graph_after: str
    ops_before: Counter = field(default_factory=Counter)
    ops_after: Counter = field(default_factory=Counter)

    @property
    def rewrites(self) -> int:
        """Rewrites made by all the passes together."""
        return sum(self.matches.values())


def run_passes(graph: torch.fx.GraphModule | torch.fx.Graph, *passes: str | type, config: Any = None) -> PassRun:
    """Run the moefx passes `passes` (toggle names or pass classes) on `graph` in place, through the pass manager as a
    compile runs them: pipeline order, dead code removed after a pass that rewrote, the graph linted. A GraphModule
    is recompiled, so it runs the rewritten graph. `config`: anything `CompilationConfig.from_any` takes."""
    from moefx.config import CompilationConfig
    from moefx.passes import PassManager

    gm = graph if isinstance(graph, torch.fx.GraphModule) else None
    graph = gm.graph if gm is not None else graph
    names = [p if isinstance(p, str) else p.name for p in passes]
    manager = PassManager(CompilationConfig.from_any(config), names)
    before, ops_before = str(graph), _op_counts(graph)
    report = manager.run_passes(graph)
    if gm is not None:
        gm.recompile()
    skipped = [reason for name in manager.enabled for reason in report.skipped.get(name, [])]
    notes = [note for name in manager.enabled for note in report.rewrites.get(name, [])]
    return PassRun(dict(report.matches), skipped, notes, before, str(graph), ops_before, _op_counts(graph))


@contextlib.contextmanager
def without_codegen() -> Iterator[None]:
    """Inductor up to and including its post-grad passes (moefx's passes run there and write their compile
    reports), then each graph runs as the PyTorch ops it holds instead of generated C++/Triton code.

    For tests of what the passes do to a real model's graph: on a CPU, the C++ compile of one graph of the tiny
    Qwen3-MoE costs 10-25 s of CPU, every other step well under that. Code generation itself is what the tests
    that compile for real (the demo, `optimize` + `generate`, the bench smoke runs) cover.
    """
    from torch._inductor import compile_fx as inductor

    from moefx.compile import post_grad_only

    real = inductor.compile_fx

    def compile_fx(gm: torch.fx.GraphModule, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["inner_compile"] = post_grad_only
        return real(gm, example_inputs, *args, **kwargs)

    with mock.patch.object(inductor, "compile_fx", compile_fx):
        yield
