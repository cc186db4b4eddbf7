"""The stateful machine under pytest: ``pytest --kv-engine NAME --kv-level LEVEL``.

The engine and level come from the kvconform pytest plugin's options (default: the
reference at the exact level); the Hypothesis profile is ours (``--kv-profile``).
"""

from __future__ import annotations

import pytest
from hypothesis.stateful import run_state_machine_as_test

from properties.core.engine import EngineError, load_engine_factory
from properties.runner.config import CheckConfig
from properties.runner.machine import machine_for


def _machine(engine: str, level: str, **extra):
    try:
        factory = load_engine_factory(engine)
    except EngineError as exc:  # an engine not installed in this interpreter
        pytest.skip(str(exc))
    return machine_for(CheckConfig(engine=engine, level=level, **extra), factory)


def test_invariants_hold(kv_engine: str, kv_level: str, tmp_path) -> None:
    machine = _machine(kv_engine, kv_level, failure_dir=str(tmp_path))
    run_state_machine_as_test(machine)
    assert machine.stats.examples > 0 and machine.stats.steps > 0


def test_attention_outputs_match_dense(kv_engine: str, tmp_path) -> None:
    from properties.checks.registry import disabled_all_but

    machine = _machine(
        kv_engine,
        "universal",
        attention=True,
        disabled=disabled_all_but(()),
        failure_dir=str(tmp_path),
    )
    run_state_machine_as_test(machine)
    assert machine.stats.examples > 0
