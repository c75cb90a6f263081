"""`moefx.quantize(model, "fp8_block128" | "int8" | config)`: swap linears and experts for quantized ones.

torchao-style: a config dataclass per scheme, and one registered handler per config type that turns a
module into its quantized replacement (or leaves it). Skipped by default: `lm_head` and routers/gates
(their outputs pick experts and tokens, where quantization error changes decisions), configurable.
`load_fp8_checkpoint` loads the DeepSeek-V3 / Qwen3-FP8 release layout (`x.weight` float8_e4m3fn +
`x.weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)], experts either fused 3-D or one linear per expert).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moefx.facts.weights import is_stacked_experts
from moefx.log import get_logger, warn_once
from moefx.ops.quant import QuantScheme
from moefx.quant_linear import (
    Fp8BlockExperts,
    Fp8BlockLinear,
    Int8Experts,
    Int8Linear,
    experts_unsupported_reason,
)

log = get_logger("moefx.quantize")
DEFAULT_SKIP = ("lm_head", "gate", "router")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
QUANTIZED_MODULES = (Fp8BlockLinear, Fp8BlockExperts, Int8Linear, Int8Experts)


@dataclass(frozen=True)
class QuantizeConfig:
    """Shared options. `skip`: a module is left alone when any dot-separated component of its name is in
    `skip` (so "gate" skips `mlp.gate` but not `mlp.gate_proj`). `experts`: also quantize 3-D experts."""

    skip: tuple[str, ...] = DEFAULT_SKIP
    experts: bool = True

    def quantization_config(self) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class Fp8BlockConfig(QuantizeConfig):
    """FP8 e4m3 weights per `block_shape` block (`weight_scale_inv` layout), activations per token and
    group of block_shape[1] with fp32 scales."""

    block_shape: tuple[int, int] = (128, 128)
    act_eps: float = 1e-10

    def act_scheme(self) -> QuantScheme:
        return QuantScheme("fp8_group", self.block_shape[1], self.act_eps)

    def quantization_config(self) -> dict[str, Any]:
        """The `quantization_config` of a DeepSeek-V3 / Qwen3-FP8 release with this layout."""
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block_shape)}


@dataclass(frozen=True)
class Int8Config(QuantizeConfig):
    """INT8 weights per output channel, activations per token (scale = amax / 127, round half to even)."""

    def quantization_config(self) -> dict[str, Any]:
        return {"quant_method": "w8a8_int8"}


SCHEMES: dict[str, Callable[[], QuantizeConfig]] = {
    "fp8_block128": lambda: Fp8BlockConfig(block_shape=(128, 128)),
    "int8": Int8Config,
}

Handler = Callable[[str, nn.Module, Any], "nn.Module | None"]
_HANDLERS: dict[type, Handler] = {}


def register_quantize_handler(config_type: type) -> Callable[[Handler], Handler]:
    """Register `fn(name, module, config) -> replacement | None` as the handler of `config_type`."""

    def deco(fn: Handler) -> Handler:
        if config_type in _HANDLERS:
            raise ValueError(f"a quantize handler for {config_type.__name__} is registered twice")
        _HANDLERS[config_type] = fn
        return fn

    return deco


def _skipped(name: str, config: QuantizeConfig) -> bool:
    return any(part in config.skip for part in name.split("."))


def _float_weights(name: str, *weights: torch.Tensor) -> bool:
    if all(w.dtype in FLOAT_DTYPES for w in weights):
        return True
    warn_once(f"moefx.quantize: {name!r} left alone: weights are {weights[0].dtype} (already quantized?)")
    return False


def _linear_ok(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and _float_weights(name, module.weight)


def _experts_ok(name: str, module: nn.Module, config: QuantizeConfig) -> bool:
    if not config.experts or not _float_weights(name, module.gate_up_proj, module.down_proj):
        return False
    reason = experts_unsupported_reason(module)
    if reason is not None:
        warn_once(f"moefx.quantize: experts module {name!r} left unquantized: {reason}")
        return False
    return True


@register_quantize_handler(Fp8BlockConfig)
def _fp8_block(name: str, module: nn.Module, config: Fp8BlockConfig) -> nn.Module | None:
    if _linear_ok(name, module):
        return Fp8BlockLinear.from_linear(module, config.block_shape, config.act_scheme())
    if is_stacked_experts(module) and _experts_ok(name, module, config):
        return Fp8BlockExperts.from_experts(module, config.block_shape)
    return None


@register_quantize_handler(Int8Config)
def _int8(name: str, module: nn.Module, config: Int8Config) -> nn.Module | None:
    if _linear_ok(name, module):
        return Int8Linear.from_linear(module)
    if is_stacked_experts(module) and _experts_ok(name, module, config):
        return Int8Experts.from_experts(module)
    return None


def resolve_config(config: str | QuantizeConfig) -> QuantizeConfig:
    if isinstance(config, QuantizeConfig):
        if type(config) not in _HANDLERS:
            raise ValueError(f"no quantize handler for {type(config).__name__}; registered: "
                             f"{sorted(t.__name__ for t in _HANDLERS)}")
        return config
    if config not in SCHEMES:
        raise ValueError(f"quantization scheme {config!r} is invalid; valid choices: {sorted(SCHEMES)}")
    return SCHEMES[config]()


def _scheme_name(cfg: QuantizeConfig) -> str:
    """The SCHEMES name a config equals, else its repr (a custom config)."""
    return next((repr(name) for name, make in SCHEMES.items() if make() == cfg), repr(cfg))


StorageKey = tuple[str, int]


def _storage(t: torch.Tensor) -> StorageKey | None:
    """Where a tensor's memory lives (device, storage address), or None for one without its own memory."""
    if t.numel() == 0 or t.is_meta:
        return None
    try:
        return str(t.device), t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage: never released
        return None


