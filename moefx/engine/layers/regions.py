"""One compiled region per distinct decoder layer: compile time that does not grow with depth.

Dynamo inlines every decoder layer of a transformers model and specializes each on its cache: the attention
calls `cache.update(k, v, self.layer_idx)`, which picks `cache.layers[layer_idx]`, so each layer is traced,
lowered and code-generated again although all run the same code on same-shaped weights. `install_layer_regions`
gives each decoder layer a forward that, while torch.compile traces it, calls the layer through a
`torch.compiler.nested_compile_region` with that layer's cache state as explicit tensor arguments:

- a StaticLayer (the engine's decode step): its keys, values and write position go in; the region writes the
  new keys and values in place (the view's `update`, the same index_copy_ at `cumulative_length` as
  transformers' StaticLayer), so it mutates its inputs and returns only the hidden states;
- an empty DynamicLayer (the engine's prefill): the region returns the new keys and values next to the hidden
  states, and they are appended to the real cache outside it (for an empty layer the update only stores them).

Inside the region the layer sees a one-layer cache view that ignores `layer_idx` (`layer_body.py`), so the
traced body is the same for every layer: dynamo traces it once and stamps out the rest (torch >= 2.12; earlier
versions trace each call and deduplicate identical bodies, which the plan says: on the H200's torch 2.11 tracing
48 layers twice took ~29 s of a warm start, docs/FINDINGS.md), AOTAutograd and inductor compile it once, and the
moefx post-grad passes run on it like on any graph. Any other case — eager calls, other cache layers (sliding window, a
DynamicLayer that already holds tokens), no cache — runs the layer's own forward unchanged.

`frames=True` (config `layer_regions: frames`, and `auto` on a torch without region reuse) keeps the layers out
of the step's trace instead: once a compiled engine binds them, each layer call is one opaque op that runs a body
the engine compiled apart (`frames.py`); until then the region is used.

What is lost: inductor does not fuse across the region boundary, so a layer's last residual add and the next
layer's input RMSNorm are separate kernels (in one inlined graph they fuse into one). `decode=False` keeps the
regions to the prefill, so the decode step (replayed from a CUDA graph every token) keeps that fusion.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from moefx.engine.layers.frames import LayerFrames
from moefx.engine.layers.layer_body import LayerCalls, own_body, records_grad, shared_kind, static_tensors

_CACHE_NAMES = ("cache", "past_key_values")


def _reuses_regions() -> bool:
    """Whether this torch stamps out a traced region body instead of tracing every call again (torch >= 2.12,
    the release that gave nested_compile_region its reuse limit)."""
    try:
        return "max_reuse_entries" in inspect.signature(torch.compiler.nested_compile_region).parameters
    except (TypeError, ValueError):
        return False


def _region_kwargs(layers: int) -> dict[str, Any]:
    """nested_compile_region's reuse limit, where this torch has one: room for one entry per layer, so a model
    whose layers all differ compiles as before instead of failing."""
    return {"max_reuse_entries": layers + 1} if _reuses_regions() else {}


class _Region(LayerCalls):
    """The decoder layers' calls through one nested compile region, traced inside the step."""

    def __init__(self, layers: int) -> None:
        self.region = torch.compiler.nested_compile_region(own_body(), **_region_kwargs(layers))

    def body(self, kind: str) -> Callable[..., Any]:
        return self.region


