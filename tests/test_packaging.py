"""What the installed package is made of (``ci/wheel`` checks the built wheel itself).

* every package under ``reference``, ``paged``, ``optimized``, ``properties`` and
  ``kvconform`` is found by the ``[tool.setuptools.packages.find]`` patterns, and ``tests`` is not;
* no module of those packages imports ``tests`` (an installed copy has no ``tests``);
* the ``kvconform`` script and the ``pytest11`` entry point name real objects, and the
  entry point is named after its module (so ``-p`` with the module does not register
  the plugin twice).
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TOPS = ("reference", "paged", "optimized", "properties", "kvconform")


def _packages() -> list[str]:
    return sorted(
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in TOPS
        for p in (ROOT / top).rglob("__init__.py")
    )


def test_find_patterns_cover_every_package() -> None:
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    for package in _packages():
        assert any(fnmatch.fnmatch(package, pattern) for pattern in include), package
    assert not any(fnmatch.fnmatch("tests", pattern) for pattern in include)
    assert not any(fnmatch.fnmatch("tests.properties", pattern) for pattern in include)


def test_no_installed_module_imports_tests() -> None:
    offenders = []
    for top in TOPS:
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and node.level == 0
                    else []
                )
                if any(n == "tests" or n.startswith("tests.") for n in names):
                    offenders.append(str(path.relative_to(ROOT)))
    assert not offenders


def test_entry_points_name_real_objects() -> None:
    module, _, attr = PYPROJECT["project"]["scripts"]["kvconform"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    plugins = PYPROJECT["project"]["entry-points"]["pytest11"]
    assert list(plugins.items()) == [
        ("properties.tools.pytest_plugin", "properties.tools.pytest_plugin")
    ]
    plugin = importlib.import_module("properties.tools.pytest_plugin")
    assert callable(plugin.pytest_addoption) and callable(plugin.pytest_configure)
    assert "addopts" not in PYPROJECT["tool"]["pytest"]["ini_options"]


def test_extras_and_the_report_schema_ship() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    # the plugin's route runs Hypothesis as the CLI does: the same pinned version, so a
    # seed gives the same examples under pytest and under kvconform check
    assert extras["pytest"] == ["pytest>=7", "pytest-xdist", "hypothesis==6.155.2"]
    assert "torch==2.13.0" in extras["cpu"]
    assert {"redis", "gpu", "engines", "test"} <= set(extras)
    assert "jsonschema" in extras["test"]
    package_data = PYPROJECT["tool"]["setuptools"]["package-data"]["properties.tools"]
    assert any(fnmatch.fnmatch("report.schema.json", pattern) for pattern in package_data)
