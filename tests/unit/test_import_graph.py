"""Imports run one way: no cycles in the package, the benchmarks or the tools (one graph over all
three, so a cycle through any of them shows), the package never importing the benchmarks or the
tools, and no package module reaching into another's privates.

The graph is read from the source with ``ast``, so imports inside functions (lazy imports, which
hide a cycle from Python but not from a reader) count as edges too. An edge goes to the module
an import names: ``from .pkg import name`` is an edge to ``pkg.name`` when that is a submodule,
else to ``pkg`` itself. The implicit import of a parent package is not an edge: every module
would otherwise sit in a cycle with ``flash_inductor/__init__.py``.

Private names are those starting with one underscore. The one exception is a Triton kernel:
``_attn_fwd`` and its siblings are private by the kernel naming convention, and the launchers
exist to import them.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = "flash_inductor"
# The benchmarks and tools sit above the package: they import it, never the reverse.
TREES = (PACKAGE, "benchmarks", "tools")
REPO = pathlib.Path(__file__).resolve().parents[2]
ROOT = REPO / PACKAGE


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(path): path for tree in TREES for path in sorted((REPO / tree).rglob("*.py"))}


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _resolve(importer: str, level: int, target: str | None) -> str:
    """The absolute name of a relative import's base, as Python resolves it."""
    if level == 0:
        return target or ""
    base = importer.split(".")
    if not _is_package(importer):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of TREES' modules in module."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in TREES:
                    found.append((alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node.level, node.module)
            if base.split(".")[0] not in TREES:
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in MODULES:
                    found.append((submodule, None, node.lineno))
                else:
                    found.append((base, alias.name, node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    return {
        module: {target for target, _, _ in _imports(module) if target in MODULES and target != module}
        for module in MODULES
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _triton_kernels(module: str) -> set[str]:
    """Names of the functions in module decorated with a Triton (or Gluon) jit."""
    tree = ast.parse(MODULES[module].read_text())
    kernels = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if isinstance(target, ast.Attribute) and target.attr == "jit":
                    kernels.add(node.name)
    return kernels


def test_the_package_has_modules_to_check():
    # A path mistake would make every check below pass on an empty graph.
    assert f"{PACKAGE}.api" in MODULES and len(MODULES) > 20
    assert "benchmarks.bench_attention" in MODULES and "tools.launch_sass" in MODULES


def test_imports_have_no_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (lazy imports count):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle_through_a_lazy_import():
    graph = {"benchmarks.a": {"benchmarks.b"}, "benchmarks.b": {"benchmarks.a"}, "tools.c": set()}
    assert _cycles(graph) == [["benchmarks.a", "benchmarks.b"]]


def test_the_package_imports_neither_benchmarks_nor_tools():
    offenders = [f"{MODULES[module].relative_to(REPO)}:{line} imports {target}"
                 for module in MODULES if module.split(".")[0] == PACKAGE
                 for target, _, line in _imports(module) if target.split(".")[0] != PACKAGE]
    assert not offenders, "the package reaches up into benchmarks/ or tools/:\n" + "\n".join(offenders)


def test_no_module_imports_another_modules_private_names():
    offenders = []
    for module in (m for m in MODULES if m.split(".")[0] == PACKAGE):
        for target, name, line in _imports(module):
            if name is None or not name.startswith("_") or name.startswith("__"):
                continue
            if target in MODULES and name in _triton_kernels(target):
                continue
            offenders.append(f"{MODULES[module].relative_to(REPO)}:{line} imports {target}.{name}")
    assert not offenders, "private names imported across modules:\n" + "\n".join(offenders)


def _module_aliases(module: str) -> dict[str, str]:
    """Local names bound to package modules by module's imports (``from . import common``,
    ``from ..launch import hopper``, ``import flash_inductor.x as y``)."""
    tree = ast.parse(MODULES[module].read_text())
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _resolve(module, node.level, node.module)
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in MODULES:
                    aliases[alias.asname] = alias.name
    return aliases


def test_no_module_reads_another_modules_private_names_through_it():
    """``common._x`` reaches into a private as surely as ``from .common import _x`` does."""
    offenders = []
    for module in MODULES:
        aliases = _module_aliases(module)
        for node in ast.walk(ast.parse(MODULES[module].read_text())):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
                continue
            target = aliases.get(node.value.id)
            name = node.attr
            if target is None or target == module or not name.startswith("_") or name.startswith("__"):
                continue
            if name in _triton_kernels(target):
                continue
            offenders.append(f"{MODULES[module].relative_to(ROOT.parent)}:{node.lineno} reads {target}.{name}")
    assert not offenders, "private names read across modules:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]]),
    ],
)
def test_cycle_finder(graph, expected):
    # The checks above are only as good as the cycle finder: prove it finds cycles.
    assert _cycles(graph) == expected
