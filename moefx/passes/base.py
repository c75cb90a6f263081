"""The contract every moefx pass follows, and the registry that maps toggle names to passes.

A pass is one class in one file: `name` is its `PassConfig` toggle, `order` places it in the pipeline,
`run()` rewrites the post-grad graph in place and returns how many rewrites it made. Candidates it
leaves alone are recorded with `ctx.skip(reason)` so users see why in the compile report.
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
    plan: object | None = None  # moefx.signatures.Plan
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
    order: ClassVar[int] = 100
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


PASS_REGISTRY: dict[str, type[MoefxPass]] = {}


def register_pass(cls: type[MoefxPass]) -> type[MoefxPass]:
    """Class decorator: make `cls` selectable by its toggle name."""
    from moefx.config import PassConfig

    if cls.name in PASS_REGISTRY:
        raise ValueError(f"pass {cls.name!r} is registered twice")
    if cls.name not in PassConfig.__dataclass_fields__:
        raise ValueError(f"pass {cls.name!r} has no toggle of that name in PassConfig")
    PASS_REGISTRY[cls.name] = cls
    return cls


def count_targets(graph: torch.fx.Graph, *targets: object) -> int:
    """Number of call nodes whose target is one of `targets` (handy for tests and logs)."""
    wanted = set(targets)
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target in wanted)
