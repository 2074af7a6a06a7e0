"""The import rules of docs/architecture.md: the core (minicb/*.py, model/, attention/) imports
nothing from benchmark/, serving/ or course/; the page pool and the trace are leaves; and no
modules import each other, in a cycle of any length, an import inside a function included."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "minicb"
TOOLING = ("minicb.benchmark", "minicb.serving", "minicb.course")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Module -> the minicb modules it imports anywhere in its file. `from pkg import name`
    imports the submodule pkg.name when there is one, else the package."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                          else node.module for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_the_core_imports_no_tooling_and_its_leaves_import_nothing():
    """No core module (runner and model.loader included) imports benchmark, serving or course, and
    kv_cache and trace import no other minicb module."""
    graph = imports()
    core = [m for m in graph if m != "minicb.__main__" and not m.startswith(TOOLING)]
    assert "minicb.runner" in core and "minicb.model.loader" in core
    bad = {m: sorted(i for i in graph[m] if i.startswith(TOOLING)) for m in core}
    assert not {m: i for m, i in bad.items() if i}
    assert graph["minicb.kv_cache"] == set() and graph["minicb.trace"] == set()


OPEN_CYCLES: list[set[str]] = []  # cycles still open, each to be broken by its owner


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for nxt in graph[module]:
            if nxt not in index:
                visit(nxt)
                low[module] = min(low[module], low[nxt])
            elif nxt in stack:
                low[module] = min(low[module], index[nxt])
        if low[module] == index[module]:
            group = set()
            while not group or module not in group:
                group.add(stack.pop())
            if len(group) > 1:
                found.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_modules_import_each_other():
    """Beyond the open cycles listed (each must still exist: remove it once broken)."""
    found = cycles(imports())
    assert [c for c in found if c not in OPEN_CYCLES] == []
    assert [c for c in OPEN_CYCLES if c not in found] == []
