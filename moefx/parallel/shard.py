"""`shard_model`: split a transformers model over the ranks of a process group by the model's own TP plan.

transformers shards a model itself with `from_pretrained(..., tp_plan="auto")`, but that path needs
`accelerate` and loads a checkpoint; `shard_model` applies the same layout to a model already in memory, with
plain local tensors and functional collectives (no DTensor), so tests and benchmarks can build a TP model from a
config on any machine. It reads the model's plan (`model.tp_plan`, else the class `_tp_plan` plus the config's
`base_model_tp_plan`) and implements the styles MoE models name:

  colwise                 Linear rows (output features) split; the output stays split
  rowwise                 Linear columns / expert `down_proj` [E, H, I] last dim split; output all-reduced
  packed_colwise          expert `gate_up_proj` [E, 2I, H]: each rank keeps its slice of the gate rows and of the
                          up rows (the packed layout survives: [gate_r; up_r])
  moe_tp_experts          the experts module's output all-reduced (each rank ran its slice of every expert)
  embedding_rowwise       Embedding rows (vocabulary) split; each rank looks up its ids, the results are summed
  colwise_gather_output   LM head rows split; the logits all-gathered along the vocabulary
  replicated_with_grad_allreduce   nothing at inference
  mla_kv_a_proj           nothing at inference either (transformers 5.25: MLA's kv_a_proj_with_mqa stays whole,
                          its rope part's gradient is averaged)

`experts="ep"` places whole experts instead (E / world per rank, every rank runs its experts on the whole batch
with the other ranks' routes masked, outputs summed): transformers' `ep_dispatch_experts` with its
`all_reduce` implementation, which its plan uses when `ep_size == tp_size`.

Splits follow `torch.chunk` (DTensor `Shard`) semantics: ceil(n / world) per rank, the last ranks shorter.
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moefx.facts.weights import is_stacked_experts
from moefx.parallel.comm import all_gather_uneven, all_reduce, group_name

EXPERT_LAYOUTS = ("tp", "ep")
STYLES = (
    "colwise",
    "rowwise",
    "packed_colwise",
    "moe_tp_experts",
    "embedding_rowwise",
    "colwise_gather_output",
    "replicated_with_grad_allreduce",
    "mla_kv_a_proj",
)
REPLICATED = ("replicated_with_grad_allreduce", "mla_kv_a_proj")  # the weights stay whole at inference


@dataclass(frozen=True)
class ShardSpec:
    """One tensor's split: rows [start, start + size) of `full` along `dim`, over `world` ranks of `group`."""

    dim: int
    start: int
    size: int
    full: int
    rank: int
    world: int
    group: str


@dataclass(frozen=True)
class Sharding:
    """What `shard_model` did, kept on the model as `model.moefx_sharding` (read by `detect_parallel`)."""

    tp_size: int
    tp_rank: int
    ep_size: int
    ep_rank: int
    group: str
    experts: str  # "tp" (intermediate dim split) or "ep" (whole experts per rank)
    styles: tuple[tuple[str, int], ...]  # (style, modules or parameters it was applied to)


