"""Running the properties: what ``kvconform check`` does, as library calls.

Four properties (:data:`PROPERTIES`):

* ``invariants``: the stateful machine with every invariant after every call (and, at
  the exact level, the lockstep comparison with the reference);
* ``attention``: the same machine with the attention check instead of the invariants;
* ``determinism``: the same trace twice on fresh engines gives the same calls and
  results (H6);
* ``production``: the invariants machine with the deployed settings drawn on top
  (retention interval, EAGLE and lookahead hashes per layout; asynchronous scheduling
  and the admission gate per trace, for engines with ``SupportsServingModes``).

:func:`run_property` runs one under Hypothesis settings and returns a
:class:`PropertyResult`; a failure's shrunk trace is taken from memory (the machine's
:class:`properties.runner.machine.RunStats`) and saved once, with the one trace writer
(:func:`properties.core.trace.save_trace`). :func:`replay_command` is the command that
reproduces a saved failure.

Worked example::

    config = CheckConfig(engine="reference", level="exact")
    result = run_property("invariants", config, load_profile("dev"), seed=None)
    assert result.failure is None
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from hypothesis import given, settings
from hypothesis import seed as hseed
from hypothesis.stateful import run_state_machine_as_test

from properties.checks.registry import PropertyViolation, disabled_all_but
from properties.core.constants import PROPERTIES
from properties.core.engine import EngineError, load_engine_factory
from properties.core.trace import Trace, save_trace
from properties.generate import strategies as kvst
from properties.runner.config import CheckConfig
from properties.runner.machine import (
    RunStats,
    TraceRun,
    layout_strategy,
    machine_for,
    replay_trace,
)

#: Default bound of the shrink phase, seconds: a failure found in CI reaches its replay
#: command within a minute of the start (the first failing trace is saved before it).
DEFAULT_SHRINK_SECONDS = 30.0


@dataclass
class FirstFailure:
    """When a property first failed (before shrinking) and the trace saved for it:
    ``seconds`` since the property started, after ``examples`` examples and ``steps``
    machine steps; ``trace_path`` is ``None`` when the trace did not fail again on
    replay (a failure that depends on more than the operations)."""

    prop: str
    check: str
    seconds: float
    examples: int
    steps: int
    trace_path: Path | None
    engine: str
    level: str

    def describe(self) -> str:
        return (
            f"{self.prop}: first failure [{self.check}] after {self.seconds:.1f}s, "
            f"example {self.examples}, step {self.steps}"
        )

    def replay(self) -> str | None:
        if self.trace_path is None:
            return None
        return replay_command(self.trace_path, self.engine, self.level, self.prop == "attention")


@dataclass
class PropertyResult:
    """One property's run: counts, time, the failure with its saved (shrunk) trace and
    the first failure as found."""

    name: str
    examples: int
    steps: int
    seconds: float
    failure: str | None = None
    trace_path: Path | None = None
    first: FirstFailure | None = None
    #: production property: mode tag -> (examples, steps)
    modes: dict[str, tuple[int, int]] | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None


def config_for(name: str, config: CheckConfig) -> CheckConfig:
    """The configuration property ``name`` runs with: ``attention`` swaps the invariants
    for the attention check."""
    if name == "attention":
        return replace(config, attention=True, disabled=disabled_all_but(()))
    if name == "production":
        return replace(config, production=True)
    return config


def settings_for(name: str, base: settings) -> settings:
    """Numeric attention costs about 10x a symbolic step: a third of the examples."""
    if name == "attention":
        return settings(base, max_examples=max(20, base.max_examples // 3))
    return base


def run_property(
    name: str,
    config: CheckConfig,
    hyp_settings: settings,
    seed: int | None,
    factory: Callable | None = None,
    shrink_seconds: float | None = DEFAULT_SHRINK_SECONDS,
    on_first_failure: Callable[[FirstFailure], None] | None = None,
) -> PropertyResult:
    """Run property ``name`` (one of :data:`PROPERTIES`) and save a failure's trace.

    Shrinking stops after ``shrink_seconds`` (``None``: Hypothesis' own bound) with the
    best trace found so far. The first failure's trace is replayed and saved as soon
    as it is found, and ``on_first_failure`` hears of it then (before any shrinking).
    """
    if name not in PROPERTIES:
        raise ValueError(f"unknown property {name!r}; known: {', '.join(PROPERTIES)}")
    if shrink_seconds is not None and shrink_seconds < 0:
        raise ValueError(f"--shrink-seconds must be >= 0, got {shrink_seconds}")
    config = config_for(name, config)
    hyp_settings = settings_for(name, hyp_settings)
    with bounded_shrinking(shrink_seconds):
        if name == "determinism":
            return _run_determinism(config, hyp_settings, seed, factory)
        return _run_machine(name, config, hyp_settings, seed, factory, on_first_failure)


@contextmanager
def bounded_shrinking(seconds: float | None) -> Iterator[None]:
    """Hypothesis stops shrinking after ``seconds`` and reports the best example so far.

    Hypothesis documents its shrink time bound (``MAX_SHRINKING_SECONDS``) as the
    setting to patch for this; it is restored afterwards."""
    from hypothesis.internal.conjecture import engine

    old = engine.MAX_SHRINKING_SECONDS
    if seconds is not None:
        engine.MAX_SHRINKING_SECONDS = seconds
    try:
        yield
    finally:
        engine.MAX_SHRINKING_SECONDS = old


def save_first_failure(
    prop: str,
    stats: RunStats,
    started: float,
    config: CheckConfig,
    seed: int | None,
    factory: Callable | None,
) -> FirstFailure:
    """Replay the first failing trace (before shrinking) and save it if it fails again."""
    step, examples, when, check = stats.first_failure
    path = None
    trace = stats.first_trace
    if trace is not None:
        _run, exc = replay_trace(trace, config, factory)
        if exc is not None:
            path = _save(trace, config, seed)
    return FirstFailure(
        prop, check, when - started, examples, step, path, config.engine, config.level
    )


def _failure_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _save(trace: Trace | None, config: CheckConfig, seed: int | None) -> Path | None:
    if trace is None:
        return None
    return save_trace(replace(trace, seed=seed), config.failure_dir)


def _run_machine(
    name: str,
    config: CheckConfig,
    hyp_settings: settings,
    seed: int | None,
    factory: Callable | None,
    on_first_failure: Callable[[FirstFailure], None] | None = None,
) -> PropertyResult:
    # Under a derandomized profile the examples depend on the machine's class name only.
    machine = machine_for(config, factory, name=f"{name.capitalize()}Machine")
    stats = machine.stats
    start = time.perf_counter()
    found: list[FirstFailure] = []

    def first_failure(stats: RunStats) -> None:
        found.append(save_first_failure(name, stats, start, config, seed, machine.factory))
        if on_first_failure is not None:
            on_first_failure(found[0])

    stats.on_first_failure = first_failure
    if seed is not None:
        machine = hseed(seed)(machine)
    failure, path = None, None
    try:
        run_state_machine_as_test(machine, settings=hyp_settings)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure is reported
        failure = _failure_text(exc)
        path = _save(stats.last_failure, config, seed)
    modes = {tag: (e, n) for tag, (e, n) in sorted(stats.modes.items())} or None
    return PropertyResult(
        name,
        stats.examples,
        stats.steps,
        time.perf_counter() - start,
        failure,
        path,
        found[0] if found else None,
        modes,
    )


def _run_determinism(
    config: CheckConfig, hyp_settings: settings, seed: int | None, factory: Callable | None
) -> PropertyResult:
    """H6: the same trace twice on fresh engines gives the same calls and results."""
    factory = factory or load_engine_factory(config.engine)
    counts = {"examples": 0, "steps": 0}
    failing: dict[str, Trace] = {}

    @hyp_settings
    @given(kvst.traces(layout_strategy(config, factory), max_ops=30))
    def determinism(trace: Trace) -> None:
        logs = []
        for _ in range(2):
            run = TraceRun(config, trace.layout, factory)
            try:
                for op in trace.operations:
                    run.apply(op)
            except (AssertionError, EngineError):
                pass  # other properties report violations; here only the calls matter
            logs.append(run.lockstep.log)
        counts["examples"] += 1
        counts["steps"] += len(trace.operations)
        if logs[0] != logs[1]:
            first = next(
                (i for i, (a, b) in enumerate(zip(logs[0], logs[1])) if a != b),
                min(map(len, logs)),
            )
            violation = PropertyViolation(
                "determinism",
                f"call {first} differs between two runs: "
                f"{logs[0][first : first + 1]} vs {logs[1][first : first + 1]}",
            )
            failing["trace"] = replace(
                trace,
                failure={
                    "property": "determinism",
                    "message": str(violation),
                    "engine": config.engine,
                    "level": config.level,
                },
            )
            raise violation

    if seed is not None:
        determinism = hseed(seed)(determinism)
    start = time.perf_counter()
    failure, path = None, None
    try:
        determinism()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure is reported
        failure = _failure_text(exc)
        path = _save(failing.get("trace"), config, seed)
    return PropertyResult(
        "determinism",
        counts["examples"],
        counts["steps"],
        time.perf_counter() - start,
        failure,
        path,
    )


def replay_command(path: Path | str, engine: str, level: str, attention: bool) -> str:
    """The command that replays a saved failure (``--attention`` for that property)."""
    return (
        f"kvconform replay {path} --engine {engine} --level {level}"
        f"{' --attention' if attention else ''}"
    )
