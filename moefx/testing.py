"""Helpers for testing passes at the FX level: get the post-grad graph inductor would hand to moefx."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass


class _Capture(CustomGraphPass):
    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs.append(copy.deepcopy(graph.owning_module))

    def uuid(self) -> None:
        return None  # never cache: the capture must run


def post_grad_graphs(fn: Callable[..., Any], *args: Any, dynamic: bool | None = False) -> list[torch.fx.GraphModule]:
    """Compile `fn(*args)` once with inductor and return a copy of each post-grad graph (before codegen).

    The copies keep `meta["val"]`, so passes can be run on them and the result executed as a GraphModule.
    """
    capture = _Capture()
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=capture, fx_graph_cache=False):
        torch.compile(fn, backend="inductor", dynamic=dynamic, fullgraph=False)(*args)
    torch._dynamo.reset()
    return capture.graphs


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


def count_ops(gm: torch.fx.GraphModule | torch.fx.Graph, *targets: object) -> int:
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    wanted = set(targets)
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target in wanted)


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
