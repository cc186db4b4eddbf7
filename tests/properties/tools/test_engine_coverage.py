"""Engine coverage (``--engine-coverage``): branch coverage of the engine's own modules,
measured wherever the engine runs, with a baseline that fails on a new unreached branch.

The engine is :mod:`tests.properties.tools.toy_cov_adapter`: the reference engine calling
into :mod:`tests.properties.tools.toy_cov_module`, whose branches are known by hand (see
its docstring): 6 branches in function bodies, 3 reached (``parity`` both ways and
``checked_size``'s fall-through), so 50.0%; unreached: ``checked_size`` line 22 -> 23
(the ``raise``) and ``never_called`` line 34 -> 35 and 34 -> 36. The module-level ``if``
(lines 15-18) runs at import, before measuring starts, and is not counted (8 branches
would mean it was). Each run is ``kvconform check`` in its own process, as a user runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from properties.core.constants import EXIT_COVERAGE
from properties.tools.engine_coverage import (
    Branch,
    EngineCoverage,
    EngineCoverageError,
    FunctionRow,
    first_reached,
    format_engine_coverage,
    is_open_gap,
    reach_lines,
    read_baseline,
    read_reasons,
    regressions,
    write_baseline,
)

ROOT = Path(__file__).resolve().parents[3]
TOY = "tests.properties.tools.toy_cov_adapter:make_engine"
TOY_PATH = "tests/properties/tools/toy_cov_module.py"
#: The unreached branches, by hand.
UNREACHED = (f"{TOY_PATH}:22->23", f"{TOY_PATH}:34->35", f"{TOY_PATH}:34->36")


def check(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "properties.tools.cli",
        "check",
        "--engine",
        TOY,
        "--only",
        "determinism",
        "--max-examples",
        "2",
        "--failure-dir",
        str(tmp_path / "failures"),
        *extra,
    ]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def unreached_lines(output: str) -> list[str]:
    return [line.split()[0] for line in output.splitlines() if line.startswith(f"  {TOY_PATH}:")]


@pytest.mark.parametrize(
    "isolation, workers",
    [("none", "1"), ("process", "1"), ("process", "2")],
    ids=["in-process", "isolated", "isolated-in-workers"],
)
def test_toy_engine_coverage_is_exact_wherever_the_engine_runs(
    tmp_path, isolation: str, workers: str
) -> None:
    extra = ["--isolation", isolation, "--workers", workers, "--engine-coverage"]
    if workers == "2":  # two properties, so the pool runs (workers hand their data back)
        extra[-1:] = ["--engine-coverage", "tests.properties.tools.toy_cov_module"]
        extra += ["--only", "determinism", "invariants"]
    run = check(tmp_path, *extra)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "engine branch coverage: 50.0% of 6 branches" in run.stdout
    assert unreached_lines(run.stdout) == list(UNREACHED)
    assert "1/2   tests/properties/tools/toy_cov_module.py  checked_size" in run.stdout
    assert "2/2   tests/properties/tools/toy_cov_module.py  never_called" in run.stdout
    assert "parity" not in run.stdout  # fully covered


def test_baseline_fails_on_a_branch_it_does_not_list_and_passes_otherwise(tmp_path) -> None:
    baseline = tmp_path / "baseline.txt"
    run = check(
        tmp_path,
        "--workers",
        "1",
        "--engine-coverage",
        "--engine-coverage-write-baseline",
        str(baseline),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [r for r in baseline.read_text().splitlines() if not r.startswith("#")]
    assert [r.split("\t")[0] for r in rows] == list(UNREACHED)
    passing = check(
        tmp_path, "--workers", "1", "--engine-coverage", "--engine-coverage-baseline", str(baseline)
    )
    assert passing.returncode == 0, passing.stdout + passing.stderr
    # drop checked_size's raise from the baseline: that branch is now a regression
    baseline.write_text("\n".join(r for r in rows if "checked_size" not in r) + "\n")
    failing = check(
        tmp_path, "--workers", "1", "--engine-coverage", "--engine-coverage-baseline", str(baseline)
    )
    assert failing.returncode == EXIT_COVERAGE == 4, failing.stdout + failing.stderr
    assert (
        f"1 branches unreached that the baseline {baseline} does not list: "
        f"{TOY_PATH}:22->23" in failing.stdout
    )


def test_engine_without_declared_modules_and_unknown_module_are_usage_errors(tmp_path) -> None:
    run = check(tmp_path, "--engine", "reference", "--engine-coverage")
    # --engine given twice: argparse keeps the last one
    assert run.returncode == 2
    assert "declares no coverage_modules" in run.stderr
    run = check(tmp_path, "--engine-coverage", "no_such_pkg.mod")
    assert run.returncode == 2
    assert "--engine-coverage: cannot find module 'no_such_pkg.mod'" in run.stderr
    run = check(tmp_path, "--engine-coverage-baseline", "x.txt")
    assert run.returncode == 2
    assert "need --engine-coverage" in run.stderr


def _branch(line: int, target: int, target_source: str, source: str = "if a:") -> Branch:
    return Branch("m.py", line, target, "f", source, target_source)


def test_baseline_matches_without_line_numbers_and_counts_repeats(tmp_path) -> None:
    result = EngineCoverage(
        (FunctionRow("m.py", "f", 6, 3),),
        (
            _branch(3, 4, "x = 1"),
            _branch(9, 10, "y = 1", "if b:"),
            _branch(9, 12, "y = 2", "if b:"),
        ),
    )
    path = tmp_path / "b.txt"
    write_baseline(result, str(path))
    listed = read_baseline(str(path))
    assert regressions(result, listed) == []
    # the same branches after the code moved down by 5 lines still match
    moved = EngineCoverage(
        result.functions,
        tuple(
            _branch(b.line + 5, b.target + 5, b.target_source, b.source) for b in result.unreached
        ),
    )
    assert regressions(moved, listed) == []
    # "if a: -> x = 1" is listed once: a second unreached copy of it is a regression
    twice = EngineCoverage(result.functions, (_branch(3, 4, "x = 1"), _branch(30, 31, "x = 1")))
    assert [b.where for b in regressions(twice, listed)] == ["m.py:30->31"]
    # a changed target line is another branch
    changed = EngineCoverage(result.functions, (_branch(3, 4, "x = 2"),))
    assert [b.where for b in regressions(changed, listed)] == ["m.py:3->4"]
    # reached since the baseline: both branches of "if b:" are first reached
    fewer = EngineCoverage(result.functions, (_branch(3, 4, "x = 1"),))
    assert [k[3] for k in first_reached(fewer, listed)] == ["y = 1", "y = 2"]
    assert result.percent == 50.0 and result.branches == 6


def test_bad_baseline_is_one_line_error(tmp_path) -> None:
    path = tmp_path / "b.txt"
    path.write_text("# header\nonly\ttwo\n")
    with pytest.raises(EngineCoverageError, match=r"b.txt:2: expected 4 or 5 tab-separated fields"):
        read_baseline(str(path))
    with pytest.raises(EngineCoverageError, match="cannot read"):
        read_baseline(str(tmp_path / "missing.txt"))


def test_reasons_split_the_reachable_branches_from_the_out_of_reach_ones(tmp_path) -> None:
    # 10 branches, 4 unreached: 2 with a reason (out of reach), 1 "open gap", 1 with none.
    # Reachable 10 - 2 = 8, of which 8 - 2 = 6 reached: 75.0%.
    unreached = (
        _branch(3, 4, "x = 1"),
        _branch(5, 6, "raise E", "if bad:"),
        _branch(9, 10, "y = 1", "if b:"),
        _branch(9, 12, "y = 2", "if b:"),
    )
    result = EngineCoverage((FunctionRow("m.py", "f", 10, 4),), unreached)
    path = tmp_path / "b.txt"
    path.write_text(
        "# header\n"
        "m.py:3->4\tf\tif a:\tx = 1\terror path — only a corrupt pool\n"
        "m.py:5->6\tf\tif bad:\traise E\terror path\n"
        "m.py:9->10\tf\tif b:\ty = 1\topen gap\n"
        "m.py:9->12\tf\tif b:\ty = 2\n"
    )
    reasons = read_reasons(str(path))
    assert len(reasons) == 4 and sum(read_baseline(str(path)).values()) == 4
    lines = reach_lines(result, reasons)
    assert lines[0] == (
        "adapter-reachable branch coverage: 75.0% of 8 branches "
        "(2 open gaps; 2 unreached branches out of the adapter's reach)"
    )
    # the two reasons are one kind ("error path"; the detail follows " — ")
    assert [line.split(maxsplit=1) for line in lines[1:]] == [["2", "error path"]]
    # a re-written baseline keeps the reasons of the branches still unreached
    fewer = EngineCoverage(result.functions, unreached[1:])
    again = tmp_path / "again.txt"
    write_baseline(fewer, str(again), reasons)
    assert read_reasons(str(again)) == {
        ("m.py", "f", "if bad:", "raise E"): ["error path"],
        ("m.py", "f", "if b:", "y = 1"): ["open gap"],
        ("m.py", "f", "if b:", "y = 2"): [""],
    }


def test_an_open_gap_may_say_why_and_is_counted_by_that_reason(tmp_path) -> None:
    # 10 branches, 3 unreached: one out of reach (GPU only), two open gaps that say why
    # (one kind, "one rank"): reachable 10 - 1 = 9, reached 9 - 2 = 7 (77.8%)
    unreached = (
        _branch(3, 4, "x = 1"),
        _branch(5, 6, "y = 1", "if tp > 1:"),
        _branch(7, 8, "z = 1", "if pp > 1:"),
    )
    result = EngineCoverage((FunctionRow("m.py", "f", 10, 3),), unreached)
    path = tmp_path / "b.txt"
    path.write_text(
        "m.py:3->4\tf\tif a:\tx = 1\tout of reach on CPU — a CUDA kernel\n"
        "m.py:5->6\tf\tif tp > 1:\ty = 1\topen gap — one rank: tensor parallel\n"
        "m.py:7->8\tf\tif pp > 1:\tz = 1\topen gap — one rank: pipeline parallel\n"
    )
    assert is_open_gap("open gap — one rank: tp") and is_open_gap("") and is_open_gap("open gap")
    assert not is_open_gap("error path — a raise")
    lines = reach_lines(result, read_reasons(str(path)))
    assert lines == [
        "adapter-reachable branch coverage: 77.8% of 9 branches "
        "(2 open gaps; 1 unreached branches out of the adapter's reach)",
        "     1  out of reach on CPU",
        "open gaps by reason (reachable on CPU, not driven):",
        "     2  one rank",
    ]


def test_two_branches_with_the_same_lines_take_their_reasons_in_line_order(tmp_path) -> None:
    # two equal loops in one function: "for c in cs: -> c.go()" at lines 5 and 9; the
    # first is out of reach (rotation), the second an open gap: 1 of 3 out of reach,
    # reachable 4 - 1 = 3, reached 3 - 1 = 2 (66.7%)
    unreached = (_branch(5, 6, "c.go()", "for c in cs:"), _branch(9, 10, "c.go()", "for c in cs:"))
    result = EngineCoverage((FunctionRow("m.py", "f", 4, 2),), unreached)
    path = tmp_path / "b.txt"
    path.write_text(
        "m.py:5->6\tf\tfor c in cs:\tc.go()\trotation\n"
        "m.py:9->10\tf\tfor c in cs:\tc.go()\topen gap\n"
    )
    lines = reach_lines(result, read_reasons(str(path)))
    assert lines[0].startswith("adapter-reachable branch coverage: 66.7% of 3 branches (1 open")
    again = tmp_path / "again.txt"
    write_baseline(result, str(again), read_reasons(str(path)))
    rows = [line for line in again.read_text().splitlines() if not line.startswith("#")]
    assert [line.split("\t")[4] for line in rows] == [
        "rotation",
        "open gap",
    ]


def test_long_table_goes_to_a_file(tmp_path) -> None:
    branches = tuple(_branch(i, i + 1, f"x = {i}") for i in range(1, 46))
    result = EngineCoverage((FunctionRow("m.py", "f", 90, 45),), branches)
    table = tmp_path / "table.txt"
    text = format_engine_coverage(result, str(table))
    assert f"... 5 more; the whole table: {table}" in text
    assert len(table.read_text().splitlines()) == 45
    assert text.splitlines()[-1] == "engine branch coverage: 50.0% of 90 branches"
    assert Counter(line.split()[0] for line in table.read_text().splitlines())["m.py:45->46"] == 1


def test_pytest_option_reports_the_same_coverage(tmp_path) -> None:
    """``--kv-engine-coverage`` of the pytest plugin, on the packaged conformance tests
    (the toy adapter runs isolated there: a module:factory with the default deadline)."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--pyargs",
        "properties.tools.conformance",
        "--kv-engine",
        TOY,
        "--kv-engine-coverage",
        "--kv-profile",
        "dev",
        "-k",
        "determinism",
    ]
    run = subprocess.run(
        command,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "engine branch coverage: 50.0% of 6 branches" in run.stdout
    assert unreached_lines(run.stdout) == list(UNREACHED)
