"""The pytest plugin and the packaged conformance tests, in a project of their own.

Each test runs pytest in a fresh process from an empty folder (the plugin named with
``-p`` as its ``pytest11`` entry point would load it in an installed copy):

* installed in a project that does not opt in, the plugin leaves Hypothesis' settings
  alone; ``--kv-profile`` or the ini setting ``kv_hypothesis_profile`` load ours;
* ``--pyargs properties.tools.conformance`` runs every property on an engine
  given by ``--kv-engine`` and reports a broken engine with the replay command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from properties.core.constants import PROPERTIES

ROOT = Path(__file__).resolve().parents[3]

PROBE = """
from hypothesis import settings

def test_profile():
    print("MAX_EXAMPLES", settings.default.max_examples)
"""


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}  # ci/test runs with CI=true
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "properties.tools.pytest_plugin",
         "-p", "no:cacheprovider", "-s", *args],
        cwd=folder, env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip


def test_plugin_changes_no_hypothesis_setting_unless_asked(tmp_path) -> None:
    (tmp_path / "test_probe.py").write_text(PROBE)
    assert "MAX_EXAMPLES 100" in _pytest(tmp_path, "test_probe.py").stdout
    assert "MAX_EXAMPLES 40" in _pytest(tmp_path, "test_probe.py", "--kv-profile", "dev").stdout
    (tmp_path / "pytest.ini").write_text("[pytest]\nkv_hypothesis_profile = auto\n")
    assert "MAX_EXAMPLES 40" in _pytest(tmp_path, "test_probe.py").stdout


def test_conformance_module_runs_every_property(tmp_path) -> None:
    result = _pytest(
        tmp_path, "--pyargs", "properties.tools.conformance", "--kv-engine", "reference",
        "--kv-level", "exact", "--kv-profile", "dev", "--kv-seed", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # a test per property and one per check it ran (none failed)
    passed = int(result.stdout.rsplit(" passed", 1)[0].rsplit(None, 1)[-1])
    assert passed > len(PROPERTIES) * 4, result.stdout[-2000:]
    for prop in PROPERTIES:
        assert f"kvconform {prop}:" in result.stdout


def test_conformance_module_reports_a_broken_engine(tmp_path) -> None:
    engine = "properties.mutants.reference_mutants:make_null_block_handed_out"
    result = _pytest(
        tmp_path, "--pyargs", "properties.tools.conformance", "--kv-engine", engine,
        "--kv-profile", "dev", "-k", "invariants",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "replay: kvconform replay .kvconform/failures/" in result.stdout
    assert list((tmp_path / ".kvconform" / "failures").glob("*.json"))
