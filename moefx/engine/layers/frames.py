"""Decoder layer calls as opaque ops of the traced step, each running one body the engine compiled apart.

With config `layer_regions: frames` (the default where torch traces every nested region call again, < 2.12),
a compiled engine binds `LayerFrames`: while its prefill or decode step is traced, each decoder layer call
becomes one `moefx::layer_prefill` or `moefx::layer_decode` op with the layer's tensors as arguments and the
layer index as a constant. Dynamo never traces the layer there, so the step is traced once whatever the depth
and stays one graph (a graph break would do as much, but transformers calls its layers in a loop, and dynamo
drops a frame whose loop breaks to eager: its mask, rotary and glue code would then be compiled frame by frame,
and they hit dynamo's recompile limit once two engines share a process). At run time the op calls the engine's
compiled body for its kind (`layer[prefill]`, `layer[decode]`), traced once and reused by every layer whose
guards pass, as PyTorch's regional-compilation recipe does.

What it costs: inductor fuses nothing across the op (a layer's last residual add and the next layer's input
norm are two kernels, as with the nested region), and an uncaptured call pays the op's dispatch and the body's
guard check per layer (replayed from a CUDA graph, neither is paid). A layer call with other arguments than
transformers' decoder layers take (hidden states, the cache, attention_mask, position_ids, cache_position,
position_embeddings, and flags that are plain Python literals) goes through the nested region instead.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from moefx.engine.layers.layer_body import LayerCalls, own_body

_TENSORS = ("attention_mask", "position_ids", "cache_position")
_TENSOR_ARGS = "Tensor? mask, Tensor? position_ids, Tensor? cache_position, Tensor cos, Tensor sin"
_CONSTANTS = "str names, str constants, str cache_name, int handle, int index"
_FRAMES: weakref.WeakValueDictionary[int, LayerFrames] = weakref.WeakValueDictionary()

_LIB = torch.library.Library("moefx", "FRAGMENT")  # other moefx files define more ops in the same namespace
# flexible_layout on the decode op: under inductor's default (exact strides) each layer's op got its own copy of the
# mask and the rotary tables, recomputed before every layer (one kernel per layer on the H200); the compiled body
# guards on strides. Not on the prefill op: there the tables reached the body in inductor's own layout, the query
# came out with a strided last dim and SDPA refused it (H200, a GPU test).
_LIB.define(f"layer_decode(Tensor hidden, Tensor(a!) keys, Tensor(b!) values, Tensor length, {_TENSOR_ARGS}, "
            f"{_CONSTANTS}) -> Tensor", tags=(torch.Tag.flexible_layout,))
_LIB.define(f"layer_prefill(Tensor hidden, {_TENSOR_ARGS}, {_CONSTANTS}) -> (Tensor, Tensor, Tensor)")


class LayerFrames(LayerCalls):
    """The compiled-frame form of a model's decoder layer calls (see the module docstring); `bind` gives it the
    engine's compile function, `fallback` is the nested region for calls it does not take."""

    def __init__(self, layers: list[torch.nn.Module], fallback: LayerCalls) -> None:
        self.layers, self.fallback = layers, fallback
        self._compile: Callable[[str, Callable[..., Any]], Callable[..., Any]] | None = None
        self._fns: dict[str, Callable[..., Any]] = {}
        self._lengths: list[torch.Tensor] = []  # the write positions this step's ops have not advanced yet
        self.handle = _handle(layers)
        _FRAMES[self.handle] = self

    def __reduce__(self) -> tuple[Any, tuple]:
        """Pickled as None: a saved trace's guard state (`aot.py`) pickles the layers its guards read, and each
        layer's forward holds this object with the compiled bodies; no kept guard reads it."""
        return type(None), ()

    @property
    def bound(self) -> bool:
        return self._compile is not None

    def bind(self, compile_fn: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> None:
        """`compile_fn(name, fn)` compiles a layer body (the engine's backend, counted under `name`)."""
        self._compile, self._fns = compile_fn, {}

    def body(self, kind: str) -> Callable[..., Any]:
        fn = self._fns.get(kind)
        if fn is None:
            assert self._compile is not None
            fn = self._fns[kind] = self._compile(f"layer[{kind}]", own_body())
        return fn

    def decode(self, index: int, layer: torch.nn.Module, hidden: torch.Tensor, name: str,
               static: tuple[torch.Tensor, ...], args: tuple, rest: dict[str, Any]) -> torch.Tensor:
        if index == 0:
            self._lengths = []
        tensors = None if args else _op_arguments(rest)
        if tensors is None:
            self._advance(hidden.shape[-2])
            return self.fallback.decode(index, layer, hidden, name, static, args, rest)
        out = torch.ops.moefx.layer_decode(hidden, *static, *tensors, *self._constants(rest, name, index))
        # Not in the op: inductor orders its own mutations after every read. Not one add per layer either: on the
        # H200 each was a kernel of its own. The write positions advance together after the last layer.
        self._lengths.append(static[2])
        if index == len(self.layers) - 1:
            self._advance(hidden.shape[-2])
        return out

    def _advance(self, tokens: int) -> None:
        """Advance the write positions of the layers whose ops ran since the step's first layer (one foreach)."""
        if self._lengths:
            torch._foreach_add_(self._lengths, tokens)
        self._lengths = []

    def prefill(self, cache: Any, index: int, layer: torch.nn.Module, hidden: torch.Tensor, name: str,
                static: tuple[torch.Tensor, ...], args: tuple, rest: dict[str, Any]) -> torch.Tensor:
        tensors = None if args else _op_arguments(rest)
        if tensors is None:
            return self.fallback.prefill(cache, index, layer, hidden, name, static, args, rest)
        out, keys, values = torch.ops.moefx.layer_prefill(hidden, *tensors, *self._constants(rest, name, index))
        cache.update(keys, values, index)
        return out

    def _constants(self, rest: dict[str, Any], name: str, index: int) -> tuple[Any, ...]:
        tensors = [k for k in (*_TENSORS, "position_embeddings") if k in rest]
        return ",".join(tensors), ";".join(f"{k}={rest[k]!r}" for k in _flags(rest)), name, self.handle, index


def _handle(layers: list[torch.nn.Module]) -> int:
    """The handle the frame ops name these layers by: a constant of every traced step, so it is in inductor's keys
    and the compile-cache file's identity. Derived from the layers' kind (class, count, parameter shapes), not from
    how many engines this process built before, so a new process that builds one model gets the handle the process
    that saved its file gave it, whatever else that one optimized first; the next free value where a model of the
    same kind is alive in the process."""
    kind = [(type(layer).__module__, type(layer).__qualname__, [tuple(p.shape) for p in layer.parameters()])
            for layer in layers]
    handle = int.from_bytes(hashlib.sha256(repr(kind).encode()).digest()[:4], "big") >> 2  # an int64 op argument
    while handle in _FRAMES:
        handle += 1
    return handle


def _flags(rest: dict[str, Any]) -> list[str]:
    """The names of the keyword arguments that are not tensors (use_cache, output_router_logits, ...)."""
    return sorted(k for k in rest if k not in _TENSORS and k != "position_embeddings")


def _op_arguments(rest: dict[str, Any]) -> tuple[Any, ...] | None:
    """The op's tensor arguments for a layer call's keyword arguments, or None where it has others: tensors under
    other names, or flags that are not None, a bool or a number (they travel in the op as their repr)."""
    embeddings = rest.get("position_embeddings")
    if not (isinstance(embeddings, (tuple, list)) and len(embeddings) == 2
            and all(isinstance(t, torch.Tensor) for t in embeddings)):
        return None
    optional = [rest.get(k) for k in _TENSORS]
    if not all(t is None or isinstance(t, torch.Tensor) for t in optional):
        return None
    if not all(rest[k] is None or isinstance(rest[k], (bool, int, float)) for k in _flags(rest)):
        return None
    return (*optional, *embeddings)


def _call(handle: int, index: int, names: str, constants: str, tensors: tuple) -> tuple[Any, torch.nn.Module, dict]:
    """The frames, the layer and its keyword arguments of one op call, rebuilt from the op's arguments."""
    frames = _FRAMES[handle]
    mask, position_ids, cache_position, cos, sin = tensors
    values = {"attention_mask": mask, "position_ids": position_ids, "cache_position": cache_position,
              "position_embeddings": (cos, sin)}
    kwargs = {k: values[k] for k in names.split(",") if k}
    kwargs.update(_parsed_flags(constants))
    return frames, frames.layers[index], kwargs


@functools.lru_cache(maxsize=64)
def _parsed_flags(constants: str) -> dict[str, Any]:
    """The flags `LayerFrames._constants` wrote, parsed once per distinct string (every layer of every uncaptured
    call passes the same one)."""
    pairs = (flag.split("=", 1) for flag in constants.split(";") if flag)
    return {key: ast.literal_eval(value) for key, value in pairs}


def _below_autograd() -> Any:
    """The bodies run with the autograd keys excluded, whoever calls the op: the compiled steps' calls come without
    them and a loaded trace's with them, and a body's guards compare its input's dispatch keys, so each caller
    would otherwise get a trace of its own (the steps run under no_grad: nothing is recorded either way)."""
    return torch._C._AutoDispatchBelowADInplaceOrView()


@torch.library.impl(_LIB, "layer_decode", "CompositeExplicitAutograd")
def _layer_decode(hidden: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor,
                  mask: torch.Tensor | None, position_ids: torch.Tensor | None, cache_position: torch.Tensor | None,
                  cos: torch.Tensor, sin: torch.Tensor, names: str, constants: str, cache_name: str, handle: int,
                  index: int) -> torch.Tensor:
    frames, layer, kwargs = _call(handle, index, names, constants, (mask, position_ids, cache_position, cos, sin))
    with _below_autograd():
        (out,) = frames.body("decode")(layer, hidden, cache_name, (keys, values, length), (), kwargs, False)
    return _as_declared(out, hidden.shape, hidden.dtype)


@torch.library.impl(_LIB, "layer_prefill", "CompositeExplicitAutograd")
def _layer_prefill(hidden: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                   cache_position: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, names: str,
                   constants: str, cache_name: str, handle: int, index: int) -> tuple[torch.Tensor, ...]:
    frames, layer, kwargs = _call(handle, index, names, constants, (mask, position_ids, cache_position, cos, sin))
    with _below_autograd():
        out, keys, values = frames.body("prefill")(layer, hidden, cache_name, (), (), kwargs)
    shape = _kv_shape(layer, hidden)
    return (_as_declared(out, hidden.shape, hidden.dtype), _as_declared(keys, shape, hidden.dtype),
            _as_declared(values, shape, hidden.dtype))


def _kv_shape(layer: torch.nn.Module, hidden: torch.Tensor) -> tuple[int, ...]:
    """[batch, KV heads, tokens, head dim]: what transformers' attention stores for `hidden`."""
    attn = layer.self_attn
    heads = attn.k_proj.out_features // attn.head_dim
    return (hidden.shape[0], heads, hidden.shape[1], attn.head_dim)


def _as_declared(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`t` contiguous, checked against the shape and dtype the op's fake told the compiler (a mismatch would be
    read with the wrong layout, so it is an error)."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise RuntimeError(f"moefx layer frame returned {tuple(t.shape)}/{t.dtype} where {tuple(shape)}/{dtype} was "
                           f"declared; set config layer_regions to 'all' for this model")
    return t.contiguous()


@torch.library.register_fake("moefx::layer_decode", lib=_LIB)
def _layer_decode_fake(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


@torch.library.register_fake("moefx::layer_prefill", lib=_LIB)
def _layer_prefill_fake(hidden: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
    handle, index = args[-2], args[-1]
    shape = _kv_shape(_FRAMES[handle].layers[index], hidden)
    return (torch.empty_like(hidden, memory_format=torch.contiguous_format), hidden.new_empty(shape),
            hidden.new_empty(shape))
