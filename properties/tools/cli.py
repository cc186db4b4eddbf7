"""The ``kvconform`` command line.

* ``kvconform check --engine NAME|module:factory [--level universal|exact]
  [--profile dev|ci|nightly|gpu] [--preset NAME] [--no-attention]``: runs the
  properties and prints a table (property, examples, steps, time, result; a row per
  scale tier under each property: small, medium, production); exit 1
  on any failure, after writing the shrunk trace and printing its replay command.
* ``kvconform fuzz --engine ... --minutes N [--workers K]``: a campaign with a live
  progress line, the Hypothesis database under ``.kvconform/``, Ctrl-C stops cleanly.
* ``kvconform replay TRACE --engine ...``: replays one trace, shows the first failure
  or divergence (operation, group, expected and observed tables).
* ``kvconform corpus export DIR`` / ``corpus run DIR --engine ... [--level]``: the
  conformance corpus (traces with the reference's expected results), replayed without
  Hypothesis (:mod:`properties.tools.corpus`, ``docs/corpus-format.md``).
* ``kvconform bench suite|engines|attention``: speed figures.

Exit codes (:mod:`properties.core.constants`): 0 passed, 1 a property failed, 2 usage or
configuration error (bad option, unknown preset, an adapter that cannot be loaded, an
engine that rejects every layout), 3 the engine broke the protocol (an exception, a
malformed answer, a call past ``--call-timeout``), 130 interrupted. When several
properties end differently the code is the first of 2, 3, 1. Errors are one line; a
traceback only with ``--verbose``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import traceback
from pathlib import Path

from properties.core.constants import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_DATABASE_DIR,
    DEFAULT_FAILURE_DIR,
    DEFAULT_ISOLATION,
    DEFAULT_LEVEL,
    DEFAULT_PROFILE,
    EXIT_ENGINE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_PASSED,
    EXIT_USAGE,
    ISOLATION_MODES,
    LEVELS,
    PROFILES,
    PROPERTIES,
)
from properties.core.engine import EngineError, EngineLoadError
from reference.errors import KVConformError

#: A result's kind -> the exit code it gives (PropertyResult.kind).
EXIT_FOR_KIND = {
    "usage": EXIT_USAGE,
    "no_layout": EXIT_USAGE,
    "engine": EXIT_ENGINE,
    "property": EXIT_FAILED,
    "internal": EXIT_FAILED,
}


def exit_code(kinds: list[str | None]) -> int:
    """The exit code of several results: the first of 2, 3, 1 that occurs, else 0."""
    codes = {EXIT_FOR_KIND[k] for k in kinds if k is not None}
    for code in (EXIT_USAGE, EXIT_ENGINE, EXIT_FAILED):
        if code in codes:
            return code
    return EXIT_PASSED


def usage_error(message: str) -> KVConformError:
    return KVConformError(message)


def check_count(option: str, value: int | None, lowest: int) -> None:
    if value is not None and value < lowest:
        raise usage_error(f"{option} must be >= {lowest}, got {value}")


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
    from properties.runner.check import replay_command
    from properties.runner.machine import engine_factory, known_divergences
    from properties.runner.profiles import load_profile

    check_count("--max-examples", args.max_examples, 1)
    check_count("--seed", args.seed, 0)
    config = config_from_args(args, preset=args.preset)
    profile = load_profile(args.profile)
    seed = args.seed
    if seed is None and not profile.derandomize:
        seed = random.SystemRandom().randrange(2**32)
    print(
        f"kvconform check: engine={args.engine} level={args.level} profile={args.profile} "
        f"preset={args.preset or '-'} seed={seed if seed is not None else 'derandomized'}",
        flush=True,
    )
    factory = engine_factory(config)
    if getattr(factory, "spec_types", None) is not None:
        print(
            "  spec types the engine supports (only these are drawn): "
            f"{', '.join(factory.spec_types)}"
        )
    for d in known_divergences(factory):
        print(
            f"  known divergence {d.name}: {d.summary}\n    layouts where it applies are "
            f"not drawn; see {d.finding}"
        )
    wanted = [p for p in PROPERTIES if not (p == "attention" and args.no_attention)]
    if args.only:
        wanted = [p for p in wanted if p in args.only]
    print(format_active_checks_or_why(factory, config))
    results = run_checks(args, config, wanted, seed, factory)
    print(format_results(results))
    failed = [r for r in results if not r.passed]
    for r in failed:
        print(f"\n{FAILURE_TITLE[result_kind(r)]} in {r.name}: {r.failure[:4000]}")
        if r.note:
            print(f"  note: {r.note}")
        if getattr(r, "first", None) is not None:
            print(f"  {r.first.describe()}")
        if r.trace_path is not None:
            command = replay_command(r.trace_path, args.engine, args.level, r.name == "attention")
            print(f"  trace: {r.trace_path}\n  replay: {command}")
    return exit_code([result_kind(r) for r in results])


def result_kind(result) -> str | None:
    """A result's kind; a failed row without one (the coverage gate) is a failure."""
    if result.passed:
        return None
    return getattr(result, "kind", None) or "property"


