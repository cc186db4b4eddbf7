"""One run of the engine under test: :class:`TraceRun`, :func:`start_run`, :func:`replay_trace`.

Also what every run is drawn on and tagged with, shared by the stateful machine and the
determinism property: :func:`layout_strategy` (the layouts drawn for an engine) and
:func:`mode_tags` (the production modes a run exercises); and :func:`active_checks_for`
(the invariants an engine's capabilities enable, from a probe build).

:class:`TraceRun` runs trace operations through the scheduler against a
:class:`properties.checks.lockstep.LockstepEngine` (the engine under test, plus the
reference at the ``exact`` level) and, when asked, the attention check. Its serving mode
is fixed when it is built: with a KV connector (external hits) the host tier is made
first and given to both the scheduler (which fills it) and the checks (which bound
external hits by it, X1).

:func:`start_run` is the one start-of-run rule of the stateful machine and the
determinism property: a layout the engine does not support is not an example
(``hypothesis.reject()``); a factory that fails is the failure of a trace made of the
layout alone (handed to ``on_failure``), and a factory past its deadline stops the
Hypothesis run (:class:`RunStopped`) instead of being shrunk.

Worked example::

    engine = resolve_engine("reference")
    run, failure = replay_trace(trace, CheckConfig(level="exact"), engine)
    assert failure is None and run.operations == list(trace.operations)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hypothesis import reject
from hypothesis import strategies as st

from properties.checks.boundary import build_engine, engine_name
from properties.checks.lockstep import LockstepEngine
from properties.checks.registry import PropertyViolation
from properties.core.engine import (
    CallTimeoutError,
    CopiesBlocks,
    EngineError,
    ExposesDataPlane,
    HostTransfer,
    KVCacheEngine,
    OwnsHostTier,
    SupportsServingModes,
    UnsupportedLayoutError,
)
from properties.core.heap import tune_collector
from properties.core.modes import SYNC, ServingMode
from properties.core.outcome import Outcome
from properties.core.torch_threads import torch_on_one_thread
from properties.core.trace import Operation, Trace
from properties.core.versions import versions
from properties.engines.under_test import EngineUnderTest, resolve_engine
from properties.generate import strategies as kvst
from properties.runner.config import CheckConfig
from properties.runner.scheduler import RequestState, Scheduler, StepRecord
from properties.runner.serving import connector_host_tier, make_scheduler
from reference.errors import KVConformError
from reference.layout import KVCacheLayout, draft_token_limit
from reference.specs import MambaSpec


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


def failure_info(
    failure: BaseException, config: CheckConfig, found_versions: dict | None = None
) -> dict:
    """The ``failure`` record of a trace: the check, the message, whether the engine broke
    the protocol (``kind``), the engine, level and the versions."""
    info = {
        "property": getattr(failure, "name", type(failure).__name__),
        "kind": failure_kind(failure),
        "message": str(failure),
        "engine": config.engine,
        "level": config.level,
        "versions": found_versions if found_versions is not None else versions(),
    }
    options = config.replay_options()
    if options:  # what a replay needs to reproduce this very failure
        info["replay_options"] = options
    return info


#: Picks the serving mode of a run once its engine is built, from whether the engine
#: offers the serving calls (:class:`properties.core.engine.SupportsServingModes`).
ModeChooser = Callable[[bool], ServingMode]


class TraceRun:
    """One engine (and the reference at ``exact``) under one layout, driven op by op."""

    def __init__(
        self,
        config: CheckConfig,
        layout: KVCacheLayout,
        engine: EngineUnderTest,
        mode: ServingMode = SYNC,
        expected: KVCacheEngine | None = None,
        choose_mode: ModeChooser | None = None,
        at_boundaries: bool = False,
    ) -> None:
        """``expected`` (exact level): what the engine is compared with instead of a fresh
        reference, e.g. the recorded results of a corpus case. ``choose_mode``: called
        with whether the built engine offers the serving calls, it gives the mode
        (instead of ``mode``), so that the machine draws it once the engine is built.
        ``at_boundaries``: the O(pool) checks and reads run at step boundaries and at
        :meth:`finish` instead of after every call (the large tiers, the bench traces:
        ``Checker.check_every_call`` off)."""
        self.config = config
        self.layout = layout
        # an engine in a child process has its own deadline, which kills the child
        timeout = engine.call_timeout(config.call_timeout)
        built = build_engine(engine.factory, layout, timeout)
        tune_collector()  # the engine is imported: the collector set for a check's heap
        self.versions = versions(built, engine)
        reference = None
        if config.level == "exact":
            if expected is not None:
                reference = expected
            else:
                from properties.engines.reference import make_engine as make_reference

                reference = make_reference(layout)
        self.attention = None
        if config.attention:
            from properties.checks.attention import AttentionChecker

            plane = built if isinstance(built, ExposesDataPlane) else None
            self.attention = AttentionChecker(layout, data_plane=plane)
        if layout.partial_hits_enabled and not isinstance(built, CopiesBlocks):
            raise UnsupportedLayoutError(
                f"{engine_name(built)} does not hand over the block copies of partial hits "
                "(properties.core.engine.CopiesBlocks), which this layout has"
            )
        supports = isinstance(built, SupportsServingModes)
        if choose_mode is not None:
            mode = choose_mode(supports)
        if not mode.is_default and not supports:
            raise UnsupportedLayoutError(
                f"{engine_name(built)} does not offer the calls of "
                f"serving mode {mode.describe()} (properties.core.engine.SupportsServingModes)"
            )
        self.mode = mode
        torch_on_one_thread()  # the engine's and the attention oracle's tensors are small
        host_tier = connector_host_tier(layout, mode, built)
        # the engine's batched calls (commit_step, free_requests) are driven and compared,
        # except against a corpus case: it recorded the per-request calls, in their order
        make_lockstep = LockstepEngine if expected is not None else LockstepEngine.around
        self.lockstep = make_lockstep(
            built, layout, reference, config.disabled, timeout, host_tier=host_tier
        )
        self.scheduler = make_scheduler(
            self.lockstep,
            layout,
            mode,
            on_scheduled=self._on_scheduled,
            on_offload=self._on_offload if self.attention is not None else None,
            on_load=self._on_load if self.attention is not None else None,
            host_tier=host_tier,
        )
        self.lockstep.checker.check_every_call = not at_boundaries
        if self.attention is not None and isinstance(built, OwnsHostTier):
            self.lockstep.on_host_transfers = self._on_host_transfers
        self.operations: list[Operation] = []

    def finish(self) -> None:
        """The trace ended: the checks deferred to the next step boundary run now."""
        self.lockstep.on_step_boundary()

    def supports_serving_modes(self) -> bool:
        return isinstance(self.lockstep.engine, SupportsServingModes)

    def apply(self, op: Operation) -> StepRecord | None:
        self.operations.append(op)
        return self.scheduler.apply(op)

    def requests_holding_blocks(self) -> list[str]:
        """The requests whose blocks the checks track as held, in arrival order."""
        return [
            rid for rid, tracked in self.lockstep.checker.requests.items() if tracked.holds_blocks
        ]

    def num_free(self) -> int:
        """The engine's free block count, as the checks read it."""
        return self.lockstep.checker.state.num_free()

    def _on_scheduled(self, scheduler: Scheduler, record: StepRecord) -> None:
        if self.attention is None or not (record.scheduled or record.copies):
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
            state = self.lockstep.checker.state
            groups = None
            if not state.shared_pool:
                groups = [state.copy_groups.get(tuple(pair)) for pair in record.copies]
            self.attention.check_step(chunks, record.copies, groups)
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

    def _on_host_transfers(self, transfers: list[HostTransfer]) -> None:
        """The engine's own host tier copied blocks: the attention check's caches follow."""
        from properties.checks.attention import AttentionMismatch

        assert self.attention is not None
        try:
            self.attention.host_transfers(transfers)
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


