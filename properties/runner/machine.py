"""The stateful machine: an engine driven through generated traces, checked at every step.

:class:`TraceRun` runs trace operations through the scheduler against a
:class:`properties.checks.lockstep.LockstepEngine` (the engine under test, plus the
reference at the ``exact`` level) and, when asked, the attention check.
:class:`KVCacheMachine` is the Hypothesis ``RuleBasedStateMachine`` over it:
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
stops with :class:`RunStopped` and the trace so far is kept.
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

from properties.checks.boundary import build_engine
from properties.checks.lockstep import LockstepEngine
from properties.checks.registry import PropertyViolation
from properties.core.engine import (
    CallTimeoutError,
    EngineError,
    ExposesDataPlane,
    KVCacheEngine,
    SupportsServingModes,
    UnsupportedLayoutError,
    load_engine_factory,
)
from properties.core.modes import SYNC, ServingMode, production_settings
from properties.core.outcome import Outcome
from properties.core.trace import (
    Abort,
    Arrive,
    Operation,
    Preempt,
    ResetPrefixCache,
    Step,
    Trace,
)
from properties.core.versions import versions
from properties.generate import strategies as kvst
from properties.runner.config import CheckConfig
from properties.runner.scheduler import RequestState, Scheduler, StepRecord
from reference.errors import KVConformError
from reference.layout import KVCacheLayout
from reference.specs import MambaSpec


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


def mode_tags(layout: KVCacheLayout, mode: ServingMode) -> list[str]:
    """The production modes a run exercises, for the counts ``kvconform check`` prints:
    ``retention=dense|sparse|interval``, ``eagle-drop``, ``lookahead-hashes``,
    ``async``, ``admission-gate``, ``drafts``, ``external-hits``, ``async-loads``,
    ``load-failures``."""
    r = layout.prefix_cache_retention_interval
    tags = [f"retention={'dense' if r is None else 'sparse' if r == 0 else 'interval'}"]
    if layout.drop_eagle_group_ids:
        tags.append("eagle-drop")
    if layout.num_hash_lookahead_tokens:
        tags.append("lookahead-hashes")
    if mode.async_scheduling:
        tags.append("async")
    if mode.admission_gate:
        tags.append("admission-gate")
    if mode.num_draft_tokens:
        tags.append("drafts")
    if mode.external_hits and not any(isinstance(s, MambaSpec) for s in layout.specs):
        tags.append("external-hits")
        if mode.async_loads:
            tags.append("async-loads")
        if mode.load_failures:
            tags.append("load-failures")
    return tags


class RunStopped(BaseException):
    """Ends a Hypothesis run at once, without shrinking (a call ran past its deadline).

    A ``BaseException`` so that Hypothesis does not treat it as a failure to shrink;
    ``error`` is the :class:`CallTimeoutError`."""

    def __init__(self, error: CallTimeoutError) -> None:
        super().__init__(str(error))
        self.error = error


def failure_kind(exc: BaseException) -> str:
    """The kind of a run's failure (:meth:`properties.core.outcome.Outcome.of_failure`):
    ``"property"``, ``"engine"``, ``"usage"`` or ``"internal"``."""
    return Outcome.of_failure(exc).kind


def engine_factory(config: CheckConfig) -> Callable:
    """The factory ``config.engine`` names, run in a child process when
    ``config.isolation`` asks for it (:mod:`properties.engines.isolation`)."""
    from properties.engines.isolation import isolated_factory, wants_isolation

    factory = load_engine_factory(config.engine)
    if wants_isolation(config.engine, config.isolation, config.call_timeout):
        return isolated_factory(config.engine, factory, config.call_timeout)
    return factory


class TraceRun:
    """One engine (and the reference at ``exact``) under one layout, driven op by op."""

    def __init__(
        self,
        config: CheckConfig,
        layout: KVCacheLayout,
        factory: Callable | None = None,
        mode: ServingMode = SYNC,
        expected: KVCacheEngine | None = None,
    ) -> None:
        """``expected`` (exact level): what the engine is compared with instead of a fresh
        reference, e.g. the recorded results of a corpus case."""
        self.config = config
        self.layout = layout
        self.mode = mode
        factory = factory or engine_factory(config)
        # an engine in a child process has its own deadline, which kills the child
        timeout = 0.0 if getattr(factory, "enforces_call_timeout", False) else config.call_timeout
        engine = build_engine(factory, layout, timeout)
        self.versions = versions(engine, factory)
        reference = None
        if config.level == "exact":
            if expected is not None:
                reference = expected
            else:
                from properties.engines.reference import make_engine as make_reference

                reference = make_reference(layout)
        self.lockstep = LockstepEngine(engine, layout, reference, config.disabled, timeout)
        self.attention = None
        if config.attention:
            from properties.checks.attention import AttentionChecker

            plane = engine if isinstance(engine, ExposesDataPlane) else None
            self.attention = AttentionChecker(layout, data_plane=plane)
        self.mode = SYNC
        self.scheduler = self._scheduler(SYNC)
        self.operations: list[Operation] = []
        if not mode.is_default:
            self.set_mode(mode)

    def set_mode(self, mode: ServingMode) -> None:
        """Drive the run in ``mode`` (before its first operation)."""
        if self.operations:
            raise KVConformError("TraceRun.set_mode: the run has started already")
        if not mode.is_default and not self.supports_serving_modes():
            raise UnsupportedLayoutError(
                f"{self.lockstep.engine_name} does not offer the calls of serving mode "
                f"{mode.describe()} (properties.core.engine.SupportsServingModes)"
            )
        self.mode = mode
        self.scheduler = self._scheduler(mode)

    def _scheduler(self, mode: ServingMode) -> Scheduler:
        """The scheduler in ``mode``; its host tier (external hits) is the store the
        checks bound external hits by (X1), and its offloads and loads go through the
        attention check's paged cache when that runs."""
        scheduler = Scheduler(
            self.lockstep,
            self.layout,
            on_scheduled=self._on_scheduled,
            mode=mode,
            on_offload=self._on_offload if self.attention is not None else None,
            on_load=self._on_load if self.attention is not None else None,
        )
        self.lockstep.checker.state.host_tier = scheduler.host_tier
        return scheduler

    def supports_serving_modes(self) -> bool:
        return isinstance(self.lockstep.engine, SupportsServingModes)

    def apply(self, op: Operation) -> StepRecord | None:
        self.operations.append(op)
        return self.scheduler.apply(op)

    def _on_scheduled(self, scheduler: Scheduler, record: StepRecord) -> None:
        if self.attention is None or not record.scheduled:
            return
        from properties.checks.attention import AttentionMismatch, ScheduledChunk

        chunks = []
        for item in record.scheduled:
            state = scheduler.requests[item.request_id]
            chunks.append(
                ScheduledChunk(
                    request=state.input,
                    token_ids=state.token_ids,
                    num_computed_before=item.start,
                    num_scheduled=item.num_tokens,
                    block_ids=tuple(tuple(g) for g in self.lockstep.get_block_ids(item.request_id)),
                )
            )
        try:
            self.attention.check_step(chunks)
        except AttentionMismatch as exc:
            raise PropertyViolation("attention", str(exc)) from exc

    def _on_offload(self, state: RequestState, gid: int, block_index: int, block: int) -> None:
        assert self.attention is not None
        self.attention.offload(gid, state.input, state.token_ids, block_index, block)

    def _on_load(self, state: RequestState, start: int, end: int) -> None:
        from properties.checks.attention import AttentionMismatch

        assert self.attention is not None
        table = self.lockstep.get_block_ids(state.request_id)
        try:
            self.attention.load(state.input, state.token_ids, table, start, end)
        except AttentionMismatch as exc:
            raise PropertyViolation("attention", str(exc)) from exc

    def to_trace(self, failure: BaseException | None = None, seed: int | None = None) -> Trace:
        info = None if failure is None else failure_info(failure, self.config, self.versions)
        return Trace(
            layout=self.layout,
            operations=tuple(self.operations),
            seed=seed,
            observed=tuple(self.lockstep.log),
            failure=info,
            mode=self.mode,
        )


