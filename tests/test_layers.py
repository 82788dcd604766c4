"""The package's import graph: no circle between modules, and no import from a lower layer up to a
higher one. Layers, bottom to top: ``envs`` and ``objectives``; ``modules`` and ``models``;
``collectors``; ``trainers``. Every ``import`` counts, at module level and inside functions alike
(a lazy import is still a dependency), read with :mod:`ast` without importing anything."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "torchrl_agent"
LAYERS = {"envs": 0, "objectives": 0, "modules": 1, "models": 1, "collectors": 2, "trainers": 3}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, up `level - 1` packages
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    graph = _graph()
    assert set(LAYERS) <= {name.split(".")[1] for name in graph if "." in name}
    # a known edge of each kind: module level, inside a function, and `from pkg import submodule`
    assert "torchrl_agent.trainers.config" in graph["torchrl_agent.trainers.trainer"]
    assert "torchrl_agent.modules.vllm_policy" in graph["torchrl_agent.trainers.engines"]
    assert "torchrl_agent.trainers.algorithms.ppo" in graph["torchrl_agent.trainers.algorithms"]


def test_no_import_from_a_lower_layer_up_to_a_higher_one():
    upward = [f"{a} -> {b}" for a, targets in _graph().items() for b in sorted(targets)
              if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)]
    assert not upward, "imports from a lower layer up to a higher one:\n" + "\n".join(upward)


@pytest.mark.parametrize("package", ["objectives", "modules", "models", "collectors", "trainers", "envs"])
def test_no_import_circle(package):
    cycles = [c for c in _cycles(_graph()) if any(m.split(".")[1] == package for m in c if "." in m)]
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
