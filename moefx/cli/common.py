"""Helpers shared by subcommands: config loading with overrides, progress display, tables."""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Iterator, Sequence

from moefx.config import CompilationConfig


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="config as a .json/.yaml path or a JSON string")


def load_config(args: argparse.Namespace) -> CompilationConfig:
    cfg = CompilationConfig.from_any(getattr(args, "config", None))
    overrides = getattr(args, "config_overrides", [])
    return cfg.with_overrides(overrides) if overrides else cfg


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


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
