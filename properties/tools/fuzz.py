"""``kvconform fuzz``: a time-boxed campaign over many seeds, in ``--workers`` processes.

Each worker runs the stateful machine in rounds (one Hypothesis run of 50 examples per
round, a fresh seed per round: ``base_seed + 1000 * worker + round``), sharing the
Hypothesis example database under ``.kvconform/hypothesis`` so failures found once are
replayed first next time. The parent prints progress (on a terminal a live line; else
one line per ``--progress-seconds``, no carriage returns) and a summary. Ctrl-C
(SIGINT) or SIGTERM stops the workers, prints the summary and exits 130, or the failure
code when something was found (1 a property failed, 3 the engine broke the protocol).
Every failure is saved as a replayable trace, once (the same shrunk trace found again is
not saved again), and its replay command is printed.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from properties.core.constants import (
    DEFAULT_DATABASE_DIR,
    EXIT_ENGINE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_PASSED,
)
from properties.runner.check import replay_command, run_property
from properties.runner.config import CheckConfig
from properties.runner.machine import engine_factory


def _worker(
    index: int, base_seed: int, deadline: float, config: CheckConfig, prop: str, out: mp.Queue
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the workers
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
        result = run_property(prop, config, s, seed)
        out.put(
            (
                "progress",
                index,
                result.examples,
                result.steps,
                None
                if result.failure is None
                else (seed, result.failure[:2000], str(result.trace_path or ""), result.kind),
            )
        )
    out.put(("done", index, 0, 0, None))


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the parent, like Ctrl-C."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
    config: CheckConfig,
    minutes: float,
    workers: int = 1,
    attention: bool = False,
    seed: int | None = None,
    progress_seconds: float = 30.0,
) -> int:
    """Fuzz ``config.engine`` for ``minutes`` in ``workers`` processes; the exit code."""
    engine_factory(config)  # a bad --engine fails here, with a clear message
    prop = "attention" if attention else "invariants"
    base_seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
    print(
        f"kvconform fuzz: engine={config.engine} level={config.level} workers={workers} "
        f"minutes={minutes} base seed={base_seed}",
        flush=True,
    )
    start = time.time()
    deadline = start + minutes * 60
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(i, base_seed, deadline, config, prop, out), daemon=True)
        for i in range(workers)
    ]
    examples = steps = 0
    failures: dict[str, tuple] = {}  # trace path (or message) -> failure, each once
    progress = Progress(start, progress_seconds)
    done = 0
    interrupted = False
    with _sigterm_interrupts():
        try:
            for p in procs:
                p.start()
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
                    if failure is not None and (failure[2] or failure[1]) not in failures:
                        failures[failure[2] or failure[1]] = failure
                        command = replay_command(failure[2], config.engine, config.level, attention)
                        print(
                            f"\nFAILURE (seed {failure[0]}): {failure[1][:300]}\n"
                            f"  trace: {failure[2]}\n  replay: {command}",
                            flush=True,
                        )
                progress.show(examples, steps, len(failures), time.time())
        except KeyboardInterrupt:
            interrupted = True
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
        f"{' (interrupted)' if interrupted else ''}",
        flush=True,
    )
    for seed_, message, path, _kind in failures.values():
        print(f"  seed {seed_}: {message.splitlines()[0][:200]}\n    trace: {path}")
    kinds = {f[3] for f in failures.values()}
    if "engine" in kinds:
        return EXIT_ENGINE
    if kinds or crashed:
        return EXIT_FAILED
    return EXIT_INTERRUPTED if interrupted else EXIT_PASSED
