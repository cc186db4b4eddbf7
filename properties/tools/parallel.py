"""Properties in parallel worker processes, with the result one process gives.

``kvconform check --workers N`` runs each property (``invariants``, ``attention``,
``determinism``) as one task in a pool of ``N`` spawned processes. A property's examples
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

import importlib
import multiprocessing as mp
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass


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


def run_task(task: PropertyTask, factory=None):
    """Run one task in this process; a first failure is announced
    (:func:`announce_first_failure`) the moment it is found. In a measuring worker the
    data so far is saved after each task (the pool ends workers without ``atexit``)."""
    try:
        return _run(task, factory)
    finally:
        if _WORKER_COVERAGE is not None:
            _WORKER_COVERAGE.save()


def _run(task: PropertyTask, factory):
    from hypothesis import settings

    from properties.runner.check import run_property
    from properties.runner.profiles import load_profile, tier_examples

    profile = load_profile(task.profile)
    hyp = settings(profile, max_examples=task.max_examples or profile.max_examples)
    if task.seed is not None:  # a seed reproduces a run exactly: no example database
        hyp = settings(hyp, database=None)
    return run_property(
        task.name,
        task.config,
        hyp,
        task.seed,
        factory,
        shrink_seconds=task.shrink_seconds,
        on_first_failure=announce_first_failure,
        tiers=tier_examples(task.profile),
    )


def announce_first_failure(first) -> None:
    """Print a first failure (a :class:`properties.runner.check.FirstFailure`) and its
    replay command the moment it is found, before shrinking."""
    print(f"  {first.describe()}", flush=True)
    if first.trace_path is not None:
        print(f"  first failing trace: {first.trace_path}\n  replay: {first.replay()}", flush=True)


def run_tasks(tasks: Sequence[PropertyTask], workers: int, coverage_dir: str | None = None) -> list:
    """Every task, in ``workers`` spawned processes (in this one when ``workers`` is 1
    and no coverage is measured); the results in task order."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if workers == 1 and coverage_dir is None:
        return [run_task(t) for t in tasks]
    ctx = mp.get_context("spawn")
    init, init_args = (_start_coverage, (coverage_dir,)) if coverage_dir else (None, ())
    with ProcessPoolExecutor(
        max_workers=min(workers, len(tasks)),
        mp_context=ctx,
        initializer=init,
        initargs=init_args,
    ) as pool:
        futures = [pool.submit(run_task, t) for t in tasks]
        return [f.result() for f in futures]