def chunk_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """(start, size) of rank's piece when `n` rows are split like `torch.chunk(world)`."""
    step = -(-n // world)
    start = min(rank * step, n)
    return start, max(0, min(step, n - start))


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's TP plan: transformers' merged `tp_plan` where it has one, else class + config plans; stacked
    experts the plan names nowhere get the usual expert styles (`_expert_styles`)."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return _expert_styles(model, dict(plan))
    merged: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    for key, style in base.items():
        merged[f"{prefix}.{key}" if prefix and hasattr(model, prefix) else key] = style
    merged.update(getattr(type(model), "_tp_plan", None) or {})
    return _expert_styles(model, merged)


def _expert_styles(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """`plan` with the expert TP styles transformers' MoE plans used to carry (packed_colwise gate_up_proj, rowwise
    down_proj, moe_tp_experts) for each stacked-experts module the plan has no key for: transformers 5.25 left them
    out of Qwen3-MoE's TP plan (its experts are in the EP plan only), and without them a TP model keeps every
    expert whole on every rank."""
    if not plan:
        return plan
    patterns = [_pattern(key) for key in plan]
    for name, module in model.named_modules():
        if not is_stacked_experts(module) or any(p.fullmatch(name) for p in patterns):
            continue
        key = re.sub(r"\.\d+(?=\.|$)", ".*", name)
        plan.update({f"{key}.gate_up_proj": "packed_colwise", f"{key}.down_proj": "rowwise", key: "moe_tp_experts"})
        patterns.append(_pattern(key))
    return plan


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def _split(t: torch.Tensor, dim: int, rank: int, world: int, group: str) -> tuple[torch.Tensor, ShardSpec]:
    start, size = chunk_bounds(t.shape[dim], world, rank)
    if size == 0:
        raise ValueError(f"cannot split {t.shape[dim]} rows over {world} ranks: rank {rank} would hold none")
    piece = t.detach().narrow(dim, start, size).clone()
    return piece, ShardSpec(dim % t.dim(), start, size, t.shape[dim], rank, world, group)


def _packed_split(t: torch.Tensor, dim: int, rank: int, world: int, group: str) -> tuple[torch.Tensor, ShardSpec]:
    half = t.shape[dim] // 2
    if t.shape[dim] % 2 or half % world:
        raise ValueError(f"packed gate/up rows {t.shape[dim]} do not split into 2 x {world} equal pieces")
    size = half // world
    gate = t.detach().narrow(dim, rank * size, size)
    up = t.detach().narrow(dim, half + rank * size, size)
    return torch.cat([gate, up], dim=dim), ShardSpec(dim % t.dim(), rank * size, 2 * size, t.shape[dim], rank,
                                                     world, group)


def _set_param(module: nn.Module, name: str, value: torch.Tensor, spec: ShardSpec) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value, requires_grad=bool(getattr(old, "requires_grad", False))))
    specs = dict(getattr(module, "moefx_shard", {}))
    specs[name] = spec
    module.moefx_shard = specs


def _wrap_forward(module: nn.Module, after: Any) -> None:
    """module.forward := after(module, original forward output) (an instance attribute, as transformers does)."""
    original = module.forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return after(self, original(*args, **kwargs))

    module.forward = types.MethodType(forward, module)


def _colwise(module: nn.Module, rank: int, world: int, group: str) -> None:
    _require(module, nn.Linear, "colwise")
    weight, spec = _split(module.weight, 0, rank, world, group)
    _set_param(module, "weight", weight, spec)
    if module.bias is not None:
        _set_param(module, "bias", *_split(module.bias, 0, rank, world, group))
    module.out_features = spec.size


def _rowwise(module: nn.Module, rank: int, world: int, group: str) -> None:
    _require(module, nn.Linear, "rowwise")
    weight, spec = _split(module.weight, 1, rank, world, group)
    _set_param(module, "weight", weight, spec)
    module.in_features = spec.size

    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x, self.weight), group)
        return out if self.bias is None else out + self.bias

    module.forward = types.MethodType(forward, module)


def _embedding_rowwise(module: nn.Module, rank: int, world: int, group: str) -> None:
    _require(module, nn.Embedding, "embedding_rowwise")
    weight, spec = _split(module.weight, 0, rank, world, group)
    _set_param(module, "weight", weight, spec)
    lo, n = spec.start, spec.size

    def forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        local = ids - lo
        mine = (local >= 0) & (local < n)
        rows = F.embedding(local.clamp(0, n - 1), self.weight)
        return all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype), group)

    module.forward = types.MethodType(forward, module)


def _colwise_gather_output(module: nn.Module, rank: int, world: int, group: str) -> None:
    _require(module, nn.Linear, "colwise_gather_output")
    full = module.out_features
    _colwise(module, rank, world, group)
    sizes = [chunk_bounds(full, world, r)[1] for r in range(world)]
    _wrap_forward(module, lambda self, local: all_gather_uneven(local, sizes, group))


def _moe_tp_experts(module: nn.Module, rank: int, world: int, group: str) -> None:
    _wrap_forward(module, lambda self, out: all_reduce(out, group))


def _experts_param(style: str, module: nn.Module, name: str, rank: int, world: int, group: str) -> None:
    t = getattr(module, name)
    if t.dim() != 3:
        raise ValueError(f"{style} on {name}: expected stacked experts [E, rows, cols], got shape {tuple(t.shape)}")
    transposed = bool(getattr(module, "is_transposed", False))
    if style == "packed_colwise":
        _set_param(module, name, *_packed_split(t, 2 if transposed else 1, rank, world, group))
    else:  # rowwise: split the input (intermediate) dim
        _set_param(module, name, *_split(t, 1 if transposed else 2, rank, world, group))


