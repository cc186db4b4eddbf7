"""Properties in parallel worker processes, with the result one process gives.

``kvconform check --workers N`` runs each property (``invariants``, ``attention``,
``determinism``) as one task in its own child process, ``N`` at a time
(:func:`run_tasks`). A child that ends without a verdict (an in-process engine that
called ``os._exit(0)``, a segfault, a kill) is an engine error naming the engine call it
was in (:func:`died_result`), never a pass; a stop signal in the parent ends every child
within :data:`STOP_GRACE_S` (:mod:`properties.tools.stopping`). A property's examples
depend only on its machine's name and the seed (the ``ci`` profile is derandomized), so a
property gives the same examples, steps and failure in a worker as in the parent: the
table is the same for any ``N``, only the wall time changes. Results come back in the
order of the properties.

With ``coverage_dir`` every worker measures rule coverage
(:mod:`properties.tools.rule_coverage`) from its start, before the first import of the
reference (the pool's initializer), and saves its data file there for the parent to
combine. This module imports nothing of ``reference`` at load time for that reason.

Worked example::

    tasks = [PropertyTask("invariants", config, "ci"), PropertyTask("determinism", config, "ci")]
    results = run_tasks(tasks, workers=2)   # same PropertyResults as workers=1
"""

from __future__ import annotations

import dataclasses
import importlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from properties.core.processes import die_with_parent, reap_descendants, watchdog_pid


@dataclass(frozen=True)
class PropertyTask:
    """One property to run: its name, the check configuration (picklable, engine by
    name), the profile, and the overrides of ``kvconform check``."""

    name: str
    config: object  # properties.runner.config.CheckConfig
    profile: str
    max_examples: int | None = None
    seed: int | None = None
    shrink_seconds: float | None = None
    #: the large tiers to run after the small one (None: every tier the profile names)
    tiers: tuple[str, ...] | None = None
    #: examples per large tier (None: the profile's counts; ``--tier-examples``)
    examples_per_tier: int | None = None


