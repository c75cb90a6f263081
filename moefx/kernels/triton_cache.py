"""moefx's own Triton kernels' compiled binaries, carried in the engine's compile-cache file.

moefx launches its Triton kernels from its custom ops, so Triton compiles each specialization at its first launch
and keeps it in its cache folder (`TRITON_CACHE_DIR`, default `~/.triton/cache`); inductor's artifacts (the
Mega-Cache bytes beside these entries) do not hold them. A process on a new machine, with an empty Triton folder,
would compile them again while it captures its first graphs. `collect` reads the cache entries of moefx's kernels
(and the launcher stubs Triton builds per kernel signature) so the compile-cache file can carry them; `restore`
writes them into this machine's Triton folder before the first launch. Triton's cache key covers the kernel source,
its specialization, the compiler version and the target, so an entry written here is used only where it is the
binary Triton would build; a mismatch costs nothing but the compile it would have done anyway.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MAX_BYTES = 64 << 20  # an upper bound on what one file carries; entries past it are left out (and compiled there)
LAUNCHER = "__triton_launcher"
GROUP = "__grp__"
KERNEL_TYPES = ("JITFunction", "InterpretedFunction")  # triton.jit's result, compiled or under TRITON_INTERPRET


def cache_dir() -> Path | None:
    """Triton's cache folder in this process, or None without triton."""
    try:
        from triton import knobs
    except ImportError:
        return None
    folder = getattr(getattr(knobs, "cache", None), "dir", None)
    return Path(folder) if folder else Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))


def moefx_kernel_names() -> set[str]:
    """The names of the Triton kernels defined in moefx's modules loaded in this process (jit functions, also
    inside autotuners and heuristics)."""
    names = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("moefx.") or module is None:
            continue
        for value in vars(module).values():
            fn = value
            while hasattr(fn, "fn") and type(fn).__name__ not in KERNEL_TYPES:
                fn = fn.fn  # Autotuner / Heuristics -> the JITFunction
            # the function's own module: a kernel imported from elsewhere is named where it is defined too
            if type(fn).__name__ in KERNEL_TYPES and getattr(fn.fn, "__module__", "").startswith("moefx"):
                names.add(fn.fn.__name__)
    return names


def _entry_kind(entry: Path, names: set[str]) -> str | None:
    """'kernel' for a compiled moefx kernel's folder, 'launcher' for a launcher stub's, else None."""
    files = [f.name for f in entry.iterdir() if f.is_file()]
    if any(f.startswith(LAUNCHER) for f in files):
        return "launcher"
    for f in files:
        if f.endswith(".json") and not f.startswith(GROUP):
            try:
                meta = json.loads((entry / f).read_text())
            except (OSError, ValueError):
                return None
            if isinstance(meta, dict) and meta.get("name") in names:
                return "kernel"
    return None


def entries(names: set[str] | None = None) -> dict[str, str]:
    """{entry folder name: "kernel" or "launcher"} for moefx's kernels (`names`, default those loaded) and the
    launcher stubs in Triton's cache folder, in name order. Nothing when triton or its folder is missing or
    unreadable."""
    folder = cache_dir()
    if folder is None or not folder.is_dir():
        return {}
    names = moefx_kernel_names() if names is None else names
    found: dict[str, str] = {}
    try:
        for entry in sorted(folder.iterdir()):
            kind = entry.is_dir() and _entry_kind(entry, names)
            if kind:
                found[entry.name] = kind
    except OSError:
        return {}
    return found


def collect(names: set[str] | None = None, limit: int = MAX_BYTES) -> dict[str, dict[str, bytes]]:
    """{entry folder name: {file name: bytes}} of moefx's kernels and the launcher stubs in Triton's cache, at most
    `limit` bytes (kernels first). Nothing when triton or its folder is missing or unreadable."""
    found = entries(names)
    folder = cache_dir()
    if not found or folder is None:
        return {}
    out: dict[str, dict[str, bytes]] = {}
    total = 0
    for name in sorted(found, key=lambda n: found[n] != "kernel"):  # kernels first, each kind in name order
        entry = folder / name
        try:
            files = {f.name: f.read_bytes() for f in entry.iterdir() if f.is_file() and f.name != "lock"}
        except OSError:
            continue
        size = sum(len(b) for b in files.values())
        if total + size > limit:
            continue
        out[entry.name] = files
        total += size
    return out


def restore(entries: dict[str, dict[str, bytes]]) -> int:
    """Write the entries Triton's cache folder lacks; returns how many were written. A group file's child paths
    name the folder they were saved from, so they are pointed at this one. Raises OSError where the folder cannot
    be written (the caller warns once and goes on: the kernels then compile at their first launch)."""
    folder = cache_dir()
    if folder is None or not entries:
        return 0
    written = 0
    for key, files in entries.items():
        target = folder / key
        if target.is_dir() and all((target / name).is_file() for name in files):
            continue
        target.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            if name.startswith(GROUP):
                group = json.loads(data)
                group["child_paths"] = {c: str(target / Path(p).name) for c, p in group.get("child_paths", {}).items()}
                data = json.dumps(group).encode()
            tmp = target / f".{name}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, target / name)
        written += 1
    return written
