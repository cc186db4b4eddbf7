"""``ci/nightly``, the long job, run in its quick form (dev profile, a few seconds of fuzzing,
two traces to grow the reach corpus, no bench) on the reference and on an engine that
miscounts its free blocks: every step runs, the broken engine's check and campaign fail
with their traces kept in the step's folder, the summary names each step, and the job
exits 1."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BROKEN = "tests.properties.tools.broken_engines:make_miscounts_free_blocks"
BROKEN_LABEL = "tests.properties.tools.broken_engines_make_miscounts_free_blocks"


def test_nightly_runs_every_step_and_fails_on_the_broken_engine(tmp_path) -> None:
    env = {
        **os.environ,
        "NIGHTLY_PROFILE": "dev",
        "NIGHTLY_FUZZ_MINUTES": "0.05",
        "NIGHTLY_WORKERS": "1",
        "NIGHTLY_BENCH": "0",
        "NIGHTLY_REACH_EXAMPLES": "2",
        "NIGHTLY_SEED": "7",
        "NIGHTLY_DIR": str(tmp_path),
        "NIGHTLY_ENGINES": f"reference {BROKEN}",
    }
    done = subprocess.run(
        ["bash", "ci/nightly"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600
    )  # (a bound against a hang, never a speed)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    summary = out[out.index("ci/nightly summary") :].splitlines()[1:]
    verdicts = {line.split()[2]: line.split()[0] for line in summary}
    assert verdicts == {
        "check-reference": "PASS",
        "fuzz-reference": "PASS",
        f"check-{BROKEN_LABEL}": "FAIL",
        f"fuzz-{BROKEN_LABEL}": "FAIL",
        "reach-grow": "PASS",
    }, summary
    # the grown corpus starts from the shipped one
    assert list((tmp_path / "reach").glob("failed-async-load-retry.json"))
    # each failure kept its replayable trace in the step's folder, and each step its log
    for step in ("check", "fuzz"):
        assert list((tmp_path / f"{step}-{BROKEN_LABEL}").glob("*.json")), step
    assert (tmp_path / "check-reference.log").read_text().rstrip().endswith("PASSED")
    assert "seed 7, profile dev" in out