def default_workers() -> int:
    """The number of cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


#: The coverage measurement of this worker process (started by :func:`_start_coverage`).
_WORKER_COVERAGE = None


def _start_coverage(coverage_dir: str) -> None:
    """Pool initializer: measure from before the first import of ``reference``."""
    global _WORKER_COVERAGE
    from properties.tools.rule_coverage import new_coverage

    _WORKER_COVERAGE = new_coverage(os.path.join(coverage_dir, ".coverage"))
    _WORKER_COVERAGE.start()


def measured_worker(coverage_dir: str, target: str, config_fields: dict, *args) -> None:
    """A process target measured from its start (``kvconform fuzz --coverage``).

    ``target`` names the worker function as ``module:function`` and the configuration
    comes as plain fields: unpickling a function or a ``CheckConfig`` would import the
    reference before measuring starts. The worker is called as
    ``function(config, *args, after_round=save)``; the data is saved after every round.
    """
    _start_coverage(coverage_dir)
    try:
        from properties.runner.config import CheckConfig

        module, name = target.split(":")
        function = getattr(importlib.import_module(module), name)
        function(CheckConfig(**config_fields), *args, after_round=_WORKER_COVERAGE.save)
    finally:
        _WORKER_COVERAGE.stop()
        _WORKER_COVERAGE.save()


def run_task(task: PropertyTask, engine=None, on_first_failure=None):
    """Run one task in this process on ``engine`` (an
    :class:`properties.engines.under_test.EngineUnderTest`; None: the task's
    configuration names it, resolved here); a first failure is announced the moment it
    is found (``on_first_failure``, default :func:`announce_first_failure`). In a
    measuring worker the data so far is saved after each task."""
    from properties.tools.engine_coverage import measure_task

    try:
        with measure_task(task.config):  # --engine-coverage: measured where the engine runs
            return _run(task, engine, on_first_failure or announce_first_failure)
    finally:
        if _WORKER_COVERAGE is not None:
            _WORKER_COVERAGE.save()


def _run(task: PropertyTask, engine, on_first_failure):
    from hypothesis import settings

    from properties.runner.check import run_property
    from properties.runner.profiles import get_profile

    profile = get_profile(task.profile)
    hyp = settings(profile, max_examples=task.max_examples or profile.max_examples)
    if task.seed is not None:  # a seed reproduces a run exactly: no example database
        hyp = settings(hyp, database=None)
    return run_property(
        task.name,
        task.config,
        hyp,
        task.seed,
        engine,
        shrink_seconds=task.shrink_seconds,
        on_first_failure=on_first_failure,
        tiers=large_tier_counts(task),
    )


def large_tier_counts(task: PropertyTask) -> dict[str, int]:
    """The examples of each large tier ``task`` runs (:func:`properties.tools.options.tier_counts`;
    the attention and determinism properties then scale them as they scale the profile's:
    :func:`properties.runner.check.tiers_for`)."""
    from properties.tools.options import tier_counts

    return tier_counts(task.profile, task.tiers, task.examples_per_tier)


def announce_first_failure(first) -> None:
    """Print a first failure (a :class:`properties.runner.check.FirstFailure`) and its
    replay command the moment it is found, before shrinking. Its HTML page is written
    here unless a Hypothesis test is running in this process (a property run in the
    main process announces from inside its test): then :func:`write_first_failure_page`
    writes it once the property has ended."""
    from hypothesis.control import currently_in_test_context

    print(f"  {first.describe()}", flush=True)
    if first.trace_path is not None:
        print(f"  first failing trace: {first.trace_path}", flush=True)
        if not currently_in_test_context():
            write_first_failure_page(first)
        print(f"  replay: {first.replay()}", flush=True)


def write_first_failure_page(first) -> None:
    """Write (once) and name the HTML page of a first failure's saved trace."""
    from properties.tools.report import report_beside

    if first.trace_path is not None and not getattr(first, "page_written", False):
        first.page_written = True
        print(f"  {report_beside(first.trace_path)[1]}", flush=True)


#: Seconds a stopped worker gets to end after SIGTERM before it is killed.
STOP_GRACE_S = 1.0


