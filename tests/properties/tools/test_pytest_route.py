"""The pytest route as good as the CLI (issue 42): the packaged conformance tests run in a
fresh folder, as an engine team's CI runs them, and their JUnit XML, JSON report and
failure text are compared with what ``kvconform check`` writes for the same run.

* one JUnit testcase per check (``test_check[PROPERTY-CHECK]``) and per listed check
  (``test_xfail[CHECK]``): an XFAIL is an XFAIL of that check, a strict XPASS a
  ``<failure>`` (the job is red and the JUnit says so);
* ``--kv-report-json`` writes the CLI's report (same schema), with the same examples,
  steps, verdicts and checks as ``check --report-json`` on the same seed;
* ``kv_checks_ran`` is the CLI's list of checks (never one the CLI says is off);
  ``kv_seed`` is the seed (or ``derandomized``), never "None";
* a failure's text carries the seed, the trace, its HTML page (written) and the replay
  command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest

from properties.tools.results import SCHEMA_PATH

ROOT = Path(__file__).resolve().parents[3]
MUTANT = "properties.mutants.reference_mutants:make_no_hit_cap"
XFAILS = "hit_bounds  # lookups may hit a whole prompt\n"
SMALL = ["--kv-profile", "dev", "--kv-seed", "7", "--kv-max-examples", "12"]
PLAIN = "tests.properties.tools.broken_engines_37:make_plain"


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "properties.tools.pytest_plugin", "-p",
         "no:cacheprovider", "--pyargs", "kvconform.conformance", *args],
        cwd=folder, env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip


def _cli(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "properties.tools.cli", "check", *args],
        cwd=folder, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=3600,
    )  # fmt: skip


def _cases(junit: Path) -> tuple[dict, dict[str, ET.Element]]:
    suite = ET.parse(junit).getroot().find("testsuite")
    counts = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    return counts, {case.get("name"): case for case in suite.iter("testcase")}


def _state(case: ET.Element) -> str:
    for tag in ("failure", "error", "skipped"):
        found = case.find(tag)
        if found is not None:
            return "xfail" if found.get("type") == "pytest.xfail" else tag
    return "passed"


def test_an_xfailed_check_is_one_testcase_of_many_and_the_rest_pass(tmp_path) -> None:
    (tmp_path / "xf.txt").write_text(XFAILS)
    result = _pytest(
        tmp_path, "--kv-engine", MUTANT, *SMALL, "--kv-xfails-file", "xf.txt",
        "--junitxml", "junit.xml", "-k", "invariants or xfail",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    counts, cases = _cases(tmp_path / "junit.xml")
    assert counts["failures"] == counts["errors"] == 0
    assert _state(cases["test_property[invariants]"]) == "xfail"
    assert _state(cases["test_check[invariants-hit_bounds]"]) == "xfail"
    assert _state(cases["test_xfail[hit_bounds]"]) == "xfail"
    # every other check of the property is a testcase of its own, and passed
    others = [n for n in cases if n.startswith("test_check[invariants-") and "hit_bounds" not in n]
    assert len(others) >= 15
    assert all(_state(cases[n]) == "passed" for n in others)


def test_a_strict_xpass_is_a_failure_in_the_junit_too(tmp_path) -> None:
    (tmp_path / "xf.txt").write_text(XFAILS)
    result = _pytest(
        tmp_path, "--kv-engine", "reference", *SMALL, "--kv-tiers", "none", "--kv-xfails-file",
        "xf.txt", "--junitxml", "junit.xml", "-k", "xfail",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    counts, cases = _cases(tmp_path / "junit.xml")
    assert counts["failures"] == 1
    failure = cases["test_xfail[hit_bounds]"].find("failure")
    assert failure is not None and "XPASS (strict): hit_bounds" in failure.get("message")


def test_the_report_json_is_the_cli_s_for_the_same_run(tmp_path) -> None:
    """Same engine, seed and examples: the same examples, steps, verdicts and checks,
    and ``kv_checks_ran`` is the CLI's list (issue 42: it listed checks the CLI says are
    off for the engine, here an engine without the serving calls)."""
    py_dir, cli_dir = tmp_path / "py", tmp_path / "cli"
    py_dir.mkdir()
    cli_dir.mkdir()
    result = _pytest(
        py_dir, "--kv-engine", PLAIN, *SMALL, "--kv-report-json", "report.json",
        "--junitxml", "junit.xml", "-k", "test_property and (invariants or determinism)",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    cli = _cli(
        cli_dir, "--engine", PLAIN, "--profile", "dev", "--seed", "7", "--max-examples",
        "12", "--only", "invariants", "determinism", "--workers", "1", "--report-json",
        "report.json",
    )  # fmt: skip
    assert cli.returncode == 0, cli.stdout + cli.stderr
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    py_report = json.loads((py_dir / "report.json").read_text())
    cli_report = json.loads((cli_dir / "report.json").read_text())
    jsonschema.validate(py_report, schema)

    def essentials(report: dict) -> list:
        return [
            (p["name"], p["examples"], p["steps"], p["result"], p["checks"])
            for p in report["properties"]
        ]

    assert essentials(py_report) == essentials(cli_report)
    assert py_report["run"]["seed"] == 7 and py_report["exit_code"] == 0
    _counts, cases = _cases(py_dir / "junit.xml")
    props = {
        p.get("name"): p.get("value") for p in cases["test_property[invariants]"].iter("property")
    }
    assert props["kv_checks_ran"].split() == cli_report["properties"][0]["checks"]
    assert "in_flight_reads_held" not in props["kv_checks_ran"]  # off without serving calls
    assert props["kv_seed"] == "7"


def test_a_failure_names_its_seed_trace_page_and_replay(tmp_path) -> None:
    engine = "properties.mutants.reference_mutants:make_null_block_handed_out"
    result = _pytest(tmp_path, "--kv-engine", engine, *SMALL, "-k", "test_property and invariants")
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert "seed: 7" in out
    relative = Path(out.split("trace: ", 1)[1].split()[0])
    trace = tmp_path / relative
    assert trace.is_file() and trace.with_suffix(".html").is_file()
    assert f"report: {relative.with_suffix('.html')}" in out
    assert f"replay: kvconform replay {relative} --engine {engine}" in out


def test_a_report_json_that_cannot_be_written_is_a_usage_error(tmp_path) -> None:
    result = _pytest(tmp_path, "--kv-engine", "reference", "--kv-report-json", str(tmp_path))
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "--kv-report-json" in result.stderr and "is a directory" in result.stderr


def test_a_first_failure_is_announced_as_it_is_found(tmp_path) -> None:
    """Live output: the first failure (and its trace and page) is printed the moment it is
    found, before the shrink and before pytest's own report (issue 42: no output for
    minutes)."""
    result = _pytest(tmp_path, "--kv-engine", MUTANT, "--kv-tiers", "none", "-k",
                     "test_property and invariants")  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    announced = out.index("invariants: first failure [hit_bounds]")
    assert announced < out.index("= FAILURES =")
    assert "first failing trace: " in out[announced:]
