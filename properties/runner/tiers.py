"""The large scale tiers of a property: medium, offline and production examples after the
small ones.

The small tier is the stateful machine (:mod:`properties.runner.machine`), unchanged. A
large tier (:data:`properties.generate.strategies.TIERS`) runs a bounded number of whole
traces per property instead, each a second Hypothesis run of its own (so the small
tier's stream does not move): a swarm layout (:func:`kvst.swarm_layouts`: each group type
and pool pressure switched on independently; the production settings on top for the
``production`` property), a swarm serving mode (:func:`kvst.swarm_modes`; the attention
property draws a connector mode, as its machine does) and a bulk trace
(:func:`kvst.tier_operations`: thousands of requests, a few dozen big steps; or, in the
offline tier, one batch of requests at once and steps until it is done). The O(pool)
checks and reads leave the per-call path there (``TraceRun(..., at_boundaries=True)``):
the pool checks and the free-queue comparison run at step boundaries, a call's snapshot
holds the free counts only, a call reads again only the table of the request it names
(every table at the boundary), and H3 reads the cached blocks only when the shadow's
contents allow a longer hit; every other check runs after every call. ``determinism``
runs each trace twice and compares the calls.

Worked example::

    outcome = run_tier("invariants", CheckConfig(), "medium", settings(max_examples=1))
    assert outcome.failure is None and outcome.examples == 1
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import given, reject, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

from properties.checks.registry import PropertyViolation
from properties.core.constants import PROPERTIES
from properties.core.engine import KnownDivergenceMet, UnsupportedLayoutError
from properties.core.modes import SYNC, ServingMode
from properties.core.trace import Operation, Trace
from properties.engines.under_test import EngineUnderTest
from properties.generate import strategies as kvst
from properties.runner.config import CheckConfig
from properties.runner.run import (
    TraceRun,
    declared_layouts,
    engine_of,
    excused_config,
    failure_info,
)
from reference.errors import KVConformError
from reference.layout import KVCacheLayout


@dataclass
class TierOutcome:
    """One tier's run of one property: examples and operations run, seconds, and the
    failing trace (with its failure record) and exception if one failed."""

    tier: str
    examples: int = 0
    steps: int = 0
    seconds: float = 0
    failure: BaseException | None = None
    timings: list[float] = field(default_factory=list)
    #: called with the first failing trace the moment it is recorded (before Hypothesis
    #: shrinks it), so a tier's failure announces itself like the small tier's
    on_first_failure: Callable[[Trace], None] | None = None
    _trace: Trace | None = None
    _announced: bool = False

    @property
    def trace(self) -> Trace | None:
        """The failing trace (the last one recorded)."""
        return self._trace

    @trace.setter
    def trace(self, trace: Trace | None) -> None:
        self._trace = trace
        if trace is not None and not self._announced and self.on_first_failure is not None:
            self._announced = True
            self.on_first_failure(trace)


def tier_layouts(
    config: CheckConfig, scale: kvst.ScaleTier, engine: EngineUnderTest
) -> st.SearchStrategy[KVCacheLayout]:
    """The layouts of a large tier for this engine: swarm layouts of the spec types it
    supports (in the offline tier mostly served models, :func:`kvst.offline_layouts`),
    the production settings it declares on top for the production property, its
    documented divergences left out."""
    strategy = kvst.workload_layouts(scale, engine.spec_types)
    return declared_layouts(strategy, engine, scale.max_len, config.production)


def kept_mode(
    mode: ServingMode, layout: KVCacheLayout, supports: bool, engine: EngineUnderTest
) -> ServingMode:
    """What the engine gets of a drawn mode: nothing a Mamba group does not model
    (:func:`kvst.mode_for_layout`), then what its declarations take
    (:meth:`properties.engines.under_test.EngineUnderTest.serving_mode`: the default mode
    without the serving calls, no external hits unless it declares them, the default
    mode where a known divergence of a serving mode applies)."""
    if not supports:
        return SYNC
    return engine.serving_mode(kvst.mode_for_layout(mode, layout), supports, layout)


_INVARIANTS, _ATTENTION, _DETERMINISM, _PRODUCTION = PROPERTIES


def _drawn_mode(name: str, data: st.DataObject) -> ServingMode:
    if name == _ATTENTION:
        return data.draw(kvst.connector_modes())
    return data.draw(kvst.swarm_modes())


def drawn_run(
    config: CheckConfig,
    layout: KVCacheLayout,
    mode: ServingMode,
    engine: EngineUnderTest,
    at_boundaries: bool = False,
) -> TraceRun:
    """A run of a drawn example: the engine built for ``layout``, driven in what it takes
    of ``mode`` (:func:`kept_mode`), without the checks its known divergences excuse on
    ``layout`` (:func:`properties.runner.run.excused_config`); a layout the engine
    refuses is not an example (``reject()``). ``at_boundaries``: the O(pool) checks at
    step boundaries."""
    try:
        return TraceRun(
            excused_config(config, engine, layout),
            layout,
            engine,
            choose_mode=lambda supports: kept_mode(mode, layout, supports, engine),
            at_boundaries=at_boundaries,
        )
    except UnsupportedLayoutError:
        reject()
        raise  # unreachable: reject() raises


def _run_trace(
    config: CheckConfig,
    layout: KVCacheLayout,
    mode: ServingMode,
    ops: tuple[Operation, ...],
    engine: EngineUnderTest,
    outcome: TierOutcome,
) -> TraceRun:
    """Run ``ops`` with the O(pool) checks at step boundaries; a layout the engine
    refuses is not an example. Raises the first violation or engine error, its trace
    kept as ``outcome.trace``."""
    run = drawn_run(config, layout, mode, engine, at_boundaries=True)
    try:
        for op in ops:
            run.apply(op)
        run.finish()
    except KnownDivergenceMet:
        reject()  # a documented engine behaviour met at run time: not an example
    except (AssertionError, KVConformError) as exc:
        outcome.trace = run.to_trace(exc)
        raise
    return run


def run_tier(
    name: str,
    config: CheckConfig,
    tier_name: str,
    hyp_settings: settings,
    seed: int | None = None,
    engine: EngineUnderTest | Callable | None = None,
    on_first_failure: Callable[[Trace], None] | None = None,
) -> TierOutcome:
    """Run ``hyp_settings.max_examples`` examples of tier ``tier_name`` for property
    ``name`` (``config`` as :func:`properties.runner.check.config_for` gives it).
    Failures are not shrunk far (a large trace shrinks slowly): the failing trace is
    the outcome's ``trace``; ``on_first_failure`` hears of the first one as it is
    recorded."""
    scale = kvst.tier(tier_name)
    engine = engine_of(config, engine)
    layouts = tier_layouts(config, scale, engine)
    outcome = TierOutcome(tier_name, on_first_failure=on_first_failure)

    def example(data: st.DataObject) -> None:
        layout = data.draw(layouts)
        mode = _drawn_mode(name, data)
        ops = data.draw(kvst.tier_operations(layout, scale))
        started = time.perf_counter()
        run = _run_trace(config, layout, mode, ops, engine, outcome)
        if name == _DETERMINISM:
            again = _run_trace(config, layout, mode, ops, engine, outcome)
            if run.lockstep.log != again.lockstep.log:
                violation = PropertyViolation(
                    _DETERMINISM, f"two runs of one {tier_name} trace differ in their calls"
                )
                trace = dataclasses.replace(run.to_trace(), failure=failure_info(violation, config))
                outcome.trace = trace
                raise violation
        outcome.timings.append(time.perf_counter() - started)
        outcome.examples += 1
        outcome.steps += len(ops)

    # the function's name and source key the derandomized stream: one stream per property
    # and tier (an edit of this function's body moves every tier's stream)
    example.__name__ = example.__qualname__ = f"{name}_{tier_name}_tier"
    test = settings(hyp_settings)(given(st.data())(example))
    if seed is not None:
        test = hseed(seed)(test)
    start = time.perf_counter()
    try:
        test()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure is reported
        outcome.failure = exc  # a group too: the caller reports its first error
    outcome.seconds = time.perf_counter() - start
    return outcome