def _slots(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every parameter and buffer of `module`'s subtree as (owner, name, tensor), each module once."""
    return [(m, name, t) for m in module.modules()
            for name, t in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False))]


def _release(t: torch.Tensor) -> None:
    """Drop `t`'s memory now: it becomes an empty tensor of its dtype and device, whoever still holds it."""
    t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def _replace(model: nn.Module, places: list[str], module: nn.Module, new: nn.Module,
             owners: Counter[StorageKey | None], used_elsewhere: bool) -> None:
    """Put `new` at every place `module` sat, then release the memory of `module`'s tensors that nothing left in
    the model holds (not a tied weight kept by another module, not reused by `new`)."""
    for name in places:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    kept = Counter(_storage(t) for *_, t in _slots(new))
    old = _slots(module)
    owners.subtract(_storage(t) for *_, t in old)
    owners.update(kept)
    if used_elsewhere:  # a submodule also sits outside `module`: its tensors stay where it is used
        return
    for *_, t in old:
        key = _storage(t)
        if key is not None and owners[key] <= 0 and key not in kept:
            _release(t)


def _used_elsewhere(module: nn.Module, names: list[str], places: dict[int, list[str]]) -> bool:
    """Whether a submodule of `module` (sitting at `names`) also sits in the model outside it (`places`: every
    module's names, by id, taken before anything was replaced)."""
    inside = tuple(f"{n}." for n in names)
    return any(not place.startswith(inside) for m in module.modules() if m is not module
               for place in places.get(id(m), ()))


def quantize(model: nn.Module, config: str | QuantizeConfig = "fp8_block128") -> nn.Module:
    """Replace, in place, every linear and experts module the config's handler takes (except skipped
    names); returns the model with `moefx_quantization` set to the config and, for a transformers model
    without one, `config.quantization_config` describing the result (so signatures and plans see it).

    One module at a time: its weights are quantized a bounded slice at a time straight into the replacement,
    the replacement takes the module's place (every place, where one module sits under several names), and the
    replaced module's float tensors are released at once -- emptied to size 0, so that a reference held
    elsewhere (a hook, a variable, a list of modules) cannot keep them. A tensor the rest of the model still
    uses (a weight tied to an unquantized module) is kept. Peak memory is the float model plus one module's
    quantized copy and the slices' temporaries, never the float model plus the whole quantized one.

    A model is quantized once: the same config again returns it unchanged, another one raises (its modules
    already hold the first format, which a second pass would neither convert nor describe)."""
    cfg = resolve_config(config)
    previous = getattr(model, "moefx_quantization", None)
    if previous is not None:
        if previous == cfg:
            log.info("quantize: %s is already quantized with %s; unchanged", type(model).__name__, previous)
            return model
        raise ValueError(f"moefx.quantize: the model is already quantized with {_scheme_name(previous)}; it cannot "
                         f"be re-quantized to {_scheme_name(cfg)} (quantize a fresh copy of the unquantized model)")
    handler = _HANDLERS[type(cfg)]
    # Names only from here on: a list of the modules themselves would keep every replaced original alive.
    places: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if name:
            places.setdefault(id(m), []).append(name)
    owners = Counter(_storage(t) for *_, t in _slots(model))
    replaced: set[str] = set()
    count = 0
    for names in list(places.values()):
        name = names[0]
        parts = name.split(".")
        if any(".".join(parts[:i]) in replaced for i in range(1, len(parts))) or _skipped(name, cfg):
            continue  # inside a module replaced already, or skipped
        module = model.get_submodule(name)
        if isinstance(module, QUANTIZED_MODULES):
            continue
        new = handler(name, module, cfg)
        if new is None:
            continue
        _replace(model, names, module, new, owners, _used_elsewhere(module, names, places))
        replaced.update(names)
        count += 1
        del module, new
    log.info("quantize: %d module(s) replaced with %s", count, type(cfg).__name__)
    model.moefx_quantization = cfg
    config = getattr(model, "config", None)
    if count and config is not None and getattr(config, "quantization_config", None) is None:
        # What the signatures read: the plan then knows activations are quantized dynamically.
        config.quantization_config = cfg.quantization_config()
    return model