def format_active_checks_or_why(factory, config) -> str:
    """:func:`format_active_checks`, or why the engine's capabilities are unknown (its
    factory failed on the probe layouts: the properties report that as an engine error
    with a trace)."""
    try:
        return format_active_checks(factory, config)
    except EngineLoadError:
        raise
    except EngineError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"  capabilities: unknown (the engine could not be built: {first})"


#: How a failed result is announced, by its kind.
FAILURE_TITLE = {
    "property": "FAILED",
    "engine": "ENGINE ERROR (the engine broke the protocol)",
    "no_layout": "NO LAYOUT",
    "usage": "CONFIGURATION ERROR (the engine cannot be started)",
    "internal": "INTERNAL ERROR (please report it)",
}


def result_word(result) -> str:
    if result.passed:
        return "PASS"
    words = {"engine": "ENGINE ERROR", "no_layout": "NO LAYOUT", "usage": "CONFIG ERROR"}
    return words.get(getattr(result, "kind", None), "FAIL")


def run_checks(args: argparse.Namespace, config, wanted: list[str], seed, factory) -> list:
    """The properties, in ``--workers`` processes (default: the cores), with the rule
    coverage report (``--coverage``) as one more row that fails on a gated gap
    (``--coverage-gate``)."""
    from properties.tools.parallel import PropertyTask, default_workers, run_task, run_tasks

    workers = args.workers if args.workers is not None else default_workers()
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    tasks = [
        PropertyTask(name, config, args.profile, args.max_examples, seed, args.shrink_seconds)
        for name in wanted
    ]
    if not args.coverage and (workers == 1 or len(tasks) == 1):
        results = []
        for task in tasks:  # in this process: each line as soon as it is known
            results.append(run_task(task, factory=factory))
            print_result_line(results[-1])
        return results
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvconform-cov-") as tmp:
        results = run_tasks(tasks, workers, tmp if args.coverage else None)
        for r in results:
            print_result_line(r)
        if args.coverage:
            results.append(coverage_result(tmp, args.coverage_gate))
    return results


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
    print(
        f"  {r.name:<12} {result_word(r)} "
        f"({r.examples} examples, {r.steps} steps, {r.seconds:.1f}s)",
        flush=True,
    )
    if r.tiers:
        per_tier = ", ".join(f"{t} {e}/{n} {s:.1f}s" for t, (e, n, s) in r.tiers.items())
        print(f"    tiers (examples/steps, time): {per_tier}", flush=True)
    if getattr(r, "modes", None):
        drawn = ", ".join(f"{tag} {e}/{n}" for tag, (e, n) in r.modes.items())
        print(f"    modes drawn (examples/steps): {drawn}", flush=True)


