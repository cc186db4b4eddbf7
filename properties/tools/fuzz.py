"""``kvconform fuzz``: a time-boxed campaign over many seeds, in ``--workers`` processes.

Each worker first replays every example the database holds for this engine and level
(a failure found there is reported as *replayed from the example database*), then runs
the stateful machine in rounds (one Hypothesis run of 50 examples per round, a fresh
seed per round: ``base_seed + 1000 * worker + round``). The parent prints progress (on a
terminal a live line; else one line per ``--progress-seconds``, no carriage returns):
workers send their counts every second, within a round too, and a first failure at once.
The workers are stopped at most ``STOP_GRACE_SECONDS`` after ``--minutes``. One failure
is reported once across workers: the key is the check that failed
(:func:`failure_key`). Then a summary. Ctrl-C (SIGINT), SIGTERM or SIGHUP stops the
workers, prints the summary and exits 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP), or the
failure code when something was found (1 a property failed, 3 the engine broke the
protocol). Every failure is saved as a replayable trace, once (the same shrunk trace
found again is not saved again), and its replay command is printed.

The example database (``--database``) is where Hypothesis keeps failing examples and
its example corpus: by default the directory ``.kvconform/hypothesis``; with
``redis://HOST:PORT[/DB]`` it is Hypothesis' own ``RedisExampleDatabase`` on that
server, so every worker of every machine pointing at the same Redis shares failures:
one found on machine A is replayed first by machine B. Keys are prefixed with the
engine and level (``kvconform:ENGINE:LEVEL:``), so campaigns on different engines do
not mix. Example: ``kvconform fuzz --engine vllm --minutes 60 --workers 8 --database
redis://10.0.0.5:6379``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from properties.core.constants import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_DATABASE_DIR,
    DEFAULT_FAILURE_DIR,
    DEFAULT_ISOLATION,
    DEFAULT_LEVEL,
    EXIT_COVERAGE,
    EXIT_ENGINE,
    EXIT_FAILED,
    EXIT_PASSED,
    EXIT_USAGE,
)
from properties.runner.check import replay_command, run_property
from properties.runner.config import CheckConfig
from properties.tools.engine_coverage import open_session
from properties.tools.stopping import stop_on_signals, stopped_exit_code
from reference.errors import KVConformError

REDIS_SCHEME = "redis://"


def _redis_client(url: str):
    try:
        import redis
    except ImportError:
        raise KVConformError(
            f"--database {url}: the redis package is not installed (pip install 'kvconform[redis]')"
        ) from None
    try:
        return redis.Redis.from_url(url, socket_connect_timeout=5)
    except ValueError as exc:
        raise KVConformError(f"--database {url}: {exc}") from None


def example_database(spec: str | None, engine: str, level: str):
    """The Hypothesis example database of ``--database``: ``redis://HOST:PORT[/DB]`` (a
    ``RedisExampleDatabase`` whose keys start with ``kvconform:ENGINE:LEVEL:``), a
    directory, or (None) :data:`DEFAULT_DATABASE_DIR`."""
    from hypothesis.database import DirectoryBasedExampleDatabase

    if spec is None:
        return DirectoryBasedExampleDatabase(DEFAULT_DATABASE_DIR)
    if spec.startswith(REDIS_SCHEME):
        from hypothesis.extra.redis import RedisExampleDatabase

        prefix = f"kvconform:{engine}:{level}:".encode()
        return RedisExampleDatabase(_redis_client(spec), key_prefix=prefix)
    if "://" in spec:
        raise KVConformError(
            f"--database {spec!r}: only redis://HOST:PORT or a directory is supported"
        )
    return DirectoryBasedExampleDatabase(spec)


def check_database(spec: str | None) -> None:
    """Fail early, in the parent and with one line, when ``--database`` names a scheme
    other than ``redis://``, a Redis server that cannot be reached, or a directory that
    cannot take new files (a file, a read-only folder: failures would not be stored)."""
    if spec is not None and "://" in spec and not spec.startswith(REDIS_SCHEME):
        raise KVConformError(
            f"--database {spec!r}: only redis://HOST:PORT[/DB] or a directory is supported"
        )
    if spec is None or not spec.startswith(REDIS_SCHEME):
        from properties.core.output_files import check_output_dir

        check_output_dir(spec or DEFAULT_DATABASE_DIR, "--database")
        return
    client = _redis_client(spec)
    try:
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any connection failure is reported
        raise KVConformError(f"--database {spec}: cannot reach the Redis server: {exc}") from None


def _worker(
    config: CheckConfig,
    index: int,
    base_seed: int,
    deadline: float,
    prop: str,
    out: mp.Queue,
    shrink_seconds: float | None = None,
    database: str | None = None,
    after_round: Callable[[], None] | None = None,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the workers
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from properties.core.processes import die_with_parent

    die_with_parent(signal.SIGTERM)  # the parent killed (kill -9): this worker ends too
    from hypothesis import Phase, settings

    from properties.runner.profiles import load_profile
    from properties.runner.progress import set_sink
    from properties.tools.engine_coverage import measure_here, save_measurement

    measure_here(config)  # --engine-coverage: measured where the engine runs
    profile = load_profile("nightly")
    db = example_database(database, config.engine, config.level)
    # live counts of the round in progress, every second (the parent's counters move)
    set_sink(lambda examples, steps, _failures: out.put(("live", index, examples, steps, None)))
    round_no = 0

    def first_failure(first) -> None:  # reported at once, not at the end of the round
        failure = (first.trace.failure or {}) if first.trace is not None else {}
        message = f"[{first.check}] {failure.get('message', first.describe())}"
        found = (seed, message, str(first.trace_path or ""), failure.get("kind"), round_no == 0)
        out.put(("progress", index, 0, 0, found))

    # round 0 replays what the database holds (failures other workers or machines found)
    replay = settings(profile, database=db, phases=(Phase.explicit, Phase.reuse, Phase.shrink))
    engine = config.resolve_engine()  # once per worker
    while round_no == 0 or time.time() < deadline:
        seed = base_seed + 1000 * index + round_no
        s = replay if round_no == 0 else settings(profile, max_examples=50, database=db)
        result = run_property(
            prop,
            config,
            s,
            seed,
            engine,
            shrink_seconds=shrink_seconds,
            on_first_failure=first_failure,
        )
        if after_round is not None:
            after_round()
        save_measurement()
        if round_no == 0 and result.kind not in ("property", "engine"):
            result.failure = None  # nothing to replay (Hypothesis says it ran no example)
        out.put(
            (
                "progress",
                index,
                result.examples,
                result.steps,
                None
                if result.failure is None
                else (
                    seed,
                    result.failure[:2000],
                    str(result.trace_path or ""),
                    result.kind,
                    round_no == 0,
                ),
            )
        )
        round_no += 1
    out.put(("done", index, 0, 0, None))


def _worker_process(
    ctx,
    coverage_dir: str | None,
    args: tuple,
    shrink_seconds: float | None,
    database: str | None = None,
):
    """A campaign worker; with ``coverage_dir``, measured from its start."""
    index, base_seed, deadline, config, prop, out = args
    worker_args = (index, base_seed, deadline, prop, out, shrink_seconds, database)
    if coverage_dir is None:
        return ctx.Process(target=_worker, args=(config, *worker_args), daemon=True)
    from properties.tools.parallel import measured_worker

    fields = dataclasses.asdict(config)
    return ctx.Process(
        target=measured_worker,
        args=(coverage_dir, f"{__name__}:_worker", fields, *worker_args),
        daemon=True,
    )


def print_campaign_coverage(coverage_dir: str) -> None:
    """The rule coverage of every worker's data, then the data is removed."""
    from properties.tools.rule_coverage import analyse, combine, format_rule_coverage

    files = [str(p) for p in Path(coverage_dir).glob(".coverage*")]
    if files:
        print(format_rule_coverage(analyse(combine(files))))
    else:
        print("kvconform fuzz: no coverage data (no worker finished a round)")
    shutil.rmtree(coverage_dir, ignore_errors=True)


