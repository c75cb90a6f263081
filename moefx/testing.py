"""Helpers for testing passes at the FX level: get the post-grad graph inductor would hand to moefx."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

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


def count_ops(gm: torch.fx.GraphModule | torch.fx.Graph, *targets: object) -> int:
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    wanted = set(targets)
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target in wanted)
