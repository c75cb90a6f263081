"""Collectives for tensor-parallel inference, and the two ways moefx counts what each rank sends.

Every collective moefx issues is a functional collective (`torch.ops._c10d_functional.*` followed by
`wait_tensor`), addressed by the process group's name: dynamo traces it into the graph, inductor schedules it,
and a CUDA graph can capture it, so a compiled decode step never leaves the graph to communicate.

"Bytes sent" is the payload a rank puts into a collective (the input tensor's bytes): an all-gather of a
[rows, 2] int32 tensor is 8 bytes per row per rank whatever algorithm the backend runs underneath (a ring
all-gather forwards (world - 1) times that on the wire). `CommCounter` counts it for eager code;
`graph_collectives` reads it off a traced graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_funcol = torch.ops._c10d_functional


def group_name(group: Any = None) -> str:
    """The registered name of `group` (a ProcessGroup, a 1-D DeviceMesh, a name, or None = the world group)."""
    import torch.distributed as dist

    if isinstance(group, str):
        return group
    if group is None:
        group = dist.group.WORLD
    elif hasattr(group, "get_group") and hasattr(group, "ndim"):
        if group.ndim != 1:
            raise ValueError(f"a DeviceMesh group must be 1-D, got mesh dims {getattr(group, 'mesh_dim_names', None)}")
        group = group.get_group()
    return group.group_name


def all_gather(x: torch.Tensor, world: int, group: str, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order (one collective)."""
    out = _funcol.wait_tensor(_funcol.all_gather_into_tensor(x.contiguous(), world, group))
    if dim % x.dim() == 0:
        return out
    return torch.cat(out.chunk(world, dim=0), dim=dim)


def all_gather_uneven(x: torch.Tensor, sizes: Sequence[int], group: str) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dim, rank r holding `sizes[r]` columns: equal slices in one
    all-gather, uneven ones padded to the widest, gathered once and trimmed."""
    world = len(sizes)
    if len(set(sizes)) == 1:
        return all_gather(x, world, group, dim=-1)
    width = max(sizes)
    padded = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    pieces = all_gather(padded, world, group, dim=-1).split(width, dim=-1)
    return torch.cat([p[..., :s] for p, s in zip(pieces, sizes)], dim=-1)


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum of every rank's `x` (one collective, out of place)."""
    return _funcol.wait_tensor(_funcol.all_reduce(x.contiguous(), "sum", group))


@dataclass(frozen=True)
class Collective:
    op: str  # e.g. "all_gather_into_tensor"
    payload_bytes: int  # what this rank put in
    shape: tuple[int, ...]
    dtype: str


# Which argument holds the payload, for the collectives eager code can issue (functional and in-place c10d).
_PAYLOAD_ARG = {
    "_c10d_functional.all_gather_into_tensor": 0,
    "_c10d_functional.all_gather_into_tensor_coalesced": 0,
    "_c10d_functional.all_reduce": 0,
    "_c10d_functional.all_reduce_": 0,
    "_c10d_functional.all_reduce_coalesced": 0,
    "_c10d_functional.reduce_scatter_tensor": 0,
    "_c10d_functional.reduce_scatter_tensor_coalesced": 0,
    "_c10d_functional.all_to_all_single": 0,
    "_c10d_functional.broadcast": 0,
    "c10d.allreduce_": 0,
    "c10d.allgather_": 1,
    "c10d._allgather_base_": 1,
    "c10d.allgather_into_tensor_coalesced_": 1,
    "c10d.reduce_scatter_": 1,
    "c10d._reduce_scatter_base_": 1,
    "c10d.broadcast_": 0,
    "c10d.alltoall_base_": 1,
}
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_")


def _op_name(func: Any) -> str | None:
    """'namespace.op' for a collective overload, None for anything else."""
    packet = getattr(func, "overloadpacket", func)  # an OpOverload, or the packet itself (dynamo graphs)
    qualified = getattr(packet, "_qualified_op_name", "")  # "_c10d_functional::all_reduce"
    namespace, _, name = qualified.partition("::")
    if namespace not in ("_c10d_functional", "c10d") or name in _NOT_COLLECTIVES:
        return None
    return f"{namespace}.{name}"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _record(name: str, payload: Any) -> Collective:
    tensors = _tensors(payload)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    first = tensors[0] if tensors else None
    return Collective(name.partition(".")[2], nbytes, tuple(first.shape) if first is not None else (),
                      str(first.dtype).replace("torch.", "") if first is not None else "")


class CommCounter(TorchDispatchMode):
    """Records every collective run eagerly inside `with CommCounter() as c:` (functional and in-place c10d ops).

    Compiled code bypasses dispatch modes; count a compiled step with `graph_collectives` instead.
    """

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = _op_name(func)
        if name is not None:
            if name not in _PAYLOAD_ARG:
                raise ValueError(f"CommCounter does not know which argument of collective {name} is its payload")
            self.collectives.append(_record(name, args[_PAYLOAD_ARG[name]]))
        return func(*args, **(kwargs or {}))

    @property
    def payload_bytes(self) -> int:
        return sum(c.payload_bytes for c in self.collectives)


def graph_collectives(gm: torch.fx.GraphModule) -> list[Collective]:
    """The collectives in a traced graph (dynamo, AOT or post-grad), payloads from the nodes' example values."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = _op_name(node.target)
        if name is None:
            continue
        if name not in _PAYLOAD_ARG:
            raise ValueError(f"graph_collectives does not know which argument of collective {name} is its payload")
        arg = node.args[_PAYLOAD_ARG[name]]
        vals = [a.meta.get("val", a.meta.get("example_value")) for a in _nodes(arg)]
        found.append(_record(name, vals))
    return found


def _nodes(arg: Any) -> list[torch.fx.Node]:
    if isinstance(arg, torch.fx.Node):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [n for a in arg for n in _nodes(a)]
    return []
