"""Decoder layer calls as opaque ops of the traced step, each running one body the engine compiled apart.

With config `layer_regions: frames` (the default where torch traces every nested region call again, < 2.12),
a compiled engine binds `LayerFrames`: while its prefill or decode step is traced, the decoder layer calls become
one `moefx::layer_stack_prefill` or `moefx::layer_stack_decode` op for the whole stack. The first layer's call is
held back (it returns its hidden states unchanged), so is every later call with the same arguments, and the last
layer's call runs every layer's body in layer order inside the op. The decode op takes the engine's cache as
three tensors whatever the depth (every layer's keys, every layer's values, every layer's write position: the
slot's layers are views of them, `moefx/engine/slots.py`) and declares the two it writes mutated, so the traced
step has three cache inputs and AOTAutograd functionalizes two mutations (per-layer cache inputs and their
functionalization were most of the decode step's cold compile growth with depth, docs/FINDINGS.md). A padded
prefill whose cache names those buffers (`layer_body.PREFILL_INTO`, moefx/engine/prefill.py) is one
`moefx::layer_stack_prefill_into` op that likewise takes the keys and values buffers and writes each layer's prompt
into them inside its body. Where the
stack does not apply (`LayerFrames._why_no_stack`, or a later call whose arguments differ: the held layers then
run their own ops), each decoder layer call is one `moefx::layer_prefill` or `moefx::layer_decode` op with the
layer's tensors (indexed from the buffers in the graph, where the cache has them) as arguments and the layer
index as a constant. Dynamo never traces a layer, so the step is traced once whatever
the depth and stays one graph (a graph break would do as much, but transformers calls its layers in a loop, and dynamo
drops a frame whose loop breaks to eager: its mask, rotary and glue code would then be compiled frame by frame,
and they hit dynamo's recompile limit once two engines share a process). At run time the op calls the engine's
compiled body for its kind (`layer[prefill]`, `layer[decode]`), traced once and reused by every layer whose
guards pass, as PyTorch's regional-compilation recipe does.

What it costs: inductor fuses nothing across a layer boundary (a layer's last residual add and the next layer's
input norm are two kernels, as with the nested region), and an uncaptured call pays the body's guard check per
layer, and the op's dispatch per layer where the stack does not apply (a CUDA graph replay pays neither). A layer
call with other arguments than
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

from moefx.engine.layers.layer_body import (
    LayerCalls,
    kv_buffers,
    own_body,
    prefill_into,
    records_grad,
    shared_kind,
    static_tensors,
)
from moefx.log import warn_once

_TENSORS = ("attention_mask", "position_ids", "cache_position")
_TENSOR_ARGS = "Tensor? mask, Tensor? position_ids, Tensor? cache_position, Tensor cos, Tensor sin"
_CONSTANTS = "str names, str constants, str cache_name, int handle, int index"
_STACK_CONSTANTS = "str names, str constants, str cache_name, int handle"
_FRAMES: weakref.WeakValueDictionary[int, LayerFrames] = weakref.WeakValueDictionary()

_LIB = torch.library.Library("moefx", "FRAGMENT")  # other moefx files define more ops in the same namespace
# flexible_layout on the decode op: under inductor's default (exact strides) each layer's op got its own copy of the
# mask and the rotary tables, recomputed before every layer (one kernel per layer on the H200); the compiled body
# guards on strides. Not on the prefill op: there the tables reached the body in inductor's own layout, the query
# came out with a strided last dim and SDPA refused it (H200, a GPU test).
_LIB.define(f"layer_decode(Tensor hidden, Tensor(a!) keys, Tensor(b!) values, Tensor length, {_TENSOR_ARGS}, "
            f"{_CONSTANTS}) -> Tensor", tags=(torch.Tag.flexible_layout,))
_LIB.define(f"layer_prefill(Tensor hidden, {_TENSOR_ARGS}, {_CONSTANTS}) -> (Tensor, Tensor, Tensor)")
# The whole stack as one op (the same bodies in layer order): one op call whatever the depth. The decode op takes
# the cache's buffers ([layers, ...] each; layer i's tensors are their index i), so the traced step has three cache
# inputs and AOTAutograd functionalizes two mutated tensors, not two per layer. Same layout tags as the per-layer
# ops, for the same reasons.
_LIB.define(f"layer_stack_decode(Tensor hidden, Tensor(a!) keys, Tensor(b!) values, Tensor lengths, "
            f"{_TENSOR_ARGS}, {_STACK_CONSTANTS}) -> Tensor", tags=(torch.Tag.flexible_layout,))
_LIB.define(f"layer_stack_prefill(Tensor hidden, {_TENSOR_ARGS}, {_STACK_CONSTANTS}) -> (Tensor, Tensor[], Tensor[])")
# A padded prefill into a static cache's buffers (`layer_body.PREFILL_INTO`): each layer body writes its keys and
# values into its index of the buffers where they are computed, so no copy of them follows the step (at 48 layers
# the copies were 96 kernels after the forward, moefx/engine/prefill.py). Exact strides, as the prefill op's.
_LIB.define(f"layer_stack_prefill_into(Tensor hidden, Tensor(a!) keys, Tensor(b!) values, Tensor keep, "
            f"{_TENSOR_ARGS}, {_STACK_CONSTANTS}) -> Tensor")


class LayerFrames(LayerCalls):
    """The compiled-frame form of a model's decoder layer calls (see the module docstring); `bind` gives it the
    engine's compile function, `fallback` is the nested region for calls it does not take, `stack_off` why the
    model's layer calls never run as one stack op (None: wherever each call agrees, `_why_no_stack`)."""

    def __init__(self, layers: list[torch.nn.Module], fallback: LayerCalls, stack_off: str | None = None) -> None:
        self.layers, self.fallback, self.stack_off = layers, fallback, stack_off
        self._compile: Callable[[str, Callable[..., Any]], Callable[..., Any]] | None = None
        self._fns: dict[str, Callable[..., Any]] = {}
        self._lengths: list[torch.Tensor] = []  # the write positions this step's ops have not advanced yet
        self._all_lengths: torch.Tensor | None = None  # this step's cache's write-position buffer, if it has one
        self._held: list[Any] = []  # while a trace holds the layer calls back for one stack op: its first call
        self.unstacked: dict[str, str] = {}  # kind of step -> why its last trace ran one op per layer
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

    def decode(self, cache: Any, index: int, layer: torch.nn.Module, hidden: torch.Tensor, name: str,
               static: tuple[torch.Tensor, ...], args: tuple, rest: dict[str, Any]) -> torch.Tensor:
        if index == 0:
            buffers = kv_buffers(cache)
            self._lengths, self._all_lengths = [], buffers[2] if buffers is not None else None
        taken, hidden = self._stacked("decode", cache, index, hidden, name, args, rest)
        if taken:
            return hidden
        return self._decode_layer(index, layer, hidden, name, static, args, rest)

    def prefill(self, cache: Any, index: int, layer: torch.nn.Module, hidden: torch.Tensor, name: str,
                static: tuple[torch.Tensor, ...], args: tuple, rest: dict[str, Any]) -> torch.Tensor:
        taken, hidden = self._stacked("prefill", cache, index, hidden, name, args, rest)
        if taken:
            return hidden
        return self._prefill_layer(cache, index, layer, hidden, name, args, rest)

    def _stacked(self, kind: str, cache: Any, index: int, hidden: torch.Tensor, name: str, args: tuple,
                 rest: dict[str, Any]) -> tuple[bool, torch.Tensor]:
        """The stack form of a traced step's layer calls: the first layer's call is held back and returns its
        hidden states unchanged, as does every later call that gets the same arguments, and the last one runs the
        whole stack as one op and returns its output. (True, what the call returns) where the stack takes the call;
        (False, the hidden states) where this layer runs its own op. A call whose arguments differ from the first
        one's ends the stack: the held layers run their own ops first, and this layer takes their output."""
        if index == 0:
            why = self._why_no_stack(kind, cache, hidden, args, rest)
            self._held = [] if why else [hidden, cache, name, rest]
            if why:
                self._unstacked(kind, why)
            return not why, hidden
        if not self._held:
            return False, hidden
        first, held_cache, held_name, held_rest = self._held
        if hidden is not first:
            self._held = []
            raise RuntimeError(f"moefx layer stack: decoder layer {index} got other hidden states than the layer "
                               f"before it returned (the model changes them between its layers); set config "
                               f"layer_regions to 'all' for this model")
        if cache is held_cache and name == held_name and not args and _same_arguments(rest, held_rest):
            if index < len(self.layers) - 1:
                return True, hidden
            self._held = []
            return True, self._run_stack(kind, cache, hidden, name, rest)
        self._held = []
        self._unstacked(kind, f"decoder layer {index} got other arguments than layer 0")
        for held in range(index):
            hidden = self._one_layer(kind, cache, held, hidden, name, held_rest)
        return False, hidden

    def _why_no_stack(self, kind: str, cache: Any, hidden: torch.Tensor, args: tuple,
                      rest: dict[str, Any]) -> str | None:
        """Why this step's layer calls cannot run as one op (None: they can, if every call agrees with this one)."""
        if self.stack_off is not None:
            return self.stack_off
        if args or _op_arguments(rest) is None:
            return "the first layer call has arguments the layer ops do not carry"
        collected = [k for k in _flags(rest) if k.startswith("output_") and rest[k]]
        if collected:
            return f"outputs collected per layer ({', '.join(collected)})"
        entries = list(getattr(cache, "layers", ()))
        if len(entries) != len(self.layers):
            return f"a cache of {len(entries)} layers for {len(self.layers)} decoder layers"
        kinds = [shared_kind(entry, True) for entry in entries]
        if any(k != kind for k in kinds):
            return f"cache layers the {kind} body does not take ({sorted({type(e).__name__ for e in entries})})"
        if kind == "decode" and kv_buffers(cache) is None:
            return ("cache layers that are not views of one buffer per kind (a cache the engine did not make, or "
                    "layers of different shapes)")
        hooked = [i for i, layer in enumerate(self.layers) if layer._forward_hooks or layer._forward_pre_hooks]
        if hooked:
            return f"forward hooks on decoder layers {hooked} (they would see the stack's output)"
        if any(records_grad(layer, hidden) for layer in self.layers):
            return "autograd records a layer call"
        return None

    def _unstacked(self, kind: str, why: str) -> None:
        _note_unstacked(self.handle, kind, why)

    def _run_stack(self, kind: str, cache: Any, hidden: torch.Tensor, name: str, rest: dict[str, Any]) -> torch.Tensor:
        tensors = _op_arguments(rest)
        constants = self._constants(rest, name)
        if kind == "decode":
            keys, values, lengths = kv_buffers(cache)
            out = torch.ops.moefx.layer_stack_decode(hidden, keys, values, lengths, *tensors, *constants)
            lengths.add_(hidden.shape[-2])  # after the op, as the per-layer ops' advance (`_decode_layer`)
            return out
        into = prefill_into(cache)
        if into is not None:
            return torch.ops.moefx.layer_stack_prefill_into(hidden, *into, *tensors, *constants)
        out, keys, values = torch.ops.moefx.layer_stack_prefill(hidden, *tensors, *constants)
        for index, (k, v) in enumerate(zip(keys, values)):
            cache.update(k, v, index)
        return out

    def _one_layer(self, kind: str, cache: Any, index: int, hidden: torch.Tensor, name: str,
                   rest: dict[str, Any]) -> torch.Tensor:
        """Layer `index` through its own op (a held call, run when the stack was given up)."""
        layer = self.layers[index]
        if kind == "decode":
            return self._decode_layer(index, layer, hidden, name, static_tensors(cache, index), (), rest)
        return self._prefill_layer(cache, index, layer, hidden, name, (), rest)

    def _decode_layer(self, index: int, layer: torch.nn.Module, hidden: torch.Tensor, name: str,
                      static: tuple[torch.Tensor, ...], args: tuple, rest: dict[str, Any]) -> torch.Tensor:
        tensors = None if args else _op_arguments(rest)
        if tensors is None:
            self._advance(hidden.shape[-2])
            return self.fallback.decode(None, index, layer, hidden, name, static, args, rest)
        out = torch.ops.moefx.layer_decode(hidden, *static, *tensors, *self._constants(rest, name), index)
        # Not in the op: inductor orders its own mutations after every read. Not one add per layer either: on the
        # H200 each was a kernel of its own. The write positions advance together after the last layer.
        self._lengths.append(static[2])
        if index == len(self.layers) - 1:
            self._advance(hidden.shape[-2])
        return out

    def _advance(self, tokens: int) -> None:
        """Advance the write positions of the layers whose ops ran since the step's first layer: one add over the
        cache's write-position buffer where every layer's op ran (an add per view of it would be functionalized into
        a scatter per layer), else one foreach."""
        if len(self._lengths) == len(self.layers) and self._all_lengths is not None:
            self._all_lengths.add_(tokens)
        elif self._lengths:
            torch._foreach_add_(self._lengths, tokens)
        self._lengths = []

    def _prefill_layer(self, cache: Any, index: int, layer: torch.nn.Module, hidden: torch.Tensor, name: str,
                       args: tuple, rest: dict[str, Any]) -> torch.Tensor:
        tensors = None if args else _op_arguments(rest)
        if tensors is None:
            return self.fallback.prefill(cache, index, layer, hidden, name, (), args, rest)
        out, keys, values = torch.ops.moefx.layer_prefill(hidden, *tensors, *self._constants(rest, name), index)
        cache.update(keys, values, index)
        return out

    def _constants(self, rest: dict[str, Any], name: str) -> tuple[Any, ...]:
        """The ops' constant arguments but the layer index: which tensors the call passed, its flags, the cache's
        argument name and the handle."""
        tensors = [k for k in (*_TENSORS, "position_embeddings") if k in rest]
        return ",".join(tensors), ";".join(f"{k}={rest[k]!r}" for k in _flags(rest)), name, self.handle


