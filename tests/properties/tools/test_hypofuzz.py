"""The conformance checks under HypoFuzz (``hypothesis fuzz``), as docs/fuzz-campaigns.md
documents them: the three targets of ``kvconform.fuzz_targets`` are collected and fuzzed
(examples land in the database); a target's example fails on a broken engine and passes
on the reference (the same function under plain pytest).

The fuzzer runs until stopped: the test waits, for at most a few minutes (a liveness
bound, never a speed), until the database holds examples, then stops it with SIGINT.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("hypofuzz")

ROOT = Path(__file__).resolve().parents[3]


def test_hypothesis_fuzz_collects_and_fuzzes_the_targets(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    fuzz = Path(sys.executable).with_name("hypothesis")
    proc = subprocess.Popen(
        [str(fuzz), "fuzz", "--no-dashboard", "-n", "1", "--", "-p",
         "properties.tools.pytest_plugin", "--pyargs", "kvconform.fuzz_targets",
         "--kv-engine", "reference", "--kv-profile", "nightly"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    examples = tmp_path / ".hypothesis" / "examples"
    try:
        end = time.monotonic() + 600
        while time.monotonic() < end and proc.poll() is None:
            if examples.is_dir() and sum(1 for p in examples.rglob("*") if p.is_file()) >= 3:
                break
            time.sleep(1)
        assert proc.poll() is None, proc.communicate()[0]  # still fuzzing, never crashed
        stored = sum(1 for p in examples.rglob("*") if p.is_file())
        assert stored >= 3, "the fuzzer stored no examples"
    finally:
        if proc.poll() is None:  # a fuzzer that exited has nothing left to stop
            os.killpg(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=120)[0]
    assert "using 1 process to fuzz 3 tests" in out, out


def test_a_target_fails_on_a_broken_engine_and_passes_on_the_reference(tmp_path) -> None:
    """The same targets as plain Hypothesis tests, a few derandomized examples each, no
    shrinking (a conftest of the temporary folder loads that profile before the targets
    are imported, as an engine's own conftest would)."""
    (tmp_path / "conftest.py").write_text(
        "from hypothesis import Phase, settings\n"
        "settings.register_profile('smoke', max_examples=40, derandomize=True, database=None,"
        " phases=[Phase.explicit, Phase.generate])\n"
        "settings.load_profile('smoke')\n"
    )

    def run(engine: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "properties.tools.pytest_plugin", "-p",
             "no:cacheprovider", "--pyargs", "kvconform.fuzz_targets", "--kv-engine", engine,
             "-k", "invariants", "-q"],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
            text=True, timeout=3600,
        )  # fmt: skip

    broken = run("properties.mutants.reference_mutants:make_null_block_handed_out")
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "PropertyViolation: [pool_accounting]" in broken.stdout
    passing = run("reference")
    assert passing.returncode == 0, passing.stdout + passing.stderr
