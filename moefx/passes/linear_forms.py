"""What fuse_sibling_linears and dense_linears share: the forms a linear takes in a post-grad graph, and the rewrite
of a set of linears that read the same input into one `moefx::dense_linear` call.

Forms matched (each is `out = x @ W^T (+ b)` with W [N, K]):
- `mm(x2, permute(W, [1, 0]))` and `addmm(b, x2, permute(W, [1, 0]))` (beta = alpha = 1): decomposed
  `F.linear` / `nn.Linear`, where x2 is the input flattened to 2-D by a reshape (one reshape per linear: post-grad
  graphs do not merge them) and W a weight, i.e. a graph input or constant (a parameter). `t(W)` and
  `transpose(W, 0, 1)` count as the permute. An mm of two activations (attention scores) is not a linear here.
- `moefx::fp8_block_gemm(a, a_scale, W, W_scale, bn, bk, b, out_dtype)`: `Fp8BlockLinear` (moefx.quantize). Its
  activation comes from `moefx::quant(x, scheme)` (or a fused norm/SiLU quant); two quant calls of one x with one
  scheme give the same values, so they count as the same input (so do two getitems of one output).
- `moefx::dense_linear` itself (the op's own form): its outputs are its getitems.
Two linears read the same input when they read the same node, or the same reshape of the same node.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx

import moefx.backends.dense  # registers moefx::dense_linear
import moefx.ops  # noqa: F401  (registers moefx::quant, moefx::fp8_block_gemm)
from moefx.passes.fx import RESHAPES, call, meta_val, source_of

aten = torch.ops.aten
DENSE = torch.ops.moefx.dense_linear.default
FP8_GEMM = torch.ops.moefx.fp8_block_gemm.default
QUANT = torch.ops.moefx.quant.default
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BACKENDS_DIR = Path(__file__).resolve().parent.parent / "backends"
DEPENDENCY_FILES = (
    str(Path(__file__).resolve()),
    str(_BACKENDS_DIR / "dense.py"),
    str(Path(__file__).resolve().parent / "fx.py"),
)


@dataclass
class Linear:
    """One candidate: the linears of one node, as arguments of a dense_linear call."""

    node: torch.fx.Node  # mm / addmm / fp8_block_gemm / dense_linear
    outputs: list[torch.fx.Node]  # the nodes whose uses the new call's outputs take over, one per weight
    x: torch.fx.Node
    input_key: tuple
    weights: list[torch.fx.Node]
    biases: list[Any]
    x_scale: torch.fx.Node | None = None
    weight_scales: list[torch.fx.Node] = field(default_factory=list)
    block_shape: list[int] | None = None
    out_dtype: torch.dtype | None = None
    backend: str | None = None  # dense_linear only: the backend its call names

    @property
    def ns(self) -> list[int]:
        return [int(meta_val(w).shape[0]) for w in self.weights]

    @property
    def k(self) -> int:
        return int(meta_val(self.weights[0]).shape[1])

    def group_key(self) -> tuple:
        """Linears with equal keys can share one call."""
        dtype = meta_val(self.x).dtype
        block = tuple(self.block_shape) if self.block_shape is not None else None
        return (bool(self.weight_scales), self.input_key, self.k, dtype, block, self.out_dtype)

    def where(self) -> str:
        return source_of(self.node)


def _is_weight(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op in ("placeholder", "get_attr")


def _untransposed(node: Any) -> torch.fx.Node | None:
    """W when `node` is W^T for a 2-D weight W (permute [1, 0], t, transpose 0/1), else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    src = node.args[0] if node.args else None
    if node.target is aten.permute.default and list(node.args[1]) == [1, 0]:
        pass
    elif node.target is aten.t.default:
        pass
    elif node.target is aten.transpose.int and sorted(int(d) % 2 for d in node.args[1:3]) == [0, 1]:
        pass
    else:
        return None
    val = meta_val(src)
    return src if _is_weight(src) and isinstance(val, torch.Tensor) and val.dim() == 2 else None


def _tensor_key(node: torch.fx.Node) -> tuple:
    """Equal keys = equal values: a node, a reshape of a node to one shape, one output of a node (getitems of one
    output are not merged in post-grad graphs), or moefx::quant of one value with one scheme (a pure op)."""
    if node.op == "call_function" and node.target in RESHAPES:
        return ("view", _tensor_key(node.args[0]), str(tuple(meta_val(node).shape)))
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return ("item", _tensor_key(node.args[0]), node.args[1])
    if node.op == "call_function" and node.target is QUANT:
        return ("quant", _tensor_key(node.args[0]), tuple(node.args[1:]), tuple(sorted(node.kwargs.items())))
    return ("node", node)


def _weight_problem(w: torch.fx.Node, x: torch.fx.Node) -> str | None:
    wv, xv = meta_val(w), meta_val(x)
    if not isinstance(wv, torch.Tensor) or not isinstance(xv, torch.Tensor):
        return "untyped nodes"
    if wv.stride(-1) != 1:
        return f"the weight {w.name} is not contiguous in K (the kernel streams its rows)"
    if wv.device != xv.device:
        return "weight and input on different devices"
    return None


