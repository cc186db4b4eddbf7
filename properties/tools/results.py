"""Results for machines: ``check --report-json FILE`` and ``check --junit-xml FILE``.

:func:`build_report` gathers one ``kvconform check`` run into a plain dictionary (format
``kvconform-report/1``, described by ``properties/tools/report.schema.json``): the run
(engine, level, profile, preset, seed, skipped checks, xfails file), the versions, the
total time, the result (``passed`` or ``failed``) and exit code, one entry per property
(examples, steps, seconds, result, the checks that ran, the listed checks that failed as
expected, and a failure with its check, kind, message, trace path, replay command and
first failure) and one entry per listed check (``xfail``, ``xpass``, ``not run``).

:func:`write_json` writes it; :func:`write_junit` writes the same run as JUnit XML, the
structure CI systems read: ``<testsuites><testsuite name="kvconform" tests failures
errors skipped time>`` with ``<properties>`` (engine, level, profile, seed, versions), one
``<testcase classname="kvconform.ENGINE" name="PROPERTY">`` per property (a ``<failure>``
for a failed check, an ``<error>`` for a protocol or configuration error, ``<skipped
type="pytest.xfail">`` for an XFAIL, as pytest writes it) and one testcase
``xfail[CHECK]`` per listed check (an XPASS is a ``<failure>``).

Worked example: a run whose invariants passed and whose attention property failed on
``attention`` gives ``report["result"] == "failed"``, ``report["properties"][1]
["failure"]["check"] == "attention"`` and, in the XML, ``tests="2" failures="1"``.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from properties.core.output_files import write_text_atomic

REPORT_FORMAT = "kvconform-report/1"
#: The JSON Schema of the report, shipped with the package.
SCHEMA_PATH = Path(__file__).with_name("report.schema.json")

#: A failed result's kind -> the word of the report (PropertyResult.kind).
RESULT_FOR_KIND = {
    "property": "failed",
    "internal": "failed",
    "engine": "engine_error",
    "usage": "config_error",
    "no_layout": "no_layout",
}


def property_entry(result, checks: Sequence[str], replay: str | None) -> dict[str, Any]:
    """One property's entry (``result`` is a :class:`properties.runner.check.PropertyResult`)."""
    if result.passed:
        outcome = "xfailed" if getattr(result, "xfailed", ()) else "passed"
    else:
        outcome = RESULT_FOR_KIND.get(result.kind or "property", "failed")
    entry: dict[str, Any] = {
        "name": result.name,
        "examples": result.examples,
        "steps": result.steps,
        "seconds": round(result.seconds, 3),
        "result": outcome,
        "checks": list(checks),
        "xfailed": list(getattr(result, "xfailed", ())),
        "failure": None,
    }
    if not result.passed:
        first = getattr(result, "first", None)
        entry["failure"] = {
            "check": getattr(result, "check", None),
            "kind": result.kind or "property",
            "message": result.failure,
            "trace": str(result.trace_path) if result.trace_path is not None else None,
            "replay": replay,
            "note": result.note,
            "first": None
            if first is None
            else {
                "check": first.check,
                "seconds": round(first.seconds, 3),
                "example": first.examples,
                "step": first.steps,
                "trace": str(first.trace_path) if first.trace_path is not None else None,
            },
        }
    return entry


def build_report(
    *,
    run: Mapping[str, Any],
    results: Sequence,
    checks: Mapping[str, Sequence[str]],
    replays: Mapping[str, str | None],
    xfails: Sequence,
    versions: Mapping[str, str | None],
    seconds: float,
    exit_code: int,
) -> dict[str, Any]:
    """The report of one run (see the module docstring). ``run`` holds engine, level,
    profile, preset, seed, skip_checks and xfails_file; ``checks`` and ``replays`` are
    per property name; ``xfails`` are :class:`properties.tools.selection.XfailOutcome`."""
    return report_of(
        run,
        [property_entry(r, checks.get(r.name, ()), replays.get(r.name)) for r in results],
        [xfail_entry(o) for o in xfails],
        versions,
        seconds,
        exit_code,
    )


