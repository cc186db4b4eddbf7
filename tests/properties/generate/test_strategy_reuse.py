"""Strategies reused instead of rebuilt (:mod:`properties.generate.strategies.reuse`)
draw exactly what strategies built anew draw: the derandomized streams (layouts and
whole trace bodies, small tier and a large one) are the same with every reused factory
replaced by one that builds a new object on each call. A reused factory returns one
object per distinct arguments, and a new one for unhashable arguments."""

from __future__ import annotations

import sys

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from properties.generate import strategies as kvst
from properties.generate.strategies import arrivals, generated_layouts, group_specs, reuse
from properties.generate.strategies import trace_bodies as bodies

#: Every factory the package reuses (what ``_reused`` and the two cached helpers wrap).
REUSED = (
    group_specs._kind_specs,
    generated_layouts.block_size_lists,
    generated_layouts.pool_sizes,
    arrivals.prefix_pools,
    arrivals.prompts,
    arrivals.outputs,
    bodies.token_budgets,
    bodies.lookaheads,
    bodies.step_ops,
    reuse._sampled_list,
    reuse._integers_either,
)


def _fresh(factory):
    """``factory`` building a new strategy object on every call, as before the reuse."""
    build = factory.__wrapped__

    def fresh(*args, **kwargs):
        return build(*args, **kwargs)

    return fresh


@pytest.fixture
def built_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every module of ``properties`` that holds a reused factory holds the fresh form."""
    fresh = {id(f): _fresh(f) for f in REUSED}
    for name, module in list(sys.modules.items()):
        if not name.startswith("properties.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in fresh:
                monkeypatch.setattr(module, attr, fresh[id(value)])


def _draws(strategy: st.SearchStrategy, n: int) -> list:
    """The first ``n`` values a derandomized run draws from ``strategy``."""
    seen: list = []

    @settings(
        derandomize=True,
        database=None,
        max_examples=n,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(value) -> None:
        seen.append(value)

    collect()
    return seen


@st.composite
def _large_tier_traces(draw) -> tuple:
    layout = draw(kvst.workload_layouts(kvst.tier("medium")))
    return layout, draw(kvst.tier_operations(layout, kvst.tier("medium")))


STREAMS = {
    "small tier traces": lambda: kvst.traces(),
    "production layouts": lambda: kvst.production_base_layouts(),
    "medium tier traces": lambda: _large_tier_traces(),
}


@pytest.mark.parametrize("stream", sorted(STREAMS))
def test_reused_strategies_draw_the_stream_of_strategies_built_anew(stream, request) -> None:
    reused = _draws(STREAMS[stream](), 25)
    layout_of_one = _draws(kvst.layouts(), 1)[0]
    request.getfixturevalue("built_anew")
    assert arrivals.outputs(layout_of_one, 3) is not arrivals.outputs(layout_of_one, 3)
    anew = _draws(STREAMS[stream](), 25)
    assert len(reused) == 25
    assert anew == reused


def test_one_object_per_distinct_arguments() -> None:
    layout = _draws(kvst.layouts(), 1)[0]
    assert kvst.outputs(layout, 31) is kvst.outputs(layout, 31)
    assert kvst.outputs(layout, 31) is not kvst.outputs(layout, 30)
    assert kvst.step_ops(layout) is kvst.step_ops(layout)
    # a list is unhashable: a new object each call, drawing as the tuple form
    pool = [(1, 2, 3)]
    assert kvst.prompts(layout, pool) is not kvst.prompts(layout, pool)
    assert kvst.prompts(layout, tuple(pool)) is kvst.prompts(layout, tuple(pool))
