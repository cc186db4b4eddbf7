"""Per-check control (``--skip-checks``, ``--xfails-file``) and the machine-readable
results (``--report-json``, ``--junit-xml``) of ``kvconform check``.

The mutant ``no_hit_cap`` (a lookup may hit a whole prompt) breaks H1 (``hit_bounds``)
and nothing else: ``tests/properties/mutants/test_mutants.py`` names ``hit_bounds`` as
what catches it on the ci stream. With ``hit_bounds`` in an xfails file the run passes
(XFAIL); the reference, which never breaks H1, fails the same file (XPASS, strict). The
JSON report is validated against the schema shipped with the package and the JUnit XML
is read with :mod:`xml.etree.ElementTree`.
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

from properties.core.constants import EXIT_FAILED, EXIT_PASSED, EXIT_USAGE
from properties.tools.results import SCHEMA_PATH
from properties.tools.selection import CheckSelection, load_selection, parse_xfails
from reference.errors import KVConformError

ROOT = Path(__file__).resolve().parents[3]
MUTANT = "properties.mutants.reference_mutants:make_no_hit_cap"
SCHEMA = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
XFAILS = "# known failures of our engine\n\nhit_bounds   # lookups may hit a whole prompt\n"


def run_cli(*args: str, cwd: Path) -> tuple[int, str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "properties.tools.cli", "check", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )  # fmt: skip (a bound against a hang, never a speed: a loaded machine only waits)
    return proc.returncode, proc.stdout, proc.stderr


def reports(tmp_path: Path) -> tuple[dict, ET.Element]:
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    jsonschema.validate(report, SCHEMA)
    return report, ET.parse(tmp_path / "junit.xml").getroot()


def outputs(tmp_path: Path) -> list[str]:
    return ["--report-json", "report.json", "--junit-xml", "junit.xml"]


# --- the xfails file and the names ------------------------------------------------------


def test_xfails_file_lines() -> None:
    text = "# header\n\n  hit_bounds  # whole prompts # (issue 3)\nexact_match#LRU order\n"
    assert parse_xfails(text) == (
        ("hit_bounds", "whole prompts # (issue 3)"),
        ("exact_match", "LRU order"),
    )
    assert parse_xfails("") == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("hit_bounds\n", "f:1: 'hit_bounds' needs a reason after '#'"),
        ("# c\nno_such_check  # why\n", "f:2: unknown check 'no_such_check'; known: "),
        ("hit_bounds # a\nhit_bounds # b\n", "f:2: 'hit_bounds' is listed twice"),
        ("hit_bounds pool_accounting # a\n", "f:1: one check name per line"),
    ],
)
def test_bad_xfails_file_is_a_usage_error(text: str, expected: str) -> None:
    with pytest.raises(KVConformError) as info:
        parse_xfails(text, "f")
    assert str(info.value).startswith(expected)


def test_skips_must_be_invariants_and_not_expected_to_fail(tmp_path) -> None:
    assert load_selection(["idle_pool_free"], None) == CheckSelection(frozenset({"idle_pool_free"}))
    with pytest.raises(KVConformError, match="'exact_match' is not an invariant"):
        load_selection(["exact_match"], None)
    with pytest.raises(KVConformError, match="unknown check 'bogus'"):
        load_selection(["bogus"], None)
    path = tmp_path / "xf.txt"
    path.write_text("hit_bounds # x\n")
    with pytest.raises(KVConformError, match="both skipped and expected to fail: hit_bounds"):
        load_selection(["hit_bounds"], str(path))


@pytest.mark.parametrize(
    "args",
    [
        ["--skip-checks", "no_such_check"],
        ["--skip-checks", "determinism"],
        ["--xfails-file", "missing.txt"],
        ["--xfails-file", "bad.txt"],
    ],
)
def test_unknown_check_names_exit_2(args: list[str], tmp_path) -> None:
    (tmp_path / "bad.txt").write_text("hit_bound  # a typo\n")
    code, out, err = run_cli(*args, cwd=tmp_path)
    assert code == EXIT_USAGE, out + err
    assert err.startswith("kvconform: ") and len(err.strip().splitlines()) == 1
    assert "properties ran" not in out and "property " not in out  # nothing ran


# --- XFAIL, XPASS and the reports ----------------------------------------------------------


@pytest.mark.slow
def test_xfail_lets_a_mutant_that_breaks_only_that_check_pass(tmp_path) -> None:
    (tmp_path / "xfails.txt").write_text(XFAILS)
    code, out, err = run_cli(
        "--engine", MUTANT, "--only", "invariants", "--workers", "1", "--tiers", "none",
        "--xfails-file", "xfails.txt", *outputs(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert code == EXIT_PASSED, out + err
    assert "invariants: [hit_bounds] failed as expected (XFAIL: lookups may hit" in out
    assert "xfail hit_bounds: XFAIL" in out
    report, junit = reports(tmp_path)
    assert report["result"] == "passed" and report["exit_code"] == 0
    (prop,) = report["properties"]
    assert (prop["name"], prop["result"], prop["xfailed"]) == (
        "invariants",
        "xfailed",
        ["hit_bounds"],
    )
    assert prop["failure"] is None and prop["examples"] > 0 and prop["steps"] > 0
    assert "hit_bounds" in prop["checks"] and "answers" in prop["checks"]
    assert report["xfails"] == [
        {
            "check": "hit_bounds",
            "reason": "lookups may hit a whole prompt",
            "status": "xfail",
            "property": "invariants",
        }
    ]
    suite = junit.find("testsuite")
    assert suite is not None and junit.tag == "testsuites"
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("2", "0", "2")
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    assert set(cases) == {"invariants", "xfail[hit_bounds]"}
    assert cases["invariants"].find("skipped").get("type") == "pytest.xfail"
    assert cases["invariants"].find("failure") is None


@pytest.mark.slow
def test_the_same_mutant_fails_without_the_xfail_and_reports_its_trace(tmp_path) -> None:
    code, out, err = run_cli(
        "--engine", MUTANT, "--only", "invariants", "--workers", "1", "--tiers", "none",
        "--shrink-seconds", "0", *outputs(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert code == EXIT_FAILED, out + err
    report, junit = reports(tmp_path)
    failure = report["properties"][0]["failure"]
    assert report["result"] == "failed" and report["exit_code"] == 1
    assert (failure["check"], failure["kind"]) == ("hit_bounds", "property")
    assert failure["message"].startswith("PropertyViolation: [hit_bounds]")
    assert (tmp_path / failure["trace"]).is_file()
    assert failure["replay"] == (
        f"kvconform replay {failure['trace']} --engine {MUTANT} --level universal"
    )
    assert failure["first"]["check"] == "hit_bounds"
    case = junit.find("testsuite/testcase[@name='invariants']")
    element = case.find("failure")
    assert element.get("type") == "hit_bounds"
    assert f"replay: kvconform replay {failure['trace']}" in element.text
    assert junit.find("testsuite").get("failures") == "1"


def test_xpass_fails_the_run(tmp_path) -> None:
    (tmp_path / "xfails.txt").write_text(XFAILS)
    code, out, err = run_cli(
        "--engine", "reference", "--only", "invariants", "--max-examples", "5",
        "--xfails-file", "xfails.txt", *outputs(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert code == EXIT_FAILED, out + err
    assert "xfail hit_bounds: XPASS" in out
    assert "XPASS (strict): hit_bounds listed in xfails.txt as expected to fail" in out
    report, junit = reports(tmp_path)
    assert report["result"] == "failed" and report["exit_code"] == 1
    assert report["properties"][0]["result"] == "passed"
    assert report["xfails"][0]["status"] == "xpass"
    case = junit.find("testsuite/testcase[@name='xfail[hit_bounds]']")
    assert case.find("failure").get("type") == "xpass"


def test_skipped_checks_do_not_run(tmp_path) -> None:
    code, out, err = run_cli(
        "--engine", "reference", "--only", "invariants", "--max-examples", "5",
        "--skip-checks", "idle_pool_free", "hit_bounds", *outputs(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert code == EXIT_PASSED, out + err
    line = next(line for line in out.splitlines() if line.startswith("  checks: "))
    listed = line.removeprefix("  checks: ").split(", ")
    assert "idle_pool_free" not in listed and "hit_bounds" not in listed
    assert "hit_soundness" in listed and "external_hit_bounds" in listed
    report, _ = reports(tmp_path)
    assert report["run"]["skip_checks"] == ["hit_bounds", "idle_pool_free"]
    checks = report["properties"][0]["checks"]
    assert "idle_pool_free" not in checks and "hit_bounds" not in checks
    assert "pool_accounting" in checks


# --- the same in the pytest plugin ---------------------------------------------------------


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "properties.tools.pytest_plugin",
         "-p", "no:cacheprovider", "-s", "--pyargs", "kvconform.conformance", *args],
        cwd=folder, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.slow
def test_pytest_plugin_xfail_and_xpass(tmp_path) -> None:
    (tmp_path / "xfails.txt").write_text(XFAILS)
    common = ["-k", "invariants", "--kv-xfails-file", "xfails.txt", "--junitxml", "j.xml",
              "--kv-tiers", "none"]  # fmt: skip
    result = _pytest(tmp_path, "--kv-engine", MUTANT, *common)
    assert result.returncode == 0, result.stdout + result.stderr
    # the property's test and the expected failure's own test (test_xfail[hit_bounds])
    assert "2 xfailed" in result.stdout
    cases = ET.parse(tmp_path / "j.xml").getroot().iter("testcase")
    case = next(c for c in cases if c.get("name") == "test_property[invariants]")
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert props["kv_xfailed"] == "hit_bounds" and "hit_bounds" in props["kv_checks_ran"]

    result = _pytest(tmp_path, "--kv-engine", "reference", "--kv-max-examples", "5", *common)
    assert result.returncode == 1, result.stdout + result.stderr
    # every test passes (test_xfail[hit_bounds] is not selected by -k): the session's
    # end names the listed check that never failed, and fails the run
    assert " passed" in result.stdout.splitlines()[-1]
    assert "failed" not in result.stdout.splitlines()[-1]
    assert "kvconform: XPASS (strict): hit_bounds" in result.stdout


def test_pytest_plugin_max_examples_and_bad_names(tmp_path) -> None:
    result = _pytest(
        tmp_path, "--kv-engine", "reference", "-k", "determinism", "--kv-max-examples", "3"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kvconform determinism: 3 examples" in result.stdout
    assert "profile ci, seed derandomized" in result.stdout  # the CLI's default profile
    result = _pytest(tmp_path, "--kv-skip-checks", "no_such_check")
    assert result.returncode == 4  # pytest's usage error
    assert "unknown check 'no_such_check'" in result.stderr


# --- the rules, on hand-made results -------------------------------------------------------


def _result(name: str, check: str | None = None, kind: str = "property"):
    from properties.runner.check import PropertyResult

    if check is None:
        return PropertyResult(name, 10, 100, 1.0)
    return PropertyResult(
        name, 3, 30, 0.5, f"PropertyViolation: [{check}] x", kind=kind, check=check
    )


def test_run_selected_reruns_without_a_listed_invariant() -> None:
    from properties.runner.config import CheckConfig
    from properties.tools.selection import run_selected, xfail_outcomes

    calls: list[tuple[list[str], frozenset[str]]] = []
    answers = {
        # first run: invariants fails on hit_bounds, determinism passes, production fails
        # on exact_match (not an invariant: no second run), attention on a listed check
        ("invariants", frozenset()): _result("invariants", "hit_bounds"),
        ("invariants", frozenset({"hit_bounds"})): _result("invariants", "pool_accounting"),
        ("determinism", frozenset()): _result("determinism"),
        ("production", frozenset()): _result("production", "exact_match"),
    }

    def run(config, names):
        calls.append((names, config.disabled))
        return [answers[(n, config.disabled)] for n in names]

    selection = CheckSelection(
        xfail=(("hit_bounds", "a"), ("exact_match", "b"), ("idle_pool_free", "c"))
    )
    config = CheckConfig(level="exact")
    results, outcomes = run_selected(
        run, config, ["invariants", "determinism", "production"], selection
    )
    assert calls == [
        (["invariants", "determinism", "production"], frozenset()),
        (["invariants"], frozenset({"hit_bounds"})),
    ]
    # invariants: XFAIL on hit_bounds, then a real failure on pool_accounting
    assert results[0].xfailed == ("hit_bounds",) and results[0].check == "pool_accounting"
    assert not results[0].passed
    assert results[1].passed and results[1].xfailed == ()
    assert results[2].passed and results[2].xfailed == ("exact_match",)
    settled = xfail_outcomes(outcomes, {"hit_bounds", "exact_match", "idle_pool_free"})
    assert [(o.check, o.status, o.prop) for o in settled] == [
        ("hit_bounds", "xfail", "invariants"),
        ("exact_match", "xfail", "production"),
        ("idle_pool_free", "xpass", None),
    ]
    assert xfail_outcomes(outcomes, set())[2].status == "not run"


def test_an_engine_error_is_never_an_xfail() -> None:
    from properties.runner.config import CheckConfig
    from properties.tools.selection import run_selected

    def run(config, names):
        return [_result("invariants", "answers", kind="engine")]

    selection = CheckSelection(xfail=(("answers", "protocol"),))
    results, outcomes = run_selected(run, CheckConfig(), ["invariants"], selection)
    assert not results[0].passed and results[0].xfailed == ()
    assert outcomes[0].status == "unknown"


def test_junit_of_an_engine_error_and_an_xpass() -> None:
    from properties.tools.results import build_report, junit_tree
    from properties.tools.selection import XfailOutcome

    report = build_report(
        run={"engine": "e", "level": "universal", "profile": "ci", "preset": None,
             "seed": None, "max_examples": None, "skip_checks": [], "xfails_file": "x"},
        results=[_result("invariants", "answers", kind="engine"), _result("determinism")],
        checks={"invariants": ["answers"], "determinism": ["answers", "determinism"]},
        replays={},
        xfails=[XfailOutcome("hit_bounds", "why", "xpass")],
        versions={"kvconform": "0.1.0", "python": "3", "hypothesis": "6", "torch": None},
        seconds=2.0,
        exit_code=3,
    )  # fmt: skip
    jsonschema.validate(report, SCHEMA)
    assert [p["result"] for p in report["properties"]] == ["engine_error", "passed"]
    suite = junit_tree(report).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("3", "1", "1")
    assert suite.find("testcase[@name='invariants']/error").get("type") == "answers"
    assert suite.find("testcase[@name='xfail[hit_bounds]']/failure").get("type") == "xpass"
    assert suite.find("testcase[@name='determinism']").find("*") is None
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["engine"] == "e" and props["version.torch"] == "None"
