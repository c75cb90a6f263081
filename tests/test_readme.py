"""README.md's Python snippets run as written on a CPU machine.

Every ```python block is compiled; each one runs in a fresh namespace unless its first line declares what it
needs that this machine lacks: `# needs: cuda`, `# needs: vllm` or `# needs: network` (a download; never run
here). A README that declares no needs at all predates this convention and is skipped, saying so.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
NEEDS = {
    "cuda": torch.cuda.is_available,
    "vllm": lambda: importlib.util.find_spec("vllm") is not None,
    "network": lambda: False,
}


def python_blocks(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)]


def needs_of(block: str) -> list[str]:
    first = block.splitlines()[0].strip() if block.strip() else ""
    if not first.startswith("# needs:"):
        return []
    return [n.strip() for n in first.removeprefix("# needs:").split(",") if n.strip()]


BLOCKS = python_blocks(README.read_text())


def test_blocks_are_found_and_needs_are_known() -> None:
    assert BLOCKS, "README.md has no ```python blocks"
    for block in BLOCKS:
        unknown = sorted(set(needs_of(block)) - set(NEEDS))
        assert not unknown, f"unknown needs {unknown} in a README snippet; known: {sorted(NEEDS)}"
        compile(block, "README.md", "exec")


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[b.strip().splitlines()[0][:40] for b in BLOCKS])
def test_snippet_runs(index: int) -> None:
    if not any(needs_of(b) for b in BLOCKS):
        pytest.skip("README.md declares no '# needs:' lines: its snippets predate the runnable convention")
    block = BLOCKS[index]
    unmet = [n for n in needs_of(block) if n in NEEDS and not NEEDS[n]()]
    if unmet:
        pytest.skip(f"snippet needs {unmet}")
    import moefx
    from moefx.testing import without_codegen

    moefx.clear_compile_reports()
    with without_codegen():  # a snippet's torch.compile runs the passes; the C++ compile is not what it shows
        exec(compile(block, f"README.md snippet {index}", "exec"), {"__name__": "__readme__"})
