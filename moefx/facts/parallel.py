"""Where a model's tensor- and expert-parallel sizes come from: `detect_parallel(model)`.

In order, the first that has a word decides:
  1. sizes passed by the caller                      "argument"
  2. moefx's own sharding (`shard_model`)            `model.moefx_sharding`
  3. transformers' sharding (`tp_plan="auto"` / `distributed_config`): the device mesh on `model._device_mesh`
     (its "tp" dim), `model._tp_size`, and `config.distributed_config.ep_size`
  4. a model that is none of these is not sharded: tp = ep = 1 even inside a process group (data parallel)
  5. no model: the default process group's world size is the TP size (each process one TP rank)
  6. no process group: tp = ep = 1
Ranks come from the mesh or the process group. The experts' layout is read off their weights where it can be:
"tp" (intermediate dim split over the TP ranks), "ep" (whole experts per rank), or "replicated".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moefx.facts.weights import is_stacked_experts

EXPERT_LAYOUTS = ("replicated", "tp", "ep")


@dataclass(frozen=True)
class ParallelInfo:
    tp_size: int = 1
    ep_size: int = 1
    tp_rank: int = 0
    ep_rank: int = 0
    world_size: int = 1
    rank: int = 0
    backend: str | None = None  # the process group's backend (gloo, nccl, ...)
    experts: str = "replicated"
    source: str = "no torch.distributed process group"

    def __post_init__(self) -> None:
        if self.experts not in EXPERT_LAYOUTS:
            raise ValueError(f"ParallelInfo experts {self.experts!r} is invalid; valid: {EXPERT_LAYOUTS}")
        for name in ("tp_size", "ep_size", "world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelInfo {name} must be >= 1, got {getattr(self, name)}")

    def describe(self) -> str:
        where = f"rank {self.rank} of {self.world_size} ({self.backend})" if self.world_size > 1 else "one process"
        return (f"tp {self.tp_size} (rank {self.tp_rank}), ep {self.ep_size} (rank {self.ep_rank}), "
                f"experts {self.experts}, {where}")


def _dist() -> tuple[int, int, str | None]:
    """(world size, rank, backend) of the default process group; (1, 0, None) without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0, None
    return dist.get_world_size(), dist.get_rank(), str(dist.get_backend())


def _dtensor_layout(weight: torch.Tensor) -> str | None:
    """'ep' / 'tp' / 'replicated' from a DTensor's placement (dim 0 = experts), None for a plain tensor."""
    placements = getattr(weight, "placements", None)
    if placements is None:
        return None
    # Shard and _StridedShard (transformers' packed gate/up split) both carry the split dim.
    dims = {p.dim for p in placements if isinstance(getattr(p, "dim", None), int)}
    if not dims:
        return "replicated"
    return "ep" if 0 in dims else "tp"


def _mesh_dim(mesh: Any, name: str) -> tuple[int, int] | None:
    """(size, this rank's coordinate) along mesh dim `name` (or the only dim of a 1-D mesh)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if name in names:
        return int(mesh.size(names.index(name))), int(mesh.get_local_rank(name))
    if getattr(mesh, "ndim", 0) == 1 and not names:
        return int(mesh.size()), int(mesh.get_local_rank())
    return None


def _from_transformers(model: torch.nn.Module, rank: int) -> tuple[int, int, int, int, str] | None:
    """(tp, tp_rank, ep, ep_rank, source) from what transformers' distributed loading left on the model."""
    mesh = getattr(model, "_device_mesh", None)
    tp_size = getattr(model, "_tp_size", None)
    config = getattr(model, "config", None)
    dcfg = getattr(config, "distributed_config", None)
    if mesh is None and not tp_size and dcfg is None:
        return None
    tp, tp_rank, parts = 1, 0, []
    found = _mesh_dim(mesh, "tp") if mesh is not None else None
    if found is not None:
        tp, tp_rank = found
        parts.append("model._device_mesh 'tp' dim")
    elif tp_size:
        tp, tp_rank = int(tp_size), rank % int(tp_size)
        parts.append("model._tp_size")
    ep = int(getattr(dcfg, "ep_size", None) or 1)
    if ep == 1 and getattr(dcfg, "enable_expert_parallel", False):
        ep = tp  # transformers before `ep_size`: expert parallel over the TP ranks
    ep_rank = 0
    if ep > 1:
        manager = getattr(model, "_mesh_manager", None)
        ep_mesh = manager.get_mesh("ep") if manager is not None else None
        coord = _mesh_dim(ep_mesh, "ep") if ep_mesh is not None else None
        ep_rank = coord[1] if coord is not None else rank % ep
        parts.append("config.distributed_config.ep_size")
    return tp, tp_rank, ep, ep_rank, "transformers: " + ", ".join(parts or ["config.distributed_config"])


def detect_parallel(model: torch.nn.Module | None = None, tp_size: int | None = None,
                    ep_size: int | None = None) -> ParallelInfo:
    """The TP/EP sizes and ranks this process runs `model` with (see the module docstring for the order)."""
    world, rank, backend = _dist()
    base = dict(world_size=world, rank=rank, backend=backend)
    experts_layout = "replicated"
    if model is not None:
        experts = next((m for m in model.modules() if is_stacked_experts(m)), None)
        if experts is not None:
            layout = _dtensor_layout(experts.gate_up_proj)
            specs = getattr(experts, "moefx_shard", {})
            if layout is None and "gate_up_proj" in specs:
                layout = "ep" if specs["gate_up_proj"].dim == 0 else "tp"
            experts_layout = layout or "replicated"
    if tp_size is not None or ep_size is not None:
        tp, ep = tp_size or 1, ep_size or 1
        layout = experts_layout if model is not None else ("ep" if ep > 1 else "tp" if tp > 1 else "replicated")
        return ParallelInfo(tp, ep, rank % tp, rank % ep, experts=layout, source="argument", **base)
    if world == 1 and model is None:
        return ParallelInfo(**base)
    if model is None:
        return ParallelInfo(world, 1, rank, 0, experts="tp", **base,
                            source=f"torch.distributed world size {world} (no model given: one TP rank per process)")
    sharding = getattr(model, "moefx_sharding", None)
    if sharding is not None:
        return ParallelInfo(sharding.tp_size, sharding.ep_size, sharding.tp_rank, sharding.ep_rank,
                            experts=sharding.experts, source="moefx.parallel.shard_model", **base)
    found = _from_transformers(model, rank)
    if found is not None:
        tp, tp_rank, ep, ep_rank, source = found
        return ParallelInfo(tp, ep, tp_rank, ep_rank, experts=experts_layout, source=source, **base)
    why = "model is not sharded (no transformers device mesh, no moefx sharding)"
    if world > 1:
        why += f"; the {world} ranks of the process group each run the whole model"
    return ParallelInfo(experts=experts_layout, source=why, **base)
