"""Profiles (properties/runner/profiles.py): the derandomized stream does not depend on
the modules a process has loaded, nor on the literals of kvconform's own source."""

from __future__ import annotations

import importlib
import sys

from hypothesis.internal.conjecture import providers

from properties.runner import profiles  # noqa: F401 - pins the constant pool on import


def test_the_constant_pool_ignores_newly_loaded_local_modules(tmp_path, monkeypatch) -> None:
    """Hypothesis reads constants from every local module loaded; kvconform pins the pool
    to an empty one, so loading a module full of new constants changes nothing, and
    neither does a literal added to kvconform itself (4096 is one of its cache sizes)."""
    before = providers._get_local_constants()
    assert 4096 not in before.integers and not before.integers and not before.strings
    (tmp_path / "kv_local_constants_probe.py").write_text(
        "PROBE = 987654321\nNAME = 'kv-probe-string'\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("kv_local_constants_probe")
    try:
        after = providers._get_local_constants()
        assert 987654321 not in after.integers
        assert "kv-probe-string" not in after.strings
        assert after is before
    finally:
        sys.modules.pop("kv_local_constants_probe", None)
