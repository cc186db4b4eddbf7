"""The stateful machine: an engine driven through generated traces, checked at every step.

:class:`KVCacheMachine` is the Hypothesis ``RuleBasedStateMachine`` over a
:class:`properties.runner.run.TraceRun` (the engine under test, the reference at the
``exact`` level, the scheduler and the checks):
rules arrive, resend (an earlier prompt, possibly extended by its output: a
retry or the next chat turn), step, abort, preempt and reset the prefix cache. Levels:

* ``universal``: the invariants, hit soundness and maximality, window liveness;
  holds for any correct engine whatever its allocation policy;
* ``exact``: additionally the same hits, block ids and free counts as the
  reference (engines that claim vLLM's policy).

Every failing run keeps its trace (the operations so far, the calls observed and the
failure) in memory, in the machine class's :class:`RunStats`; Hypothesis' final run is
the shrunk one, so ``stats.last_failure`` then holds the minimal trace. A call that runs
past its deadline is not shrunk (every attempt would cost the deadline again): the run
stops with :class:`properties.runner.run.RunStopped` and the trace so far is kept.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import note, reject, target
from hypothesis import strategies as st
from hypothesis.control import current_build_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from properties.core.engine import CallTimeoutError, KnownDivergenceMet
from properties.core.modes import MULTIMODAL, SYNC, ServingMode
from properties.core.trace import (
    Abort,
    Arrive,
    Operation,
    Preempt,
    ResetPrefixCache,
    Step,
    Trace,
)
from properties.engines.under_test import EngineUnderTest
from properties.generate import strategies as kvst
from properties.runner.config import CheckConfig
from properties.runner.pairs import count_pairs, features
from properties.runner.run import RunStopped, TraceRun, layout_strategy, mode_tags, start_run
from properties.runner.scheduler import StepRecord
from reference.errors import KVConformError
from reference.layout import KVCacheLayout


def failure_label(exc: BaseException) -> str:
    """How a first failure is named: the check a violation reports, else the error's type.
    Example: a ``PropertyViolation("hit_bounds", ...)`` is ``hit_bounds``; an
    ``EngineError`` is ``EngineError``."""
    return getattr(exc, "name", type(exc).__name__)


@dataclass
class RunStats:
    """Counts of one machine class's runs; its first failure as it happened,
    ``(step number, examples so far, time.perf_counter(), check name)``; and the trace
    of its last failing run (the shrunk one once Hypothesis is done)."""

    examples: int = 0
    steps: int = 0
    first_failure: tuple[int, int, float, str] | None = None
    last_failure: Trace | None = None
    #: the trace of the first failing run, as it was found (before any shrinking)
    first_trace: Trace | None = None
    #: called once with this object when the first failure happens (before shrinking)
    on_first_failure: Callable[[RunStats], None] | None = None
    #: production modes drawn: tag -> [examples, steps] (:func:`mode_tags`)
    modes: dict[str, list[int]] = field(default_factory=dict)
    #: pairs of features reached: pair -> examples (:mod:`properties.runner.pairs`)
    pairs: dict[tuple[str, str], int] = field(default_factory=dict)
    #: whether the engine offered the serving-mode calls (a run was built)
    serving_calls: bool = False


class KVCacheMachine(RuleBasedStateMachine):
    """Rules over one generated layout; configure with :func:`machine_for`."""

    config: CheckConfig = CheckConfig()
    engine: EngineUnderTest | None = None
    stats: RunStats = RunStats()
    #: the layouts this machine class draws from (:meth:`layouts`), built on first use
    layout_draws: st.SearchStrategy[KVCacheLayout] | None = None

    def __init__(self) -> None:
        super().__init__()
        self.run: TraceRun | None = None
        #: an operation of this run failed (the teardown then adds none)
        self.failed = False
        self.next_id = 0
        self.pool: tuple[tuple[int, ...], ...] = ()
        self.sent: list[Arrive] = []
        #: requests this run aborted: one whose abort waits (tokens in flight, a load
        #: not complete) stays among the scheduler's requests, but a trace names an
        #: aborted request no more (``properties.core.trace``)
        self.aborted: set[str] = set()
        self.tags: list[str] = []
        self.reach = Reach()
        # strategies of this run's layout, built once (building one per draw costs more
        # than the engine call it feeds)
        self.arrivals: st.SearchStrategy[Arrive] | None = None
        self.steps: st.SearchStrategy[Operation] | None = None

    def _guard(self, fn: Callable[[], object]) -> object:
        assert self.run is not None
        try:
            return fn()
        except KnownDivergenceMet:
            raise
        except (AssertionError, KVConformError) as exc:  # violations and engine errors
            type(self).stats.last_failure = self.run.to_trace(exc)
            if isinstance(exc, CallTimeoutError):
                raise RunStopped(exc) from exc
            raise

    @classmethod
    def layouts(cls) -> st.SearchStrategy[KVCacheLayout]:
        """The layout strategy of this class's configuration and engine, built once (a
        strategy built per example was validated per example: its lambdas' labels come
        from their source); the same draws as one built anew."""
        draws = cls.__dict__.get("layout_draws")  # this class's own, never a base's
        if draws is None:
            draws = cls.layout_draws = layout_strategy(cls.config, cls.engine)
        return draws

    @initialize(data=st.data())
    def build(self, data: st.DataObject) -> None:
        layout = data.draw(self.layouts(), label="layout")
        note(f"layout: {layout.describe()}")
        self.run = start_run(
            self.config,
            layout,
            self.engine,
            on_failure=self._record_failure,
            choose_mode=lambda supports: self._choose_mode(data, supports, layout),
        )
        self.pool = data.draw(kvst.prefix_pools(layout), label="prefix pool")
        self.arrivals = kvst.request_inputs(layout, self.pool, "r")
        if self.config.production and MULTIMODAL in self.engine.production_settings:
            self.arrivals = kvst.media_request_inputs(layout, self.pool, "r")
        self.steps = kvst.step_ops(layout)
        stats = type(self).stats
        stats.examples += 1
        drawn = self.config.production or self.config.attention
        self.tags = mode_tags(layout, self.run.mode) if drawn else []
        for tag in self.tags:
            stats.modes.setdefault(tag, [0, 0])[0] += 1
        count_pairs(stats.pairs, features(layout, self.run.mode))

    def _record_failure(self, trace: Trace) -> None:
        type(self).stats.last_failure = trace

    def _choose_mode(
        self, data: st.DataObject, supports: bool, layout: KVCacheLayout
    ) -> ServingMode:
        """The serving mode of this run, once its engine is built: the one drawn
        (:meth:`_draw_mode`) as the layout runs it (:func:`kvst.mode_for_layout`) and the
        engine gets it (:meth:`properties.engines.under_test.EngineUnderTest.serving_mode`)."""
        type(self).stats.serving_calls |= supports
        drawn = self._draw_mode(data, supports)
        if drawn is None:
            return SYNC
        mode = self.engine.serving_mode(kvst.mode_for_layout(drawn, layout), supports, layout)
        note(f"serving mode: {mode.describe()}")
        return mode

    def _draw_mode(self, data: st.DataObject, supports: bool) -> ServingMode | None:
        """The serving mode drawn for this run, or None for the default one: the
        ``production`` property draws every mode for an engine with the serving calls
        (``supports``; a preset run: the mode it is served with); the ``attention``
        property draws a connector mode (:func:`kvst.connector_modes`) for every engine,
        so the stream is the same."""
        if self.config.production and supports:
            if self.config.preset is not None:
                return kvst.PRODUCTION_MODE
            return data.draw(kvst.swarm_modes(), label="serving mode")
        if self.config.attention:
            return data.draw(kvst.connector_modes(), label="connector mode")
        return None

    def _apply(self, op: Operation) -> None:
        assert self.run is not None
        if current_build_context().is_final:
            note(f"op: {op!r}")
        stats = type(self).stats
        try:
            record = self._guard(lambda: self.run.apply(op))
        except KnownDivergenceMet as met:
            # a documented engine behaviour met at run time: not an example
            self.failed = True
            stats.modes.setdefault(f"met {met.divergence}", [0, 0])[0] += 1
            reject()
        except BaseException as exc:
            self.failed = True
            if isinstance(exc, Exception) and stats.first_failure is None:
                stats.first_failure = (
                    stats.steps + 1,
                    stats.examples,
                    time.perf_counter(),
                    failure_label(exc),
                )
                stats.first_trace = stats.last_failure
                if stats.on_first_failure is not None:
                    stats.on_first_failure(stats)
            raise
        stats.steps += 1
        for tag in self.tags:
            stats.modes[tag][1] += 1
        if record is not None:
            self.reach.observe(record, self.run)

    def teardown(self) -> None:
        """With a KV connector, end the run with a reload from the host tier
        (:meth:`_reload_at_end`); then guide the search (``hypothesis.target``) toward
        runs that stress the pool."""
        if self.run is None:
            return
        if not self.failed and self.run.scheduler.host_tier is not None and self.sent:
            self._reload_at_end()
        self.reach.report(self.run.layout)

    def _reload_at_end(self) -> None:
        """Connector modes: every run ends by loading from the host tier, whatever rules
        were drawn (nothing is drawn here, so the example stream is unchanged): every
        request runs to its end (its blocks go to the tier), the device cache is reset,
        and the longest request sent comes back as :func:`kvst.reload_ops` (its head on
        the device, the rest from the tier), or whole from the tier when it has fewer
        than two aligned blocks; then everything runs to its end. The operations are part
        of the trace, so a failure replays."""
        assert self.run is not None
        self._drain()
        self._apply(ResetPrefixCache())
        old = max(self.sent, key=lambda op: len(op.prompt) + len(op.output))
        again = dataclasses.replace(old, request_id=f"r{self.next_id}", output=())
        for op in kvst.reload_ops(self.run.layout, old, self.next_id) or (again,):
            self.next_id += 1
            self.sent.append(op)
            self._apply(op)
        self._drain()

    @rule(data=st.data())
    def arrive(self, data: st.DataObject) -> None:
        assert self.run is not None and self.arrivals is not None
        op = data.draw(self.arrivals, label="arrive")
        op = dataclasses.replace(op, request_id=f"r{self.next_id}")
        self.next_id += 1
        self.sent.append(op)
        self._apply(op)

    @precondition(lambda self: bool(self.sent))
    @rule(data=st.data())
    def resend(self, data: st.DataObject) -> None:
        """An earlier prompt again (a retry, or the next turn of a chat: the old prompt
        and its output plus a few new tokens), with the same or another salt."""
        assert self.run is not None
        old = self.sent[data.draw(st.integers(0, len(self.sent) - 1), label="resent request")]
        op = data.draw(kvst.resend_ops(self.run.layout, old, f"r{self.next_id}"), label="resend")
        self.next_id += 1
        self.sent.append(op)
        self._apply(op)

    @precondition(lambda self: bool(self.sent))
    @rule(data=st.data())
    def burst(self, data: st.DataObject) -> None:
        """An earlier prompt cut at a multiple of the hit alignment, then that prompt and
        a few new tokens, scheduled in one step with a budget for both: the second looks
        up what the first registers in the same step (a same-step Mamba state must be
        refused; two blocks end up under one key).

        With a KV connector (external hits), every request first runs to its end (its
        blocks go to the host tier) and the device cache is reset. Then either the burst
        as above (the first request loads the cut prompt from the tier while the second
        looks it up in the same step: blocks still loading must not be hit), or
        :func:`kvst.reload_ops` when the prompt has two aligned blocks: the second
        request's hit combines the first one's head on the device with the rest of the
        earlier prompt from the tier, the case where device and tier blocks must agree."""
        assert self.run is not None
        old = self.sent[data.draw(st.integers(0, len(self.sent) - 1), label="burst of")]
        ops = kvst.burst_ops(self.run.layout, old, self.next_id)
        if self.run.scheduler.host_tier is not None:
            self._drain()
            self._apply(ResetPrefixCache())
            if data.draw(st.booleans(), label="reload"):
                ops = kvst.reload_ops(self.run.layout, old, self.next_id) or ops
        for op in ops:
            self.next_id += 1
            self.sent.append(op)
            self._apply(op)
        self._apply(Step(2 * self.run.layout.max_model_len))

    def _drain(self, max_steps: int = 64) -> None:
        """Steps with a budget for every request until none is left (at most ``max_steps``)."""
        assert self.run is not None
        for _ in range(max_steps):
            if self.run.scheduler.is_idle():
                return
            self._apply(Step(2 * self.run.layout.max_model_len))

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        assert self.run is not None and self.steps is not None
        self._apply(data.draw(self.steps, label="step"))

    @rule(data=st.data())
    def step_again(self, data: st.DataObject) -> None:
        """Steps outnumber other operations, so requests make progress."""
        self.step(data)

    def _live(self, ids) -> list[str]:
        """``ids`` without the requests this run aborted already (a deferred abort)."""
        return [rid for rid in ids if rid not in self.aborted]

    @precondition(
        lambda self: self.run is not None and bool(self._live(self.run.scheduler.requests))
    )
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        assert self.run is not None
        live = sorted(self._live(self.run.scheduler.requests))
        rid = live[data.draw(st.integers(0, len(live) - 1), label="abort")]
        self.aborted.add(rid)
        self._apply(Abort(rid))

    @precondition(
        lambda self: self.run is not None and bool(self._live(self.run.scheduler.running))
    )
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        assert self.run is not None
        running = self._live(self.run.scheduler.running)
        self._apply(Preempt(running[data.draw(st.integers(0, len(running) - 1), label="preempt")]))

    @rule()
    def reset_prefix_cache(self) -> None:
        self._apply(ResetPrefixCache())


class Reach:
    """How hard one run pushed the engine, fed to ``hypothesis.target`` at its end:
    the pool pressure (the largest share of blocks in use after a step), the longest
    hit relative to ``max_model_len``, and the free-queue churn (blocks handed out per
    block of the pool: above 1, cached blocks were evicted and reused)."""

    def __init__(self) -> None:
        self.min_free: int | None = None
        self.longest_hit = 0
        self.blocks_allocated = 0

    def observe(self, record: StepRecord, run: TraceRun) -> None:
        for item in record.scheduled:
            self.longest_hit = max(self.longest_hit, item.hit_tokens)
            self.blocks_allocated += sum(len(g) for g in item.new_block_ids)
        free = run.num_free()
        self.min_free = free if self.min_free is None else min(self.min_free, free)

    def report(self, layout: KVCacheLayout) -> None:
        usable = max(1, layout.num_blocks - 1)
        if self.min_free is not None:
            target(1.0 - self.min_free / usable, label="pool pressure")
        target(self.longest_hit / layout.max_model_len, label="hit length")
        target(self.blocks_allocated / usable, label="free-queue churn")


def machine_for(
    config: CheckConfig, engine: EngineUnderTest, name: str = "InvariantsMachine"
) -> type[KVCacheMachine]:
    """A machine class bound to ``config`` and ``engine`` (a plain subclass with class
    attributes).

    Under a derandomized profile the examples drawn depend on ``name`` only (Hypothesis
    digests the class name), so every engine sees the same stream for one name:
    ``kvconform check`` names its machines after the property.
    """
    return type(name, (KVCacheMachine,), {"config": config, "engine": engine, "stats": RunStats()})


__all__ = [
    "KVCacheMachine",
    "RunStats",
    "machine_for",
]
