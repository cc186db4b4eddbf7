"""One run of the engine under test (``properties/runner/run.py``): the start-of-run rule
shared by the stateful machine and the determinism property, the host tier handed to the
checks through their constructor, and what a run tells its callers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from properties.core.engine import CallTimeoutError, EngineError, UnsupportedLayoutError
from properties.core.modes import SYNC, ServingMode
from properties.core.trace import Arrive, Step
from properties.engines.reference import ReferenceEngine
from properties.engines.under_test import EngineUnderTest, resolve_engine
from properties.runner.config import CheckConfig
from properties.runner.run import RunStopped, TraceRun, start_run
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

#: one full-attention group, block size 4, 16 blocks (15 usable)
LAYOUT = KVCacheLayout(
    groups=(KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),),
    num_blocks=16,
    max_model_len=64,
)


def _failing(exc: BaseException) -> EngineUnderTest:
    def make(layout: KVCacheLayout):
        raise exc

    return EngineUnderTest(name="failing", factory=make)


def test_the_checks_get_the_schedulers_host_tier() -> None:
    engine = resolve_engine("reference")
    run = TraceRun(CheckConfig(level="universal"), LAYOUT, engine, ServingMode(external_hits=True))
    assert run.scheduler.host_tier is not None
    assert run.lockstep.checker.state.host_tier is run.scheduler.host_tier
    plain = TraceRun(CheckConfig(level="universal"), LAYOUT, engine)
    assert plain.scheduler.host_tier is None and plain.lockstep.checker.state.host_tier is None


def test_a_failing_factory_is_the_failure_of_a_trace_of_the_layout_alone() -> None:
    seen = []
    config = CheckConfig(engine="failing", level="universal")
    with pytest.raises(EngineError, match="pool"):
        start_run(config, LAYOUT, _failing(EngineError("no pool")), seen.append)
    [trace] = seen
    assert trace.layout == LAYOUT and trace.operations == ()
    assert trace.failure["property"] == "EngineError"
    assert trace.failure["kind"] == "engine" and trace.failure["engine"] == "failing"


def test_a_factory_past_its_deadline_stops_the_run() -> None:
    seen = []
    timeout = CallTimeoutError("factory make(layout) did not return within 5 s")
    with pytest.raises(RunStopped) as stopped:
        start_run(CheckConfig(), LAYOUT, _failing(timeout), seen.append)
    assert stopped.value.error is timeout and len(seen) == 1


def test_a_refused_layout_is_not_an_example() -> None:
    seen = []
    refused = _failing(UnsupportedLayoutError("full attention only"))

    @settings(max_examples=5, database=None)
    @given(st.just(LAYOUT))
    def every_example(layout: KVCacheLayout) -> None:
        start_run(CheckConfig(), layout, refused, seen.append)

    with pytest.raises(Unsatisfiable):  # every example rejected, none failed
        every_example()
    assert seen == []  # not a failure


def test_the_mode_is_chosen_once_the_engine_is_built() -> None:
    asked = []

    def choose(supports: bool) -> ServingMode:
        asked.append(supports)
        return ServingMode(async_scheduling=True)

    engine = resolve_engine("reference")
    run = start_run(CheckConfig(), LAYOUT, engine, lambda t: None, choose_mode=choose)
    assert asked == [True]  # the reference offers the serving calls
    assert run.mode == ServingMode(async_scheduling=True)
    assert run.scheduler.mode == run.mode
    # an engine without them gets the default mode only
    bare = EngineUnderTest(name="bare", factory=_without_serving_calls)
    with pytest.raises(UnsupportedLayoutError, match="does not offer the calls"):
        TraceRun(CheckConfig(), LAYOUT, bare, ServingMode(async_scheduling=True))
    assert TraceRun(CheckConfig(), LAYOUT, bare).mode == SYNC


class _NoServingCalls:
    """The reference engine without ``set_in_flight``/``cache_blocks``."""

    def __init__(self, layout: KVCacheLayout) -> None:
        self._engine = ReferenceEngine(layout)

    def __getattr__(self, name: str):
        if name in ("set_in_flight", "cache_blocks"):
            raise AttributeError(name)
        return getattr(self._engine, name)


def _without_serving_calls(layout: KVCacheLayout):
    return _NoServingCalls(layout)


def test_a_run_names_the_requests_holding_blocks_and_the_free_count() -> None:
    run = TraceRun(CheckConfig(level="exact"), LAYOUT, resolve_engine("reference"))
    assert run.num_free() == 15 and run.requests_holding_blocks() == []
    run.apply(Arrive("r0", tuple(range(6)), (7, 7)))  # 6 prompt tokens, 2 output tokens
    run.apply(Step(64))  # the prompt: 6 slots -> 2 blocks of 4
    assert run.requests_holding_blocks() == ["r0"]
    assert run.num_free() == 13


# -- known divergences that name the checks they break ----------------------------------


def _diverging(applies: bool, checks: tuple[str, ...]) -> EngineUnderTest:
    from properties.core.engine import KnownDivergence

    divergence = KnownDivergence(
        "d", "summary", "findings/d.md", lambda layout: applies, checks=checks
    )
    return EngineUnderTest(name="x", factory=ReferenceEngine, known_divergences=(divergence,))


def test_a_drawn_run_turns_off_the_checks_of_a_divergence_that_applies() -> None:
    """A divergence naming ``exclusive_write``: a drawn run on a layout it applies to runs
    without it, one where it does not apply keeps it, and a replay keeps it too."""
    from properties.core.trace import Trace
    from properties.runner.run import replay_trace

    config = CheckConfig(level="universal")
    run = start_run(config, LAYOUT, _diverging(True, ("exclusive_write",)), lambda t: None)
    assert "exclusive_write" in run.lockstep.checker.disabled
    run = start_run(config, LAYOUT, _diverging(False, ("exclusive_write",)), lambda t: None)
    assert "exclusive_write" not in run.lockstep.checker.disabled
    trace = Trace(layout=LAYOUT, operations=(Arrive("r0", (1, 2, 3)), Step(16)))
    replayed, failure = replay_trace(trace, config, _diverging(True, ("exclusive_write",)))
    assert failure is None and "exclusive_write" not in replayed.lockstep.checker.disabled


def test_a_divergence_naming_checks_keeps_its_layouts_drawn() -> None:
    """Without checks, the layouts a divergence applies to are not drawn (Unsatisfiable
    when it applies to every layout); with checks they are."""
    from hypothesis import find

    from properties.runner.run import declared_layouts

    drawn = declared_layouts(st.just(LAYOUT), _diverging(True, ("hit_bounds",)), 64, False)
    assert find(drawn, lambda layout: True) == LAYOUT
    left_out = declared_layouts(st.just(LAYOUT), _diverging(True, ()), 64, False)
    with pytest.raises(Unsatisfiable):
        find(left_out, lambda layout: True)


def test_a_divergences_checks_must_be_a_tuple_of_names() -> None:
    from properties.core.declarations import DeclarationError
    from properties.core.engine import KnownDivergence

    bad = KnownDivergence("d", "s", "f", lambda layout: True, checks=["exclusive_write"])
    with pytest.raises(DeclarationError, match=r"checks must be a tuple of invariant names"):
        EngineUnderTest(name="x", factory=ReferenceEngine, known_divergences=(bad,))