@torch.compiler.assume_constant_result
def _note_unstacked(handle: int, kind: str, why: str) -> None:
    """Keep and say (once) why a step's layers run one op each. Run once while dynamo traces, not traced: a write
    to the frames' state inside the trace would be a guarded side effect, and the next call would trace again."""
    _FRAMES[handle].unstacked[kind] = why
    warn_once(f"moefx: the {kind} step's decoder layers run as one op each, not one op for the stack: {why}")


def _same_arguments(rest: dict[str, Any], first: dict[str, Any]) -> bool:
    """Whether a layer call's keyword arguments are the first call's: the same tensors (the same objects) and equal
    flags."""
    if sorted(rest) != sorted(first):
        return False
    for key, value in rest.items():
        held = first[key]
        if isinstance(value, (tuple, list)) and isinstance(held, (tuple, list)):
            if len(value) != len(held) or any(a is not b for a, b in zip(value, held)):
                return False
        elif isinstance(value, torch.Tensor) or isinstance(held, torch.Tensor):
            if value is not held:
                return False
        elif value != held:
            return False
    return True


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


def _call(handle: int, names: str, constants: str, tensors: tuple) -> tuple[Any, dict]:
    """The frames and the layers' keyword arguments of one op call, rebuilt from the op's arguments."""
    frames = _FRAMES[handle]
    mask, position_ids, cache_position, cos, sin = tensors
    values = {"attention_mask": mask, "position_ids": position_ids, "cache_position": cache_position,
              "position_embeddings": (cos, sin)}
    kwargs = {k: values[k] for k in names.split(",") if k}
    kwargs.update(_parsed_flags(constants))
    return frames, kwargs


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
    frames, kwargs = _call(handle, names, constants, (mask, position_ids, cache_position, cos, sin))
    with _below_autograd():
        return _decode_body(frames, index, hidden, (keys, values, length), cache_name, kwargs)


