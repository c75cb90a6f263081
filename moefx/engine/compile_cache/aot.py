"""The engine's compiled steps in a form a new process loads without dynamo tracing them again.

PyTorch's compile caches (the Mega-Cache, `file.py`) keep inductor's and AOTAutograd's outputs, not
dynamo's, so a warm process still traced every step: 6.9 s of a 22.3 s warm start at 48 layers on the H200
(docs/FINDINGS.md). torch's AOT compile (`torch.compile(fn, fullgraph=True).aot_compile(...)`) keeps dynamo's
output too: the transformed bytecode, the guards and the compiled graph, one serializable entry per trace.
`AotFunction` compiles each of the engine's functions that way, one entry per distinct call (what dynamo's cache
entries would have been), picks the entry whose guards pass at each call, and hands its entries to the engine's
compile-cache file; a new process loads them and calls them with no tracing and no backend.

What torch asks for, and how moefx gives it on the torches it runs on (2.11 and 2.13 tested): `torch.compile` offers
`aot_compile` only while `torch._dynamo.config.enable_aot_compile` is on (off by default on torch 2.11, on on 2.13), so
the flag is set around moefx's own `torch.compile` calls here and restored after (`_aot_flag`), never for the
process; and the backend's output must be a `torch._dynamo.aot_compile_types.SerializableCallable`. torch 2.13
wraps any output that AOTAutograd bundled (it has `serialize`) itself; torch 2.11 does so only for its own inductor
backend, not for a backend function such as the engine's counting one. So the backend's output is wrapped in
`SavedGraph`, moefx's serializable callable, on every torch: it keeps AOTAutograd's bundled entry (inductor's
generated code inside), and a new process rebuilds the callable from it with no backend call. `why_no_aot` asks
torch for these pieces, not for its version; where one is missing, the engine compiles as before (one warning
line says why).

Which guards an entry keeps (`_keep`): those on the call's own values, namely tensor metadata (dtype, device,
shape, strides, which dimensions are dynamic), the shape relations, constants such as `by_head` or a None mask,
sequence lengths (cache layers) and the global state (grad mode, default device). Guards on objects' identity,
on code, closures, modules and dicts cannot be serialized, and what they protect is fixed by the engine's
identity in the file name (model signature, config, plan, versions, pass sources): each is the same in a
process that finds the file. Tensor dimension marks (`maybe_mark_dynamic`) are lost by torch's guard
serialization, so they are kept beside the entry and put back on load. An entry that does not load, or a call
that fullgraph tracing cannot take (a graph break), runs the ordinary `torch.compile` path: the first such step
in a process says so in one warning line, later ones in the log.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import pickle
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moefx.log import get_logger, warn_once

log = get_logger("moefx.engine")

try:
    from torch._dynamo.aot_compile_types import SerializableCallable
except ImportError:  # why_no_aot says so
    SerializableCallable = None

# Guard kinds that speak of the call's own values and survive serialization (see the module docstring).
_KEPT_GUARDS = frozenset({
    "TENSOR_MATCH", "SHAPE_ENV", "CONSTANT_MATCH", "EQUALS_MATCH", "SEQUENCE_LENGTH", "GRAD_MODE",
    "DEFAULT_DEVICE", "DETERMINISTIC_ALGORITHMS", "TORCH_FUNCTION_STATE", "GLOBAL_STATE",
})
# Where torch keeps a tensor's dimension marks, read by the tensor guards.
_MARKS = ("_dynamo_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_unbacked_indices",
          "_dynamo_strict_unbacked_indices", "_dynamo_static_indices")


@functools.lru_cache(maxsize=1)
def why_no_aot() -> str | None:
    """Why this torch cannot keep dynamo's output across processes (None: it can): the pieces `AotFunction` and
    `SavedGraph` use, asked for by name (see the module docstring)."""
    try:
        from torch._dynamo import aot_compile
        from torch._dynamo.package import load_guard_manager, load_guards_state  # noqa: F401
        from torch._functorch._aot_autograd.aot_autograd_result import deserialize_bundled_cache_entry  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} has no AOT compile ({exc})"
    if not hasattr(aot_compile, "AOTCompiledFunction"):
        return f"torch {torch.__version__} has no AOT compile (torch._dynamo.aot_compile.AOTCompiledFunction)"
    if SerializableCallable is None:
        return f"torch {torch.__version__} has no torch._dynamo.aot_compile_types.SerializableCallable"
    with _aot_flag():
        offered = hasattr(torch.compile(_probe, fullgraph=True), "aot_compile")
    if not offered:
        flag = "" if _HAS_FLAG else ", and no torch._dynamo.config.enable_aot_compile to turn it on"
        return f"torch {torch.__version__}'s torch.compile has no aot_compile{flag}"
    return None


_HAS_FLAG = hasattr(torch._dynamo.config, "enable_aot_compile")


def _aot_flag() -> contextlib.AbstractContextManager[Any]:
    """`torch._dynamo.config.enable_aot_compile` on for a `torch.compile` call of moefx's own, restored after (torch
    2.11 attaches `aot_compile` to what torch.compile returns only while it is on); nothing where torch has no flag."""
    return torch._dynamo.config.patch(enable_aot_compile=True) if _HAS_FLAG else contextlib.nullcontext()


def _probe() -> None:
    """A function to ask torch.compile's wrapper what it offers (never called)."""


