"""``check --pairs-gate``: a supported pair of features left unreached fails the run (exit 4)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from properties.tools.cli import pair_gate_results

ROOT = Path(__file__).resolve().parents[3]


def test_no_missed_line_no_row_and_missed_pairs_are_counted() -> None:
    assert pair_gate_results(["pairs reached: 103 of 103 the engine supports (11 excluded)"]) == []
    rows = pair_gate_results(
        [
            "pairs reached: 100 of 103 the engine supports (11 excluded)",
            "  missed: drafts x {external, load-failures}",
            "  missed: gate x {mamba}",
            "  excluded by the engine's declarations: 4 pairs (no mamba groups: 4)",
        ]
    )
    assert len(rows) == 1 and not rows[0].passed
    assert rows[0].name == "pair-reach" and rows[0].kind == "coverage"
    assert rows[0].failure == (
        "3 supported pairs unreached: drafts x {external, load-failures}; gate x {mamba}"
    )


def test_cli_pairs_gate_fails_a_run_too_short_to_reach_every_pair() -> None:
    """Three examples of one property cannot reach 103 pairs: with the gate the run exits
    4 and names the unreached pairs; without it the same run passes (exit 0)."""
    command = [
        sys.executable, "-m", "properties.tools.cli", "check", "--engine", "reference",
        "--profile", "dev", "--max-examples", "3", "--only", "invariants", "--tiers", "none",
        "--workers", "1", "-q", "--seed", "1",
    ]  # fmt: skip
    gated = subprocess.run(
        [*command, "--pairs-gate"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert gated.returncode == 4, gated.stdout[-2000:] + gated.stderr[-2000:]
    assert "supported pairs unreached" in gated.stdout
    plain = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-2000:]
