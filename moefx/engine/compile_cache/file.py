"""Compile artifacts that outlive the process: the decode engine's compiles kept with PyTorch's Mega-Cache and its
traces kept with torch's AOT compile.

`torch.compiler.save_cache_artifacts()` serializes what inductor, AOTAutograd and Triton's autotuner built
in this process (generated code, on CUDA the compiled Triton kernels, autotune results);
`load_cache_artifacts()` writes them back into those caches, so the next compile of the same graph is a cache
hit instead of a compile. On the CPU the generated C++ is built again on load (only its source is kept). That
alone leaves dynamo's tracing to every new process; the engine's saved traces (`aot.py`: bytecode, guards and
compiled graph per trace) go into the same file, so a new process calls its steps without tracing them. moefx's
own Triton kernels, which its custom ops launch and Triton compiles at their first launch, are not among inductor's
artifacts: their entries in Triton's cache folder (binaries and launcher stubs) go into the file too and are written
back before the first launch (`moefx.kernels.triton_cache`). CUDA graphs are captured afresh.

One file per engine identity — model signature, device (name, capability, SMs, CPU ISA), dtype, mode, parallel sizes,
max batch size, the config hash and the compiled-frames handle its traces name — under
`<moefx cache folder>/compile/` (`machine.cache_dir()`, i.e. `$XDG_CACHE_HOME/moefx/compile`), or the folder the
config key `compile_cache` / `MOEFX_COMPILE_CACHE` names. Its header holds the format version, that identity, a
stamp (torch, triton, transformers and moefx versions, the plan's fingerprint and the pass manager's uuid, which
hashes the config, the plan and the passes' sources) and the payload's length and SHA-256. A file whose stamp
differs (stale) or whose header, checksum or payload does not load (corrupt) is named in one warning line, deleted,
and rebuilt by compiling afresh; it is never loaded. A saved trace that does not load is named in a warning and
traced again.

moefx's own plan inputs need nothing extra: calibration tables are files already (their content is in the
config hash). Nothing this process measured is in the identity or the stamp: without max_batch_size the capture
buckets come from the free memory of the process that plans (lower in a process that ran transformers' static-cache
compile first), yet the compiled graphs are the same, so the buckets stay out of both and the plan's fingerprint
leaves out its serving hints and the text saying why (`Plan.fingerprint`); a trace is picked by its guards and an
artifact by inductor's key, whatever bucket asked for it.
`save_cache_artifacts()` holds every artifact of the process, so the file may also carry other compiles made
in it (harmless: each artifact is keyed by inductor's own hash). It appends what is new since the last call, one
chunk per artifact kind, and torch's `load_cache_artifacts` keeps only the last chunk of each kind (torch 2.13 and
2.14 build a dict of the (kind, artifacts) pairs), so a file saved after several requests lost all but its last
save's artifacts; `load_payload` merges every chunk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pickle
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from moefx.env import get_setting
from moefx.kernels import triton_cache
from moefx.log import get_logger, progress_logger
from moefx.machine import unwritable

log = get_logger("moefx.engine")

FORMAT_VERSION = 2  # 2: the payload holds the Mega-Cache's bytes, the engine's saved traces (and, when present, moefx's
# Triton kernel entries: a file without them loads as before)
MAGIC = b"moefx-compile-cache\n"
ENV = "MOEFX_COMPILE_CACHE"


def load_payload(payload: bytes) -> Any:
    """`torch.compiler.load_cache_artifacts(payload)` with every save's artifacts kept (see the module docstring):
    its CacheInfo, or None when the payload holds nothing. Torch's own loader runs instead where its serializer's
    parts read here are missing or read differently (other torch versions)."""
    try:
        from torch.compiler._cache import CacheArtifactManager, _deserialize_single_cache
        from torch.utils._appending_byte_serializer import AppendingByteSerializer

        CacheArtifactManager._ensure_cache_artifacts_registered()
        merged: dict[str, list[Any]] = {}
        for kind, artifacts in AppendingByteSerializer.to_list(payload, deserialize_fn=_deserialize_single_cache):
            merged.setdefault(kind, []).extend(artifacts)
    except Exception:  # any other layout: torch's loader decides (None when it cannot load)
        return torch.compiler.load_cache_artifacts(payload)
    return CacheArtifactManager.populate_caches(merged) if merged else None


def cache_folder(value: bool | str | None = None, environ: Mapping[str, str] | None = None) -> Path | None:
    """Where compile artifacts live, or None when the cache is off. `value` is the config key `compile_cache`
    (true, false or a folder); unset (None), MOEFX_COMPILE_CACHE decides (on/off words or a folder); both unset:
    on, in `<moefx cache folder>/compile`."""
    from moefx.machine import cache_dir

    if value is None:
        value = get_setting(ENV, environ)
    if value is False:
        return None
    if value is True:
        return cache_dir() / "compile"
    return Path(value).expanduser()


def versions() -> dict[str, str | None]:
    """The library versions a compiled artifact depends on."""
    import transformers

    import moefx

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__,
            "moefx": moefx.__version__}


def _misses() -> int:
    """Compiles inductor and AOTAutograd could not serve from their caches so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_miss"]) + int(counters["aot_autograd"]["autograd_cache_miss"])


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