def format_active_checks(factory, config) -> str:
    """Which invariants run for this engine's capabilities (and which it loses)."""
    from properties.checks.registry import INVARIANTS
    from properties.runner.machine import active_checks_for

    active, capabilities = active_checks_for(factory, config)
    lost = [n for n in INVARIANTS if n not in active and n not in config.disabled]
    return (
        f"  capabilities: {', '.join(sorted(capabilities)) or 'none'}\n"
        f"  checks: {', '.join(active)}"
        + (f"\n  not run (capabilities missing): {', '.join(lost)}" if lost else "")
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
    from properties.runner.machine import engine_factory, failure_kind, replay_trace

    trace = load_trace(Path(args.trace))
    config = config_for("attention" if args.attention else "invariants", config_from_args(args))
    factory = engine_factory(config)
    print(
        f"replaying {args.trace}: {len(trace.operations)} operations on {trace.layout.describe()}"
    )
    if trace.failure:
        print(
            f"recorded failure: [{trace.failure.get('property')}] on "
            f"{trace.failure.get('engine')} ({trace.failure.get('level')})"
        )
    run, exc = replay_trace(trace, config, factory)
    if exc is None:
        print(f"no failure: {args.engine} passes every check on this trace ({args.level})")
        return EXIT_PASSED
    op_index = len(run.operations) - 1
    print(f"FAILED at operation {op_index}: {run.operations[op_index]!r}")
    print(f"  {type(exc).__name__}: {exc}")
    calls = run.lockstep.log[-6:]
    if calls:
        print("  last calls (engine under test):")
        for c in calls:
            print(f"    {json.dumps(c)}")
    if run.lockstep.reference is not None:
        print("  block tables now, per request (reference | engine):")
        for rid, tracked in run.lockstep.checker.requests.items():
            if not tracked.holds_blocks:
                continue
            try:
                exp = run.lockstep.reference.get_block_ids(rid)
                got = run.lockstep.engine.get_block_ids(rid)
            except Exception as err:  # noqa: BLE001
                print(f"    {rid}: cannot read tables: {err}")
                continue
            for gid, (e, g) in enumerate(zip(exp, got)):
                mark = "  " if list(e) == list(g) else "!="
                print(f"    {rid} group {gid}: {list(e)} {mark} {list(g)}")
    return EXIT_ENGINE if failure_kind(exc) == "engine" else EXIT_FAILED


def cmd_fuzz(args: argparse.Namespace) -> int:
    from properties.tools.fuzz import run_campaign

    check_count("--workers", args.workers, 1)
    check_count("--seed", args.seed, 0)
    if not args.minutes > 0:
        raise usage_error(f"--minutes must be > 0, got {args.minutes}")
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
    )