if SerializableCallable is not None:

    class SavedGraph(SerializableCallable):
        """The backend's output for one trace, in the form torch's AOT compile saves: AOTAutograd's bundled entry
        (the graph's runtime wrappers with inductor's generated code inside, `compiled.serialize()`), rebuilt by
        AOTAutograd in a new process without calling the backend. Calls go to the compiled function."""

        def __init__(self, compiled: Callable[..., Any]) -> None:
            self.compiled = compiled

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.compiled(*args, **kwargs)

        @classmethod
        def serialize_compile_artifacts(cls, fn: SavedGraph) -> bytes:
            with torch._functorch.config.patch(bundled_autograd_cache=True):
                return pickle.dumps(fn.compiled.serialize())

        @classmethod
        def deserialize_compile_artifacts(cls, data: bytes) -> SavedGraph:
            from torch._functorch._aot_autograd.aot_autograd_result import deserialize_bundled_cache_entry

            return cls(deserialize_bundled_cache_entry(pickle.loads(data)))


def _serializable(compiled: Any) -> Any:
    """The backend's output as torch's AOT compile can save it: `SavedGraph` around what AOTAutograd bundled; other
    outputs as they are (torch then says why it cannot save them, and the call takes the ordinary path)."""
    if SerializableCallable is None or isinstance(compiled, SerializableCallable):
        return compiled
    if getattr(compiled, "serialize", None) is None:
        return compiled
    return SavedGraph(compiled)


def _said_once(message: str) -> None:
    """The first step a saved trace fails for says so in one warning; later ones go to the log, not a wall."""
    global _SAID
    if _SAID:
        log.info("%s", message)
    else:
        _SAID = True
        warn_once(message)


_SAID = False


def _keep(entry: Any, owner: str | None) -> bool:
    """Whether a guard stays in the entry: a kept kind, on the call's arguments (not a global, not the attributes of
    `owner`, the engine's `Steps` a method is bound to, not code reached through dunder attributes)."""
    name = entry.name
    on_owner = owner is not None and (name == owner or name.startswith((f"{owner}.", f"{owner}[")))
    return entry.guard_type in _KEPT_GUARDS and not entry.is_global and not on_owner and "__" not in name


def _marks(names: Sequence[str], f_locals: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The dimension marks of the guarded tensors, by their guard's name (an expression over the call's locals)."""
    out: dict[str, dict[str, Any]] = {}
    scope = dict(f_locals)
    for name in names:
        try:
            value = eval(name, {}, scope)  # the guard's own source expression
        except Exception:
            continue
        found = {attr: getattr(value, attr) for attr in _MARKS if hasattr(value, attr)}
        if found:
            out[name] = found
    return out


def _tensors(value: Any, path: str = "", depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The tensors among a call's arguments, in tuples, lists and dicts two levels down, by path."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if depth > 2:
        return []
    if isinstance(value, (tuple, list)):
        return [t for i, v in enumerate(value) for t in _tensors(v, f"{path}[{i}]", depth + 1)]
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in _tensors(v, f"{path}[{k!r}]", depth + 1)]
    return []


def _loaded_class() -> type:
    """torch's AOTCompiledFunction, with guards rebuilt from the saved state as `_keep` left them: the dimension
    marks put back on the saved tensors, and no dict key-order sources (no dict guard is kept; torch would
    evaluate them against the saved locals, which hold only what the kept guards read)."""
    from torch._dynamo.aot_compile import AOTCompiledFunction
    from torch._dynamo.package import load_guard_manager, load_guards_state
    from torch._guards import TracingContext, tracing

    class Loaded(AOTCompiledFunction):
        marks: dict[str, dict[str, Any]] = {}

        def __post_init__(self) -> None:
            art = self._artifacts
            art.check_compatibility()
            self.fn = art.runtime_env.forward_callable(art.backend_id, art.compiled_fn,
                                                       extra_globals=self._extra_globals)
            with tracing(TracingContext(None)):  # unpickling import sources installs guards into a context
                state = load_guards_state(art.guards_state)
            scope = state.output_graph.local_scope
            for name, marks in self.marks.items():
                tensor = eval(name, {}, dict(scope))  # the guard's own source expression
                for attr, value in marks.items():
                    setattr(tensor, attr, value)
            state.output_graph.guard_on_key_order = set()
            art.guard_manager = load_guard_manager(state, art.original_code, self.fn.__globals__)

    return Loaded


def _scope(fn: Callable[..., Any]) -> dict[str, Any]:
    """`fn`'s globals as they are now, over the builtins (see `_with_builtins`)."""
    return {**vars(builtins), **fn.__globals__}


