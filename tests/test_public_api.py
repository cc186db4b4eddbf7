"""The public API (``kvconform``, ``docs/public-api.md``) and the old import paths.

* every name of ``kvconform.__all__`` is the very object of its internal module, and
  ``docs/public-api.md`` lists exactly those names;
* the docs, the README and the examples import kvconform only through ``kvconform``;
* an adapter importing only from ``kvconform`` (``examples/adapters/minimal_adapter.py``)
  passes ``kvconform check --level universal`` (a short run);
* an adapter written against the paths of before the reorganisation
  (``properties.engine``) still runs, and the run prints the deprecation naming the new
  import.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import kvconform
from properties.core import constants, engine, modes
from reference import errors, layout, specs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "adapters"
ADAPTER = EXAMPLES / "minimal_adapter.py"
#: The moved modules kept importable under their old names for one release.
OLD_PATHS = {
    "properties.engine": ("properties.core.engine", "kvconform"),
    "properties.trace": ("properties.core.trace", "properties.core.trace"),
    "properties.presets": ("properties.generate.presets", "properties.generate.presets"),
    "properties.strategies": ("properties.generate.strategies", "properties.generate.strategies"),
}


def test_public_names_are_the_internal_objects() -> None:
    from properties.engines import under_test

    homes = (engine, modes, constants, errors, layout, specs, under_test)
    for name in kvconform.__all__:
        if name == "__version__":
            continue
        obj = getattr(kvconform, name)
        assert any(getattr(home, name, None) is obj for home in homes), name
    assert kvconform.RequestInput is engine.RequestInput
    assert kvconform.KVCacheLayout is layout.KVCacheLayout
    assert issubclass(kvconform.EngineError, kvconform.KVConformError)
    assert kvconform.DEFAULTS.profile == "ci" and kvconform.DEFAULTS.level == "universal"


def test_public_api_doc_lists_every_name() -> None:
    doc = (ROOT / "docs" / "public-api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `([A-Za-z_]+)` \|", doc, re.M))
    assert documented == set(kvconform.__all__) - {"__version__"}


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _kvconform_imports(source: str) -> list[str]:
    """The modules of this project that ``source`` imports."""
    out = []
    for node in ast.walk(ast.parse(source)):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        out += [n for n in names if n.split(".")[0] in ("kvconform", "properties", "reference")]
    return out


def test_docs_and_examples_import_only_kvconform() -> None:
    sources = {
        str(path.relative_to(ROOT)) + f" block {i}": block
        for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for i, block in enumerate(_python_blocks(path.read_text(encoding="utf-8")))
    }
    sources.update(
        {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in EXAMPLES.rglob("*.py")}
    )
    imported = {where: _kvconform_imports(src) for where, src in sources.items()}
    assert any(imported.values())  # the scan sees the imports at all
    offenders = {
        where: names
        for where, names in imported.items()
        if any(n.split(".")[0] != "kvconform" for n in names)
    }
    assert not offenders, f"import from kvconform instead: {offenders}"


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_path_is_the_new_module_with_a_warning(old: str) -> None:
    new, public = OLD_PATHS[old]
    code = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module({old!r})\n"
        f"assert old is importlib.import_module({new!r}), old\n"
        "print([(w.category.__name__, str(w.message)) for w in seen])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "KVConformDeprecationWarning" in out
    assert f"{old} is deprecated and will be removed in kvconform 0.2.0" in out
    assert f"import from {public} instead" in out


def test_deprecation_warning_is_a_deprecation_warning() -> None:
    from properties.core.deprecated import KVConformDeprecationWarning

    assert issubclass(KVConformDeprecationWarning, DeprecationWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a project that turns warnings into errors
        sys.modules.pop("properties.trace", None)
        with pytest.raises(DeprecationWarning, match="properties.trace is deprecated"):
            __import__("properties.trace")


def _check(adapter_dir: Path, engine_name: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(adapter_dir), str(ROOT)])}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(
        [sys.executable, "-m", "properties.tools.cli", "check", "--engine", engine_name,
         "--level", "universal", "--only", "invariants", "determinism", "--max-examples", "10",
         "--workers", "1"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_adapter_on_the_public_api_passes_universal(tmp_path) -> None:
    assert set(_kvconform_imports(ADAPTER.read_text(encoding="utf-8"))) == {"kvconform"}
    result = _check(EXAMPLES, "minimal_adapter:make_engine", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "spec types the engine supports (only these are drawn): full" in result.stdout
    assert re.search(r"invariants +PASS \(\d+ examples, \d+ steps", result.stdout)
    assert re.search(r"determinism +PASS \(\d+ examples, \d+ steps", result.stdout)
    assert "deprecated" not in result.stderr


def test_adapter_on_the_old_paths_runs_and_prints_the_deprecation(tmp_path) -> None:
    source = ADAPTER.read_text(encoding="utf-8")
    old = source.replace(
        "from kvconform import (",
        "from reference.layout import KVCacheLayout\n"
        "from reference.specs import FullAttentionSpec\n"
        "from properties.engine import (",
    )
    old = old.replace("    FullAttentionSpec,\n", "").replace("    KVCacheLayout,\n", "")
    assert "kvconform import" not in old and "from properties.engine import" in old
    (tmp_path / "old_adapter.py").write_text(old, encoding="utf-8")
    result = _check(tmp_path, "old_adapter:make_engine", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "KVConformDeprecationWarning: properties.engine is deprecated and will be removed "
        "in kvconform 0.2.0: import from kvconform instead"
    ) in result.stderr
    assert "old_adapter.py" in result.stderr  # the warning points at the adapter's import
