"""``kvconform fuzz``: a time-boxed campaign over many seeds, in ``--workers`` processes.

Each worker first replays every example the database holds for this engine and level
(a failure found there is reported as *replayed from the example database*), then runs
the stateful machine in rounds (one Hypothesis run of 50 examples per round, a fresh
seed per round: ``base_seed + 1000 * worker + round``). The parent prints a live
progress line (elapsed, examples, steps/s, failures) and a summary; Ctrl-C stops the
workers cleanly. Every failure is saved as a replayable trace and its replay command is
printed.

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
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from properties.core.constants import DEFAULT_DATABASE_DIR, DEFAULT_FAILURE_DIR, DEFAULT_LEVEL
from properties.core.engine import load_engine_factory
from properties.runner.check import replay_command, run_property
from properties.runner.config import CheckConfig
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
    """Fail early, with one line, when a Redis database cannot be reached."""
    if spec is None or not spec.startswith(REDIS_SCHEME):
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
    from hypothesis import Phase, settings

    from properties.runner.profiles import load_profile

    profile = load_profile("nightly")
    db = example_database(database, config.engine, config.level)
    # round 0 replays what the database holds (failures other workers or machines found)
    replay = settings(profile, database=db, phases=(Phase.explicit, Phase.reuse, Phase.shrink))
    round_no = 0
    while round_no == 0 or time.time() < deadline:
        seed = base_seed + 1000 * index + round_no
        s = replay if round_no == 0 else settings(profile, max_examples=50, database=db)
        result = run_property(prop, config, s, seed, shrink_seconds=shrink_seconds)
        if round_no == 0 and result.examples == 0:
            result.failure = None  # nothing to replay (Hypothesis says it ran no example)
        if after_round is not None:
            after_round()
        out.put(
            (
                "progress",
                index,
                result.examples,
                result.steps,
                None
                if result.failure is None
                else (seed, result.failure[:2000], str(result.trace_path or ""), round_no == 0),
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


def run_campaign(
    engine: str,
    minutes: float,
    level: str = DEFAULT_LEVEL,
    workers: int = 1,
    preset: str | None = None,
    attention: bool = False,
    seed: int | None = None,
    failure_dir: str = DEFAULT_FAILURE_DIR,
    shrink_seconds: float | None = None,
    coverage: bool = False,
    production: bool = False,
    database: str | None = None,
) -> int:
    """Fuzz ``engine`` for ``minutes`` in ``workers`` processes; the exit code. With
    ``coverage`` the rule coverage of the whole campaign is printed at the end;
    ``database``: see the module docstring."""
    if minutes <= 0 or workers < 1:
        print(
            f"kvconform fuzz: --minutes must be > 0 and --workers >= 1, got "
            f"{minutes} and {workers}",
            file=sys.stderr,
        )
        return 2
    load_engine_factory(engine)  # a bad --engine fails here, with a clear message
    try:
        check_database(database)
    except KVConformError as exc:
        print(f"kvconform fuzz: {exc}", file=sys.stderr)
        return 2
    config = CheckConfig(engine=engine, level=level, preset=preset, failure_dir=failure_dir)
    prop = "attention" if attention else "production" if production else "invariants"
    base_seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
    print(
        f"kvconform fuzz: engine={engine} level={level} workers={workers} "
        f"minutes={minutes} base seed={base_seed} database={database or DEFAULT_DATABASE_DIR}",
        flush=True,
    )
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
    for p in procs:
        p.start()
    examples = steps = 0
    failures: list[tuple] = []
    done = 0
    try:
        while done < len(procs):
            try:
                kind, _idx, ex, st, failure = out.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                kind = None
            if kind == "done":
                done += 1
            elif kind == "progress":
                examples += ex
                steps += st
                if failure is not None:
                    failures.append(failure[:3])
                    command = replay_command(failure[2], engine, level, attention)
                    origin = (
                        f"replayed from the example database by worker {_idx}"
                        if failure[3]
                        else f"seed {failure[0]}"
                    )
                    print(
                        f"\nFAILURE ({origin}): {failure[1][:300]}\n  replay: {command}",
                        flush=True,
                    )
            elapsed = time.time() - start
            rate = steps / elapsed if elapsed else 0.0
            print(
                f"\r[{elapsed:7.0f}s] examples {examples}  steps {steps}  "
                f"{rate:7.1f} steps/s  failures {len(failures)}",
                end="",
                flush=True,
            )
    except KeyboardInterrupt:
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
    elapsed = time.time() - start
    print(
        f"\nsummary: {elapsed:.0f}s, {examples} examples, {steps} steps "
        f"({steps / max(elapsed, 1e-9):.1f} steps/s), {len(failures)} failures"
    )
    for seed, message, path in failures:
        print(f"  seed {seed}: {message.splitlines()[0][:200]}\n    trace: {path}")
    if coverage_dir is not None:
        print_campaign_coverage(coverage_dir)
    return 1 if failures or crashed else 0
