"""The ``kvconform`` command line.

* ``kvconform check --engine NAME|module:factory [--level universal|exact]
  [--profile dev|pr|ci|nightly|gpu] [--preset NAME] [--no-attention]``: runs the
  properties and prints a table (property, examples, steps, time, result; a row per
  scale tier under each property: small, medium, offline, production); exit 1
  on any failure, after writing the shrunk trace and printing its replay command.
* ``kvconform fuzz --engine ... --minutes N [--workers K]``: a campaign with a live
  progress line, the Hypothesis database under ``.kvconform/``, Ctrl-C stops cleanly.
* ``kvconform replay TRACE --engine ...``: replays one trace, shows the first failure
  or divergence (operation, group, expected and observed tables).
* ``kvconform corpus export DIR`` / ``corpus run DIR --engine ... [--level]``: the
  conformance corpus (traces with the reference's expected results), replayed without
  Hypothesis (:mod:`properties.tools.corpus`, ``docs/corpus-format.md``).
* ``kvconform bench suite|engines|attention|device``: speed figures.

Exit codes (one table: :mod:`properties.core.outcome`): 0 passed, 1 a property failed,
2 usage or configuration error (bad option or value, unknown preset, an adapter that
cannot be loaded, an engine that rejects every layout, an input file beyond its bounds),
3 the engine broke the protocol (an exception, a malformed answer, a call past
``--call-timeout``, a worker it ended), 4 an engine branch unreached that
``--engine-coverage-baseline`` does not list (or, with ``--pairs-gate``, a supported
pair of features unreached), 70 a bug of kvconform itself, 130 SIGINT
and 143 SIGTERM when nothing failed before (:mod:`properties.tools.stopping`). When
several properties end differently the code is the most severe: 70, 2, 3, 1, 4. Errors
are one line; a traceback only with ``--verbose``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time
import traceback
from pathlib import Path

from properties.core.constants import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_DATABASE_DIR,
    DEFAULT_FAILURE_DIR,
    DEFAULT_ISOLATION,
    DEFAULT_LEVEL,
    DEFAULT_PROFILE,
    EXIT_FAILED,
    EXIT_PASSED,
    EXIT_USAGE,
    ISOLATION_MODES,
    LEVELS,
    PROFILES,
    PROPERTIES,
)
from properties.core.engine import EngineError, EngineLoadError, UnsupportedLayoutError
from properties.core.outcome import Outcome, combined_exit_code
from properties.tools import check_outputs
from properties.tools.options import check_numbers, selected_tiers
from properties.tools.stopping import Stopped, stop_on_signals, stopped_exit_code
from reference.errors import KVConformError


def exit_code(kinds: list[str | None]) -> int:
    """The exit code of several results (:func:`properties.core.outcome.combined_exit_code`)."""
    return combined_exit_code(kinds)


def usage_error(message: str) -> KVConformError:
    return KVConformError(message)


def config_from_args(args: argparse.Namespace, **extra):
    from properties.runner.config import CheckConfig

    return CheckConfig(
        engine=args.engine,
        level=args.level,
        failure_dir=args.failure_dir,
        call_timeout=args.call_timeout,
        isolation=args.isolation,
        **extra,
    )


def cmd_check(args: argparse.Namespace) -> int:
    if args.engine == "vllm-scheduler":  # vLLM's own scheduler (issue 19, item 5)
        from properties.tools.scheduler_level import cmd_check as scheduler_level

        return scheduler_level(args)
    from properties.core.constants import SPEC_KINDS
    from properties.runner.profiles import load_profile
    from properties.tools.selection import with_skips

    started = time.monotonic()
    wanted = wanted_properties(args)  # an empty selection is refused before anything runs
    check_outputs.validate_outputs(args)  # a bad output path costs seconds, not the run
    selection = check_outputs.selection_of(args)
    config = with_skips(
        config_from_args(args, preset=args.preset, reach_corpus=not args.no_reach_corpus),
        selection,
    )
    profile = load_profile(args.profile)
    seed = args.seed
    if seed is None and not profile.derandomize:
        seed = random.SystemRandom().randrange(2**32)
    print(
        f"kvconform check: engine={args.engine} level={args.level} profile={args.profile} "
        f"preset={args.preset or '-'} seed={seed if seed is not None else 'derandomized'}",
        flush=True,
    )
    from properties.runner.profiles import profile_note

    note = profile_note(args.profile)
    if note:  # a reduced profile says what it leaves to the gate
        print(f"  {note}")
    engine = config.resolve_engine()
    if engine.spec_types != SPEC_KINDS:
        print(
            "  spec types the engine supports (only these are drawn): "
            f"{', '.join(engine.spec_types)}"
        )
    for d in engine.known_divergences:
        where = (
            "examples that meet it stop there uncounted (the adapter detects it)"
            if d.at_run_time
            else f"layouts where it applies run without {', '.join(d.checks)}"
            if d.checks
            else "layouts where it applies are not drawn"
        )
        print(f"  known divergence {d.name}: {d.summary}\n    {where}; see {d.finding}")
    from properties.runner.explain import format_summary
    from properties.runner.progress import configure_progress
    from properties.tools.engine_coverage import cli_session
    from properties.tools.report import failure_lines, report_beside

    configure_progress(args.quiet, args.workers if args.workers is not None else 2)
    with cli_session(args, engine, config) as finish_engine_coverage:  # --engine-coverage
        print(format_active_checks_or_why(engine, config))
        try:
            run = check_outputs.run_with_selection(
                lambda cfg, names: run_checks(args, cfg, names, seed, engine),
                *(config, wanted, selection, engine),
            )
        except Stopped as stop:
            return report_stopped(stop)
        regression = finish_engine_coverage()
    results = run.results
    if regression:
        from properties.runner.check import PropertyResult

        row = PropertyResult("engine-coverage", 0, 0, 0.0, regression, kind="coverage")
        results = [*results, row]
    for r in results:  # each result once: the rows not announced as they ended
        if not getattr(r, "announced", False):
            print_result_line(r)
    pair_lines = format_pair_reach(results, engine)
    print("\n".join(pair_lines))
    if getattr(args, "pairs_gate", False):
        results = [*results, *pair_gate_results(pair_lines)]
    failed = [r for r in results if not r.passed]
    reports = {}
    for r in failed:
        title = Outcome.from_kind(result_kind(r)).title
        print(f"\n{title} in {r.name}: {r.failure.splitlines()[0]}")
        print("\n".join(failure_lines(r.trace_path, r.failure)))
        if r.note:
            print(f"  note: {r.note}")
        if getattr(r, "reduced", None):
            print(f"  {r.reduced}")
        if getattr(r, "first", None) is not None:
            print(f"  {r.first.describe()}")
        if r.trace_path is not None:  # the summary below prints its path and replay
            report, line = report_beside(r.trace_path)
            reports[r.name] = report if report is not None else line
    wall = time.monotonic() - started
    options = config.replay_options()
    print(
        "\n"
        + format_summary(
            results, args.engine, args.level, reports, wall_seconds=wall, options=options
        )
    )
    code = exit_code([result_kind(r) for r in results])
    check_outputs.write_outputs(args, seed, run, code, options)
    return code


def wanted_properties(args: argparse.Namespace) -> list[str]:
    """The properties ``check`` runs: every one, less ``attention`` with
    ``--no-attention``, only those ``--only`` names. A selection that leaves none is a
    usage error naming the options that emptied it (a run that checks nothing must never
    pass). Example: ``--only attention --no-attention`` -> ``KVConformError("no property
    left to run: --only names attention and --no-attention removes attention")``."""
    if args.only is not None and not args.only:
        raise usage_error(f"--only names no property (choose from {', '.join(PROPERTIES)})")
    wanted = [p for p in PROPERTIES if not (p == "attention" and args.no_attention)]
    if args.only:
        wanted = [p for p in wanted if p in args.only]
    if not wanted:
        raise usage_error(
            f"no property left to run: --only names {', '.join(args.only)} and "
            "--no-attention removes attention"
        )
    return wanted


def result_kind(result) -> str | None:
    """A result's kind; a failed row without one (the coverage gate) is a failure."""
    if result.passed:
        return None
    return getattr(result, "kind", None) or "property"


def format_active_checks_or_why(engine, config) -> str:
    """:func:`format_active_checks`, or why the engine's capabilities are unknown (its
    factory failed on the probe layouts: the properties report that as an engine error
    with a trace)."""
    try:
        return format_active_checks(engine, config)
    except EngineLoadError:
        raise
    except EngineError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"  capabilities: unknown (the engine could not be built: {first})"


def result_word(result) -> str:
    """PASS, XFAIL, FAIL, ENGINE ERROR, ... (:class:`properties.core.outcome.Outcome`)."""
    if result.passed and getattr(result, "xfailed", ()):
        return "XFAIL"
    return Outcome.from_kind(result_kind(result)).word


def run_checks(args: argparse.Namespace, config, wanted: list[str], seed, engine) -> list:
    """The properties, in ``--workers`` processes (default: the cores), with the rule
    coverage report (``--coverage``) as one more row that fails on a gated gap
    (``--coverage-gate``)."""
    from properties.tools.engine_coverage import engine_runs_here
    from properties.tools.guard import needs_guard
    from properties.tools.parallel import (
        PropertyTask,
        announce_first_failure,
        default_workers,
        run_task,
        run_tasks,
        write_first_failure_page,
    )

    workers = args.workers if args.workers is not None else default_workers()
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    tiers = selected_tiers(getattr(args, "tiers", None), args.profile, args.max_examples)
    tasks = [
        PropertyTask(
            name,
            config,
            args.profile,
            args.max_examples,
            seed,
            args.shrink_seconds,
            tiers,
            getattr(args, "tier_examples", None),
        )
        for name in wanted
    ]
    found: list = []  # first failures, kept for a summary if the run is stopped

    def on_first(first) -> None:
        found.append(first)
        announce_first_failure(first)

    guarded = needs_guard(config)
    if not args.coverage and not guarded and (workers == 1 or len(tasks) == 1):
        results = []
        try:
            for task in tasks:  # in this process: each line as soon as it is known
                results.append(run_task(task, engine=engine, on_first_failure=on_first))
                for first in found:  # pages announced from inside the Hypothesis test
                    write_first_failure_page(first)
                print_result_line(results[-1])
        except Stopped as stop:
            stop.results, stop.found = results, found
            raise
        return results
    import tempfile

    # an engine in this process that is not kvconform's own runs in a forked worker: one
    # that ends the process (os._exit(0)) is then an engine error, never a silent pass;
    # any engine that runs in this process is forked too: the worker starts with what this
    # process imported (vLLM's import is 7 s of CPU a worker); rule coverage measures a
    # worker from its start, so it spawns
    start_method = "fork" if engine_runs_here(config) and not args.coverage else "spawn"
    with tempfile.TemporaryDirectory(prefix="kvconform-cov-") as tmp:
        try:
            results = run_tasks(
                tasks,
                workers,
                tmp if args.coverage else None,
                start_method=start_method,
                on_result=print_result_line,
                on_first_failure=on_first,
            )
        except Stopped as stop:
            stop.found = found
            raise
        if args.coverage:
            results.append(coverage_result(tmp, args.coverage_gate))
    return results


def report_stopped(stop: Stopped) -> int:
    """What a stopped ``check`` prints (the properties that finished, the failures found
    so far, with their pages) and its exit code
    (:func:`properties.tools.stopping.stopped_exit_code`)."""
    from properties.tools.parallel import write_first_failure_page

    print(f"\nkvconform check: stopped by {stop.name}; workers and engines ended", flush=True)
    if stop.results:
        print(format_results(stop.results))
    for first in getattr(stop, "found", []):
        print(f"  found before the stop: {first.describe()}")
        if first.trace_path is not None:
            print(f"  trace: {first.trace_path}\n  replay: {first.replay()}")
            write_first_failure_page(first)
    kinds = [result_kind(r) for r in stop.results]
    kinds += [getattr(f, "kind", "property") for f in getattr(stop, "found", [])]
    return stopped_exit_code(stop, kinds)


def coverage_result(data_dir: str, gate: bool):
    """Print the rule coverage report of the workers' data; its row in the table fails
    with ``gate`` when a branch of a gated module is unreached."""
    from properties.runner.check import PropertyResult
    from properties.tools.rule_coverage import analyse, combine, format_rule_coverage

    result = analyse(combine([str(p) for p in Path(data_dir).glob(".coverage*")]))
    print(format_rule_coverage(result), flush=True)
    gaps = result.unreached_in()
    failure = None
    if gate and gaps:
        failure = f"{len(gaps)} branches of the gated modules are unreached: " + ", ".join(
            u.where for u in gaps
        )
    return PropertyResult("coverage", 0, 0, 0.0, failure)


def print_result_line(r) -> None:
    """A property's result, printed once, when it ends (marked ``announced``)."""
    r.announced = True
    reach = getattr(r, "reach", 0)
    print(
        f"  {r.name:<12} {result_word(r)} "
        f"({r.examples} examples, {r.steps} steps, {r.seconds:.1f}s"
        + (f"; {reach} reach corpus traces first" if reach else "")
        + ")",
        flush=True,
    )
    if r.tiers and len(r.tiers) > 1:  # the small tier alone is the line above
        per_tier = ", ".join(f"{t} {e}/{n} {s:.1f}s" for t, (e, n, s) in r.tiers.items())
        print(f"    tiers (examples/steps, time): {per_tier}", flush=True)
        for tier in (t for t, (e, _, _) in r.tiers.items() if e == 0):
            print(
                f"    WARNING: no example ran at the {tier} tier (the engine refused or "
                "its declarations filtered every layout drawn): that tier proves nothing",
                flush=True,
            )
    if getattr(r, "modes", None):
        drawn = ", ".join(f"{tag} {e}/{n}" for tag, (e, n) in r.modes.items())
        print(f"    modes drawn (examples/steps): {drawn}", flush=True)


def pair_gate_results(pair_lines: list[str]) -> list:
    """``--pairs-gate``: a failed ``pair-reach`` row (exit 4, a reach regression) when the
    pair table has ``missed:`` lines, else nothing. Example: ``["pairs reached: 101 of
    103 ...", "  missed: drafts x {external, load-failures}"]`` -> one row whose failure
    reads ``2 supported pairs unreached: drafts x {external, load-failures}``."""
    from properties.runner.check import PropertyResult

    missed = [line.strip().removeprefix("missed: ") for line in pair_lines if "missed:" in line]
    if not missed:
        return []
    count = sum(len(m.split("{", 1)[1].split(",")) for m in missed)
    listed = "; ".join(missed)
    failure = f"{count} supported pairs unreached" + (
        f": {listed}" if len(listed) <= 200 else " (the 'missed:' lines of the pair table)"
    )
    return [PropertyResult("pair-reach", 0, 0, 0.0, failure, kind="coverage")]


def format_pair_reach(results, engine) -> list[str]:
    """The pairs of features the run reached (:func:`properties.runner.pairs.pair_table`),
    over every property, and those the engine's declarations exclude."""
    from properties.runner.pairs import Declared, pair_table

    counts: dict[tuple[str, str], int] = {}
    for r in results:
        for pair, n in (getattr(r, "pairs", None) or {}).items():
            counts[pair] = counts.get(pair, 0) + n
    declared = Declared.of(engine, any(getattr(r, "serving_calls", False) for r in results))
    return pair_table(counts, declared)


def format_active_checks(engine, config) -> str:
    """Which invariants run for this engine's capabilities, which its capabilities turn
    off, and which its declarations can never trigger
    (:func:`properties.tools.selection.engine_checks`)."""
    from properties.tools.selection import engine_checks

    checks = engine_checks(engine, config)
    return (
        f"  capabilities: {', '.join(sorted(checks.capabilities)) or 'none'}\n"
        f"  checks: {', '.join(checks.runnable)}"
        + (f"\n  not run (capabilities missing): {', '.join(checks.lost)}" if checks.lost else "")
        + "".join(f"\n  off ({why}): {n}" for n, why in checks.idle.items())
    )


def format_results(results: list) -> str:
    """A table of :class:`properties.runner.check.PropertyResult` rows."""
    rows = [("property", "examples", "steps", "time", "result")]
    for r in results:
        rows.append(
            (
                r.name,
                str(r.examples),
                str(r.steps),
                f"{r.seconds:.1f}s",
                result_word(r).lower() if r.passed else result_word(r),
            )
        )
        for tier, (examples, steps, seconds) in (r.tiers or {}).items():
            rows.append((f"  {tier}", str(examples), str(steps), f"{seconds:.1f}s", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_replay(args: argparse.Namespace) -> int:
    from properties.core.trace import load_trace
    from properties.runner.check import config_for
    from properties.tools.guard import needs_guard, run_guarded
    from properties.tools.trust import engine_named_in_file

    trace = load_trace(Path(args.trace))
    recorded = (trace.failure or {}).get("engine")
    if args.engine is None:  # the engine the trace was recorded on, if kvconform's own
        args.engine = engine_named_in_file(
            recorded,
            args.trace,
            f"kvconform replay {shlex.quote(args.trace)}",
            args.trust_recorded_engine,
        )
        print(f"--engine not given: using {args.engine}, the engine recorded in the trace")
    from properties.tools.selection import load_selection, with_skips

    base = with_skips(config_from_args(args), load_selection(args.skip_checks, None))
    config = config_for("attention" if args.attention else "invariants", base)
    engine = config.resolve_engine()
    if needs_guard(config):  # an in-process adapter must not end the process with exit 0
        return run_guarded(lambda: _replay(args, trace, config, engine), on_command_error)
    return _replay(args, trace, config, engine)


def _replay(args: argparse.Namespace, trace, config, engine) -> int:
    from properties.runner.run import replay_trace
    from properties.tools.report import replay_lines

    print(
        f"replaying {args.trace}: {len(trace.operations)} operations on {trace.layout.describe()}"
    )
    if trace.failure:
        print(
            f"recorded failure: [{trace.failure.get('property')}] on "
            f"{trace.failure.get('engine')} ({trace.failure.get('level')})"
        )
    from properties.runner.pairs import Declared

    # a group type the engine does not declare (R-SWA and rings: their production setting)
    declared = Declared.of(engine, True)
    types = {s.type_name for s in trace.layout.specs}
    unsupported = sorted(t for t in types if declared.supports(t) is not None)
    if unsupported:
        raise usage_error(
            f"{args.engine} does not support this trace's layout: it declares spec types "
            f"{', '.join(engine.spec_types)} and production settings "
            f"{', '.join(sorted(engine.production_settings)) or 'none'}, the trace has "
            f"{', '.join(unsupported)}"
        )
    run, exc = replay_trace(trace, config, engine)
    if isinstance(exc, UnsupportedLayoutError):  # the factory refused the layout
        raise usage_error(f"{args.engine} does not support this trace's layout: {exc}")
    if exc is None:
        print(f"no failure: {args.engine} passes every check on this trace ({args.level})")
        return EXIT_PASSED
    if run is None:  # the engine's build (or its first read of the fresh pool) failed
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"FAILED before the first operation: {type(exc).__name__}: {first}")
        return Outcome.of_failure(exc).exit_code
    op_index = len(run.operations) - 1
    print(f"FAILED at operation {op_index}: {run.operations[op_index]!r}")
    print(f"  {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    print("\n".join(replay_lines(run, exc, args.trace, args.engine, args.level, engine)))
    return Outcome.of_failure(exc).exit_code


def cmd_fuzz(args: argparse.Namespace) -> int:
    from properties.tools.fuzz import run_campaign

    config = config_from_args(args, preset=args.preset)  # every value checked up front
    return run_campaign(
        engine=config.engine,
        minutes=args.minutes,
        level=config.level,
        workers=args.workers,
        preset=config.preset,
        attention=args.attention,
        seed=args.seed,
        failure_dir=config.failure_dir,
        database=args.database,
        call_timeout=config.call_timeout,
        isolation=config.isolation,
        progress_seconds=args.progress_seconds,
        shrink_seconds=args.shrink_seconds,
        coverage=args.coverage,
        production=args.production,
        engine_coverage_args=args,
    )


def cmd_corpus(args: argparse.Namespace) -> int:
    from properties.tools.corpus import CorpusError

    try:
        return _corpus(args)
    except CorpusError as exc:
        print(f"kvconform corpus: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _corpus(args: argparse.Namespace) -> int:
    from properties.tools.corpus import export_corpus

    if args.action == "export":
        manifest = export_corpus(args.directory, per_mode=args.per_mode)
        print(
            f"kvconform corpus: {len(manifest['cases'])} cases in {args.directory} "
            f"({manifest['format']}; modes: {', '.join(manifest['modes'])})"
        )
        print(f"  coverage: {json.dumps(manifest['coverage'])}")
        return EXIT_PASSED
    from properties.core.engine import BUILTIN_ENGINES
    from properties.tools.guard import run_guarded

    if not (args.engine.startswith("exec:") or args.engine in BUILTIN_ENGINES):
        # the corpus runs an adapter in this process: in a forked child, so one that ends
        # the process (os._exit(0)) is an engine error, never a silent pass
        return run_guarded(lambda: _corpus_run(args), on_command_error)
    return _corpus_run(args)


def _corpus_run(args: argparse.Namespace) -> int:
    from properties.tools.corpus import run_corpus

    print(f"kvconform corpus run: {args.directory} engine={args.engine} level={args.level}")

    shown: list = []

    def show(result) -> None:
        shown.append(result)
        line = f"  {result.status.upper():<4} {result.name}"
        if result.message:
            line += (
                f" ({result.file}): {result.message[:2000]}"
                if result.status == "fail"
                else (f": {result.message}")
            )
        print(line, flush=True)

    try:
        report = run_corpus(args.directory, args.engine, args.level, on_result=show)
    except Stopped as stop:  # the cases that ran so far, and their failures
        failed = [r.kind or "property" for r in shown if r.status == "fail"]
        print(
            f"stopped by {stop.name}: {sum(r.status == 'pass' for r in shown)} passed, "
            f"{len(failed)} failed before the stop"
        )
        return stopped_exit_code(stop, failed)
    print(
        f"{report.count('pass')} passed, {report.count('fail')} failed, "
        f"{report.count('skip')} skipped"
    )
    if not report.count("pass") and not report.count("fail"):
        print("kvconform corpus run: no case ran (every one was skipped)", file=sys.stderr)
    if report.passed:
        return EXIT_PASSED
    failed = [r.kind or "property" for r in report.results if r.status == "fail"]
    return exit_code(failed) if failed else EXIT_FAILED  # none failed: no case ran


def cmd_reach(args: argparse.Namespace) -> int:
    """``kvconform reach list|add|grow`` (:mod:`properties.tools.reach_grow`)."""
    from properties.runner.reach import load_reach_corpus
    from properties.tools import reach_grow

    if args.action == "list":
        cases = load_reach_corpus(args.dir)
        for case in cases:
            print(f"{case.name}: {len(case.trace.operations)} operations, {len(case.reached)} keys")
            print(f"  {case.why}")
        print(f"{len(cases)} cases")
        return EXIT_PASSED
    if args.action == "add":
        path = reach_grow.add_case(args.trace, args.name, args.why, args.reached, args.dir)
        print(f"kvconform reach: {path}")
        return EXIT_PASSED
    kept, drawn = reach_grow.grow(args.examples, args.seed, args.dir)
    keys = [k for case in kept for k in case.reached]
    pairs = sum(k.startswith("pair:") for k in keys)
    print(
        f"kvconform reach: kept {len(kept)} of {drawn} traces ({len(keys)} new keys: "
        f"{pairs} pairs, {len(keys) - pairs} branches)"
    )
    for case in kept:
        print(f"  {case.name}: {len(case.trace.operations)} operations, {len(case.reached)} keys")
    return EXIT_PASSED


def cmd_bench(args: argparse.Namespace) -> int:
    finished: list = []  # rows measured so far (a stopped bench summarises them)
    try:
        return _bench(args, finished)
    except Stopped as stop:
        print(f"stopped by {stop.name}: {len(finished)} rows finished before the stop")
        mismatch = False
        if finished and args.what == "engines":
            from properties.tools.bench.engines import engine_mismatches, format_engine_bench

            print(format_engine_bench(finished))
            mismatch = bool(engine_mismatches(finished))
        elif finished:
            from properties.tools.bench.suite import format_suite

            print(format_suite(finished))
        return stopped_exit_code(stop, ["property"] if mismatch else [])


def _bench(args: argparse.Namespace, finished: list) -> int:
    def keeping(show):
        def on_row(row) -> None:
            finished.append(row)
            show(row)

        return on_row

    if args.what == "suite":
        from properties.tools.bench.progress import suite_line
        from properties.tools.bench.suite import bench_suite, format_suite

        rows = bench_suite(
            profile=args.profile, on_row=keeping(suite_line), engines=tuple(args.engines)
        )
        print(format_suite(rows))
    elif args.what == "engines":
        from properties.tools.bench.engines import (
            ALL_RECIPES,
            bench_engines,
            check_engine_names,
            engine_mismatches,
            format_engine_bench,
            recorded_traces,
        )
        from properties.tools.bench.progress import engine_line

        check_engine_names(args.engines)  # before the traces are built
        recipes = [r for r in ALL_RECIPES if not args.traces or r.name in args.traces]
        if not recipes:
            known = ", ".join(r.name for r in ALL_RECIPES)
            raise SystemExit(f"kvconform bench engines: --traces names none of: {known}")
        rows = bench_engines(
            engines=tuple(args.engines),
            traces=recorded_traces(scale=args.scale, recipes=recipes),
            repeat=args.repeat,
            memory=args.memory,
            on_row=keeping(engine_line),
            cpu=args.cpu,
            calls=args.calls,
            top_functions=args.hotspots,
        )
        print(format_engine_bench(rows))
        if "optimized" in args.engines:
            from properties.engines.optimized import compiled_loops_note

            print(compiled_loops_note())
        if args.calls:
            from properties.tools.bench.call_profile import format_call_profile

            print("\nwhere the time goes, per protocol call:")
            print(format_call_profile(rows))
        if args.hotspots:
            from properties.tools.bench.hotspots import format_hotspots

            print(
                "\nwhere the time goes inside the engine, per function (cProfile, one more "
                "replay; most self time first, per decode step and per prefilled request):"
            )
            print(format_hotspots(rows))
        return 1 if engine_mismatches(rows) else 0
    elif args.what == "device":
        from properties.tools.bench.device import run_device_bench

        return run_device_bench(args.device or "cuda", args.sizes, args.context, args.threads)
    else:
        from properties.tools.bench.attention import bench_attention, format_bench

        for backend in ("torch", "sdpa"):
            print(
                format_bench(
                    bench_attention(
                        args.device or "cpu", args.seed, backend=backend, num_threads=args.threads
                    )
                )
            )
    return 0


def shrink_args(p: argparse.ArgumentParser) -> None:
    from properties.runner.check import DEFAULT_SHRINK_SECONDS

    p.add_argument(
        "--shrink-seconds",
        type=float,
        default=DEFAULT_SHRINK_SECONDS,
        help="stop shrinking a failure after this many seconds",
    )


def coverage_args(p: argparse.ArgumentParser, gate: bool = True) -> None:
    p.add_argument(
        "--coverage",
        action="store_true",
        help="report which rules of reference/ the run exercised (branch coverage)",
    )
    if not gate:
        return
    p.add_argument(
        "--coverage-gate",
        action="store_true",
        help="with --coverage: fail if a branch of the gated modules is unreached",
    )


def engine_coverage_args(p: argparse.ArgumentParser) -> None:
    from properties.tools.engine_coverage import add_arguments

    add_arguments(p)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default in ``--help`` (``(default: ci)``; none for flags and
    options without one); the epilog printed as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            text += " (default: %(default)s)"
        return text


def help_epilog() -> str:
    """The end of ``kvconform --help`` and ``kvconform check --help``: the engines, the
    presets and two examples (plain text)."""
    from properties.core.engine import BUILTIN_ENGINES
    from properties.generate.presets import PRESETS

    return (
        f"engines: {', '.join(BUILTIN_ENGINES)}, module:factory (a Python adapter), "
        "exec:COMMAND (any language, docs/exec-protocol.md)\n"
        f"presets: {', '.join(PRESETS)}\n"
        f"profiles: {', '.join(PROFILES)}; levels: {', '.join(LEVELS)}\n\n"
        "examples:\n"
        "  kvconform check --engine reference --level exact\n"
        "  kvconform check --engine mypkg.adapter:make_engine --report-json report.json "
        "--junit-xml junit.xml --xfails-file kvconform-xfails.txt\n"
    )


def build_parser() -> argparse.ArgumentParser:
    epilog = help_epilog()
    parser = argparse.ArgumentParser(
        prog="kvconform",
        description="Property-based conformance checks for the KV cache managers of LLM "
        "serving engines.",
        epilog=epilog,
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    parser_of = sub.add_parser  # every subcommand's help shows its defaults too
    sub.add_parser = lambda *a, **k: parser_of(*a, formatter_class=HelpFormatter, **k)

    def engine_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--engine",
            default="reference",
            help="reference, vllm, sglang, lmdeploy, module:factory, or exec:COMMAND (an engine in "
            "any language speaking docs/exec-protocol.md)",
        )
        p.add_argument("--level", default=DEFAULT_LEVEL, choices=LEVELS, help="property level")
        p.add_argument("--failure-dir", default=DEFAULT_FAILURE_DIR, help="where failure traces go")
        p.add_argument(
            "--call-timeout",
            type=float,
            default=DEFAULT_CALL_TIMEOUT_S,
            metavar="SECONDS",
            help="deadline of one engine call (0: none)",
        )
        p.add_argument(
            "--isolation",
            default=DEFAULT_ISOLATION,
            choices=ISOLATION_MODES,
            help="run the engine in a child process: auto (module:factory adapters), "
            "process (always), none (never)",
        )
        verbose_arg(p)

    def verbose_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--verbose", action="store_true", help="tracebacks for errors")

    p = sub.add_parser("check", help="run the properties once and print a table", epilog=epilog)
    engine_args(p)
    p.add_argument(
        "--profile", default=DEFAULT_PROFILE, choices=PROFILES, help="Hypothesis profile"
    )
    p.add_argument(
        "--preset", default=None, help="draw layouts from this model preset (default: any)"
    )
    p.add_argument("--no-attention", action="store_true", help="skip the attention property")
    p.add_argument("--only", nargs="*", choices=PROPERTIES, help="run only these properties")
    p.add_argument(
        "--tiers",
        default=None,
        help="the large scale tiers to run after the small one, comma-separated "
        "(medium,offline,production; 'none': the small tier only; default: the profile's, "
        "none with --max-examples)",
    )
    p.add_argument(
        "--max-examples",
        type=int,
        default=None,
        help="examples per property (default: the profile's)",
    )
    p.add_argument(
        "--tier-examples",
        type=int,
        default=None,
        help="examples per large tier of each property (default: the profile's; "
        "attention runs a third of the medium ones and no offline or production one, "
        "determinism no production one)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed (default: none with ci, derandomized; else drawn and printed)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="properties run in N processes (default: the number of cores)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    shrink_args(p)
    coverage_args(p)
    p.add_argument(
        "--no-reach-corpus",
        action="store_true",
        help="do not replay the reach corpus before drawing (properties/runner/reach.py)",
    )
    p.add_argument(
        "--pairs-gate",
        action="store_true",
        help="fail (exit 4) if a pair of features the engine supports was not reached",
    )
    check_outputs.add_arguments(p)
    engine_coverage_args(p)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("fuzz", help="a long campaign with a live progress line")
    engine_args(p)
    p.add_argument("--minutes", type=float, required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--preset", default=None)
    p.add_argument("--attention", action="store_true")
    p.add_argument(
        "--production",
        action="store_true",
        help="fuzz the production property (deployed settings and serving modes)",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--progress-seconds",
        type=float,
        default=30.0,
        help="when the output is not a terminal, one progress line per this many seconds",
    )
    p.add_argument(
        "--database",
        default=None,
        help="example database shared by the workers: redis://HOST:PORT[/DB] (one Redis "
        f"for many machines) or a directory (default {DEFAULT_DATABASE_DIR})",
    )
    shrink_args(p)
    coverage_args(p, gate=False)
    engine_coverage_args(p)
    p.set_defaults(func=cmd_fuzz)

    p = sub.add_parser("replay", help="replay one trace and show the first failure")
    p.add_argument("trace")
    engine_args(p)
    p.set_defaults(engine=None)  # the engine recorded in the trace, if built in
    p.add_argument("--attention", action="store_true", help="check attention outputs only")
    p.add_argument(
        "--skip-checks",
        nargs="+",
        default=None,
        metavar="NAME",
        help="invariants not to run (as the run that saved the trace skipped them)",
    )
    p.add_argument(
        "--trust-recorded-engine",
        action="store_true",
        help="without --engine, run the engine the trace names even when it is not a "
        "built-in one (exec: commands and module:factory adapters run code: "
        "docs/threat-model.md)",
    )
    p.set_defaults(func=cmd_replay)

    from properties.tools.report import add_report_parser

    add_report_parser(sub)

    p = sub.add_parser("corpus", help="export or run the conformance corpus (no Hypothesis)")
    corpus = p.add_subparsers(dest="action", required=True)
    q = corpus.add_parser("export", help="write the corpus (traces and expected results)")
    q.add_argument("directory")
    q.add_argument("--per-mode", type=int, default=4, help="traces per mode (default 4)")
    q.set_defaults(func=cmd_corpus)
    q = corpus.add_parser("run", help="replay a corpus on an engine")
    q.add_argument("directory")
    engine_args(q)
    q.set_defaults(func=cmd_corpus)

    p = sub.add_parser("reach", help="the reach corpus every check replays first")
    reach = p.add_subparsers(dest="action", required=True)
    q = reach.add_parser("list", help="the cases and what each reached")
    q.add_argument("--dir", default=None, help="a corpus folder (default: the shipped one)")
    q.set_defaults(func=cmd_reach)
    q = reach.add_parser("add", help="add a trace that passes on the reference")
    q.add_argument("trace")
    q.add_argument("--name", required=True)
    q.add_argument("--why", required=True, help="what the trace reaches that must not be lost")
    q.add_argument("--reached", nargs="*", default=(), help="keys (default: its pairs)")
    q.add_argument("--dir", default=None)
    q.set_defaults(func=cmd_reach)
    q = reach.add_parser("grow", help="keep drawn traces that reach new pairs or branches")
    q.add_argument("--examples", type=int, default=200)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--dir", default=None)
    q.set_defaults(func=cmd_reach)

    p = sub.add_parser("bench", help="speed figures")
    p.add_argument("what", choices=("suite", "engines", "attention", "device"))
    p.add_argument("--profile", default=DEFAULT_PROFILE, choices=PROFILES)
    p.add_argument("--engines", nargs="*", default=["reference", "vllm"])
    p.add_argument("--device", default=None, help="attention: cpu (default); device: cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=1, help="engines: keep the fastest of N")
    p.add_argument("--scale", type=int, default=1, help="engines: shrink the traces k times")
    p.add_argument(
        "--traces", nargs="*", default=None, help="engines: run only these traces (default all)"
    )
    p.add_argument(
        "--memory", action="store_true", help="engines: also measure control-plane KiB/request"
    )
    p.add_argument(
        "--cpu", action="store_true", help="engines: time engine calls in CPU time (thread_time)"
    )
    p.add_argument(
        "--calls",
        action="store_true",
        help="engines: also split each row's time by protocol call (per decode step, per prefill)",
    )
    p.add_argument(
        "--hotspots",
        type=int,
        default=0,
        metavar="N",
        help="engines: also list the N functions of the engine with the most self time per "
        "decode step and per prefill (cProfile, in one more replay; in CPU time with --cpu)",
    )
    p.add_argument("--sizes", type=int, nargs="*", default=None, help="device: concurrencies")
    p.add_argument("--context", type=int, default=2048, help="device: prompt tokens")
    verbose_arg(p)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTHONHASHSEED", "0")
    # imported here, not at the top: a --coverage worker re-imports this module before
    # it starts measuring, and must not have imported the reference yet

    args = build_parser().parse_args(argv)  # bad options: argparse exits 2
    from properties.core.processes import start_resource_tracker

    start_resource_tracker()  # before any worker: a hang-up must not kill it
    try:
        with stop_on_signals():
            check_numbers(args)  # every numeric option finite and in range, or exit 2
            return args.func(args)
    except KeyboardInterrupt as stop:
        print(f"\nkvconform: interrupted ({getattr(stop, 'name', 'SIGINT')})", file=sys.stderr)
        return stopped_exit_code(stop, [])
    except BaseException as exc:  # noqa: BLE001 - every error becomes one line and a code
        return on_command_error(exc, getattr(args, "verbose", False))
    finally:
        end_started_processes()


def end_started_processes() -> None:
    """Nothing the command started outlives it: engine children with their process
    groups, then any process still alive below this one (what an in-process adapter
    forked), but multiprocessing's resource tracker and the watchdog, which end on
    their own (:mod:`properties.core.processes`)."""
    import multiprocessing.resource_tracker as tracker

    from properties.core.processes import reap_descendants, watchdog_pid
    from properties.engines.exec_engine import kill_engine_children

    kill_engine_children()
    tracker_pid = getattr(getattr(tracker, "_resource_tracker", None), "_pid", None)
    reap_descendants(keep=frozenset(p for p in (tracker_pid, watchdog_pid()) if p))


def on_command_error(exc: BaseException, verbose: bool = False) -> int:
    """Print the one line of an error that ended a command (a traceback with
    ``verbose``) and return its exit code (:func:`classify_error`)."""
    code, line = classify_error(exc)
    if verbose:
        traceback.print_exception(exc)
    print(f"kvconform: {line}", file=sys.stderr)
    return code


def classify_error(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one line for an error that ended a command
    (:meth:`properties.core.outcome.Outcome.of_error`)."""
    if isinstance(exc, SystemExit):
        raise exc
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    outcome = Outcome.of_error(exc)
    if outcome is Outcome.ENGINE:
        return outcome.exit_code, f"engine error: {first}"
    if outcome is Outcome.INTERNAL:
        return outcome.exit_code, (
            f"internal error: {type(exc).__name__}: {first} (--verbose shows the traceback)"
        )
    return outcome.exit_code, first


if __name__ == "__main__":
    sys.exit(main())