class Progress:
    """Progress lines: a live line on a terminal, one plain line per ``every`` seconds
    otherwise (a CI log then gets short lines, never a ``\\r``)."""

    def __init__(self, start: float, every: float, tty: bool | None = None) -> None:
        self.start = start
        self.every = every
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.last = start

    def show(self, examples: int, steps: int, failures: int, now: float) -> None:
        if not self.tty and now - self.last < self.every:
            return
        self.last = now
        elapsed = now - self.start
        rate = steps / elapsed if elapsed else 0.0
        line = (
            f"[{elapsed:7.0f}s] examples {examples}  steps {steps}  "
            f"{rate:7.1f} steps/s  failures {failures}"
        )
        if self.tty:
            print(f"\r{line}", end="", flush=True)
        else:
            print(line, flush=True)


def run_campaign(
    engine: str,
    minutes: float,
    level: str = DEFAULT_LEVEL,
    workers: int = 1,
    preset: str | None = None,
    attention: bool = False,
    seed: int | None = None,
    failure_dir: str = DEFAULT_FAILURE_DIR,
    database: str | None = None,
    call_timeout: float = DEFAULT_CALL_TIMEOUT_S,
    isolation: str = DEFAULT_ISOLATION,
    progress_seconds: float = 30.0,
    shrink_seconds: float | None = None,
    coverage: bool = False,
    production: bool = False,
    engine_coverage_args=None,
) -> int:
    """Fuzz ``engine`` for ``minutes`` in ``workers`` processes; the exit code.
    ``database``: see the module docstring. With ``coverage`` the rule coverage of the
    whole campaign is printed at the end; ``production`` fuzzes the production
    property; ``engine_coverage_args`` (the parsed ``--engine-coverage*`` options) adds
    the engine coverage the campaign reached and, with a baseline, the branches it
    reached first (:mod:`properties.tools.engine_coverage`; exit 4 on a regression)."""
    if minutes <= 0 or workers < 1:
        print(
            f"kvconform fuzz: --minutes must be > 0 and --workers >= 1, got "
            f"{minutes} and {workers}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    config = CheckConfig(
        engine=engine,
        level=level,
        preset=preset,
        failure_dir=failure_dir,
        call_timeout=call_timeout,
        isolation=isolation,
        reach_corpus=False,  # a campaign's rounds draw; the corpus is check's first step
    )
    resolved = config.resolve_engine()  # a bad --engine or declaration fails here, clearly
    try:
        check_database(database)
        from properties.core.output_files import check_output_dir

        check_output_dir(failure_dir, "--failure-dir")
    except KVConformError as exc:
        print(f"kvconform fuzz: {exc}", file=sys.stderr)
        return EXIT_USAGE
    prop = "attention" if attention else "production" if production else "invariants"
    base_seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
    print(
        f"kvconform fuzz: engine={engine} level={level} workers={workers} "
        f"minutes={minutes} base seed={base_seed} database={database or DEFAULT_DATABASE_DIR}",
        flush=True,
    )
    finish_engine_coverage = open_session(engine_coverage_args, resolved, fuzz=True)
    start = time.time()
    deadline = start + minutes * 60
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    coverage_dir = tempfile.mkdtemp(prefix="kvconform-cov-") if coverage else None
    procs = [
        _worker_process(
            ctx,
            coverage_dir,
            (i, base_seed, deadline, config, prop, out),
            shrink_seconds,
            database,
        )
        for i in range(workers)
    ]
    examples = steps = 0
    live: dict[int, tuple[int, int]] = {}  # worker -> counts of its round in progress
    failures: dict[str, tuple] = {}  # failure_key -> failure: one report per distinct failure
    progress = Progress(start, progress_seconds)
    done = 0
    interrupted: KeyboardInterrupt | None = None
    with stop_on_signals():
        try:
            for p in procs:
                p.start()
            while done < len(procs):
                if time.time() > deadline + STOP_GRACE_SECONDS:
                    print("\nkvconform fuzz: --minutes is up: stopping the workers", flush=True)
                    break
                try:
                    kind, idx, ex, st, failure = out.get(timeout=1.0)
                except queue.Empty:
                    if not any(p.is_alive() for p in procs):
                        break
                    kind = None
                if kind == "done":
                    done += 1
                elif kind == "live":
                    live[idx] = (ex, st)
                elif kind == "progress":
                    if ex or st:  # a finished round: its counts replace the live ones
                        live.pop(idx, None)
                    examples += ex
                    steps += st
                    key = None if failure is None else failure_key(failure[1])
                    if key is not None and key not in failures:
                        failures[key] = failure
                        _print_failure(failure, idx, engine, level, attention)
                running_ex = sum(e for e, _ in live.values())
                running_st = sum(n for _, n in live.values())
                progress.show(examples + running_ex, steps + running_st, len(failures), time.time())
        except KeyboardInterrupt as stop:
            interrupted = stop
            print("\ninterrupted: stopping workers", flush=True)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join(timeout=5)
    # a worker that died (not one we terminated) must not pass as a clean campaign
    crashed = [i for i, p in enumerate(procs) if p.exitcode not in (0, None, -15)]
    for i in crashed:
        print(
            f"\nkvconform fuzz: worker {i} exited with code {procs[i].exitcode} "
            "(its traceback is above)",
            file=sys.stderr,
        )
    examples += sum(e for e, _ in live.values())  # rounds cut short count too
    steps += sum(n for _, n in live.values())
    elapsed = time.time() - start
    print(
        f"\nsummary: {elapsed:.0f}s, {examples} examples, {steps} steps "
        f"({steps / max(elapsed, 1e-9):.1f} steps/s), {len(failures)} failures"
        f"{' (interrupted)' if interrupted else ''}",
        flush=True,
    )
    for seed_, message, path, _kind, _replayed in failures.values():
        print(f"  seed {seed_}: {message.splitlines()[0][:200]}\n    trace: {path}")
    if coverage_dir is not None:
        print_campaign_coverage(coverage_dir)
    regression = finish_engine_coverage()
    kinds = {f[3] for f in failures.values()}
    if "engine" in kinds:
        return EXIT_ENGINE
    if kinds or crashed:
        return EXIT_FAILED
    if regression:
        print(f"kvconform fuzz: {regression}", file=sys.stderr)
        return EXIT_COVERAGE
    return EXIT_PASSED if interrupted is None else stopped_exit_code(interrupted, [])