def _with_builtins(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` over `_scope(fn)`, for one AOT compile. torch builds a trace's function from the traced function's
    globals and checks that every global its bytecode reads is among them; torch 2.11 does not count builtins (the
    forward's fast path reads `type`), so without them in the scope the trace is refused when it is made ("Missing
    required external references: ['type']") and again when a new process loads it. torch's function holds a copy of
    the globals either way, so the copy changes nothing the trace reads; the globals dynamo installs for the trace
    land in the copy instead of the module."""
    traced = types.FunctionType(fn.__code__, _scope(fn), fn.__name__, fn.__defaults__, fn.__closure__)
    traced.__kwdefaults__ = fn.__kwdefaults__
    return traced


def _modules_as_imports(compiled: Any, f_globals: dict[str, Any]) -> None:
    """The modules the trace's bytecode reads from globals dynamo installed for it, saved as imports. Rebuilding an
    output object (a transformers ModelOutput, an OrderedDict: the forward's fast path returns one) loads its module
    from a global named after the module's id in this process (`___module_collections_<id>_c<n>`), which torch's
    saved runtime environment leaves out, so a new process could not build the function ("Missing required external
    references"); as an import source the new process imports the module under the same name."""
    env = compiled._artifacts.runtime_env
    for name in sorted(env.external_refs):
        value = f_globals.get(name)
        if name not in env.used_globals and name not in env.import_sources and isinstance(value, types.ModuleType):
            env.import_sources[name] = value.__name__


@dataclasses.dataclass
class _Entry:
    compiled: Any  # an AOTCompiledFunction
    blob: bytes | None  # what the compile-cache file keeps (None: could not be serialized)


class AotFunction:
    """`fn` (a function; `bound` its first argument, or None) compiled by `backend` one fullgraph trace per distinct
    call, each trace an entry that `blobs` gives to save and a new process loads (`pending`). Calls that fullgraph
    tracing cannot take go to `fallback` (the ordinary torch.compile of the same function)."""

    def __init__(self, name: str, fn: Callable[..., Any], bound: Any, backend: Callable[..., Any],
                 fallback: Callable[..., Any]) -> None:
        self.name, self.fn, self.bound, self.backend, self.fallback = name, fn, bound, backend, fallback
        self.entries: list[_Entry] = []
        self.pending: list[bytes] = []  # loaded from the file, deserialized at the first call
        self.loaded = 0  # entries this process loaded instead of tracing
        self.changes = 0  # entries traced, or dropped because they did not load: the file is out of date
        self.broken: str | None = None  # why calls without a matching entry go to `fallback`
        self._args = self._arg_names(fn)
        self._sizes: dict[str, tuple[int, ...]] = {}  # the first trace's argument sizes, by path

    @staticmethod
    def _arg_names(fn: Callable[..., Any]) -> tuple[str, ...] | None:
        code = fn.__code__
        if code.co_flags & 0x0C:  # *args or **kwargs: bind through inspect
            return None
        return code.co_varnames[: code.co_argcount]

    def _locals(self, args: tuple) -> dict[str, Any]:
        if self._args is not None and len(args) == len(self._args):
            return dict(zip(self._args, args))
        import inspect

        bound = inspect.signature(self.fn).bind(*args)
        bound.apply_defaults()  # the guards read defaulted arguments too (layer_body's `advance`)
        return dict(bound.arguments)

    def __call__(self, *args: Any) -> Any:
        full = args if self.bound is None else (self.bound, *args)
        if self.pending:
            self._deserialize()
        if self.entries:
            f_locals = self._locals(full)
            for entry in self.entries:
                if entry.compiled._artifacts.guard_manager.check(f_locals):
                    return entry.compiled.fn(*full)
        if self.broken is None:
            entry = self._compile(full)
            if entry is not None:
                return entry.compiled.fn(*full)
        return self.fallback(*args)

    def _dynamic_where_changed(self, full: tuple) -> None:
        """Dynamo's automatic dynamic shapes, which its AOT compile does not apply: a trace after the first marks
        the argument dimensions whose sizes differ from the first trace's dynamic, so one more trace serves every
        size (layer bodies get new batch and cache sizes from intermediate tensors the engine cannot mark)."""
        found = _tensors(full)
        if not self._sizes:
            self._sizes = {path: tuple(t.shape) for path, t in found}
            return
        for path, tensor in found:
            first = self._sizes.get(path)
            if first is not None and len(first) == tensor.dim():
                for dim, (was, now) in enumerate(zip(first, tensor.shape)):
                    if was != now:
                        torch._dynamo.maybe_mark_dynamic(tensor, dim)

    def _compile(self, full: tuple) -> _Entry | None:
        self._dynamic_where_changed(full)
        tensors: list[str] = []

        owner = self._args[0] if self.bound is not None and self._args else None

        def guard_filter(entries: Sequence[Any]) -> list[bool]:
            keep = [_keep(e, owner) for e in entries]
            tensors.extend(e.name for e, k in zip(entries, keep) if k and e.guard_type == "TENSOR_MATCH")
            return keep

        backend = self.backend
        if isinstance(backend, str):
            from torch._dynamo import lookup_backend

            backend = lookup_backend(backend)

        def serializable_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            return _serializable(backend(gm, example_inputs))

        traced = _with_builtins(self.fn)
        with _aot_flag():
            compiler = torch.compile(traced, fullgraph=True, backend=serializable_backend,
                                     options={"guard_filter_fn": guard_filter})
        try:
            with torch._dynamo.config.patch(specialize_float=True):  # moefx.compile.with_exact_floats: why
                compiled = compiler.aot_compile((full, {}))
        except Exception as exc:  # a graph break, or a torch that cannot save this trace: the ordinary path
            self.broken = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            _said_once(f"moefx: {self.name} is compiled without a saved trace, so a new process traces it again "
                       f"({self.broken}; later steps like it are logged at MOEFX_LOG=info)")
            return None
        marks = _marks(tensors, self._locals(full))
        _modules_as_imports(compiled, traced.__globals__)
        try:
            blob = pickle.dumps({"aot": type(compiled).serialize(compiled).serialized_data, "marks": marks})
        except Exception as exc:
            blob = None
            _said_once(f"moefx: {self.name}'s trace cannot be saved, so a new process traces it again "
                       f"({type(exc).__name__}: {exc}; later steps like it are logged at MOEFX_LOG=info)")
        entry = _Entry(compiled, blob)
        self.entries.append(entry)
        self.changes += blob is not None
        return entry

    def _deserialize(self) -> None:
        blobs, self.pending = self.pending, []
        cls = _loaded_class()
        for blob in blobs:
            try:
                data = pickle.loads(blob)
                loaded = type("Loaded", (cls,), {"marks": data["marks"]}).deserialize(data["aot"],
                                                                                       _scope(self.fn))
            except Exception as exc:  # whatever fails, the entry is not used: it is traced again and re-saved
                _said_once(f"moefx: a saved trace of {self.name} in the compile cache does not load, so it is traced "
                           f"afresh and saved again ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}; later ones are logged at MOEFX_LOG=info)")
                self.changes += 1
                continue
            self.entries.append(_Entry(loaded, blob))
            self.loaded += 1

    def blobs(self) -> list[bytes]:
        """Every entry that can be saved, loaded ones included."""
        return [e.blob for e in self.entries if e.blob is not None] + self.pending


class AotSteps:
    """An engine's AotFunctions by name, and the entries a compile-cache file handed over for names that are not
    compiled yet (layer bodies are made on first use)."""

    def __init__(self) -> None:
        self.functions: dict[str, AotFunction] = {}
        self._from_file: dict[str, list[bytes]] = {}
        self._changes_at_save = 0

    def add(self, function: AotFunction) -> AotFunction:
        function.pending = self._from_file.pop(function.name, [])
        self.functions[function.name] = function
        return function

    def give(self, blobs: dict[str, list[bytes]]) -> int:
        """Entries read from a file, each function's ahead of its first call; the number of entries."""
        for name, items in blobs.items():
            target = self.functions.get(name)
            if target is not None:
                target.pending = list(items)
            else:
                self._from_file[name] = list(items)
        return sum(len(items) for items in blobs.values())

    def collect(self) -> dict[str, list[bytes]]:
        """Every entry to save, by function name."""
        out = {name: list(items) for name, items in self._from_file.items()}
        for name, function in self.functions.items():
            if blobs := function.blobs():
                out[name] = blobs
        return out

    def _changes(self) -> int:
        return sum(f.changes for f in self.functions.values())

    def unsaved(self) -> bool:
        """Whether entries were traced, or dropped as unloadable, since the file was written."""
        return self._changes() != self._changes_at_save

    def mark_saved(self) -> None:
        self._changes_at_save = self._changes()

    def loaded(self) -> int:
        return sum(f.loaded for f in self.functions.values())