@dataclasses.dataclass
class CompileCache:
    """One engine's artifact file: loaded once before the first compile, saved after requests that compiled."""

    path: Path
    identity: dict[str, Any]
    stamp: dict[str, Any]
    loaded: int = 0  # artifacts and traces loaded from the file (0: none, or not yet)
    saved: int = 0  # artifacts and traces in the file after the last save
    steps: Any = None  # the engine's AotSteps (aot.py), whose traces the file keeps; None: artifacts only
    kernel_entries: frozenset[str] = frozenset()  # the Triton cache entries the loaded file carried (restored here)
    _tried: bool = False
    _misses_at_save: int = 0
    unwritable: str | None = None  # why the file could not be written: said once, then no more tries

    @classmethod
    def for_plan(cls, folder: Path, plan: Any, config: Any, pass_uuid: str, frames: int | None = None) -> CompileCache:
        es = plan.execution
        identity = {
            "model": plan.model.key(), "device": es.device_type, "device_name": es.device_name,
            "capability": list(es.capability) if es.capability else None, "sms": es.multiprocessor_count,
            "cpu_isa": list(es.cpu_isa),
            "dtype": es.dtype, "mode": es.mode, "tp": es.tp_size, "ep": es.ep_size,
            "max_batch_size": es.max_batch_size, "config": config.compute_hash(),
            # A saved trace calls the compiled-frame ops with this handle as a constant (frames.py).
            "frames": frames,
        }
        stamp = {"format": FORMAT_VERSION, **versions(), "plan": plan.fingerprint(serving=False), "passes": pass_uuid}
        name = f"{plan.model.key()}-{_digest(identity)[:16]}.bin"
        return cls(folder / name, identity, stamp)

    # -- reading ---------------------------------------------------------------------------------------------

    def _read(self) -> tuple[bytes | None, str]:
        """(payload, "") for a sound file of this identity and stamp; (None, why not) otherwise."""
        with self.path.open("rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None, "corrupt (not a moefx compile cache file)"
            try:
                header = json.loads(f.readline())
            except (ValueError, UnicodeDecodeError):
                return None, "corrupt (unreadable header)"
            payload = f.read()
        if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
            return None, f"stale (format {header.get('format') if isinstance(header, dict) else '?'}, "\
                         f"this moefx writes {FORMAT_VERSION})"
        if header.get("identity") != self.identity:
            return None, "stale (built for another model, device or config)"
        stamp = header.get("stamp") or {}
        changed = [f"{k} {stamp.get(k)} -> {v}" for k, v in self.stamp.items() if stamp.get(k) != v]
        if changed:
            return None, f"stale ({', '.join(changed)})"
        if len(payload) != header.get("size") or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            return None, "corrupt (payload checksum mismatch)"
        return payload, ""

    def _discard(self, why: str) -> None:
        log.warning("compile cache %s is %s; deleting it and compiling afresh", self.path, why)
        try:
            self.path.unlink()
        except OSError:
            pass

    def load(self) -> int:
        """Load the file into torch's compile caches (once); the number of artifacts loaded."""
        if self._tried:
            return self.loaded
        self._tried = True
        self._misses_at_save = _misses()
        start = time.perf_counter()
        try:
            payload, why = self._read()
        except (FileNotFoundError, NotADirectoryError):  # no file yet, or no folder (the save says so, once)
            return 0
        except OSError as exc:
            payload, why = None, f"unreadable ({exc})"
        if payload is None:
            self._discard(why)
            return 0
        try:
            parts = pickle.loads(payload)
            info = load_payload(parts["artifacts"]) if parts["artifacts"] else None
        except Exception as exc:  # whatever torch raises, the file must not be trusted
            self._discard(f"corrupt (torch could not load it: {type(exc).__name__}: {exc})")
            return 0
        if parts["artifacts"] and info is None:
            self._discard("corrupt (torch could not load it)")
            return 0
        artifacts = sum(len(keys) for keys in info.artifacts.values()) if info is not None else 0
        traces = self.steps.give(parts["traces"]) if self.steps is not None else 0
        self.kernel_entries = frozenset(parts.get("kernels") or {})
        kernels = self._restore_kernels(parts.get("kernels") or {})
        self.loaded = self.saved = artifacts + traces
        progress_logger().info("loaded compile cache (%d artifacts, %d traces, %d Triton kernel entries) from %s in "
                               "%.1f s", artifacts, traces, kernels, self.path, time.perf_counter() - start)
        return self.loaded

    def _restore_kernels(self, entries: dict[str, dict[str, bytes]]) -> int:
        """moefx's own Triton kernels into Triton's cache folder before their first launch (moefx.kernels.
        triton_cache); a folder that cannot be written costs one warning: the kernels then compile at first launch."""
        try:
            return triton_cache.restore(entries)
        except (OSError, ValueError) as exc:
            log.warning("moefx's Triton kernels from %s could not be written to Triton's cache (%s); they compile "
                        "at their first launch", self.path, exc)
            return 0

    # -- writing ---------------------------------------------------------------------------------------------

    def save(self, force: bool = False) -> int:
        """Write this process's artifacts when something was compiled since the last save (always with
        `force`); the number of artifacts in the file, 0 when there was nothing to write."""
        if self.unwritable:
            return 0
        misses = _misses()
        new_traces = self.steps is not None and self.steps.unsaved()
        if not force and misses == self._misses_at_save and self.saved and not new_traces:
            return 0  # nothing compiled since the file was loaded or written
        self._misses_at_save = misses
        start = time.perf_counter()
        result = torch.compiler.save_cache_artifacts()
        traces = self.steps.collect() if self.steps is not None else {}
        if result is None and not traces:
            return 0
        mega, info = result if result is not None else (None, None)
        kernels = triton_cache.collect()
        payload = pickle.dumps({"artifacts": mega, "traces": traces, "kernels": kernels})
        counts = {kind: len(keys) for kind, keys in info.artifacts.items()} if info is not None else {}
        counts["traces"] = sum(len(items) for items in traces.values())
        header = {"format": FORMAT_VERSION, "identity": self.identity, "stamp": self.stamp, "size": len(payload),
                  "sha256": hashlib.sha256(payload).hexdigest(), "artifacts": counts}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tmp.open("wb") as f:
                f.write(MAGIC)
                f.write(json.dumps(header, sort_keys=True).encode() + b"\n")
                f.write(payload)
            os.replace(tmp, self.path)  # readers see the old file or the new one, never half of one
        except OSError as exc:  # unwritable, full or vanished folder: the cache never costs the result
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self.unwritable = f"{type(exc).__name__}: {exc}"
            log.warning("compile cache %s could not be written (%s); this process keeps running without saving it "
                        "and the next process compiles afresh", self.path, self.unwritable)
            return 0
        self.saved = sum(counts.values())
        if self.steps is not None:
            self.steps.mark_saved()
        progress_logger().info("saved compile cache (%d artifacts, %d traces, %d Triton kernel entries, %.1f MiB) "
                               "to %s in %.1f s", self.saved - counts["traces"], counts["traces"], len(kernels),
                               len(payload) / 2**20, self.path, time.perf_counter() - start)
        return self.saved

    def write_problem(self) -> str | None:
        """Why the file cannot be written in its folder (None: it can)."""
        why = unwritable(self.path)
        return f"compile cache folder {str(self.path.parent)!r} is not writable ({why})" if why else None

    def attach(self, engine: Any) -> None:
        """Become `engine`'s compile store (`DecodeLoop.compile_cache`: loaded before its first request compiles,
        saved after each request that compiled something), keeping its saved traces (`engine.aot_steps`)."""
        engine.compile_cache = self
        self.steps = getattr(engine, "aot_steps", None)


def engine_cache(plan: Any, config: Any, backend: Any, frames: int | None = None) -> CompileCache | None:
    """The artifact file for an engine compiled with `backend` (moefx's), or None when the cache is off; `frames`
    is the handle of the model's compiled frames (frames.py), when it has them."""
    folder = cache_folder(getattr(config, "compile_cache", None))
    manager = getattr(backend, "pass_manager", None)
    if folder is None or manager is None:
        return None
    return CompileCache.for_plan(folder, plan, config, manager.uuid(), frames)