# ------------------------------------------------------------------------------ FP8 checkpoint loading

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                         r"\.(?P<kind>weight|weight_scale_inv)$")


def _fuse_expert_keys(sd: dict[str, torch.Tensor], block_n: int) -> dict[str, torch.Tensor]:
    """Per-expert 2-D linears (`experts.{e}.gate_proj.weight` ...) -> the fused 3-D layout
    (`experts.gate_up_proj` [E, 2I, H] with gate rows first, `experts.down_proj` [E, H, I], `*_scale_inv`)."""
    groups: dict[str, dict[tuple[str, str], dict[int, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        m = _PER_EXPERT.match(key)
        if m is None:
            out[key] = value
            continue
        groups.setdefault(m["prefix"], {}).setdefault((m["proj"], m["kind"]), {})[int(m["e"])] = value
    for prefix, parts in groups.items():
        def stack(proj: str, kind: str, prefix: str = prefix, parts: dict = parts) -> torch.Tensor:
            per = parts.get((proj, kind))
            if per is None or sorted(per) != list(range(len(per))):
                raise ValueError(f"checkpoint experts {prefix!r}: {proj}.{kind} missing or not numbered 0..E-1")
            return torch.stack([per[e] for e in range(len(per))])

        gate_w, up_w = stack("gate_proj", "weight"), stack("up_proj", "weight")
        if gate_w.shape[1] % block_n:
            raise ValueError(f"checkpoint experts {prefix!r}: intermediate size {gate_w.shape[1]} is not a multiple "
                             f"of block {block_n}, so gate and up scales cannot be concatenated")
        out[f"{prefix}.gate_up_proj"] = torch.cat([gate_w, up_w], dim=1)
        out[f"{prefix}.gate_up_proj_scale_inv"] = torch.cat(
            [stack("gate_proj", "weight_scale_inv"), stack("up_proj", "weight_scale_inv")], dim=1)
        out[f"{prefix}.down_proj"] = stack("down_proj", "weight")
        out[f"{prefix}.down_proj_scale_inv"] = stack("down_proj", "weight_scale_inv")
    return out


def load_fp8_checkpoint(
    model: nn.Module,
    source: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    config: Fp8BlockConfig | None = None,
    strict: bool = True,
) -> nn.Module:
    """Quantize `model`'s structure to FP8 blocks (if not done yet) and load a DeepSeek-V3 / Qwen3-FP8
    layout state dict or `.safetensors` file into it. Linears absent from the checkpoint's quantized keys
    (e.g. `lm_head`) load as plain weights; a shape or dtype mismatch raises."""
    cfg = config or Fp8BlockConfig()
    if isinstance(source, Mapping):
        sd = dict(source)
    else:
        from safetensors.torch import load_file

        sd = load_file(os.fspath(source))
    sd = _fuse_expert_keys(sd, cfg.block_shape[0])
    if not isinstance(getattr(model, "moefx_quantization", None), Fp8BlockConfig):
        quantize(model, cfg)
    own = model.state_dict()
    for key, value in sd.items():
        if key in own and (own[key].shape != value.shape or own[key].dtype != value.dtype):
            raise ValueError(f"checkpoint tensor {key!r} is {tuple(value.shape)}/{value.dtype}, the quantized model "
                             f"expects {tuple(own[key].shape)}/{own[key].dtype}")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if strict and (missing or unexpected):
        raise ValueError(f"FP8 checkpoint does not fit the model: missing {sorted(missing)[:8]}, "
                         f"unexpected {sorted(unexpected)[:8]}")
    return model