#: The workers are stopped this long after ``--minutes`` at the latest (a round in
#: progress, or its shrinking, does not keep the campaign running).
STOP_GRACE_SECONDS = 3.0


def failure_key(message: str) -> str:
    """What makes two failures the same bug: the check that failed (``[name]`` in the
    message), else the message's first line. Two workers that trip ``hit_soundness``
    report one failure. Example: ``failure_key("PropertyViolation: [hit_bounds] hit 9")``
    is ``'hit_bounds'``."""
    found = re.search(r"\[(\w+)\]", message)
    return found.group(1) if found else message.splitlines()[0] if message else ""


def _print_failure(failure: tuple, worker: int, engine: str, level: str, attention: bool) -> None:
    seed, message, path, _kind, replayed = failure
    origin = (
        f"replayed from the example database by worker {worker}" if replayed else f"seed {seed}"
    )
    from properties.tools.report import report_beside

    options = ""
    if path:
        from properties.core.trace import load_trace

        options = str((load_trace(path).failure or {}).get("replay_options") or "")
    command = replay_command(path, engine, level, attention, options)
    report = f"\n  {report_beside(path)[1]}" if path else ""
    print(
        f"\nFAILURE ({origin}): {message[:300]}\n  trace: {path}{report}\n  replay: {command}",
        flush=True,
    )
