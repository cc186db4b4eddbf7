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
(:func:`properties.core.trace.save_trace`); when the failure directory cannot be
written, into a fresh temporary directory instead (:func:`save_failure`), never lost.
A result's ``kind`` says what failed: ``property`` (exit 1), ``engine`` (the engine
broke the protocol: exit 3), ``no_layout`` (the engine rejected every layout drawn:
exit 2) or ``internal`` (a bug of kvconform: exit 70), as
:class:`properties.core.outcome.Outcome` says. A failure that does not repeat when
Hypothesis replays it is the first failure recorded, never Hypothesis' ``Flaky``
(:mod:`properties.runner.flaky`). :func:`replay_command` is the command that
reproduces a saved failure.

Worked example::

    config = CheckConfig(engine="reference", level="exact")
    result = run_property("invariants", config, load_profile("dev"), seed=None)
    assert result.failure is None
"""

from __future__ import annotations

import shlex
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from hypothesis import given, settings
from hypothesis import seed as hseed
from hypothesis.errors import Unsatisfiable
from hypothesis.stateful import run_state_machine_as_test

from properties.checks.registry import CHECKS, PropertyViolation, disabled_all_but
from properties.core.constants import PROPERTIES
from properties.core.diff import short_record
from properties.core.engine import CallTimeoutError, EngineError
from properties.core.trace import Trace, save_trace
from properties.engines.under_test import EngineUnderTest
from properties.generate import strategies as kvst
from properties.runner.config import CheckConfig
from properties.runner.flaky import not_reproduced
from properties.runner.machine import RunStats, failure_label, machine_for
from properties.runner.progress import Ticker
from properties.runner.run import (
    RunStopped,
    TraceRun,
    engine_of,
    failure_info,
    failure_kind,
    layout_strategy,
    replay_trace,
    start_run,
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
    #: the trace saved (reduced), None when it did not fail again
    trace: Trace | None = None
    #: what the reduction did (sizes before and after), None without one
    reduced: str | None = None
    #: the failure's kind (:class:`properties.core.outcome.Outcome`): its exit code if
    #: the run is stopped before it ends
    kind: str = "property"
    #: the scale tier it was found in (None: the small tier)
    tier: str | None = None
    #: what its replay needs beyond the engine and level (:meth:`CheckConfig.replay_options`)
    options: str = ""
    #: the reach corpus case it was found in (None: the draws)
    case: str | None = None

    def describe(self) -> str:
        if self.case is not None:
            return (
                f"{self.prop}: first failure [{self.check}] in reach corpus case "
                f"{self.case!r} after {self.seconds:.1f}s"
            )
        where = f" at the {self.tier} tier" if self.tier else ""
        return (
            f"{self.prop}: first failure [{self.check}]{where} after {self.seconds:.1f}s, "
            f"example {self.examples}, step {self.steps}"
        )

    def replay(self) -> str | None:
        if self.trace_path is None:
            return None
        return replay_command(
            self.trace_path, self.engine, self.level, self.prop == "attention", self.options
        )


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
    kind: str | None = None
    note: str | None = None
    first: FirstFailure | None = None
    #: production property: mode tag -> (examples, steps)
    modes: dict[str, tuple[int, int]] | None = None
    #: the check that failed (a :data:`properties.checks.registry.CHECKS` name), if any
    check: str | None = None
    #: checks listed as expected to fail that failed here (``--xfails-file``)
    xfailed: tuple[str, ...] = ()
    #: pairs of features reached: pair -> examples (:mod:`properties.runner.pairs`)
    pairs: dict[tuple[str, str], int] | None = None
    #: whether the engine offered the serving-mode calls
    serving_calls: bool = False
    #: what the trace reducer did (sizes before and after), None without a reduction
    reduced: str | None = None
    #: scale tier -> (examples, steps, seconds), the small tier first (:func:`run_tiers`)
    tiers: dict[str, tuple[int, int, float]] | None = None
    #: reach corpus cases replayed before the draws (:mod:`properties.runner.reach`)
    reach: int = 0

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
    """Numeric attention costs about 10x a symbolic step: a third of the examples. One
    bug, one name: Hypothesis reports one failure (``report_multiple_bugs=False``)."""
    base = settings(base, report_multiple_bugs=False)
    if name == "attention":
        return settings(base, max_examples=max(20, base.max_examples // 3))
    return base


def run_property(
    name: str,
    config: CheckConfig,
    hyp_settings: settings,
    seed: int | None,
    engine: EngineUnderTest | Callable | None = None,
    shrink_seconds: float | None = DEFAULT_SHRINK_SECONDS,
    on_first_failure: Callable[[FirstFailure], None] | None = None,
    tiers: Mapping[str, int] | None = None,
) -> PropertyResult:
    """Run property ``name`` (one of :data:`PROPERTIES`) on ``engine`` and save a
    failure's trace. ``engine``: the engine under test, resolved once by the caller;
    None resolves ``config.engine`` here (a worker process given the configuration).

    Shrinking stops after ``shrink_seconds`` (``None``: Hypothesis' own bound) with the
    best trace found so far. The first failure's trace is replayed and saved as soon
    as it is found, and ``on_first_failure`` hears of it then (before any shrinking).
    ``tiers`` (large tier -> examples, e.g. ``tier_examples("ci")``): then those tiers
    run too (:func:`run_tiers`); with ``config.tier`` a large tier, only that one.
    """
    if name not in PROPERTIES:
        raise ValueError(f"unknown property {name!r}; known: {', '.join(PROPERTIES)}")
    if shrink_seconds is not None and shrink_seconds < 0:
        raise ValueError(f"--shrink-seconds must be >= 0, got {shrink_seconds}")
    config = config_for(name, config)
    hyp_settings = settings_for(name, hyp_settings)
    engine = engine_of(config, engine)
    reached, reach_pairs = 0, {}
    if config.reach_corpus and config.tier == kvst.SMALL:  # what must never be lost, first
        failed, reached, reach_pairs = _replay_reach_corpus(name, config, seed, engine)
        if failed is not None:
            if on_first_failure is not None and failed.first is not None:
                on_first_failure(failed.first)
            return failed
    with bounded_shrinking(shrink_seconds):
        if config.tier != kvst.SMALL:
            result = PropertyResult(name, 0, 0, 0, tiers={})
        elif name == "determinism":
            result = _run_determinism(config, hyp_settings, seed, engine)
        else:
            result = _run_machine(
                name, config, hyp_settings, seed, engine, on_first_failure, shrink_seconds
            )
        result.reach = reached
        if reach_pairs and result.pairs is not None:  # the cases ran those pairs too
            for pair, count in reach_pairs.items():
                result.pairs[pair] = result.pairs.get(pair, 0) + count
        if tiers is not None and result.passed:
            run_tiers(
                result,
                config,
                hyp_settings,
                seed,
                engine,
                tiers_for(name, tiers),
                on_first_failure,
            )
    return result


def _replay_reach_corpus(
    name: str, config: CheckConfig, seed: int | None, engine: EngineUnderTest
) -> tuple[PropertyResult | None, int, dict[tuple[str, str], int]]:
    """Replay the reach corpus for property ``name`` (:mod:`properties.runner.reach`):
    ``(the failed result, cases replayed, the pairs they ran)``; the result is None when
    every case passed.
    A failing case is saved and reported like a failure of the property's own draws,
    its message naming the case."""
    from properties.runner.reach import load_reach_corpus, replay_reach

    started = time.perf_counter()
    replay = replay_reach(name, config, engine, load_reach_corpus())
    if replay.failed is None:
        return None, replay.replayed, replay.pairs
    kind, text = _classify(replay.error, 0)
    path, note = _save(replay.trace, config, seed, engine)
    seconds = time.perf_counter() - started
    check = failed_check(replay.error)
    result = PropertyResult(
        name,
        0,
        0,
        seconds,
        f"{text}\n(reach corpus case {replay.failed.name!r}: {replay.failed.why})",
        path,
        kind,
        note,
        check=check,
    )
    result.reach = replay.replayed
    label = failure_label(_first_error(replay.error))
    first = FirstFailure(
        name, label, seconds, 0, 0, path, config.engine, config.level, replay.trace
    )
    first.kind, first.case, first.options = kind, replay.failed.name, config.replay_options()
    result.first = first
    return result, replay.replayed, replay.pairs


def tiers_for(name: str, counts: Mapping[str, int]) -> dict[str, int]:
    """The large tiers' example counts property ``name`` runs: the attention property
    (numeric, about 10x a symbolic step) a third of the medium ones (at least 2: the
    first example of a derandomized run is the simplest) and no offline or production
    one (numeric attention over hundreds of requests or a 10^4-block trace takes
    minutes); determinism no production one either. Example: ``tiers_for("attention",
    {"medium": 5, "production": 3}) == {"medium": 2, "offline": 0, "production": 0}``."""
    if name == "determinism":  # two runs of a 10^4-block trace: minutes on 2 cores; the
        # invariants and production properties run that tier, nightly runs it here too
        return {t: n for t, n in counts.items() if t != kvst.PRODUCTION}
    if name != "attention":
        return dict(counts)
    medium = counts.get(kvst.MEDIUM, 0)
    return {kvst.MEDIUM: max(min(2, medium), medium // 3), kvst.OFFLINE: 0, kvst.PRODUCTION: 0}


def run_tiers(
    result: PropertyResult,
    config: CheckConfig,
    hyp_settings: settings,
    seed: int | None,
    engine: EngineUnderTest,
    counts: Mapping[str, int],
    on_first_failure: Callable[[FirstFailure], None] | None = None,
) -> None:
    """Run the large tiers ``counts`` names (only ``config.tier`` when it is one) after
    the small one and add them to ``result``: its per-tier counts, its totals, and the
    first tier failure with its saved trace (the later tiers then do not run). A tier's
    first failing trace is saved and handed to ``on_first_failure`` as it is found, as
    the small tier's is."""
    from properties.runner.tiers import run_tier

    started = time.perf_counter() - result.seconds

    result.tiers = result.tiers if result.tiers is not None else {}
    if config.tier == kvst.SMALL:
        result.tiers[kvst.SMALL] = (result.examples, result.steps, result.seconds)
    for tier, count in counts.items():
        if count < 1 or config.tier not in (kvst.SMALL, tier):
            continue
        tier_settings = settings(hyp_settings, max_examples=count)
        announce = None
        if on_first_failure is not None:

            def announce(trace: Trace, tier: str = tier) -> None:
                on_first_failure(
                    tier_first_failure(result, tier, trace, started, config, seed, engine)
                )

        outcome = run_tier(result.name, config, tier, tier_settings, seed, engine, announce)
        result.tiers[tier] = (outcome.examples, outcome.steps, outcome.seconds)
        result.examples += outcome.examples
        result.steps += outcome.steps
        result.seconds += outcome.seconds
        refused = outcome.examples == 0 and outcome.failure is not None
        if refused and isinstance(_first_error(outcome.failure), Unsatisfiable):
            # an engine that refuses every layout of a large tier is not failed for it
            result.note = f"{tier} tier: the engine refused every layout drawn"
            continue
        if outcome.failure is not None:
            result.kind, text = _classify(outcome.failure, outcome.examples)
            result.failure = f"[{tier} tier] {text}"
            result.trace_path, result.note = _save(outcome.trace, config, seed, engine)
            return


def tier_first_failure(
    result: PropertyResult,
    tier: str,
    trace: Trace,
    started: float,
    config: CheckConfig,
    seed: int | None,
    engine: EngineUnderTest,
) -> FirstFailure:
    """The first failure of a large tier, its trace saved as found (a large trace is not
    reduced before it is announced). Example: a medium-tier pool-accounting failure
    describes itself as ``invariants: first failure [pool_accounting] at the medium tier
    after 12.0s, example 30, step 812``."""
    failure = trace.failure or {}
    path, _note = _save(trace, config, seed, engine)
    first = FirstFailure(
        result.name,
        str(failure.get("property", "?")),
        time.perf_counter() - started,
        result.examples,
        result.steps,
        path,
        config.engine,
        config.level,
        trace,
    )
    first.kind = str(failure.get("kind", "property"))
    first.tier = tier
    first.options = config.replay_options()
    return first


@contextmanager
def bounded_shrinking(seconds: float | None) -> Iterator[None]:
    """Hypothesis stops shrinking after ``seconds`` and reports the best example so far.

    Hypothesis documents its shrink time bound (``MAX_SHRINKING_SECONDS``) as the
    setting to patch for this; it is restored afterwards."""
    from hypothesis.internal.conjecture import engine

    from properties.runner.progress import honest_shrink_reporter

    old = engine.MAX_SHRINKING_SECONDS
    if seconds is not None:
        engine.MAX_SHRINKING_SECONDS = seconds
    try:
        with honest_shrink_reporter(seconds):
            yield
    finally:
        engine.MAX_SHRINKING_SECONDS = old


def save_first_failure(
    prop: str,
    stats: RunStats,
    started: float,
    config: CheckConfig,
    seed: int | None,
    engine: EngineUnderTest,
    reduce_seconds: float | None = None,
) -> FirstFailure:
    """Replay the first failing trace (before shrinking) and save it if it fails again,
    reduced first (:mod:`properties.runner.reduce`) when ``reduce_seconds`` is given."""
    from properties.runner.reduce import reduce_failure

    step, examples, when, check = stats.first_failure
    path = reduced = None
    trace = stats.first_trace
    if trace is not None:
        _run, exc = replay_trace(trace, config, engine)
        if exc is None:
            trace = None
        elif reduce_seconds is not None:
            trace, reduced = reduce_failure([trace], check, config, engine, reduce_seconds)
        path, _note = _save(trace, config, seed, engine)
    kind = (trace.failure or {}).get("kind", "property") if trace is not None else "property"
    first = FirstFailure(
        prop, check, when - started, examples, step, path, config.engine, config.level, trace
    )
    first.reduced = reduced
    first.kind = kind
    first.options = config.replay_options()
    return first


def _first_error(exc: BaseException) -> BaseException:
    """The failure itself: a timeout's error, the first of a group Hypothesis raised."""
    if isinstance(exc, RunStopped):
        return exc.error
    inner = getattr(exc, "exceptions", None)  # ExceptionGroup (several distinct bugs)
    if inner:
        return _first_error(inner[0])
    return exc


def failed_check(exc: BaseException | None) -> str | None:
    """The name of the check a run's exception reports (``answers`` for a protocol
    error), or None."""
    if exc is None:
        return None
    error = _first_error(exc)
    if isinstance(error, PropertyViolation):
        return error.name
    return "answers" if isinstance(error, EngineError) else None


def _failure_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _classify(exc: BaseException, examples: int) -> tuple[str, str]:
    """``(kind, text)`` of a run's exception (see the module docstring)."""
    error = _first_error(exc)
    if isinstance(error, Unsatisfiable) and examples == 0:
        return "no_layout", (
            "the engine raised UnsupportedLayoutError for every layout drawn (no example "
            "ran): give its factory a layout_strategy of the layouts it supports, or pick "
            "a --preset it supports"
        )
    return failure_kind(error), _failure_text(error)


def _report(
    exc: BaseException,
    examples: int,
    first: Trace | None,
    last: Trace | None,
    config: CheckConfig,
    seed: int | None,
    engine: EngineUnderTest,
) -> tuple[str, str, Path | None, str | None]:
    """``(kind, text, saved trace, note)`` of a run's exception: a failure that did not
    repeat (:mod:`properties.runner.flaky`) is the ``first`` failure recorded, its trace
    saved as it ran; any other the exception itself with the ``last`` (shrunk) trace."""
    unrepeated = not_reproduced(exc, first)
    if unrepeated is None:
        kind, failure = _classify(exc, examples)
        return (kind, failure, *_save(last, config, seed, engine))
    path, moved = _save(unrepeated.trace, config, seed, engine)
    note = unrepeated.note + (f"; {moved}" if moved else "")
    return unrepeated.kind, unrepeated.failure, path, note


def save_failure(trace: Trace, directory: str) -> tuple[Path, str | None]:
    """Save ``trace`` under ``directory``; if that cannot be written, under a new
    temporary directory. Returns the path and a note saying why it moved (or None)."""
    try:
        return save_trace(trace, directory), None
    except OSError as exc:
        fallback = tempfile.mkdtemp(prefix="kvconform-failures-")
        path = save_trace(trace, fallback)
        return path, (
            f"cannot write the failure directory {directory!r} "
            f"({type(exc).__name__}: {exc.strerror or exc}); trace saved to {path} instead"
        )


def _save(
    trace: Trace | None, config: CheckConfig, seed: int | None, engine: EngineUnderTest
) -> tuple[Path | None, str | None]:
    """Save a failing trace with the engine's view of it (what the engine showed after
    each operation: :mod:`properties.runner.engine_view`), so that its report is drawn
    from the file alone."""
    if trace is None:
        return None, None
    from properties.runner.engine_view import record_engine_view

    view = record_engine_view(trace, config, engine)
    return save_failure(replace(trace, seed=seed, engine_view=view), config.failure_dir)


def _run_machine(
    name: str,
    config: CheckConfig,
    hyp_settings: settings,
    seed: int | None,
    engine: EngineUnderTest,
    on_first_failure: Callable[[FirstFailure], None] | None = None,
    reduce_seconds: float | None = DEFAULT_SHRINK_SECONDS,
) -> PropertyResult:
    # Under a derandomized profile the examples depend on the machine's class name only.
    machine = machine_for(config, engine, name=f"{name.capitalize()}Machine")
    stats = machine.stats
    start = time.perf_counter()
    found: list[FirstFailure] = []

    def first_failure(stats: RunStats) -> None:
        found.append(save_first_failure(name, stats, start, config, seed, engine, reduce_seconds))
        if on_first_failure is not None:
            on_first_failure(found[0])

    stats.on_first_failure = first_failure
    if seed is not None:
        machine = hseed(seed)(machine)
    failure = path = kind = note = error = reduced = None
    try:
        with Ticker(name, lambda: (stats.examples, stats.steps, len(found))):
            run_state_machine_as_test(machine, settings=hyp_settings)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure is reported
        error = exc
        first = stats.first_trace or stats.last_failure
        if not_reproduced(exc, first) is not None:  # a failure that did not repeat
            kind, failure, path, note = _report(
                exc, stats.examples, first, stats.last_failure, config, seed, engine
            )
        else:
            kind, failure = _classify(exc, stats.examples)
            trace = stats.last_failure
            if found and kind in ("property", "engine"):  # one bug, one name; minimal
                trace, kind, failure, reduced = reduced_failure(
                    stats, found[0], config, engine, reduce_seconds, kind, failure
                )
            path, note = _save(trace, config, seed, engine)
    modes = {tag: (e, n) for tag, (e, n) in sorted(stats.modes.items())} or None
    return PropertyResult(
        name,
        stats.examples,
        stats.steps,
        time.perf_counter() - start,
        failure,
        path,
        kind,
        note,
        found[0] if found else None,
        modes,
        failed_check(error),
        reduced=reduced,
        pairs=dict(stats.pairs),
        serving_calls=stats.serving_calls,
    )


def _smaller(a: Trace, b: Trace) -> bool:
    """``a`` is a smaller failure than ``b`` (fewer operations, then fewer tokens), or
    ``b`` fails with another check."""
    from properties.runner.reduce import TraceSize

    if (b.failure or {}).get("property") != (a.failure or {}).get("property"):
        return True
    size_a, size_b = TraceSize.of(a), TraceSize.of(b)
    return (size_a.operations, size_a.tokens) <= (size_b.operations, size_b.tokens)


def reduced_failure(
    stats: RunStats,
    found: FirstFailure | None,
    config: CheckConfig,
    factory: Callable | None,
    seconds: float | None,
    kind: str,
    failure: str | None,
) -> tuple[Trace | None, str, str | None, str | None]:
    """The failure to report: the trace of the first check that failed (Hypothesis'
    shrunk trace when it fails with that check, else the trace as found), reduced by
    :func:`properties.runner.reduce.reduce_failure`; its kind, text and a note of the
    sizes."""
    from properties.runner.reduce import reduce_failure

    check = found.check if found is not None else (stats.first_failure or ("",) * 4)[3]
    budget = DEFAULT_SHRINK_SECONDS if seconds is None else seconds
    first = found.trace if found is not None else None
    last = stats.last_failure
    if first is not None and last is not None and last.operations == stats.first_trace.operations:
        last = None  # Hypothesis shrank nothing: the first failure's reduction stands
    trace, note = reduce_failure([last], check, config, factory, budget)
    if first is not None and (trace is None or _smaller(first, trace)):
        trace, note = first, found.reduced  # the first failure's reduced trace, saved already
    if trace is not None and trace.failure and trace.failure.get("property") == check:
        error = PropertyViolation.__name__ if check in CHECKS else check
        failure = f"{error}: {trace.failure['message']}"
        kind = trace.failure.get("kind", kind)
    return trace, kind, failure, note


def _run_determinism(
    config: CheckConfig, hyp_settings: settings, seed: int | None, engine: EngineUnderTest
) -> PropertyResult:
    """H6: the same trace twice on fresh engines gives the same calls and results.

    Under a derandomized profile Hypothesis seeds this property from the source text of
    ``determinism`` below (its decorators and body): that text must not change, or the
    ci stream moves (hence the name ``factory`` for the engine under test)."""
    factory = engine
    counts = {"examples": 0, "steps": 0}
    failing: dict[str, Trace] = {}

    @hyp_settings
    @given(kvst.traces(layout_strategy(config, factory), max_ops=30))
    def determinism(trace: Trace) -> None:
        logs = []
        for _ in range(2):
            run = _determinism_run(config, trace, factory, failing)
            try:
                for op in trace.operations:
                    run.apply(op)
            except AssertionError:
                pass  # the invariants property reports violations; here only calls matter
            except EngineError as exc:  # the engine broke the protocol: reported as such
                failing["trace"] = run.to_trace(exc)
                if isinstance(exc, CallTimeoutError):
                    raise RunStopped(exc) from exc
                raise
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
                f"{_call_at(logs[0], first)} vs {_call_at(logs[1], first)}",
            )
            failing["trace"] = replace(trace, failure=failure_info(violation, config))
            raise violation

    if seed is not None:
        determinism = hseed(seed)(determinism)
    start = time.perf_counter()
    failure = path = kind = note = error = None
    try:
        with Ticker("determinism", lambda: (counts["examples"], counts["steps"], len(failing))):
            determinism()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure is reported
        error = exc
        trace = failing.get("trace")
        kind, failure, path, note = _report(
            exc, counts["examples"], trace, trace, config, seed, engine
        )
    return PropertyResult(
        "determinism",
        counts["examples"],
        counts["steps"],
        time.perf_counter() - start,
        failure,
        path,
        kind,
        note,
        check=failed_check(error),
    )