def xfail_entry(outcome) -> dict[str, Any]:
    """One listed check's entry (an :class:`properties.tools.selection.XfailOutcome`)."""
    return {
        "check": outcome.check,
        "reason": outcome.reason,
        "status": outcome.status,
        "property": outcome.prop,
    }


def report_of(
    run: Mapping[str, Any],
    properties: Sequence[Mapping[str, Any]],
    xfails: Sequence[Mapping[str, Any]],
    versions: Mapping[str, str | None],
    seconds: float,
    exit_code: int,
) -> dict[str, Any]:
    """The report from its entries (:func:`property_entry`, :func:`xfail_entry`): what
    ``kvconform check --report-json`` and ``pytest --kv-report-json`` both write."""
    return {
        "format": REPORT_FORMAT,
        "run": dict(run),
        "versions": dict(versions),
        "seconds": round(seconds, 3),
        "result": "passed" if exit_code == 0 else "failed",
        "exit_code": exit_code,
        "properties": [dict(p) for p in properties],
        "xfails": [dict(x) for x in xfails],
    }


def write_json(report: Mapping[str, Any], path: str | Path) -> Path:
    """Write the JSON report whole or not at all
    (:func:`properties.core.output_files.write_text_atomic`)."""
    return write_text_atomic(path, json.dumps(report, indent=2) + "\n", "the JSON report")


def _failure_text(failure: Mapping[str, Any]) -> str:
    lines = [failure["message"] or ""]
    for key in ("note", "trace", "replay"):
        if failure.get(key):
            lines.append(f"{key}: {failure[key]}")
    return "\n".join(lines)


def junit_tree(report: Mapping[str, Any]) -> ET.ElementTree:
    """The JUnit XML of a report (see the module docstring)."""
    run = report["run"]
    classname = f"kvconform.{run.get('engine')}"
    suites = ET.Element("testsuites")
    suite = ET.SubElement(suites, "testsuite", name="kvconform")
    props = ET.SubElement(suite, "properties")
    for key in ("engine", "level", "profile", "preset", "seed"):
        ET.SubElement(props, "property", name=key, value=str(run.get(key)))
    for key, value in report["versions"].items():
        ET.SubElement(props, "property", name=f"version.{key}", value=str(value))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for entry in report["properties"]:
        counts["tests"] += 1
        case = ET.SubElement(
            suite, "testcase", classname=classname, name=entry["name"], time=f"{entry['seconds']}"
        )
        failure = entry["failure"]
        if entry["result"] == "xfailed":
            counts["skipped"] += 1
            ET.SubElement(
                case,
                "skipped",
                type="pytest.xfail",
                message="xfail: " + ", ".join(entry["xfailed"]),
            )
        elif failure is not None:
            tag = "failure" if failure["kind"] in ("property", "internal") else "error"
            counts["failures" if tag == "failure" else "errors"] += 1
            first_line = (failure["message"] or "").splitlines()[0] if failure["message"] else ""
            element = ET.SubElement(
                case, tag, message=first_line[:500], type=failure["check"] or failure["kind"]
            )
            element.text = _failure_text(failure)
    for xfail in report["xfails"]:
        counts["tests"] += 1
        case = ET.SubElement(
            suite, "testcase", classname=classname, name=f"xfail[{xfail['check']}]", time="0"
        )
        message = f"{xfail['status']}: {xfail['reason']}"
        if xfail["status"] == "xpass":
            counts["failures"] += 1
            ET.SubElement(case, "failure", message=f"XPASS(strict) {message}", type="xpass")
        elif xfail["status"] == "xfail":
            counts["skipped"] += 1
            ET.SubElement(case, "skipped", type="pytest.xfail", message=message)
        else:
            counts["skipped"] += 1
            ET.SubElement(case, "skipped", message=message)
    for key, value in counts.items():
        suite.set(key, str(value))
    suite.set("time", f"{report['seconds']}")
    return ET.ElementTree(suites)


def write_junit(report: Mapping[str, Any], path: str | Path) -> Path:
    """Write the JUnit XML whole or not at all."""
    tree = junit_tree(report)
    ET.indent(tree)
    text = ET.tostring(tree.getroot(), encoding="unicode", xml_declaration=True)
    return write_text_atomic(path, text + "\n", "the JUnit XML")
