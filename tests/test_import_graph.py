"""Every moefx module imports, and the module-level imports between moefx's packages form no cycle.

A node is a subpackage of moefx (`moefx.backends`) or a top-level module (`moefx.config`); an edge is an import
statement a module runs when it is imported (the module body, including its `if`/`try`/`with` blocks, but not
`if TYPE_CHECKING:` blocks or imports inside functions and classes, which run later, on call).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import moefx

ROOT = Path(moefx.__file__).parent


def _modules() -> list[str]:
    """Every moefx module but `__main__` (which runs the CLI when imported)."""
    found = pkgutil.walk_packages([str(ROOT)], prefix="moefx.")
    return sorted(info.name for info in found if not info.name.endswith(".__main__"))


def _node(module: str) -> str:
    """The package-level node of a dotted moefx module name: moefx.<first part>, or moefx itself."""
    return ".".join(module.split(".")[:2])


def _module_level(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt
        elif isinstance(stmt, ast.If):
            if not (isinstance(stmt.test, ast.Name) and stmt.test.id == "TYPE_CHECKING"):
                yield from _module_level(stmt.body)
            yield from _module_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, *(h.body for h in stmt.handlers), stmt.orelse, stmt.finalbody):
                yield from _module_level(block)
        elif isinstance(stmt, ast.With):
            yield from _module_level(stmt.body)


def _imported(module: str, path: Path, stmt: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(stmt, ast.Import):
        return [alias.name for alias in stmt.names]
    if stmt.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = package[: len(package) - stmt.level + 1]
        target = ".".join([*base, stmt.module] if stmt.module else base)
    else:
        target = stmt.module or ""
    # `from moefx import passes` imports the subpackage moefx.passes, not only moefx itself.
    return [target] + [f"{target}.{alias.name}" for alias in stmt.names if target == "moefx"]


def package_graph() -> dict[str, dict[str, set[str]]]:
    """node -> imported node -> the modules whose module-level imports make that edge."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for stmt in _module_level(ast.parse(path.read_text()).body):
            for target in _imported(module, path, stmt):
                if target.split(".")[0] != "moefx" or _node(target) == _node(module):
                    continue
                graph.setdefault(_node(module), {}).setdefault(_node(target), set()).add(module)
    return graph


def _cycle(graph: dict[str, dict[str, set[str]]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_module_imports() -> None:
    modules = _modules()
    assert len(modules) > 100
    for name in modules:
        importlib.import_module(name)


def test_no_package_cycle_at_module_level() -> None:
    graph = package_graph()
    assert "moefx.backends" in graph and "moefx.kernels" in graph["moefx.backends"]
    cycle = _cycle(graph)
    why = [f"{a} -> {b} ({', '.join(sorted(graph[a][b]))})" for a, b in zip(cycle[:-1], cycle[1:])] if cycle else []
    assert cycle is None, "package import cycle: " + "; ".join(why)


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycle({"a": {"b": {"a.x"}}, "b": {"c": {"b.y"}}, "c": {"a": {"c.z"}}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": {"a.x"}}, "b": {}}) is None


def test_kernels_is_the_bottom_layer() -> None:
    assert set(package_graph().get("moefx.kernels", {})) == set()