@torch.library.impl(_LIB, "layer_stack_decode", "CompositeExplicitAutograd")
def _layer_stack_decode(hidden: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                        *args: Any) -> torch.Tensor:
    """The stack op's arguments after the cache's: `_TENSOR_ARGS`, then `_STACK_CONSTANTS`."""
    return _stack_bodies("decode", hidden, lambda i: (keys[i], values[i], lengths[i]), args, False)


@torch.library.impl(_LIB, "layer_stack_prefill_into", "CompositeExplicitAutograd")
def _layer_stack_prefill_into(hidden: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor,
                              *args: Any) -> torch.Tensor:
    """As `_layer_stack_decode`; each body writes its layer's prompt into the buffers (`layer_body.into`)."""
    return _stack_bodies("prefill_into", hidden, lambda i: (keys[i], values[i], keep), args, True, True)


def _stack_bodies(kind: str, hidden: torch.Tensor, static: Callable[[int], tuple[torch.Tensor, ...]], args: tuple,
                  *flags: bool) -> torch.Tensor:
    """Every layer's `kind` body in layer order over `static(index)` and `flags` (`layer_body`'s advance, into),
    each output checked as declared; `args` are a stack op's tensor arguments and constants."""
    *tensors, names, constants, cache_name, handle = args
    frames, kwargs = _call(handle, names, constants, tuple(tensors))
    body = frames.body(kind)
    with _below_autograd():
        for index, layer in enumerate(frames.layers):
            (out,) = body(layer, hidden, cache_name, static(index), (), kwargs, *flags)
            hidden = _as_declared(out, hidden.shape, hidden.dtype)
    return hidden


