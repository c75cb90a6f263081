"""`moefx.optimize`: resolve the plan for a model, apply its model transforms, compile its forward.

A model transform is `fn(model, plan, config) -> list[str]`: it rewrites the model where the plan says so and
returns the decisions it applied, which land in the plan's provenance (`explain()` shows them) under its name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moefx.compile import backend, with_exact_floats
from moefx.config import CompilationConfig
from moefx.facts import ExecutionSignature, ModelSignature
from moefx.log import get_logger, warn_once
from moefx.planner import resolve

log = get_logger("moefx.optimize")

TransformFn = Callable[[Any, Any, Any], list[str]]


@dataclass(frozen=True)
class ModelTransform:
    name: str  # the prefix of its provenance lines
    fn: TransformFn
    after: tuple[str, ...] = ()  # transforms that must run before this one (each with its reason at the tuple)


def model_transforms() -> tuple[ModelTransform, ...]:
    """Every model transform, in the order `optimize` applies them (their modules load on first use, as the engine
    and the transformers integrations are not needed to import moefx)."""
    from moefx.backends import BACKENDS
    from moefx.engine.install import install_engine
    from moefx.engine.layers.regions import layer_regions_transform
    from moefx.integrations.attention import use_moefx_attention
    from moefx.integrations.transformers import use_moefx_experts
    from moefx.offload.transform import apply_offload
    from moefx.parallel.transform import install_vocab_parallel_head

    return (
        ModelTransform("offload", functools.partial(apply_offload, backends=BACKENDS)),
        ModelTransform("moe_experts", use_moefx_experts),
        ModelTransform("attention", use_moefx_attention),
        ModelTransform("vocab_parallel_lm_head", install_vocab_parallel_head),
        ModelTransform("layer_regions", layer_regions_transform),
        # after layer_regions: the engine binds the compiled-frame hook that transform leaves on the model; last, as
        # it takes the model's forward as the other transforms leave it (`optimize` compiles that forward after)
        ModelTransform("engine", install_engine, after=("layer_regions",)),
    )


def optimize(model: Any = None, *, config: Any = None) -> Any:
    """Optimize an `nn.Module` instance, or decorate an `nn.Module` class (compiles on first call).

    Usable as `optimize(model)`, `optimize(model, config=cfg)`, `@optimize` and `@optimize(config=cfg)`.
    """
    if model is None:
        return functools.partial(optimize, config=config)
    if isinstance(model, type):
        if not issubclass(model, torch.nn.Module):
            raise ValueError(f"moefx.optimize decorates nn.Module classes, got class {model.__name__}")
        return _decorate_class(model, CompilationConfig.from_any(config))
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"moefx.optimize takes an nn.Module or an nn.Module class, got {type(model).__name__}")
    return _optimize_instance(model, CompilationConfig.from_any(config))


def _first_param(model: torch.nn.Module) -> torch.Tensor | None:
    return next(iter(model.parameters()), None)


def _optimize_instance(model: torch.nn.Module, cfg: CompilationConfig) -> torch.nn.Module:
    if getattr(model, "moefx_plan", None) is not None:
        warn_once(f"{type(model).__name__} was already optimized by moefx; returning it unchanged")
        return model
    param = _first_param(model)
    device = param.device if param is not None else None
    es = ExecutionSignature.detect(
        device=device,
        mode=cfg.mode,
        max_batch_size=cfg.max_batch_size,
        dtype=param.dtype if param is not None else None,
        model=model,
    )
    plan = resolve(ModelSignature.from_module(model), es, cfg)
    uncalibrated = uncalibrated_calls(plan)
    if uncalibrated:
        warn_once(f"moefx: no calibration rows for this model on {es.device_name}: {', '.join(uncalibrated)} run "
                  f"the upstream path (Plan.explain() lists each); `moefx calibrate --model {_model_spec(model)}` "
                  "measures this device once, and later optimize() calls use its rows")
    for transform in model_transforms():
        applied = transform.fn(model, plan, cfg)
        plan.provenance.extend(f"{transform.name}: {line}" for line in applied)
    if cfg.mode != "eager":
        # A model whose generate() runs on moefx's engine gets its decode graphs from the engine; its own
        # forward (direct calls, transformers' loop for other requests) is compiled without CUDA graphs.
        graphs = False if hasattr(model, "moefx_generate") else None
        compiled = torch.compile(model.forward, backend=backend(cfg, plan, cudagraphs=graphs), dynamic=cfg.dynamic)
        plain = with_exact_floats(compiled)
        # The engine's forward front (moefx/engine/forward.py) runs the calls that fit its padded prefill, the
        # compiled forward the rest.
        front = getattr(model, "moefx_forward", None)
        model.forward = plain if front is None else front.route(plain)
    model.moefx_plan = plan
    log.info("optimized %s\n%s", type(model).__name__, plan.explain())
    return model


def uncalibrated_calls(plan: Any) -> list[str]:
    """The calls that stay on the upstream path on a CUDA device only because no calibration row (shipped or the
    user's) matches them: MoE experts and dense projections whose backend is `auto` and found no row. Empty where
    the device is not CUDA or a backend was chosen by config or env."""
    if plan.execution.device_type != "cuda":
        return []
    def no_row(policies: dict[str, Any]) -> bool:
        return bool(policies) and all(p.source.startswith("no calibration row") for p in policies.values())

    missing = []
    if plan.moe is not None and plan.moe.backend == "auto" and no_row(plan.moe.policies):
        missing.append("MoE experts")
    if plan.dense is not None and plan.dense.backend == "auto":
        missing += [f"dense {e.label}" for e in plan.dense.entries if no_row(e.policies)]
    return missing


def _model_spec(model: torch.nn.Module) -> str:
    """What `moefx calibrate --model` takes for this model: its hub id or folder when transformers recorded one."""
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "")
    return str(name) if name else "<hub id or config folder>"


def _decorate_class(cls: type, cfg: CompilationConfig) -> type:
    original_forward = cls.forward

    @functools.wraps(original_forward)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        # First call on this instance: bind the original forward, optimize, then run the compiled one.
        self.forward = original_forward.__get__(self)
        _optimize_instance(self, cfg)
        return self.forward(*args, **kwargs)

    cls.forward = forward
    return cls