def replayed_trace(
    trace: Trace, run: TraceRun | None, failure: BaseException, config: CheckConfig
) -> Trace:
    """The trace a failing replay of ``trace`` leaves (:func:`replay_trace`): the run's
    operations up to the failure, or, when the build failed (``run`` is None), the layout
    alone in the trace's mode, as :func:`start_run` records a failed build."""
    if run is not None:
        return run.to_trace(failure)
    return Trace(trace.layout, (), failure=failure_info(failure, config), mode=trace.mode)


def start_run(
    config: CheckConfig,
    layout: KVCacheLayout,
    engine: EngineUnderTest,
    on_failure: Callable[[Trace], None],
    choose_mode: ModeChooser | None = None,
) -> TraceRun:
    """A run of the engine under test on ``layout`` (the module docstring's rule): an
    example the engine refuses is not one (``reject()``); a factory that fails hands the
    trace of the layout alone, with the failure, to ``on_failure`` and raises (a
    :class:`RunStopped` for a deadline). Example: a factory raising ``EngineError("boom")``
    gives ``on_failure(Trace(layout, (), failure={"property": "EngineError", ...}))``."""
    try:
        return TraceRun(
            excused_config(config, engine, layout), layout, engine, choose_mode=choose_mode
        )
    except UnsupportedLayoutError:
        reject()
        raise  # unreachable: reject() raises
    except (EngineError, PropertyViolation) as exc:  # the build failed (or a first read
        # of the fresh pool was impossible): the trace is the layout alone
        on_failure(Trace(layout, (), failure=failure_info(exc, config)))
        if isinstance(exc, CallTimeoutError):
            raise RunStopped(exc) from exc
        raise


