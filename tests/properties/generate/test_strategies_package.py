"""The strategies package re-exports its modules' public names: callers import every
strategy from :mod:`properties.generate.strategies`, whichever module defines it.
Example: ``layouts`` is defined in ``generated_layouts`` and imported as
``from properties.generate.strategies import layouts``."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

from properties.generate import strategies as kvst


def _defined_names(path: Path) -> list[str]:
    """The names a module's top-level statements define (not the names it imports)."""
    names: list[str] = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    return names


def test_every_public_name_of_a_module_is_re_exported() -> None:
    missing = []
    for info in pkgutil.iter_modules(kvst.__path__):
        module = importlib.import_module(f"{kvst.__name__}.{info.name}")
        for name in _defined_names(Path(module.__file__)):
            if not name.startswith("_") and getattr(kvst, name, None) is not vars(module)[name]:
                missing.append(f"{info.name}.{name}")
    assert not missing, f"not re-exported by properties.generate.strategies: {missing}"


def test_all_lists_each_exported_name_once() -> None:
    assert [name for name in kvst.__all__ if not hasattr(kvst, name)] == []
    assert len(set(kvst.__all__)) == len(kvst.__all__)
    assert {"layouts", "traces", "TIERS", "swarm_modes", "bulk_arrivals"} <= set(kvst.__all__)
