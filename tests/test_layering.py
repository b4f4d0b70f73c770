"""The import graph of gateway/ and gpu_backend/, read with `ast`: no circles, and no crossing between the two
sides (the gateway runs on a DPU: it reaches the GPU host only through `protocols/`).

Edges are module-level imports, those under `if TYPE_CHECKING:` included (a circle of type hints is still a
circle in the design); imports inside functions are not edges (they run late, when everything is loaded)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The absolute modules an `from ... import ...` names (a name may be a submodule or an attribute)."""
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]


def module_level_imports(tree: ast.Module):
    """Import nodes that run when the module is imported (TYPE_CHECKING blocks included)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            stack.extend(ast.iter_child_nodes(node))
        elif isinstance(node, ast.ExceptHandler):
            stack.extend(node.body)


def import_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module -> the modules it imports (any module, in or out of `packages`)."""
    graph: dict[str, set[str]] = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            module, tree = module_name(path), ast.parse(path.read_text(), str(path))
            targets = graph.setdefault(module, set())
            for node in module_level_imports(tree):
                if isinstance(node, ast.Import):
                    targets.update(alias.name for alias in node.names)
                else:
                    targets.update(resolve(module, path.name == "__init__.py", node))
    return graph


def internal_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph restricted to its own modules (a `from pkg import name` of an attribute is no edge)."""
    return {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_circle_finder_finds_a_circle_through_type_hints(tmp_path):
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_circle(edges) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import Y\n"
                     "def f():\n    from .z import W\n")
    names = [resolve("p.m", False, n) for n in module_level_imports(tree) if isinstance(n, ast.ImportFrom)]
    assert ["p.x", "p.x.Y"] in names and not any("p.z" in n for n in names)


@pytest.mark.parametrize("package", ["gateway", "gpu_backend"])
def test_no_import_circle(package):
    circle = find_circle(internal_edges(import_graph((package,))))
    assert circle is None, f"import circle in {package}/: {' -> '.join(circle)}"


@pytest.mark.parametrize("package, forbidden", [("gateway", ("kernels", "gpu_backend")),
                                                ("gpu_backend", ("gateway",))])
def test_no_import_across_the_sides(package, forbidden):
    graph = import_graph((package,))
    for path in sorted((ROOT / package).rglob("*.py")):  # here imports inside functions count too
        module = module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[module].update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                graph[module].add(node.module or "")
    crossings = sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets
                       if t.split(".")[0] in forbidden)
    assert not crossings, f"{package}/ must reach the other side only through protocols/: {crossings}"
