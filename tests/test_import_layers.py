"""Import layering: neither the config schema nor any algorithm module sits on an import circle (the schema
validates names against the torch-free `megarl.algorithms.catalog`, the registry imports the schema). Every import
counts, including those inside functions (a lazy import is still an edge of the dependency graph), read with `ast`
from the source, so the test needs no import of the package itself."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megarl"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            deps.update(t for t in targets if t in files and t != name)
        graph[name] = deps
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return circles


def test_circle_finder_sees_a_lazy_circle():
    """The finder itself: a circle closed by an import inside a function (schema <-> registry, as it was) is found."""
    graph = {"a.schema": {"a.registry"}, "a.registry": {"a.schema", "a.losses"}, "a.losses": set()}
    assert _circles(graph) == [{"a.schema", "a.registry"}]


def test_config_and_algorithm_layers_import_only_downward():
    graph = _import_graph()
    assert "megarl.algorithms.catalog" in graph["megarl.config.schema"]  # the schema validates names downward
    assert "megarl.config.schema" in graph["megarl.algorithms.registry"]  # the registry reads the schema's types
    layered = [
        c for c in _circles(graph) if any(m.startswith(("megarl.algorithms.", "megarl.config.schema")) for m in c)
    ]
    assert layered == [], f"import circles through the config/algorithm layers: {layered}"
