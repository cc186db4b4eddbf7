"""The conformance checks as plain Hypothesis tests, for coverage-guided fuzzing with
HypoFuzz (``hypothesis fuzz``), and for any runner of ``@given`` tests.

HypoFuzz collects a project's Hypothesis tests through pytest and spends its time on the
ones whose examples keep reaching new branches (of the engine and of kvconform), with a
shared example database and a dashboard. Its targets must be ``@given`` tests that use
the default database, which the conformance tests (one derandomized run per property,
:mod:`properties.tools.conformance`) are not. So each property also exists here as one
``@given`` test whose example is a whole trace, checked as ``kvconform check`` checks it:

* ``test_invariants_trace``: a layout drawn for the engine (its spec types, its own
  strategy and declarations: :func:`properties.runner.run.layout_strategy`) and a trace
  (:func:`properties.generate.strategies.operations`), every invariant after every call
  (and the reference beside it at ``--kv-level exact``);
* ``test_production_trace``: the deployed settings the engine declares and a swarm
  serving mode, the same checks;
* ``test_attention_trace``: attention outputs through the engine's block tables.

The engine and level come from the plugin's ``--kv-engine`` and ``--kv-level``::

    hypothesis fuzz --no-dashboard -- --pyargs kvconform.fuzz_targets \
        --kv-engine mypkg.adapter:make_engine --kv-level universal --kv-profile nightly

(``--kv-profile nightly``: under ``CI=true`` the default is the derandomized ``ci``
profile, whose tests HypoFuzz does not fuzz.)

A failure raises the check's error with the trace's operations in Hypothesis' report;
``kvconform fuzz`` is the campaign to use when you want kvconform's own saved traces,
their pages and replay commands (``docs/fuzz-campaigns.md`` says when to use which).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from properties.core.modes import SYNC
from properties.generate import strategies as kvst
from properties.runner.check import config_for
from properties.runner.config import CheckConfig
from properties.runner.run import layout_strategy
from properties.runner.tiers import drawn_run

#: What every target relaxes: a trace is slow and large by Hypothesis' standards.
_RELAXED = settings(
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)


def check_trace(data: st.DataObject, prop: str, engine, level: str) -> None:
    """Draw a layout, a serving mode and a trace for property ``prop`` and run it on
    ``engine`` with the property's checks; a violation or an engine error is raised."""
    config = config_for(prop, CheckConfig(engine=engine.name, level=level))
    layout = data.draw(layout_strategy(config, engine), label="layout")
    mode = data.draw(kvst.swarm_modes(), label="serving mode") if prop == "production" else SYNC
    operations = data.draw(kvst.operations(layout), label="operations")
    run = drawn_run(config, layout, mode, engine)  # every check after every call
    for op in operations:
        run.apply(op)
    run.finish()


@_RELAXED
@given(data=st.data())
def test_invariants_trace(data, kv_engine_under_test, kv_level) -> None:
    check_trace(data, "invariants", kv_engine_under_test, kv_level)


@_RELAXED
@given(data=st.data())
def test_production_trace(data, kv_engine_under_test, kv_level) -> None:
    check_trace(data, "production", kv_engine_under_test, kv_level)


@_RELAXED
@given(data=st.data())
def test_attention_trace(data, kv_engine_under_test, kv_level) -> None:
    check_trace(data, "attention", kv_engine_under_test, kv_level)
