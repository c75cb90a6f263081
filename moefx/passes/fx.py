"""Small FX helpers shared by the moefx passes: node tests, insert nodes with fake values, name the user code a node
came from (`location`: the `file:line` format of every pass report).

Inductor's later post-grad passes read `meta["val"]` (device, shape, dtype), so every node a moefx
rewrite inserts gets a value computed under the graph's own fake mode.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_map

aten = torch.ops.aten
RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
LOW_DTYPES = (torch.bfloat16, torch.float16)


def meta_val(node: object) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def val(node: Any) -> Any:
    """A node's fake value, or the argument itself when it is not a node (a constant)."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def dtype_of(node: Any) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _fake_mode(args: Any) -> Any:
    found = []

    def visit(x: Any) -> Any:
        val = meta_val(x)
        # a multi-output op's value is a list of fake tensors: a getitem of it takes their mode
        for v in val if isinstance(val, (list, tuple)) else (val,):
            mode = getattr(v, "fake_mode", None)
            if mode is not None:
                found.append(mode)
        return x

    tree_map(visit, args)
    return found[0] if found else None


def call(graph: torch.fx.Graph, target: Any, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
    """Insert `target(*args, **kwargs)` at the graph's current insert point, with its fake value."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    mode = _fake_mode((args, kwargs))
    if mode is not None:

        def to_val(x: Any) -> Any:
            return meta_val(x) if isinstance(x, torch.fx.Node) else x

        with mode:
            node.meta["val"] = target(*tree_map(to_val, args), **tree_map(to_val, kwargs))
    return node


def sizes_of(graph: torch.fx.Graph, node: torch.fx.Node) -> list[Any]:
    """`node`'s shape as the size argument of a reshape inserted at the graph's insert point: static sizes as ints, a
    symbolic one as a `sym_size` node of `node`. A SymInt written into a node's arguments names a symbol the graph
    may not bind: inductor re-traces a nested region's body when it decomposes the region's auto_functionalized
    call, and failed with "name 's2' is not defined" on one (H200, torch 2.11)."""
    val = meta_val(node)
    return [d if isinstance(d, int) else call(graph, aten.sym_size.int, (node, i)) for i, d in enumerate(val.shape)]


@dataclass(frozen=True)
class Frame:
    """One frame of a node's stack trace: the file, the line and that line's code ("" when the trace has none)."""

    path: str
    line: int
    code: str


_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)')


def frames(node: Any) -> list[Frame]:
    """The frames of `node`'s stack trace, outermost first (none when `node` is not a node or has no trace)."""
    trace = node.meta.get("stack_trace") if isinstance(node, torch.fx.Node) else None
    lines = (trace or "").rstrip().splitlines()
    found = []
    for i, text in enumerate(lines):
        m = _FRAME.match(text)
        if m:
            after = lines[i + 1] if i + 1 < len(lines) else ""
            found.append(Frame(m.group(1), int(m.group(2)), "" if _FRAME.match(after) else after.strip()))
    return found


def user_frame(node: Any) -> Frame | None:
    """The innermost frame of `node`'s stack trace outside torch (the innermost frame when all are torch's)."""
    found = frames(node)
    user = [f for f in found if not f.path.startswith(_TORCH_DIR)] or found
    return user[-1] if user else None


def source_line(node: torch.fx.Node) -> str:
    """The code line of the innermost frame of `node`'s stack trace, torch's included (what op a decomposition
    came from)."""
    found = frames(node)
    return found[-1].code if found else ""


def location(node: Any) -> str:
    """`file:line` of the user code that made `node` -- the one format every pass report names a place in (the file
    relative to the working directory when under it) -- or the node's name when its trace is unknown."""
    frame = user_frame(node)
    if frame is None:
        return getattr(node, "name", str(node))
    path = frame.path
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:
        pass
    return f"{path}:{frame.line}"


def source_of(node: torch.fx.Node) -> str:
    """`file:line (code)` of the user code a node came from (`location` and the line's code), or `node NAME` when
    unknown."""
    frame = user_frame(node)
    if frame is None:
        return f"node {node.name}"
    return f"{location(node)} ({frame.code})" if frame.code else location(node)