def engine_of(config: CheckConfig, engine: EngineUnderTest | Callable | None) -> EngineUnderTest:
    """``engine`` as an :class:`EngineUnderTest`: as given, a factory resolved, or (None)
    the engine ``config`` names, resolved with its isolation and call timeout."""
    if engine is None:
        return config.resolve_engine()
    if isinstance(engine, EngineUnderTest):
        return engine
    return resolve_engine(engine, isolation=config.isolation, call_timeout=config.call_timeout)


def replay_trace(
    trace: Trace, config: CheckConfig, engine: EngineUnderTest, at_boundaries: bool = False
) -> tuple[TraceRun | None, BaseException | None]:
    """Replay ``trace`` (in its serving mode) with every check; returns the run and the
    first failure (or None). The run is None when the build itself failed (an engine
    error, or an impossible first read of the fresh pool such as more free blocks than
    the pool has): nothing ran, the failure is the build's. ``at_boundaries``: the
    O(pool) checks at step boundaries (:class:`TraceRun`), as for a bench trace of 10^5
    blocks. An :class:`UnsupportedLayoutError` is returned as the failure too."""
    try:
        run = TraceRun(config, trace.layout, engine, trace.mode, at_boundaries=at_boundaries)
    except (EngineError, PropertyViolation) as exc:
        return None, exc
    try:
        for op in trace.operations:
            run.apply(op)
        run.finish()
    except (AssertionError, KVConformError) as exc:  # violations and engine errors
        return run, exc
    return run, None


def mode_tags(layout: KVCacheLayout, mode: ServingMode) -> list[str]:
    """The production modes a run exercises, for the counts ``kvconform check`` prints:
    ``retention=dense|sparse|interval``, ``eagle-drop``, ``lookahead-hashes``,
    ``partial-hits``, ``context-parallel``, ``rswa``, ``circular-buffer``, ``async``,
    ``admission-gate``, ``drafts``, ``external-hits``, ``async-loads``, ``load-failures``."""
    r = layout.prefix_cache_retention_interval
    tags = [f"retention={'dense' if r is None else 'sparse' if r == 0 else 'interval'}"]
    if layout.drop_eagle_group_ids:
        tags.append("eagle-drop")
    if layout.num_hash_lookahead_tokens:
        tags.append("lookahead-hashes")
    if layout.partial_hits_enabled:
        tags.append("partial-hits")
    if layout.dcp_world_size > 1 or layout.pcp_world_size > 1:
        tags.append("context-parallel")
    if any(s.type_name == "rswa" for s in layout.specs):
        tags.append("rswa")
    if any(not s.prefix_cacheable for s in layout.specs):
        tags.append("circular-buffer")
    if mode.async_scheduling:
        tags.append("async")
    if mode.admission_gate:
        tags.append("admission-gate")
    if mode.num_draft_tokens and draft_token_limit(layout) != 0:
        tags.append("drafts")
    if mode.external_hits and not any(isinstance(s, MambaSpec) for s in layout.specs):
        tags.append("external-hits")
        if mode.async_loads:
            tags.append("async-loads")
        if mode.load_failures:
            tags.append("load-failures")
    return tags


