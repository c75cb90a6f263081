"""Helpers shared by subcommands: config loading with overrides, progress display, tables."""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from moefx.config import CompilationConfig


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="config as a .json/.yaml path or a JSON string")


def load_config(args: argparse.Namespace) -> CompilationConfig:
    cfg = CompilationConfig.from_any(getattr(args, "config", None))
    overrides = getattr(args, "config_overrides", [])
    return cfg.with_overrides(overrides) if overrides else cfg


def add_model_args(parser: argparse.ArgumentParser, default_name: str, positional: bool = True) -> None:
    """MODEL (positional, or `--model`) and `--layers`, as `moefx.models.spec.build_model_from_spec` takes them."""
    from moefx.models.catalog import catalog_names

    names = ["model"] if positional else ["--model"]
    parser.add_argument(*names, nargs="?" if positional else None, default=default_name,
                        help=f"built-in name ({', '.join(catalog_names())}), a config.json or a model folder "
                             f"(default {default_name})")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers to build (default: the dense prefix + 1 MoE layer, at least 2; "
                             "every layer of the built-in tiny model)")




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
