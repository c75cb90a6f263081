"""The contract every moefx pass follows, and how a pipeline of passes becomes the registry of toggle names.

A pass is one class in one file: `name` is its `PassConfig` toggle, `run()` rewrites the post-grad graph in place
and returns how many rewrites it made. Candidates it leaves alone are recorded with `ctx.skip(reason)` so users see
why in the compile report. Where a pass runs is its place in `moefx.passes.manager.PIPELINE`, the one list of
passes.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch.fx

from moefx.log import get_logger

log = get_logger("moefx.passes")


@dataclass
class PassContext:
    """What a pass may consult and what it reports."""

    config: object  # moefx.config.CompilationConfig
    plan: object | None = None  # moefx.planner.Plan
    skipped: list[str] = field(default_factory=list)
    # every pass the manager runs on this graph (passes that share candidates report each one once)
    enabled: tuple[str, ...] = ()
    # one line per rewrite made, for the compile report and `moefx.explain_fusions`
    notes: list[str] = field(default_factory=list)

    def skip(self, reason: str) -> None:
        self.skipped.append(reason)

    def note(self, rewrite: str) -> None:
        self.notes.append(rewrite)


class MoefxPass:
    name: ClassVar[str]
    # Extra source files whose change must invalidate inductor's cache (the pass's own file is always in).
    uuid_files: ClassVar[tuple[str, ...]] = ()

    def run(self, graph: torch.fx.Graph, ctx: PassContext) -> int:
        raise NotImplementedError

    @classmethod
    def unsupported_reason(cls, ms: object, es: object) -> str | None:
        """None when the pass can run for this ModelSignature × ExecutionSignature, else why not."""
        return None

    @classmethod
    def source_digest(cls) -> str:
        files = [inspect.getsourcefile(cls), *cls.uuid_files]
        digest = hashlib.sha256()
        for path in files:
            digest.update(Path(path).read_bytes())
        return digest.hexdigest()


def registry(pipeline: tuple[type[MoefxPass], ...]) -> dict[str, type[MoefxPass]]:
    """`pipeline`'s passes by toggle name, in pipeline order; each name must be unique and a `PassConfig` toggle."""
    from moefx.config import PassConfig

    by_name: dict[str, type[MoefxPass]] = {}
    for cls in pipeline:
        if cls.name in by_name:
            raise ValueError(f"pass {cls.name!r} is in the pipeline twice")
        if cls.name not in PassConfig.__dataclass_fields__:
            raise ValueError(f"pass {cls.name!r} has no toggle of that name in PassConfig")
        by_name[cls.name] = cls
    return by_name
