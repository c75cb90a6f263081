"""Helpers shared by subcommands: config loading with overrides, progress display, tables."""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from moefx.config import CompilationConfig, load_data_file


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="config as a .json/.yaml path or a JSON string")


def load_config(args: argparse.Namespace) -> CompilationConfig:
    cfg = CompilationConfig.from_any(getattr(args, "config", None))
    overrides = getattr(args, "config_overrides", [])
    return cfg.with_overrides(overrides) if overrides else cfg


def model_config(spec: str) -> dict[str, Any]:
    """The transformers config dict of a built-in name (`moefx.models.catalog`, HF ids too), a config.json or a
    model folder holding one; a missing path is named as missing, not as an unknown built-in name."""
    from moefx.models.catalog import catalog_config, catalog_names

    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"model folder {spec!r} holds no config.json")
    if path.is_file():
        data = load_data_file(path, "model config")
        if not isinstance(data, dict):
            raise ValueError(f"model config {str(path)!r} must hold a JSON object")
        return data
    try:
        return catalog_config(spec)
    except ValueError:
        if "/" in spec or spec.startswith((".", "~")) or spec.lower().endswith((".json", ".yaml", ".yml")):
            raise ValueError(f"model {spec!r}: no such file or folder (nor a built-in name; built-in names: "
                             f"{catalog_names()})") from None
        raise


def add_model_args(parser: argparse.ArgumentParser, default_name: str, positional: bool = True) -> None:
    """MODEL (positional, or `--model`) and `--layers`, as `build_model_from_spec` takes them."""
    from moefx.models.catalog import catalog_names

    names = ["model"] if positional else ["--model"]
    parser.add_argument(*names, nargs="?" if positional else None, default=default_name,
                        help=f"built-in name ({', '.join(catalog_names())}), a config.json or a model folder "
                             f"(default {default_name})")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers to build (default: the dense prefix + 1 MoE layer, at least 2; "
                             "every layer of the built-in tiny model)")


def default_layers(config: dict[str, Any]) -> int:
    """Enough depth to hold every kind of layer once: the dense prefix, then one MoE layer (at least 2 layers)."""
    total = int(config["num_hidden_layers"])
    dense = int(config.get("first_k_dense_replace") or 0)
    return min(total, max(2, dense + 1))


def free_memory_bytes(device: Any) -> int:
    """Memory a new model may take on `device`: free GPU memory, or the host's MemAvailable."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    from moefx.machine import host_memory_available

    avail = host_memory_available()
    if avail is not None:
        return avail
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def build_model_from_spec(spec: str, layers: int | None, device: Any, dtype: Any, seed: int = 0) -> tuple[Any, str]:
    """(causal LM with seeded random weights, a one-line description) for a built-in name or config at `layers`
    decoder layers. The size is computed on the meta device first: a model whose weights would take more than
    half of the free memory is refused with the depth that fits, never built."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    data = model_config(spec)
    total = data.get("num_hidden_layers")
    if not isinstance(total, int) or total < 1:
        raise ValueError(f"model {spec!r}: the config has no num_hidden_layers")
    depth = default_layers(data) if layers is None else layers
    if not 1 <= depth <= total:
        raise ValueError(f"--layers must be between 1 and {total} (the model's depth), got {depth}")
    # Per-layer lists (mlp_only_layers holds indices and is kept) follow the reduced depth.
    data = {k: (v[:depth] if isinstance(v, list) and len(v) == total and k != "mlp_only_layers" else v)
            for k, v in data.items()}
    data["num_hidden_layers"] = depth
    data.pop("torch_dtype", None)
    data["dtype"] = str(dtype).replace("torch.", "")  # transformers builds in the config's dtype: no fp32 copy
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ValueError(f"model {spec!r}: the config states no model_type")
    config = AutoConfig.for_model(model_type, **data)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    width = torch.empty((), dtype=dtype).element_size()
    need = sum(t.numel() for t in (*meta.parameters(), *meta.buffers())) * width
    budget = free_memory_bytes(device) // 2
    if need > budget:
        blocks = list(getattr(getattr(meta, "model", None), "layers", None) or [])
        sizes = [sum(p.numel() for p in b.parameters()) * width for b in blocks]
        used, fits = need - sum(sizes), 0
        for size in sizes:  # the deepest prefix of these layers that fits
            used += size
            if used > budget:
                break
            fits += 1
        hint = f"--layers {fits} fits" if fits >= 1 else "not even one layer fits"
        name = str(dtype).replace("torch.", "")
        raise ValueError(f"model {spec!r} at {depth} layers needs about {need / 2**30:.1f} GiB of {name} weights, "
                         f"more than half of the {2 * budget / 2**30:.1f} GiB free on {device.type}; {hint}")
    del meta
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    return model.eval(), f"{spec} ({depth} of {total} layers, random weights, {need / 2**20:.0f} MiB)"


@contextlib.contextmanager
def progress(message: str, stream=None) -> Iterator[None]:
    """Show `message` with a running elapsed-time counter until the block ends."""
    stream = stream or sys.stderr
    start = time.perf_counter()
    done = threading.Event()
    live = stream.isatty()

    def tick() -> None:
        while not done.wait(0.5):
            stream.write(f"\r{message} ... {time.perf_counter() - start:5.1f}s")
            stream.flush()

    if live:
        thread = threading.Thread(target=tick, daemon=True)
        thread.start()
    else:
        stream.write(f"{message} ...\n")
        stream.flush()
    try:
        yield
    finally:
        done.set()
        stream.write(f"{chr(13) if live else ''}{message} ... done in {time.perf_counter() - start:.1f}s\n")
        stream.flush()


class ProgressBar:
    """A bar over `total` steps on stderr: redrawn in place on a terminal, else a line at most every `every` seconds.
    `note` prints a message above it (stdout, or stderr with err=True) without breaking the bar."""

    WIDTH = 24

    def __init__(self, total: int, stream: Any = None, every: float = 5.0):
        self.total, self.done, self.every = max(total, 1), 0, every
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.start = self.last = time.perf_counter()
        self.label = ""

    def _line(self) -> str:
        filled = self.WIDTH * self.done // self.total
        return (f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.start:6.1f}s  {self.label}")

    def step(self, label: str) -> None:
        """Count the step before this one as done and show `label` as the one running now."""
        self.done = min(self.done + (1 if self.label else 0), self.total)
        self.label = label
        now = time.perf_counter()
        if self.live:
            self.stream.write(f"\r\033[K{self._line()}")
            self.stream.flush()
        elif now - self.last >= self.every:
            self.stream.write(self._line() + "\n")
            self.stream.flush()
            self.last = now

    def note(self, message: str, err: bool = False) -> None:
        if self.live:
            self.stream.write("\r\033[K")
        print(message, file=sys.stderr if err else sys.stdout, flush=True)
        if self.live:
            self.stream.write(self._line())
            self.stream.flush()

    def close(self) -> None:
        self.done, self.label = self.total, "done"
        self.stream.write(f"{chr(13) + chr(27) + '[K' if self.live else ''}{self._line()}\n")
        self.stream.flush()


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