def _decode_body(frames: LayerFrames, index: int, hidden: torch.Tensor, static: tuple[torch.Tensor, ...],
                 cache_name: str, kwargs: dict[str, Any]) -> torch.Tensor:
    """Layer `index`'s decode body over its cache tensors; its write position is left for the step to advance."""
    (out,) = frames.body("decode")(frames.layers[index], hidden, cache_name, static, (), kwargs, False)
    return _as_declared(out, hidden.shape, hidden.dtype)


@torch.library.impl(_LIB, "layer_prefill", "CompositeExplicitAutograd")
def _layer_prefill(hidden: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                   cache_position: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, names: str,
                   constants: str, cache_name: str, handle: int, index: int) -> tuple[torch.Tensor, ...]:
    frames, kwargs = _call(handle, names, constants, (mask, position_ids, cache_position, cos, sin))
    with _below_autograd():
        return _prefill_body(frames, index, hidden, cache_name, kwargs)


@torch.library.impl(_LIB, "layer_stack_prefill", "CompositeExplicitAutograd")
def _layer_stack_prefill(hidden: torch.Tensor, mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                         cache_position: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, names: str,
                         constants: str, cache_name: str, handle: int) -> tuple[Any, ...]:
    frames, kwargs = _call(handle, names, constants, (mask, position_ids, cache_position, cos, sin))
    keys, values = [], []
    with _below_autograd():
        for index in range(len(frames.layers)):
            hidden, k, v = _prefill_body(frames, index, hidden, cache_name, kwargs)
            keys.append(k)
            values.append(v)
    return hidden, keys, values


def _prefill_body(frames: LayerFrames, index: int, hidden: torch.Tensor, cache_name: str,
                  kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer `index`'s prefill body: its output and the new keys and values, as declared."""
    layer = frames.layers[index]
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


@torch.library.register_fake("moefx::layer_stack_decode", lib=_LIB)
def _layer_stack_decode_fake(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


@torch.library.register_fake("moefx::layer_stack_prefill_into", lib=_LIB)
def _layer_stack_prefill_into_fake(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


@torch.library.register_fake("moefx::layer_stack_prefill", lib=_LIB)
def _layer_stack_prefill_fake(hidden: torch.Tensor, *args: Any) -> tuple[Any, ...]:
    layers = _FRAMES[args[-1]].layers
    shapes = [_kv_shape(layer, hidden) for layer in layers]
    return (torch.empty_like(hidden, memory_format=torch.contiguous_format),
            [hidden.new_empty(shape) for shape in shapes], [hidden.new_empty(shape) for shape in shapes])
