"""Every moefx module imports; moefx's packages form no import cycle, and none imports a layer above its own.

A node is a subpackage of moefx (`moefx.backends`) or a top-level module (`moefx.config`); an edge is any import
statement in a module: in its body (with its `if`/`try`/`with` blocks) and inside functions and classes, which run
later, on call, but are dependencies all the same. Only `if TYPE_CHECKING:` blocks are left out, and imports of the
package root `moefx` (every module runs it anyway; it defines `__version__` and hands the public names on
lazily). The layers are the block under "## Layers" in docs/ARCHITECTURE.md, read here, so the page and the
test cannot drift apart.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path

import moefx

ROOT = Path(moefx.__file__).parent
ARCHITECTURE = ROOT.parent / "docs" / "ARCHITECTURE.md"


def _modules() -> list[str]:
    """Every moefx module but `__main__` (which runs the CLI when imported)."""
    found = pkgutil.walk_packages([str(ROOT)], prefix="moefx.")
    return sorted(info.name for info in found if not info.name.endswith(".__main__"))


def _node(module: str) -> str:
    """The package-level node of a dotted moefx module name: moefx.<first part>, or moefx itself."""
    parts = module.split(".")
    if len(parts) < 2 or not ((ROOT / parts[1]).is_dir() or (ROOT / f"{parts[1]}.py").is_file()):
        return "moefx"  # the root, or a name it defines (`from moefx import __version__`)
    return ".".join(parts[:2])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, at any depth, but those of `if TYPE_CHECKING:` blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]))
        else:
            yield from _imports(child)


def _imported(module: str, path: Path, stmt: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(stmt, ast.Import):
        return [alias.name for alias in stmt.names]
    if stmt.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = package[: len(package) - stmt.level + 1]
        target = ".".join([*base, stmt.module] if stmt.module else base)
    else:
        target = stmt.module or ""
    # `from moefx.passes import fx` imports the module moefx.passes.fx, not only the package.
    return [target] + [f"{target}.{alias.name}" for alias in stmt.names]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports() -> dict[str, set[str]]:
    """module -> the moefx modules (or packages) it imports, anywhere but under TYPE_CHECKING."""
    out: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        module = _module_name(path)
        for stmt in _imports(ast.parse(path.read_text())):
            for target in _imported(module, path, stmt):
                if target.split(".")[0] == "moefx":
                    out.setdefault(module, set()).add(target)
    return out


def package_graph() -> dict[str, dict[str, set[str]]]:
    """node -> imported node -> the modules whose imports make that edge (the root `moefx` left out)."""
    graph: dict[str, dict[str, set[str]]] = {}
    for module, targets in module_imports().items():
        for target in targets:
            if "moefx" in (_node(target), _node(module)) or _node(target) == _node(module):
                continue
            graph.setdefault(_node(module), {}).setdefault(_node(target), set()).add(module)
    return graph


def layers() -> list[list[str]]:
    """The layers docs/ARCHITECTURE.md names, bottom first: each a list of nodes."""
    text = ARCHITECTURE.read_text()
    block = re.search(r"^## Layers\n.*?^```text\n(.*?)^```", text, re.S | re.M)
    assert block, f"{ARCHITECTURE}: no ```text block under '## Layers'"
    rows = [line.split("  ")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    return [[f"moefx.{name.strip()}" for name in row.split("·")] for row in reversed(rows)]


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


def test_function_level_imports_are_counted() -> None:
    graph = package_graph()
    # moefx.planner.resolve imports the backends' policies inside resolve(), and nowhere at module level.
    assert "moefx.planner.resolve" in graph["moefx.planner"]["moefx.backends"]


def test_no_package_cycle() -> None:
    graph = package_graph()
    assert "moefx.backends" in graph and "moefx.kernels" in graph["moefx.backends"]
    cycle = _cycle(graph)
    why = [f"{a} -> {b} ({', '.join(sorted(graph[a][b]))})" for a, b in zip(cycle[:-1], cycle[1:])] if cycle else []
    assert cycle is None, "package import cycle: " + "; ".join(why)


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycle({"a": {"b": {"a.x"}}, "b": {"c": {"b.y"}}, "c": {"a": {"c.z"}}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": {"a.x"}}, "b": {}}) is None


def test_every_package_has_one_layer() -> None:
    named = [node for layer in layers() for node in layer]
    assert len(named) == len(set(named)), f"a package is named in two layers: {sorted(named)}"
    present = {_node(m) for m in (*_modules(), "moefx.__main__")} - {"moefx"}
    assert present - set(named) == set(), "packages without a layer in docs/ARCHITECTURE.md"
    assert set(named) - present == set(), "layers in docs/ARCHITECTURE.md name packages that do not exist"


def test_no_import_runs_up_the_layers() -> None:
    level = {node: i for i, layer in enumerate(layers()) for node in layer}
    upward = [f"{a} (layer {level[a]}) -> {b} (layer {level[b]}): {', '.join(sorted(modules))}"
              for a, targets in package_graph().items() for b, modules in targets.items() if level[b] > level[a]]
    assert upward == [], "imports that run up the layers of docs/ARCHITECTURE.md:\n" + "\n".join(upward)


def test_no_pass_imports_another_pass_or_the_pipeline() -> None:
    from moefx.passes.manager import PIPELINE

    passes = {cls.__module__ for cls in PIPELINE}
    imports = module_imports()
    for module in passes:
        others = {t for t in imports.get(module, set()) if t in passes | {"moefx.passes.manager"} and t != module}
        assert others == set(), f"{module} imports {sorted(others)}"
    for module, targets in imports.items():
        if module.startswith("moefx.passes.") and module not in passes and module != "moefx.passes.manager":
            assert "moefx.passes.manager" not in targets, f"{module} reads the pipeline"