def _expert_parallel(module: nn.Module, rank: int, world: int, group: str) -> None:
    """Whole experts per rank; every rank runs its own on the whole batch, the other ranks' routes masked."""
    experts = module.gate_up_proj.shape[0]
    if experts % world:
        raise ValueError(f"cannot place {experts} experts evenly on {world} ranks")
    local = experts // world
    for name in ("gate_up_proj", "down_proj"):
        _set_param(module, name, *_split(getattr(module, name), 0, rank, world, group))
    module.num_experts = local
    module._is_expert_parallel = True  # transformers' experts forward then skips the off-rank sentinel id
    original = module.forward

    def forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        off_rank = (top_k_index // local) != rank
        index = torch.where(off_rank, torch.full_like(top_k_index, local), top_k_index % local)
        out = original(hidden, index, top_k_weights.masked_fill(off_rank, 0.0))
        return all_reduce(out, group)

    module.forward = types.MethodType(forward, module)


def _require(module: nn.Module, cls: type, style: str) -> None:
    if not isinstance(module, cls):
        raise ValueError(f"TP style {style!r} shards {cls.__name__} modules, got {type(module).__name__}")


_MODULE_STYLES = {
    "colwise": _colwise,
    "rowwise": _rowwise,
    "embedding_rowwise": _embedding_rowwise,
    "colwise_gather_output": _colwise_gather_output,
    "moe_tp_experts": _moe_tp_experts,
}


def shard_model(model: nn.Module, group: Any = None, *, experts: str = "tp") -> nn.Module:
    """Shard `model` in place over `group` (default: the world group) by its TP plan; see the module docstring.

    Every rank must call it on an identical model. Returns the model, with `model.moefx_sharding` set.
    """
    import torch.distributed as dist

    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"shard_model experts={experts!r} is invalid; valid choices: {list(EXPERT_LAYOUTS)}")
    if not dist.is_initialized():
        raise ValueError("shard_model needs an initialized torch.distributed process group")
    if getattr(model, "moefx_sharding", None) is not None:
        raise ValueError(f"{type(model).__name__} is already sharded: {model.moefx_sharding}")
    name = group_name(group)
    pg = None if group is None or isinstance(group, str) else group
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    plan = model_tp_plan(model)
    if not plan:
        raise ValueError(f"{type(model).__name__} has no TP plan (no tp_plan / base_model_tp_plan)")
    unknown = sorted({s for s in plan.values() if s not in STYLES})
    if unknown:
        raise ValueError(f"TP plan of {type(model).__name__} names styles {unknown}; shard_model implements {STYLES}")
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    expert_names = [n for n, m in modules.items() if is_stacked_experts(m)] if experts == "ep" else []
    counts: dict[str, int] = {}
    for key, style in plan.items():
        pattern = _pattern(key)
        for target in [n for n in (*modules, *params) if pattern.fullmatch(n)]:
            if any(target == e or target.startswith(e + ".") for e in expert_names):
                continue  # expert-parallel placement replaces the TP rules on the experts
            if target in params:
                owner, _, attr = target.rpartition(".")
                if style in REPLICATED:
                    continue
                if style not in ("packed_colwise", "rowwise") or not is_stacked_experts(modules[owner]):
                    raise ValueError(f"TP style {style!r} on parameter {target}: only stacked expert weights are "
                                     f"sharded per parameter")
                _experts_param(style, modules[owner], attr, rank, world, name)
            elif style not in REPLICATED:
                if style == "packed_colwise":
                    raise ValueError(f"TP style 'packed_colwise' on module {target}: expected a parameter")
                _MODULE_STYLES[style](modules[target], rank, world, name)
            counts[style] = counts.get(style, 0) + 1
    for target in expert_names:
        _expert_parallel(modules[target], rank, world, name)
    if expert_names:
        counts["ep_dispatch_experts (all_reduce)"] = len(expert_names)
    ep = world if experts == "ep" else 1
    model.moefx_sharding = Sharding(world, rank, ep, rank if ep > 1 else 0, name, experts,
                                    tuple(sorted(counts.items())))
    return model
