"""Import layering: no module of `megarl/` sits on an import circle, and every import follows the layers written in
the package docstring (`megarl/__init__.py`: a module imports from its own layer or below). Every import counts,
including those inside functions and under `TYPE_CHECKING` (a lazy import is still an edge of the dependency graph),
read with `ast` from the source, so the test needs no import of the package itself."""

from __future__ import annotations

import ast
import re
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


def _written_layers() -> dict[str, int]:
    """Module prefix -> layer index (0 = bottom), read from the table in the package docstring."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    assert doc, "megarl/__init__.py has no docstring: the layers are written there"
    layers: dict[str, int] = {}
    index = -1
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 2 or cells[0] == "layer" or (cells[0] and set(cells[0]) <= {"-"}):
            continue
        if cells[0]:  # a named layer starts; a row with an empty first cell continues the one above
            index += 1
        for prefix in re.findall(r"megarl(?:\.\w+)*", cells[1]):
            layers[prefix] = index
    return layers


def _layer_of(module: str, layers: dict[str, int]) -> int | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in layers:
            return layers[".".join(parts[:n])]
    return None


def _upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                  if (la := _layer_of(a, layers)) is not None and (lb := _layer_of(b, layers)) is not None and lb > la)


def test_megarl_has_no_import_circle():
    circles = _circles(_import_graph())
    assert circles == [], "import circles in megarl/ (move the shared part into a lower module):\n" + "\n".join(
        "  " + " <-> ".join(sorted(c)) for c in circles)


def test_every_module_has_a_written_layer():
    layers = _written_layers()
    assert len(set(layers.values())) == 5, layers
    missing = sorted(m for m in _import_graph() if _layer_of(m, layers) is None and m != "megarl")
    assert missing == [], f"modules with no layer in megarl/__init__.py's table (add their package there): {missing}"


def test_imports_follow_the_written_layers():
    upward = _upward_imports(_import_graph(), _written_layers())
    assert upward == [], ("imports that point to a higher layer than their module's (megarl/__init__.py says which "
                          "layer may import which; move the shared part down):\n  " + "\n  ".join(upward))


def test_layer_checker_sees_an_upward_import_and_the_specific_prefix_wins():
    """The checker itself: the most specific prefix names the layer, and an edge to a higher layer is reported."""
    layers = {"a.config": 0, "a.rewards.registry": 0, "a.rewards": 1, "a.checks": 2}
    graph = {"a.config.load": {"a.checks", "a.rewards.registry"}, "a.rewards.scoring": {"a.config.load"},
             "a.checks": {"a.rewards.scoring"}, "a.rewards.registry": set()}
    assert _layer_of("a.rewards.registry", layers) == 0 and _layer_of("a.rewards.scoring", layers) == 1
    assert _upward_imports(graph, layers) == ["a.config.load -> a.checks"]
