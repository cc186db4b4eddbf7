"""Fast failures: the first failure is announced and its trace saved (replay-verified)
before any shrinking; shrinking is bounded; workers give the result of one process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from hypothesis.internal.conjecture import engine as hypothesis_engine

from properties.core.trace import load_trace
from properties.engines.under_test import resolve_engine
from properties.mutants.reference_mutants import MUTANT_INFO
from properties.runner.check import bounded_shrinking, run_property
from properties.runner.config import CheckConfig
from properties.runner.profiles import load_profile
from properties.runner.run import replay_trace

ROOT = Path(__file__).resolve().parents[3]


def test_first_failure_is_saved_and_announced_before_shrinking(tmp_path) -> None:
    info = MUTANT_INFO["salt_ignored"]
    # the first failure of a drawn example (the reach corpus's session case catches the
    # mutant first, before any example is drawn)
    config = CheckConfig(
        engine=info.target, level="universal", failure_dir=str(tmp_path), reach_corpus=False
    )
    heard = []
    result = run_property(
        "invariants",
        config,
        load_profile("ci"),
        None,
        resolve_engine(info.factory),
        shrink_seconds=0,
        on_first_failure=heard.append,
    )
    assert not result.passed
    assert heard == [result.first]
    first = result.first
    assert first.check in info.caught_by
    assert first.examples >= 1 and first.steps >= 1 and first.seconds >= 0
    assert first.trace_path is not None and first.trace_path.exists()
    _run, exc = replay_trace(load_trace(first.trace_path), config, resolve_engine(info.factory))
    assert exc is not None and exc.name == first.check
    assert first.replay() == (
        f"kvconform replay {first.trace_path} --engine {info.target} --level universal"
    )
    assert result.trace_path is not None and result.trace_path.exists()


def test_shrink_bound_is_applied_and_restored() -> None:
    before = hypothesis_engine.MAX_SHRINKING_SECONDS
    with bounded_shrinking(7.5):
        assert hypothesis_engine.MAX_SHRINKING_SECONDS == 7.5
    assert before == hypothesis_engine.MAX_SHRINKING_SECONDS
    with bounded_shrinking(None):
        assert before == hypothesis_engine.MAX_SHRINKING_SECONDS


def test_two_workers_give_the_table_of_one(tmp_path) -> None:
    """``kvconform check --workers 2`` prints the table ``--workers 1`` prints (the check's
    own processes: the derandomized examples depend on the local modules loaded, since
    Hypothesis draws integers from the constants of local code)."""

    def table(workers: int) -> list[str]:
        command = [
            sys.executable,
            "-m",
            "properties.tools.cli",
            "check",
            "--profile",
            "ci",
            "--only",
            "invariants",
            "determinism",
            "--max-examples",
            "15",
            "--workers",
            str(workers),
            "--failure-dir",
            str(tmp_path),
        ]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        # each property's result line: "  invariants   PASS (15 examples, 210 steps, 0.3s)"
        line = re.compile(r"^  (invariants|determinism) +PASS \((\d+) examples, (\d+) steps")
        found = (line.match(x) for x in done.stdout.splitlines())
        return sorted(m.groups() for m in found if m)

    one, two = table(1), table(2)
    assert one == two and len(one) == 2
    assert all(int(r[1]) > 0 and int(r[2]) > 0 for r in one)
