"""``kvconform fuzz``: a time-boxed campaign over many seeds, in ``--workers`` processes.

Each worker runs the stateful machine in rounds (one Hypothesis run of 50 examples per
round, a fresh seed per round: ``base_seed + 1000 * worker + round``), sharing the
Hypothesis example database under ``.kvconform/hypothesis`` so failures found once are
replayed first next time. The parent prints a live progress line (elapsed, examples,
steps/s, failures) and a summary; Ctrl-C stops the workers cleanly. Every failure is
saved as a replayable trace and its replay command is printed.
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


def _worker(
    config: CheckConfig,
    index: int,
    base_seed: int,
    deadline: float,
    prop: str,
    out: mp.Queue,
    shrink_seconds: float | None = None,
    after_round: Callable[[], None] | None = None,
) -> None:
    from hypothesis import settings
    from hypothesis.database import DirectoryBasedExampleDatabase

    from properties.runner.profiles import load_profile

    profile = load_profile("nightly")
    db = DirectoryBasedExampleDatabase(DEFAULT_DATABASE_DIR)
    round_no = 0
    while time.time() < deadline:
        seed = base_seed + 1000 * index + round_no
        round_no += 1
        s = settings(profile, max_examples=50, database=db)
        result = run_property(prop, config, s, seed, shrink_seconds=shrink_seconds)
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
                else (seed, result.failure[:2000], str(result.trace_path or "")),
            )
        )
    out.put(("done", index, 0, 0, None))


def _worker_process(ctx, coverage_dir: str | None, args: tuple, shrink_seconds: float | None):
    """A campaign worker; with ``coverage_dir``, measured from its start."""
    index, base_seed, deadline, config, prop, out = args
    worker_args = (index, base_seed, deadline, prop, out, shrink_seconds)
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
) -> int:
    """Fuzz ``engine`` for ``minutes`` in ``workers`` processes; the exit code. With
    ``coverage`` the rule coverage of the whole campaign is printed at the end."""
    if minutes <= 0 or workers < 1:
        print(
            f"kvconform fuzz: --minutes must be > 0 and --workers >= 1, got "
            f"{minutes} and {workers}",
            file=sys.stderr,
        )
        return 2
    load_engine_factory(engine)  # a bad --engine fails here, with a clear message
    config = CheckConfig(engine=engine, level=level, preset=preset, failure_dir=failure_dir)
    prop = "attention" if attention else "invariants"
    base_seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
    print(
        f"kvconform fuzz: engine={engine} level={level} workers={workers} "
        f"minutes={minutes} base seed={base_seed}",
        flush=True,
    )
    start = time.time()
    deadline = start + minutes * 60
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    coverage_dir = tempfile.mkdtemp(prefix="kvconform-cov-") if coverage else None
    procs = [
        _worker_process(
            ctx, coverage_dir, (i, base_seed, deadline, config, prop, out), shrink_seconds
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
                    failures.append(failure)
                    command = replay_command(failure[2], engine, level, attention)
                    print(
                        f"\nFAILURE (seed {failure[0]}): {failure[1][:300]}\n  replay: {command}",
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