def cmd_corpus(args: argparse.Namespace) -> int:
    from properties.tools.corpus import CorpusError

    try:
        return _corpus(args)
    except CorpusError as exc:
        print(f"kvconform corpus: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _corpus(args: argparse.Namespace) -> int:
    from properties.tools.corpus import export_corpus, run_corpus

    if args.action == "export":
        manifest = export_corpus(args.directory, per_mode=args.per_mode)
        print(
            f"kvconform corpus: {len(manifest['cases'])} cases in {args.directory} "
            f"({manifest['format']}; modes: {', '.join(manifest['modes'])})"
        )
        print(f"  coverage: {json.dumps(manifest['coverage'])}")
        return EXIT_PASSED
    print(f"kvconform corpus run: {args.directory} engine={args.engine} level={args.level}")

    def show(result) -> None:
        line = f"  {result.status.upper():<4} {result.name}"
        if result.message:
            line += (
                f" ({result.file}): {result.message[:2000]}"
                if result.status == "fail"
                else (f": {result.message}")
            )
        print(line, flush=True)

    report = run_corpus(args.directory, args.engine, args.level, on_result=show)
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


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "suite":
        from properties.tools.bench.suite import bench_suite, format_suite

        print(format_suite(bench_suite(profile=args.profile)))
    elif args.what == "engines":
        from properties.tools.bench.engines import (
            ALL_RECIPES,
            bench_engines,
            engine_mismatches,
            format_engine_bench,
            recorded_traces,
        )

        recipes = [r for r in ALL_RECIPES if not args.traces or r.name in args.traces]
        if not recipes:
            known = ", ".join(r.name for r in ALL_RECIPES)
            raise SystemExit(f"kvconform bench engines: --traces names none of: {known}")
        rows = bench_engines(
            engines=tuple(args.engines),
            traces=recorded_traces(scale=args.scale, recipes=recipes),
            repeat=args.repeat,
            memory=args.memory,
        )
        print(format_engine_bench(rows))
        return 1 if engine_mismatches(rows) else 0
    else:
        from properties.tools.bench.attention import bench_attention, format_bench

        for backend in ("torch", "sdpa"):
            print(
                format_bench(
                    bench_attention(
                        args.device, args.seed, backend=backend, num_threads=args.threads
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
        help=f"stop shrinking a failure after this long (default {DEFAULT_SHRINK_SECONDS:.0f})",
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvconform", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def engine_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--engine",
            default="reference",
            help="reference, vllm, sglang, module:factory, or exec:COMMAND (an engine in "
            "any language speaking docs/exec-protocol.md)",
        )
        p.add_argument("--level", default=DEFAULT_LEVEL, choices=LEVELS)
        p.add_argument("--failure-dir", default=DEFAULT_FAILURE_DIR)
        p.add_argument(
            "--call-timeout",
            type=float,
            default=DEFAULT_CALL_TIMEOUT_S,
            metavar="SECONDS",
            help=f"deadline of one engine call (default {DEFAULT_CALL_TIMEOUT_S:g}; 0: none)",
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

    p = sub.add_parser("check", help="run the properties once and print a table")
    engine_args(p)
    p.add_argument("--profile", default=DEFAULT_PROFILE, choices=PROFILES)
    p.add_argument("--preset", default=None, help="draw layouts from this model preset")
    p.add_argument("--no-attention", action="store_true", help="skip the attention property")
    p.add_argument("--only", nargs="*", choices=PROPERTIES, help="run only these properties")
    p.add_argument("--max-examples", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="properties run in N processes (default: the number of cores)",
    )
    shrink_args(p)
    coverage_args(p)
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
    p.set_defaults(func=cmd_fuzz)

    p = sub.add_parser("replay", help="replay one trace and show the first failure")
    p.add_argument("trace")
    engine_args(p)
    p.add_argument("--attention", action="store_true", help="check attention outputs only")
    p.set_defaults(func=cmd_replay)

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

    p = sub.add_parser("bench", help="speed figures")
    p.add_argument("what", choices=("suite", "engines", "attention"))
    p.add_argument("--profile", default=DEFAULT_PROFILE, choices=PROFILES)
    p.add_argument("--engines", nargs="*", default=["reference", "vllm"])
    p.add_argument("--device", default="cpu")
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
    verbose_arg(p)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTHONHASHSEED", "0")
    # imported here, not at the top: a --coverage worker re-imports this module before
    # it starts measuring, and must not have imported the reference yet

    args = build_parser().parse_args(argv)  # bad options: argparse exits 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\nkvconform: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BaseException as exc:  # noqa: BLE001 - every error becomes one line and a code
        code, line = classify_error(exc)
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"kvconform: {line}", file=sys.stderr)
        return code


def classify_error(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one line for an error that ended a command."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, EngineLoadError):
        return EXIT_USAGE, first
    if isinstance(exc, EngineError):
        return EXIT_ENGINE, f"engine error: {first}"
    if isinstance(exc, (KVConformError, ValueError)):
        return EXIT_USAGE, first
    if isinstance(exc, SystemExit):
        raise exc
    return EXIT_FAILED, (
        f"internal error: {type(exc).__name__}: {first} (--verbose shows the traceback)"
    )


if __name__ == "__main__":
    sys.exit(main())