def failure_info(
    failure: BaseException, config: CheckConfig, found_versions: dict | None = None
) -> dict:
    """The ``failure`` record of a trace: the check, the message, whether the engine broke
    the protocol (``kind``), the engine, level and the versions."""
    return {
        "property": getattr(failure, "name", type(failure).__name__),
        "kind": failure_kind(failure),
        "message": str(failure),
        "engine": config.engine,
        "level": config.level,
        "versions": found_versions if found_versions is not None else versions(),
    }


class KVCacheMachine(RuleBasedStateMachine):
    """Rules over one generated layout; configure with :func:`machine_for`."""

    config: CheckConfig = CheckConfig()
    factory: Callable | None = None
    stats: RunStats = RunStats()

    def __init__(self) -> None:
        super().__init__()
        self.run: TraceRun | None = None
        #: an operation of this run failed (the teardown then adds none)
        self.failed = False
        self.next_id = 0
        self.pool: tuple[tuple[int, ...], ...] = ()
        self.sent: list[Arrive] = []
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
        except (AssertionError, KVConformError) as exc:  # violations and engine errors
            type(self).stats.last_failure = self.run.to_trace(exc)
            if isinstance(exc, CallTimeoutError):
                raise RunStopped(exc) from exc
            raise

    @initialize(data=st.data())
    def build(self, data: st.DataObject) -> None:
        strategy = layout_strategy(self.config, self.factory)
        layout = data.draw(strategy, label="layout")
        note(f"layout: {layout.describe()}")
        self.run = self._trace_run(layout)
        mode = self._draw_mode(data)
        if mode is not None:
            mode = self._kept_mode(mode)
            note(f"serving mode: {mode.describe()}")
            self.run.set_mode(mode)
        self.pool = data.draw(kvst.prefix_pools(layout), label="prefix pool")
        self.arrivals = kvst.request_inputs(layout, self.pool, "r")
        self.steps = kvst.step_ops(layout)
        stats = type(self).stats
        stats.examples += 1
        drawn = self.config.production or self.config.attention
        self.tags = mode_tags(layout, self.run.mode) if drawn else []
        for tag in self.tags:
            stats.modes.setdefault(tag, [0, 0])[0] += 1

    def _trace_run(self, layout: KVCacheLayout) -> TraceRun:
        """A run of the engine under test on ``layout`` (an example the engine refuses is
        not one: ``reject()``; a factory that fails is the trace's failure)."""
        try:
            return TraceRun(self.config, layout, self.factory)
        except UnsupportedLayoutError:
            reject()
        except EngineError as exc:  # the factory failed: the trace is the layout alone
            info = failure_info(exc, self.config)
            type(self).stats.last_failure = Trace(layout, (), failure=info)
            if isinstance(exc, CallTimeoutError):
                raise RunStopped(exc) from exc
            raise

    def _draw_mode(self, data: st.DataObject) -> ServingMode | None:
        """The serving mode drawn for this run, or None for the default one: the
        ``production`` property draws every mode (a preset run: the mode it is served
        with); the ``attention`` property draws a connector mode
        (:func:`kvst.connector_modes`) for every engine, so the stream is the same."""
        assert self.run is not None
        if self.config.production and self.run.supports_serving_modes():
            if self.config.preset is not None:
                return kvst.PRODUCTION_MODE
            return data.draw(kvst.serving_modes(), label="serving mode")
        if self.config.attention:
            return data.draw(kvst.connector_modes(), label="connector mode")
        return None

    def _kept_mode(self, mode: ServingMode) -> ServingMode:
        """What the engine gets of a drawn mode: the default one without the serving calls,
        no external hits unless it declares the ``external`` setting."""
        assert self.run is not None
        if not self.run.supports_serving_modes():
            return SYNC
        if "external" not in production_settings(self.factory):
            mode = dataclasses.replace(
                mode, external_hits=False, async_loads=False, load_failures=False
            )
        return mode

    def _apply(self, op: Operation) -> None:
        assert self.run is not None
        if current_build_context().is_final:
            note(f"op: {op!r}")
        stats = type(self).stats
        try:
            record = self._guard(lambda: self.run.apply(op))
        except BaseException as exc:
            self.failed = True
            if isinstance(exc, Exception) and stats.first_failure is None:
                stats.first_failure = (
                    stats.steps + 1,
                    stats.examples,
                    time.perf_counter(),
                    getattr(exc, "name", type(exc).__name__),
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

    @precondition(lambda self: self.run is not None and bool(self.run.scheduler.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        assert self.run is not None
        live = sorted(self.run.scheduler.requests)
        self._apply(Abort(live[data.draw(st.integers(0, len(live) - 1), label="abort")]))

    @precondition(lambda self: self.run is not None and bool(self.run.scheduler.running))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        assert self.run is not None
        running = self.run.scheduler.running
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
        free = run.lockstep.checker.state.num_free()
        self.min_free = free if self.min_free is None else min(self.min_free, free)

    def report(self, layout: KVCacheLayout) -> None:
        usable = max(1, layout.num_blocks - 1)
        if self.min_free is not None:
            target(1.0 - self.min_free / usable, label="pool pressure")
        target(self.longest_hit / layout.max_model_len, label="hit length")
        target(self.blocks_allocated / usable, label="free-queue churn")


def layout_strategy(config: CheckConfig, factory: Callable | None = None):
    """Layouts to draw: the engine's own ``layout_strategy`` if it has one, else a preset
    (``--preset``) or any generated layout, made only of the spec types the factory
    supports when it says so (``factory.spec_types``, e.g. an exec engine's ``hello``)."""
    own = getattr(factory, "layout_strategy", None) if factory is not None else None
    kinds = spec_types(factory)
    if own is not None:
        strategy = own()
    elif config.preset is not None:
        if config.preset not in kvst.presets_of_kinds(kinds):
            raise KVConformError(
                f"--preset {config.preset!r} is not a preset made of the spec types the "
                f"engine supports ({', '.join(kinds)}); those are: "
                f"{', '.join(kvst.presets_of_kinds(kinds)) or 'none'}"
            )
        # a preset run of the production property keeps the retention it is served with
        strategy = kvst.preset_layouts(
            names=[config.preset], max_len=config.max_len, served=config.production
        )
    else:
        strategy = kvst.any_layouts(max_len=config.max_len, kinds=kinds)
    if config.production and config.preset is None:
        strategy = kvst.production_layouts(
            strategy, max_len=config.max_len, settings=production_settings(factory)
        )
    known = known_divergences(factory)
    if known:
        strategy = strategy.filter(lambda layout: not any(d.applies(layout) for d in known))
    return strategy


def spec_types(factory: Callable | None) -> tuple[str, ...]:
    """The spec types the factory's engines support (``factory.spec_types``), all four by
    default. Example: the Rust example engine -> ``("full", "sliding_window")``."""
    declared = getattr(factory, "spec_types", None) if factory is not None else None
    if declared is None:
        return kvst.SPEC_KINDS
    unknown = [k for k in declared if k not in kvst.SPEC_KINDS]
    if unknown or not declared:
        raise KVConformError(
            f"the engine declares spec types {list(declared)!r}; known: "
            f"{', '.join(kvst.SPEC_KINDS)}"
        )
    return tuple(declared)


def known_divergences(factory: Callable | None) -> tuple:
    """The factory's documented divergences (:class:`properties.core.engine.KnownDivergence`)."""
    return tuple(getattr(factory, "known_divergences", ()) or ())


def _probe_layouts() -> tuple[KVCacheLayout, ...]:
    """Small layouts to build an engine on when only its capabilities are wanted: one
    full-attention group, then full attention with a sliding window (bs 4, w 8)."""
    from reference.layout import KVCacheGroup
    from reference.specs import FullAttentionSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype_bytes=2)
    window = SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype_bytes=2, sliding_window=8
    )
    one = KVCacheLayout(groups=(KVCacheGroup(("l0",), full),), num_blocks=16, max_model_len=64)
    two = dataclasses.replace(
        one, groups=(KVCacheGroup(("l0",), full), KVCacheGroup(("l1",), window))
    )
    return (one, two)


def active_checks_for(
    factory: Callable | None, config: CheckConfig
) -> tuple[list[str], frozenset[str]]:
    """The invariants that run for this engine (its optional capabilities decide) and
    the capabilities, read from an engine built on a small probe layout."""
    from properties.checks.checker import Checker

    factory = factory or engine_factory(config)
    for layout in _probe_layouts():
        try:
            engine = build_engine(factory, layout, config.call_timeout)
        except UnsupportedLayoutError:
            continue
        checker = Checker(engine, layout, config.disabled)
        return checker.active_checks(), checker.state.capabilities()
    return [], frozenset()


def machine_for(
    config: CheckConfig, factory: Callable | None = None, name: str = "InvariantsMachine"
) -> type[KVCacheMachine]:
    """A machine class bound to ``config`` (a plain subclass with class attributes).

    Under a derandomized profile the examples drawn depend on ``name`` only (Hypothesis
    digests the class name), so every engine sees the same stream for one name:
    ``kvconform check`` names its machines after the property.
    """
    factory = factory or engine_factory(config)
    return type(
        name,
        (KVCacheMachine,),
        {"config": config, "factory": staticmethod(factory), "stats": RunStats()},
    )


def replay_trace(
    trace: Trace, config: CheckConfig, factory: Callable | None = None
) -> tuple[TraceRun, BaseException | None]:
    """Replay ``trace`` (in its serving mode) with every check; returns the run and the
    first failure (or None)."""
    run = TraceRun(config, trace.layout, factory, trace.mode)
    try:
        for op in trace.operations:
            run.apply(op)
    except (AssertionError, KVConformError) as exc:  # violations and engine errors
        return run, exc
    return run, None


__all__ = [
    "KVCacheMachine",
    "RunStats",
    "RunStopped",
    "engine_factory",
    "failure_kind",
    "TraceRun",
    "active_checks_for",
    "layout_strategy",
    "machine_for",
    "replay_trace",
]
