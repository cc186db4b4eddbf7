"""The import graph of kvconform's packages: layered, acyclic.

Every ``import`` statement of ``reference``, ``optimized`` and ``properties`` (found where
Python finds the packages, the function-level ones included) is read with :mod:`ast`.
Layers, lowest first (a module may import its own layer or lower ones, never higher):

====  =========================================================================
0     ``reference`` (standard library only)
1     ``optimized``
2     ``properties.core`` (the engine protocol, the trace format, constants)
3     ``properties.engines``, ``properties.checks``, ``properties.generate``
4     ``properties.mutants``
5     ``properties.runner``
6     ``properties.tools``
7     ``kvconform`` (the public API: re-exports) and the deprecated old paths
      (``properties.engine``, ``properties.trace``, ``properties.presets``,
      ``properties.strategies``: aliases of the modules that moved)
====  =========================================================================

Within layer 3 the three packages do not import each other. No module imports the
``properties`` package itself (its ``__init__`` is above every sub-package), and the
graph of modules has no cycle.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGES = ("reference", "optimized", "properties", "kvconform")
LAYERS: dict[str, int] = {
    "reference": 0,
    "optimized": 1,
    "properties.core": 2,
    "properties.engines": 3,
    "properties.checks": 3,
    "properties.generate": 3,
    "properties.mutants": 4,
    "properties.runner": 5,
    "properties.tools": 6,
    "kvconform": 7,
    "properties.engine": 7,
    "properties.trace": 7,
    "properties.presets": 7,
    "properties.strategies": 7,
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, package
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in root.rglob("*.py"):
            parts = path.relative_to(root.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports (``from a import b`` counts ``a.b`` when
    that is a module, else ``a``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def layer_of(module: str) -> tuple[str, int] | None:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix, LAYERS[prefix]
    return None


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in MODULES if m != "properties" and layer_of(m) is None]
    assert not unplaced, f"modules outside every layer: {unplaced}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "properties"))
def test_no_module_imports_a_higher_layer(module: str) -> None:
    own_name, own = layer_of(module)
    for target in GRAPH[module]:
        assert target != "properties", f"{module} imports the properties package itself"
        target_name, layer = layer_of(target)
        assert layer <= own, f"{module} (layer {own}) imports {target} (layer {layer})"
        if layer == own and own == 3:
            assert target_name == own_name, f"{module} imports {target} across layer 3"


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycle = stack[stack.index(target) :] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_the_checker_sees_imports() -> None:
    """The graph is not empty: the CLI imports the runner, the runner the checks."""
    assert "properties.runner.check" in GRAPH["properties.tools.cli"]
    assert "properties.checks.registry" in GRAPH["properties.runner.check"]