def _call_at(log: list, index: int) -> str:
    """Call ``index`` of a run's log, long lists shortened; ``no call`` past its end."""
    return short_record(log[index]) if index < len(log) else "no call"


def _determinism_run(
    config: CheckConfig, trace: Trace, engine: EngineUnderTest, failing: dict[str, Trace]
) -> TraceRun:
    """A fresh run of ``trace`` (:func:`properties.runner.run.start_run`: a layout the
    engine refuses is not an example; a factory that fails is kept as ``failing["trace"]``)."""
    return start_run(config, trace.layout, engine, lambda t: failing.update(trace=t))


def replay_command(
    path: Path | str, engine: str, level: str, attention: bool, options: str = ""
) -> str:
    """The command that replays a saved failure and reproduces it: ``--attention`` for
    that property and the run's ``options`` (:meth:`CheckConfig.replay_options`), every
    part quoted for a shell."""
    parts = ["kvconform", "replay", str(path), "--engine", engine, "--level", level]
    command = " ".join(shlex.quote(p) for p in parts)
    return command + (" --attention" if attention else "") + (f" {options}" if options else "")


def failure_report(
    result: PropertyResult,
    engine: str,
    level: str,
    seed: int | None = None,
    options: str = "",
    page: str | None = None,
) -> str:
    """What a failed property reports under pytest: the failure, the seed, where its
    trace was saved (and why elsewhere), its page and the command that replays it."""
    lines = [f"[{result.name}] ({result.kind}) {(result.failure or '')[:4000]}"]
    if result.note:
        lines.append(f"note: {result.note}")
    lines.append(f"seed: {seed if seed is not None else 'derandomized (the ci profile)'}")
    if result.trace_path is not None:
        command = replay_command(
            result.trace_path, engine, level, result.name == "attention", options
        )
        lines += [f"trace: {result.trace_path}"]
        if page:
            lines.append(page)
        lines.append(f"replay: {command}")
    return "\n".join(lines)