def _worker(
    fields: dict, config_fields: dict, index: int, out, buffer, coverage_dir: str | None
) -> None:
    """One property in a child process: its first failure and its result go to ``out``;
    the engine call running now is kept in ``buffer`` (so a worker that an engine ends
    is reported with its call). SIGINT is the parent's to handle; SIGTERM kills the
    engine children and ends the worker. The task comes as plain fields: unpickling a
    ``CheckConfig`` would import the reference before coverage starts."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal: the parent stops us
    signal.signal(signal.SIGTERM, _end_worker)
    die_with_parent(signal.SIGTERM)  # the parent killed (kill -9): end our engines too
    if coverage_dir is not None:
        _start_coverage(coverage_dir)
    from properties.core import current_call
    from properties.runner.config import CheckConfig

    task = PropertyTask(config=CheckConfig(**config_fields), **fields)
    from properties.core.forked import settle_forked_child

    settle_forked_child()  # a forked worker: no parent's timer, torch on one thread
    current_call.install(buffer)
    try:
        result = run_task(task, on_first_failure=lambda first: out.put(("first", index, first)))
    except Exception as exc:  # noqa: BLE001 - reported as the property's result
        result = _result_without_verdict(task.name, 0.0, f"{type(exc).__name__}: {exc}", exc)
    out.put(("result", index, result))


def _end_worker(signum, frame) -> None:
    """SIGTERM in a worker: its engine children killed, then every process below it, then
    the exit. No import here: the signal may land while the worker imports (an import
    from a handler then meets partly initialised modules); engine children exist only
    once the module that starts them is loaded."""
    exec_engine = sys.modules.get("properties.engines.exec_engine")
    kill = getattr(exec_engine, "kill_engine_children", None)
    if kill is not None:
        kill()
    reap_descendants(keep=frozenset(p for p in (watchdog_pid(),) if p is not None))
    os._exit(128 + signum)


def _result_without_verdict(name: str, seconds: float, text: str, exc: BaseException | None):
    from properties.core.outcome import Outcome
    from properties.runner.check import PropertyResult

    kind = Outcome.of_failure(exc).kind if exc is not None else Outcome.ENGINE.kind
    return PropertyResult(name, 0, 0, seconds, text, kind=kind)


def died_result(
    name: str, exitcode: int | None, call: str, seconds: float, process: str | None = None
):
    """The result of a worker (``process``, by default "the worker process of property
    NAME") that ended without a verdict: an engine error naming the call it was in (an
    in-process engine that called ``os._exit``, crashed, was killed), or an internal
    error when no engine call was running."""
    process = process or f"the worker process of property {name}"
    how = (
        f"exit code {exitcode}"
        if exitcode is None or exitcode >= 0
        else (f"signal {signal.Signals(-exitcode).name}")
    )
    if call:
        text = f"the engine ended {process} ({how}) during {call}, before any verdict"
        return _result_without_verdict(name, seconds, text, None)
    text = f"{process} ended ({how}) before any verdict"
    return _result_without_verdict(name, seconds, text, RuntimeError(text))


def run_tasks(
    tasks: Sequence[PropertyTask],
    workers: int,
    coverage_dir: str | None = None,
    start_method: str = "spawn",
    on_result: Callable[[object], None] | None = None,
    on_first_failure: Callable[[object], None] = announce_first_failure,
) -> list:
    """Every task in its own child process, at most ``workers`` at a time; the results
    in task order (``on_result`` hears each as it arrives). A worker that ends without
    a verdict gives :func:`died_result`. A stop signal (:class:`Stopped`, raised by the
    parent's handler) ends every worker within :data:`STOP_GRACE_S` and is raised again
    with the results that arrived."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    from properties.core import current_call

    ctx = mp.get_context(start_method)
    out = ctx.Queue()
    pending = list(enumerate(tasks))
    running: dict[int, tuple] = {}
    results: dict[int, object] = {}

    def take(message) -> None:
        what, index, value = message
        if what == "first":
            on_first_failure(value)
        elif index not in results:
            results[index] = value
            if on_result is not None:
                on_result(value)

    try:
        while pending or running:
            while pending and len(running) < workers:
                index, task = pending.pop(0)
                buffer = ctx.Array("c", current_call.CALL_BYTES, lock=False)
                fields = {f.name: getattr(task, f.name) for f in dataclasses.fields(task)}
                config_fields = dataclasses.asdict(fields.pop("config"))
                args = (fields, config_fields, index, out, buffer, coverage_dir)
                proc = ctx.Process(target=_worker, args=args, daemon=True)
                proc.start()
                running[index] = (proc, buffer, time.perf_counter())
            _drain(out, take, 0.2)
            for index, (proc, buffer, started) in list(running.items()):
                if index not in results and proc.is_alive():
                    continue
                if index not in results:  # its last messages may still be on the way
                    _drain(out, take, 0.5)
                if index not in results:
                    seconds = time.perf_counter() - started
                    call = current_call.read(buffer)
                    take(
                        (
                            "result",
                            index,
                            died_result(tasks[index].name, proc.exitcode, call, seconds),
                        )
                    )
                proc.join(timeout=STOP_GRACE_S)
                del running[index]
    except KeyboardInterrupt as stop:
        _end_all([proc for proc, _b, _t in running.values()])
        if hasattr(stop, "results"):
            stop.results = [results[i] for i in sorted(results)]
        raise
    return [results[i] for i in range(len(tasks))]


def _drain(out, take, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            take(out.get(timeout=max(0.01, deadline - time.monotonic())))
        except queue.Empty:
            return


def _end_all(procs: list) -> None:
    """SIGTERM every worker (each kills its engine children), SIGKILL what is left after
    :data:`STOP_GRACE_S`."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=STOP_GRACE_S)