def parse(node: torch.fx.Node) -> Linear | str | None:
    """The linear at `node`, a reason it is a linear that cannot be taken, or None when it is not a linear."""
    if node.op != "call_function":
        return None
    if node.target in (aten.mm.default, aten.addmm.default):
        return _parse_mm(node)
    if node.target is FP8_GEMM:
        return _parse_fp8(node)
    if node.target is DENSE:
        return _parse_dense(node)
    return None


def _parse_mm(node: torch.fx.Node) -> Linear | str | None:
    addmm = node.target is aten.addmm.default
    x, wt = node.args[1:3] if addmm else node.args[:2]
    w = _untransposed(wt)
    if w is None:
        return None
    bias = node.args[0] if addmm else None
    if addmm:
        if any(float(node.kwargs.get(k, 1)) != 1.0 for k in ("beta", "alpha")):
            return "addmm with beta/alpha other than 1"
        bv = meta_val(bias)
        if not isinstance(bv, torch.Tensor) or bv.dim() != 1:
            return "the bias is not one value per output feature"
    xv = meta_val(x)
    if not isinstance(xv, torch.Tensor) or xv.dim() != 2 or xv.dtype not in FLOAT_DTYPES:
        return "the input is not a 2-D bf16/fp16/fp32 tensor"
    if meta_val(w).dtype != xv.dtype or (bias is not None and meta_val(bias).dtype != xv.dtype):
        return "weight, bias and input dtypes differ"
    why = _weight_problem(w, x)
    if why:
        return why
    return Linear(node, [node], x, _tensor_key(x), [w], [bias])


def _parse_fp8(node: torch.fx.Node) -> Linear | str | None:
    a, a_s, w, ws, bn, bk = node.args[:6]
    bias = node.args[6] if len(node.args) > 6 else node.kwargs.get("bias")
    out_dtype = node.args[7] if len(node.args) > 7 else node.kwargs.get("out_dtype")
    if not all(isinstance(v, torch.fx.Node) for v in (a, a_s, w, ws)):
        return "untyped arguments"
    av = meta_val(a)
    if not isinstance(av, torch.Tensor) or meta_val(w) is None or meta_val(w).dim() != 2:
        return "untyped nodes"
    why = _weight_problem(w, a)
    if why:
        return why
    key = (_tensor_key(a), _tensor_key(a_s))
    return Linear(node, [node], a, key, [w], [bias], a_s, [ws], [int(bn), int(bk)], out_dtype)


def _parse_dense(node: torch.fx.Node) -> Linear | str | None:
    x, weights, biases, x_scale, scales, block, out_dtype, backend = node.args
    n = len(weights)
    items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    if len(items) != len(node.users):
        return "its outputs are used as a list, not one by one"
    outputs = [items.get(i) for i in range(n)]
    key = _tensor_key(x) if x_scale is None else (_tensor_key(x), _tensor_key(x_scale))
    return Linear(node, outputs, x, key, list(weights), list(biases), x_scale, list(scales),
                  list(block) if block is not None else None, out_dtype, backend)


def emit(graph: torch.fx.Graph, members: Sequence[Linear], backend: str, order: dict[torch.fx.Node, int]
         ) -> torch.fx.Node:
    """One dense_linear call computing every member's linears, inserted before the first member; each member's
    outputs are replaced by the call's and the members are erased. Members share `group_key()`; `order` is the
    graph's node order (positions of the original nodes)."""
    members = sorted(members, key=lambda m: order[m.node])
    first = members[0]
    weights = [w for m in members for w in m.weights]
    biases = [b for m in members for b in m.biases]
    scales = [s for m in members for s in m.weight_scales]
    args = (first.x, weights, biases, first.x_scale, scales, first.block_shape, first.out_dtype, backend)
    with graph.inserting_before(first.node):
        fused = call(graph, DENSE, args)
        fused.meta["stack_trace"] = first.node.meta.get("stack_trace")
        outs = []
        for i in range(len(weights)):
            item = call(graph, operator.getitem, (fused, i))
            item.meta["stack_trace"] = fused.meta["stack_trace"]
            outs.append(item)
    i = 0
    for m in members:
        for old in m.outputs:
            if old is not None:
                old.replace_all_uses_with(outs[i])
                graph.erase_node(old)
            i += 1
        if m.node.target is DENSE:
            graph.erase_node(m.node)
    return fused


def defined_before(member: Linear, anchor: torch.fx.Node, order: dict[torch.fx.Node, int]) -> bool:
    """Every weight, bias and scale of `member` exists before `anchor` (so a call placed there can read them)."""
    nodes = [n for n in (*member.weights, *member.biases, *member.weight_scales) if isinstance(n, torch.fx.Node)]
    return all(order[n] < order[anchor] for n in nodes)
