"""``kvconform fuzz`` (issue 20.1): counters that move while a round runs, a stop within
5 s of ``--minutes``, one report per distinct failure across workers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from properties.tools.fuzz import STOP_GRACE_SECONDS, failure_key

ROOT = Path(__file__).resolve().parents[3]
FREE_HEAD_FIRST = "properties.mutants.reference_mutants:make_free_head_first"


def test_failure_key_is_the_check_name() -> None:
    assert failure_key("PropertyViolation: [hit_bounds] hit 9 > 8") == "hit_bounds"
    assert failure_key("[exact_match] free queue ...\nlengths 3 and 3") == "exact_match"
    assert failure_key("EngineError: allocate_slots('r1') raised\nmore") == (
        "EngineError: allocate_slots('r1') raised"
    )


def test_two_workers_report_one_bug_once_and_stop_on_time(tmp_path) -> None:
    minutes = 0.3  # 18 s of campaign after the workers are started
    command = [
        sys.executable, "-m", "properties.tools.cli", "fuzz", "--engine", FREE_HEAD_FIRST,
        "--level", "exact", "--minutes", str(minutes), "--workers", "2", "--seed", "3",
        "--progress-seconds", "1", "--failure-dir", str(tmp_path / "failures"),
        "--database", str(tmp_path / "db"),
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("kvconform fuzz:")
    started = time.monotonic()
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 1, out + err
    # both workers find free_head_first's exact_match divergence: one report
    reports = [line for line in out.splitlines() if line.startswith("FAILURE (")]
    assert len(reports) == 1 and "[exact_match]" in reports[0], out
    assert "1 failures" in out
    # the campaign ends within STOP_GRACE_SECONDS of --minutes (plus the workers' exit)
    assert took <= minutes * 60 + STOP_GRACE_SECONDS + 5, (took, out)
    # the counters moved while rounds were running (not only at a round's end)
    counts = [int(m) for m in re.findall(r"examples (\d+) ", out)]
    assert any(c > 0 for c in counts), out