def layout_strategy(config: CheckConfig, engine: EngineUnderTest):
    """Layouts to draw: the engine's own ``layout_strategy`` if it has one, else a preset
    (``--preset``) or any generated layout, made only of the spec types the engine
    supports (``engine.spec_types``, e.g. an exec engine's ``hello``)."""
    kinds = engine.spec_types
    if engine.layout_strategy is not None:
        own = engine.layout_strategy()
        # prefix caching off is drawn for every engine: one that keeps caching when told
        # not to must be caught whatever layouts it draws (one example in four)
        strategy = st.one_of(own, own, own, own.map(caching_off))
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
    elif config.production:
        strategy = kvst.production_base_layouts(
            max_len=config.max_len, kinds=kinds, settings=engine.production_settings
        )
    else:
        strategy = kvst.any_layouts(max_len=config.max_len, kinds=kinds)
    production = config.production and config.preset is None
    return declared_layouts(strategy, engine, config.max_len, production)


def caching_off(layout: KVCacheLayout) -> KVCacheLayout:
    """``layout`` with prefix caching off (no hits, nothing registered)."""
    return dataclasses.replace(layout, enable_caching=False)


def declared_layouts(
    strategy: st.SearchStrategy[KVCacheLayout],
    engine: EngineUnderTest,
    max_len: int,
    production: bool,
) -> st.SearchStrategy[KVCacheLayout]:
    """``strategy`` as the engine's declarations take it: the production settings it
    declares drawn on top (``production``), its documented divergences left out. Example:
    an engine declaring only ``retention`` gets no EAGLE layouts, and vLLM no chunked
    layouts whose chunk is not a multiple of the block size."""
    if production:
        strategy = kvst.production_layouts(
            strategy, max_len=max_len, settings=engine.production_settings
        )
    known = [d for d in engine.known_divergences if not d.checks]
    if known:
        strategy = strategy.filter(lambda layout: not any(d.applies_to(layout) for d in known))
    return strategy


def excused_config(
    config: CheckConfig, engine: EngineUnderTest, layout: KVCacheLayout
) -> CheckConfig:
    """``config`` for a drawn run on ``layout``: the checks of the engine's known
    divergences that apply to it (:class:`properties.core.engine.KnownDivergence`
    ``checks``) turned off too. A replay keeps every check. Example: LMDeploy on a layout
    with prefix caching runs without ``exclusive_write``."""
    excused = {
        c for d in engine.known_divergences if d.checks and d.applies(layout) for c in d.checks
    }
    if not excused:
        return config
    return dataclasses.replace(config, disabled=config.disabled | frozenset(excused))


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
    engine: EngineUnderTest, config: CheckConfig
) -> tuple[list[str], frozenset[str]]:
    """The invariants that run for this engine (its optional capabilities decide) and
    the capabilities, read from an engine built on a small probe layout (with
    ``serving_modes`` when it offers the serving-mode calls)."""
    from properties.checks.checker import Checker

    for layout in _probe_layouts():
        try:
            built = build_engine(engine.factory, layout, config.call_timeout)
        except UnsupportedLayoutError:
            continue
        checker = Checker(built, layout, config.disabled)
        serving = {"serving_modes"} if isinstance(built, SupportsServingModes) else set()
        return checker.active_checks(), checker.state.capabilities() | serving
    return [], frozenset()


__all__ = [
    "RunStopped",
    "TraceRun",
    "active_checks_for",
    "excused_config",
    "failure_info",
    "failure_kind",
    "layout_strategy",
    "mode_tags",
    "replay_trace",
    "start_run",
]
