"""What ``kvconform check`` adds around its properties, kept out of the CLI module:
the per-check selection (:mod:`properties.tools.selection`: ``--skip-checks``,
``--xfails-file``) and the machine-readable results (:mod:`properties.tools.results`:
``--report-json``, ``--junit-xml``).

:func:`run_with_selection` runs the properties under the selection and returns the rows
of the table, with one more row ``xfails`` that fails on an XPASS (as the coverage gate
adds its row); :func:`write_outputs` writes the report files the options ask for.

Worked example: ``kvconform check --xfails-file xf.txt --report-json r.json`` with
``hit_bounds  # known`` in ``xf.txt`` on an engine that breaks H1 only: the invariants
row reads ``xfail``, the report's ``properties[0]["xfailed"] == ["hit_bounds"]`` and
its ``xfails[0]["status"] == "xfail"``; the exit code is 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from properties.core.constants import PROPERTIES

if TYPE_CHECKING:
    from properties.tools.selection import CheckSelection, XfailOutcome

# Nothing of ``reference`` is imported at load time (the CLI imports this module, and a
# ``--coverage`` worker must not have imported the reference before it measures).


@dataclass(frozen=True)
class CheckRun:
    """What :func:`run_with_selection` gives: the rows of the table, the outcome of every
    listed check, the checks each property ran, and when the run started."""

    results: list
    outcomes: list[XfailOutcome]
    ran: dict[str, list[str]]
    started: float


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``check`` that this module serves."""
    p.add_argument(
        "--skip-checks",
        nargs="+",
        default=None,
        metavar="NAME",
        help="invariants not to run (names as in the checks: line)",
    )
    p.add_argument(
        "--xfails-file",
        default=None,
        metavar="FILE",
        help="checks expected to fail, one a line with its reason after '#'; strict: "
        "a listed check that passes fails the run (XPASS)",
    )
    p.add_argument("--report-json", default=None, metavar="FILE", help="write a JSON report")
    p.add_argument("--junit-xml", default=None, metavar="FILE", help="write a JUnit XML report")


def selection_of(args: argparse.Namespace) -> CheckSelection:
    from properties.tools.selection import load_selection

    return load_selection(args.skip_checks, args.xfails_file)


def run_with_selection(
    run: Callable[[object, list[str]], list],
    config,
    wanted: list[str],
    selection: CheckSelection,
    engine,
) -> CheckRun:
    """The results (plus an ``xfails`` row that fails on an XPASS), the outcome of
    every listed check, and the checks each property ran (the invariants the engine's
    capabilities enable, read from ``engine``, the
    :class:`properties.engines.under_test.EngineUnderTest`)."""
    started = time.perf_counter()
    from properties.core.engine import EngineError
    from properties.runner.check import PropertyResult
    from properties.tools.selection import (
        checks_ran,
        engine_checks,
        run_selected,
        xfail_outcomes,
        xpass_failure,
    )

    try:
        active = list(engine_checks(engine, config).runnable)
    except EngineError:  # the properties report it with a trace
        active = []

    def announce(result, reason: str) -> None:
        print(f"  {result.name}: [{result.check}] failed as expected (XFAIL: {reason})")

    results, outcomes = run_selected(run, config, wanted, selection, announce)
    ran = {
        r.name: checks_ran(r.name, active, config.level) for r in results if r.name in PROPERTIES
    }
    outcomes = xfail_outcomes(outcomes, {c for checks in ran.values() for c in checks})
    for o in outcomes:
        print(f"  xfail {o.check}: {o.status.upper()} ({o.reason})")
    failure = xpass_failure(outcomes, selection.source)
    if selection.xfail:
        results.append(PropertyResult("xfails", 0, 0, 0.0, failure, kind="property"))
    return CheckRun(results, outcomes, ran, started)


def write_outputs(
    args: argparse.Namespace, seed: int | None, run: CheckRun, code: int, options: str = ""
) -> None:
    """Write ``--report-json`` and ``--junit-xml`` (when asked for)."""
    if not (args.report_json or args.junit_xml):
        return
    from properties.core.versions import versions
    from properties.runner.check import replay_command
    from properties.tools.results import build_report, write_json, write_junit

    report = build_report(
        run={
            "engine": args.engine,
            "level": args.level,
            "profile": args.profile,
            "preset": args.preset,
            "seed": seed,
            "max_examples": args.max_examples,
            "skip_checks": sorted(args.skip_checks or ()),
            "xfails_file": args.xfails_file,
        },
        results=[r for r in run.results if r.name != "xfails"],
        checks=run.ran,
        replays={
            r.name: replay_command(
                r.trace_path, args.engine, args.level, r.name == "attention", options
            )
            for r in run.results
            if r.trace_path is not None
        },
        xfails=run.outcomes,
        versions=versions(),
        seconds=time.perf_counter() - run.started,
        exit_code=code,
    )
    from properties.core.output_files import OutputWriteError

    for label, option, write in (
        ("report", args.report_json, write_json),
        ("junit", args.junit_xml, write_junit),
    ):
        if not option:
            continue
        try:  # a write that fails now says so and leaves the run's exit code alone
            print(f"  {label}: {write(report, option)}")
        except OutputWriteError as exc:
            print(f"  {label}: not written: {exc}", file=sys.stderr)


def validate_outputs(args: argparse.Namespace) -> None:
    """The output paths of ``check``, checked before anything runs (a usage error, exit
    2: :mod:`properties.core.output_files`): the report files writable, not directories,
    not the same file; the failure directory one that takes new files."""
    from properties.core.output_files import (
        check_distinct,
        check_output_dir,
        check_output_file,
    )

    outputs = {"--report-json": args.report_json, "--junit-xml": args.junit_xml}
    for option, path in outputs.items():
        if path is not None:
            check_output_file(path, option)
    check_distinct(outputs)
    check_output_dir(args.failure_dir, "--failure-dir")
