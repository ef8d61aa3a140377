"""The package's layering, read from the source (issue 21, item 7): no import cycle between subpackages, no
module below the launcher imports it, the library imports no benchmark, and no new cycle between files.

Imports inside functions count (they are how cycles hide); imports under ``if TYPE_CHECKING:`` do not (they never
run). The cycles between files that remain are listed in `KNOWN_FILE_CYCLES`: a new cycle fails the test, and so
does a listed one that is gone (the list must shrink with the code)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parent.parent / "src" / "loom"

LAUNCHERS = {"loom.cli", "loom.launch", "loom.ray", "loom.spark"}
"""The top layer: they start processes and may import anything below them (``loom.cli`` above the others)."""
KNOWN_FILE_CYCLES: list[set[str]] = []
"""Cycles between files not yet broken (none: add one here only with the reason it cannot be broken yet)."""


def _modules() -> dict[str, Path]:
    modules = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                if target.split(".")[0] == "loom_bench":
                    edges[name].add("loom_bench")
                    break
                while target and target not in modules and target.startswith("loom."):
                    target = target.rpartition(".")[0]
                if target in modules and target != name:
                    edges[name].add(target)
                    break  # `from pkg import module`: the module is the dependency, not pkg
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in list(edges):
        if v not in index:
            strong(v)
    return found


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_no_cycle_between_subpackages():
    edges = _graph()
    coarse: dict[str, set[str]] = defaultdict(set)
    for a, targets in edges.items():
        for b in targets:
            if _subpackage(a) != _subpackage(b):
                coarse[_subpackage(a)].add(_subpackage(b))
    assert _cycles(coarse) == []


def test_nothing_below_the_launchers_imports_them():
    upward = [
        f"{a} -> {b}"
        for a, targets in _graph().items()
        for b in targets
        if _subpackage(b) in LAUNCHERS and _subpackage(a) not in LAUNCHERS and a != "loom"
    ]
    assert upward == []


def test_the_library_imports_no_benchmark():
    assert [a for a, targets in _graph().items() if "loom_bench" in targets] == []


def test_no_new_cycle_between_files_and_the_known_ones_are_still_listed():
    cycles = _cycles(_graph())
    assert sorted(map(sorted, cycles)) == sorted(map(sorted, KNOWN_FILE_CYCLES))


def test_loom_names_its_public_names_alike_for_type_checkers_and_at_run_time():
    """``loom/__init__`` lists its public names twice: imported under ``if TYPE_CHECKING:`` (what a type checker
    sees) and in ``_LAZY`` (what ``__getattr__`` imports, from where); both must name the same, and each resolve."""
    import loom

    guarded = next(
        node for node in ast.parse((SRC / "__init__.py").read_text()).body if isinstance(node, ast.If)
    )
    typed = {alias.name: node.module for node in guarded.body for alias in node.names}
    assert {name: module for name, module in typed.items() if module != "loom"} == loom._LAZY
    assert sorted(typed) == loom.__all__
    assert all(getattr(loom, name) is not None for name in loom.__all__)