def _region_forward(region: _Region, frames: LayerFrames | None, decode: bool, index: int, layer: torch.nn.Module,
                    hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """A decoder layer's forward: while compiling, through the shared compiled code (an engine's compiled frames
    where it bound them, else the nested region) when its cache layer is one the views reproduce; the layer's own
    forward otherwise."""
    if not torch.compiler.is_compiling() or records_grad(layer, hidden_states):
        return type(layer).forward(layer, hidden_states, *args, **kwargs)
    shared = frames if frames is not None and frames.bound else region
    return _dispatch(shared, decode, index, layer, hidden_states, args, kwargs)


def _dispatch(shared: LayerCalls, decode: bool, index: int, layer: torch.nn.Module,
              hidden_states: torch.Tensor, args: tuple, kwargs: dict[str, Any]) -> Any:
    """`shared.decode` for an initialized StaticLayer (with `decode`), `shared.prefill` for an empty DynamicLayer,
    the layer's own forward for any other cache layer."""
    forward = type(layer).forward
    name = next((n for n in _CACHE_NAMES if n in kwargs), None)
    cache = kwargs.get(name) if name else None
    layers = getattr(cache, "layers", None)
    if layers is None or index >= len(layers):
        return forward(layer, hidden_states, *args, **kwargs)
    kind = shared_kind(layers[index], decode)
    rest = {k: v for k, v in kwargs.items() if k != name}
    if kind == "decode":
        static = static_tensors(cache, index)
        return shared.decode(cache, index, layer, hidden_states, name, static, args, rest)
    if kind == "prefill":
        return shared.prefill(cache, index, layer, hidden_states, name, (), args, rest)
    return forward(layer, hidden_states, *args, **kwargs)


def decoder_layers(model: Any) -> list[torch.nn.Module] | None:
    """The decoder layer stack of a transformers causal LM (`model.model.layers`), or None."""
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
        return list(layers)
    return None


def why_no_regions(model: Any) -> str | None:
    """Why the decoder layers of `model` cannot share compiled regions (None: they can)."""
    if not hasattr(torch.compiler, "nested_compile_region"):
        return f"torch {torch.__version__} has no torch.compiler.nested_compile_region"
    layers = decoder_layers(model)
    if layers is None:
        return "no decoder layer stack (model.model.layers) found"
    for index, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if getattr(attn, "layer_idx", None) != index:
            return f"layer {index} has no self_attn.layer_idx == {index} (its cache is not indexed the known way)"
    if len(layers) < 2:
        return "one decoder layer (nothing to share)"
    return None


def _why_no_stack(model: Any, layers: list[torch.nn.Module]) -> str | None:
    """Why this model's decoder layer calls never run as one stack op (None: a step's calls may, `frames.py`): the
    loop calls fewer layers than the stack holds, or gives layers of different attention types their own masks."""
    config = getattr(model, "config", None)
    count = getattr(config, "num_hidden_layers", len(layers))
    if count != len(layers):
        return f"the model calls {count} of its {len(layers)} decoder layers"
    types = set(getattr(config, "layer_types", None) or ())
    if len(types) > 1:
        return f"layers of different attention types ({', '.join(sorted(map(str, types)))}) get masks of their own"
    return None


def install_layer_regions(model: Any, decode: bool = True, frames: bool = False) -> list[str]:
    """Route every decoder layer of `model` through one nested compile region (in the prefill, and with `decode`
    in the static-cache decode step too), or with `frames` through compiled frames of their own once an engine
    binds them (`layer_frames`); returns what was done."""
    why = why_no_regions(model)
    if why is not None:
        return [f"decoder layers compiled inline: {why}"]
    layers = decoder_layers(model)
    region = _Region(len(layers))
    stack_off = _why_no_stack(model, layers)
    hook = LayerFrames(layers, region, stack_off) if frames else None
    for index, layer in enumerate(layers):
        layer.forward = functools.partial(_region_forward, region, hook, decode, index, layer)
    model._moefx_layer_frames = hook
    kinds = sorted({type(layer).__name__ for layer in layers})
    where = "prefill and decode step" if decode else "prefill only; the decode step inlines them"
    if frames:
        stack = (f"one op per layer call ({stack_off})" if stack_off else
                 "one op for the whole stack where every layer call of a step gets the same arguments (else one op "
                 "per layer call, said once in a warning)")
        return [f"decoder layers ({len(layers)} x {', '.join(kinds)}) compiled as frames of their own ({where}): "
                f"in the engine's traced steps the layers run as {stack}, each layer through a body compiled once "
                f"per kind of call (prefill, decode); across a layer boundary a layer's last residual add and the "
                f"next layer's input norm are two kernels; until a compiled engine binds them, one nested region is "
                f"used"]
    notes = [f"decoder layers ({len(layers)} x {', '.join(kinds)}) compiled as one nested region per distinct "
             f"layer graph ({where}); across a region boundary a layer's last residual add and the next layer's "
             f"input norm are two kernels"]
    if not _reuses_regions():
        notes.append(f"torch {torch.__version__} traces every layer's region call again (reuse of a traced body "
                     f"needs torch >= 2.12): inductor compiles one body, but tracing still grows with depth "
                     f"(docs/FINDINGS.md)")
    return notes


def layer_frames(model: Any) -> LayerFrames | None:
    """The compiled-frame hook `install_layer_regions(..., frames=True)` left on `model`, for the engine to bind."""
    return getattr(model, "_moefx_layer_frames", None)


def layer_regions_transform(model: Any, plan: Any, config: Any) -> list[str]:
    if getattr(config, "mode", "compile") == "eager":
        return ["decoder layers: no compiled regions (mode eager)"]
    scope = getattr(config, "layer_regions", "all")
    if scope == "none":
        return ["decoder layers compiled inline (config layer_regions: none)"]
    offload = getattr(plan, "offload", None)
    if offload is not None and getattr(offload, "experts", "gpu") == "cpu":
        # Offloaded experts keep per-layer host state that the region's guards would see; not proven shared.
        return ["decoder layers compiled inline: experts are offloaded (regions not proven with offload)"]
    notes = []
    if scope == "auto":
        scope = "all" if _reuses_regions() else "frames"
        notes.append(f"layer_regions auto = {scope}: " + (
            "this torch reuses a traced region body" if scope == "all" else
            f"torch {torch.__version__} traces every nested region call again (reuse needs torch >= 2.12); frames "
            f"trace once per kind of call, not once per layer (docs/FINDINGS.md)"))
    return notes + install_layer_regions(model, decode=scope in ("all", "frames"), frames=scope == "frames")
