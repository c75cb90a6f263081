"""A decoder layer's forward as one shared body over a one-layer view of its cache, whatever its layer index.

Dynamo specializes each decoder layer of a transformers model on its `layer_idx` (the attention calls
`cache.update(k, v, self.layer_idx)`), so every layer is traced again. `layer_body` runs the layer's own forward
against a view that ignores the index: a StaticLayer's tensors (the engine's decode step; written in place, as
transformers' StaticLayer does), an empty DynamicLayer (the prefill; the new keys and values are returned, to be
stored outside), or a static cache's keys and values for a padded prefill to write its prompt into (`into`: the
write is part of the compiled body, so inductor stores the keys where their norm and rotary kernel computes them,
and attention reads them there). The nested region (`regions.py`) and the compiled frames (`frames.py`) call it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch


class _StaticLayerView:
    """One StaticLayer's tensors as a cache: the update transformers' StaticLayer does, whatever the layer index."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor, advance: bool = True) -> None:
        self.keys, self.values, self.length, self.advance = keys, values, length, advance

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(key_states.shape[-2], device=key_states.device) + self.length
        if self.advance:
            self.length.add_(key_states.shape[-2])
        self.keys.index_copy_(2, positions, key_states)
        self.values.index_copy_(2, positions, value_states)
        return self.keys, self.values


class _EmptyLayerView:
    """An empty DynamicLayer as a cache: the update returns the new states (and keeps them for the region)."""

    def __init__(self) -> None:
        self.states: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.states = (key_states, value_states)
        return key_states, value_states


class _PrefillIntoView:
    """A static layer's keys and values [rows, KV heads, length, head dim] as the cache of a prefill over a prompt
    padded to n <= length positions, `keep` [n] bool the real ones: the new states go to positions [0, n), zeros
    where `keep` is False (the cache is zero past what a prefill writes, `Slot.prepare_write`), and attention reads
    them from there (causal: a real position never sees the zeroed padding after it)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor) -> None:
        self.keys, self.values, self.keep = keys, values, keep

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.keep.shape[0]
        keep = self.keep[:, None]  # broadcast over [rows, KV heads, n, head dim]
        for static, new in ((self.keys, key_states), (self.values, value_states)):
            static[:, :, :n].copy_(torch.where(keep, new, 0))
        return self.keys[:, :, :n], self.values[:, :, :n]


def layer_body(layer: torch.nn.Module, hidden: torch.Tensor, cache_name: str, static: tuple[torch.Tensor, ...],
               args: tuple, kwargs: dict[str, Any], advance: bool = True,
               into: bool = False) -> tuple[torch.Tensor, ...]:
    """The layer's own forward over a one-layer view of its cache; `advance=False` leaves a static layer's write
    position for the caller to advance; `into`: `static` is (keys, values, keep) for a padded prefill to write
    its prompt into (`_PrefillIntoView`), and only the output is returned."""
    if into:
        view: Any = _PrefillIntoView(*static)
    else:
        view = _StaticLayerView(*static, advance) if static else _EmptyLayerView()
    out = type(layer).forward(layer, hidden, *args, **{cache_name: view}, **kwargs)
    if static:
        return (out,)
    keys, values = view.states
    return out, keys, values


# The attribute of a cache whose StaticLayers' keys, values and write positions are views of one tensor per kind
# (`stack_cache_layers`, moefx/engine/slots.py): (keys [layers, rows, KV heads, length, head dim], values likewise,
# write positions [layers]).
KV_BUFFERS = "moefx_kv_buffers"
# The attribute of a prefill's (empty) cache that names where the prompt's keys and values go instead: (the keys
# buffer, the values buffer, keep [n] bool), the buffers as `KV_BUFFERS` (moefx/engine/prefill.py). The compiled
# frames' stack op writes them in its layer bodies; every other path ignores it and fills the cache as usual.
PREFILL_INTO = "moefx_prefill_into"


def kv_buffers(cache: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The cache's (keys, values, write positions) buffers its layers are views of, or None (a cache the engine did
    not make, or one whose layers could not share them)."""
    return getattr(cache, KV_BUFFERS, None)


def prefill_into(cache: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Where a prefill over `cache` may write the prompt's keys and values (`PREFILL_INTO`), or None."""
    return getattr(cache, PREFILL_INTO, None)


def static_tensors(cache: Any, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer `index`'s keys, values and write position, taken from the cache's buffers where it has them: a traced
    step that reads the buffers must not also read a layer's own view of them (graph inputs that alias, one of them
    mutated, make AOTAutograd build synthetic bases), so it indexes them in the graph."""
    buffers = kv_buffers(cache)
    if buffers is not None:
        return buffers[0][index], buffers[1][index], buffers[2][index]
    entry = cache.layers[index]
    return entry.keys, entry.values, entry.cumulative_length


def own_body() -> Callable[..., Any]:
    """`layer_body` with a code object of its own: dynamo keys compiled code and region reuse by code object, so
    two models (each with its own reuse limit, its own backend) do not share entries."""
    code = layer_body.__code__.replace()
    return types.FunctionType(code, layer_body.__globals__, layer_body.__name__, layer_body.__defaults__)


def shared_kind(entry: Any, decode: bool) -> str | None:
    """Which shared body takes a layer whose cache layer is `entry`: "decode" for an initialized StaticLayer (with
    `decode`), "prefill" for an empty DynamicLayer, None for any other (the layer's own forward runs)."""
    kind = type(entry).__name__
    if decode and kind == "StaticLayer" and getattr(entry, "is_initialized", False):
        return "decode"
    if kind == "DynamicLayer" and not getattr(entry, "is_initialized", True):
        return "prefill"
    return None


def records_grad(layer: torch.nn.Module, hidden_states: torch.Tensor) -> bool:
    """Whether autograd records this layer call (a training step through the compiled forward). The shared bodies
    are for inference: a compiled frame is an op without a backward, and the nested region's backward gives other
    gradients than the layer's own (torch 2.13, tests/test_forward_fast_path.py); such a call is inlined. dynamo
    guards on the grad mode and the requires_grad flags it reads, so inference traces keep the shared bodies."""
    if not torch.is_grad_enabled():
        return False
    return hidden_states.requires_grad or any(p.requires_grad for p in layer.parameters())


class LayerCalls:
    """A decoder layer call through a shared body (`body(kind)`): the decode step's body writes its cache layer in
    place and returns the hidden states; the prefill's returns the new keys and values too, stored here. Both get
    the whole cache and the layer's index first (the compiled frames read the other layers' cache layers)."""

    def body(self, kind: str) -> Callable[..., Any]:
        raise NotImplementedError

    def decode(self, cache: Any, index: int, *args: Any) -> torch.Tensor:
        (out,) = self.body("decode")(*args)
        return out

    def prefill(self, cache: Any, index: int, *args: Any) -> torch.Tensor:
        out, keys, values = self.body("prefill")(*args)
        cache.update(keys, values, index)
        return out
