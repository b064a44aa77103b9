"""No import circles in pipepar: every module's imports of pipepar modules form a DAG.

Every import counts: at module level, inside functions (a lazy import is still a dependency)
and under ``if TYPE_CHECKING:`` (a plan is data; it must not even name its renderer).
Importing ``pipepar.a.b`` also imports the package ``pipepar.a`` (its ``__init__``), and
``from pipepar.a import b`` imports ``pipepar.a.b`` when ``b`` is a submodule (and ``pipepar.a``
itself when ``b`` is a name defined there). A module's own packages (``pipepar``, and
``pipepar.a`` for ``pipepar.a.c``) have started before it runs, so reaching them only as the
parents of an import is no edge; taking a name from one is.
"""

from __future__ import annotations

import ast
import functools
import textwrap
from pathlib import Path

PACKAGE = "pipepar"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def _modules(root: Path) -> dict[str, Path]:
    """Every module under ``root`` (a package), by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _ancestors(name: str) -> set[str]:
    """The packages above module ``name`` (and ``name``): already imported when it runs."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def _with_packages(name: str, importer: str, modules: dict[str, Path]) -> set[str]:
    """Module ``name`` and each package above it (their ``__init__`` runs first), those that
    exist, less the importer's own packages: those have started before the importer runs."""
    packages = _ancestors(name) - {name} - _ancestors(importer)
    return {m for m in packages | {name} if m in modules}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the package that module ``name`` imports, anywhere in its file."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.update(_with_packages(alias.name, name, modules))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = here.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != name.split(".")[0]:
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    # A submodule: imports it, and the packages above it.
                    found.update(_with_packages(f"{base}.{alias.name}", name, modules))
                elif base in modules:
                    # A name defined in `base`: reads its namespace, an ancestor's too.
                    found.update(_with_packages(base, name, modules) | {base})
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the package at ``root`` -> the package's modules it imports."""
    modules = _modules(root)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


@functools.cache
def _pipepar() -> dict[str, set[str]]:
    return import_graph(ROOT)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components in discovery order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(component)
    return components


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One circle through the component's first module (by name), as a path that closes."""
    members = set(component)
    start = min(component)
    # Breadth-first from start within the component back to start: the shortest circle.
    previous: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in seen:
                    seen.add(child)
                    previous[child] = node
                    nxt.append(child)
        frontier = nxt
    return [start, start]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The components that hold a circle: several modules, or one importing itself."""
    return [
        sorted(component)
        for component in strongly_connected(graph)
        if len(component) > 1 or component[0] in graph[component[0]]
    ]


def test_every_kind_of_import_is_an_edge(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg.sub.c import C
            A = 1
            def lazy():
                from . import b
                import pkg.sub.d
        """,
        "pkg/b.py": "from .sub import c\nfrom .a import A\n",
        "pkg/sub/__init__.py": "from pkg import b\n",
        "pkg/sub/c.py": "from ..a import A\nfrom pkg.sub import d\n",
        "pkg/sub/d.py": "import os\nfrom pkg.sub import NAME\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    graph = import_graph(tmp_path / "pkg")
    assert graph["pkg"] == {"pkg.a"}
    # TYPE_CHECKING and lazy imports count; so does each package above the module imported,
    # except the importer's own packages (pkg, for pkg.a).
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.c", "pkg.b", "pkg.sub.d"}
    assert graph["pkg.b"] == {"pkg.sub", "pkg.sub.c", "pkg.a"}
    assert graph["pkg.sub"] == {"pkg.b"}
    assert graph["pkg.sub.c"] == {"pkg.a", "pkg.sub.d"}
    # Taking a name from one's own package is an edge to its __init__.
    assert graph["pkg.sub.d"] == {"pkg.sub"}
    assert _circles(graph) == [["pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c", "pkg.sub.d"]]
    assert _cycle_in(["pkg.b", "pkg.a", "pkg.sub"], graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_a_module_importing_itself_is_a_circle() -> None:
    graph = {"m": {"m", "n"}, "n": set()}
    assert _circles(graph) == [["m"]] and _cycle_in(["m"], graph) == ["m", "m"]


def test_graph_sees_the_package() -> None:
    graph = _pipepar()
    assert "pipepar" in graph and "pipepar.core.schedule" in graph
    # A package's __init__ counts: pipepar.program.rank_messages imports pipepar.ranks.mesh, so
    # pipepar.ranks too.
    assert {"pipepar.ranks", "pipepar.ranks.mesh"} <= graph["pipepar.program.rank_messages"]


def test_no_import_cycles() -> None:
    graph = _pipepar()
    cycles = _circles(graph)
    if cycles:
        lines = []
        for component in cycles:
            lines.append(f"- {len(component)} modules: {', '.join(component)}")
            lines.append(f"  e.g. {' -> '.join(_cycle_in(component, graph))}")
        raise AssertionError(
            "Import circles in pipepar (every import counts: lazy ones inside functions and "
            "those under `if TYPE_CHECKING:` too):\n"
            + "\n".join(lines)
            + "\nTo fix one: move the piece both modules share into a module of its own that "
            "both import, or make the data module not import the code that reads it (the "
            "reader, e.g. a renderer or a dispatcher, imports the data, never the reverse; "
            "put a function that needs both in a module above them)."
        )
