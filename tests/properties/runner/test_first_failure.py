"""Fast failures: the first failure is announced and its trace saved (replay-verified)
before any shrinking; shrinking is bounded; workers give the result of one process."""

from __future__ import annotations

from hypothesis.internal.conjecture import engine as hypothesis_engine

from properties.core.trace import load_trace
from properties.mutants.reference_mutants import MUTANT_INFO
from properties.runner.check import bounded_shrinking, run_property
from properties.runner.config import CheckConfig
from properties.runner.machine import replay_trace
from properties.runner.profiles import load_profile
from properties.tools.parallel import PropertyTask, run_tasks


def test_first_failure_is_saved_and_announced_before_shrinking(tmp_path) -> None:
    info = MUTANT_INFO["salt_ignored"]
    config = CheckConfig(engine=info.target, level="universal", failure_dir=str(tmp_path))
    heard = []
    result = run_property(
        "invariants",
        config,
        load_profile("ci"),
        None,
        info.factory,
        shrink_seconds=0,
        on_first_failure=heard.append,
    )
    assert not result.passed
    assert heard == [result.first]
    first = result.first
    assert first.check in info.caught_by
    assert first.examples >= 1 and first.steps >= 1 and first.seconds >= 0
    assert first.trace_path is not None and first.trace_path.exists()
    _run, exc = replay_trace(load_trace(first.trace_path), config, info.factory)
    assert exc is not None and exc.name == first.check
    assert first.replay() == (
        f"kvconform replay {first.trace_path} --engine {info.target} --level universal"
    )
    assert result.trace_path is not None and result.trace_path != first.trace_path


def test_shrink_bound_is_applied_and_restored() -> None:
    before = hypothesis_engine.MAX_SHRINKING_SECONDS
    with bounded_shrinking(7.5):
        assert hypothesis_engine.MAX_SHRINKING_SECONDS == 7.5
    assert before == hypothesis_engine.MAX_SHRINKING_SECONDS
    with bounded_shrinking(None):
        assert before == hypothesis_engine.MAX_SHRINKING_SECONDS


def test_two_workers_give_the_table_of_one(tmp_path) -> None:
    config = CheckConfig(engine="reference", level="exact", failure_dir=str(tmp_path))
    tasks = [
        PropertyTask("invariants", config, "ci", max_examples=15),
        PropertyTask("determinism", config, "ci", max_examples=10),
    ]
    one = run_tasks(tasks, 1)
    two = run_tasks(tasks, 2)

    def table(results):
        return [(r.name, r.examples, r.steps, r.failure) for r in results]

    assert table(one) == table(two)
    assert [r.name for r in two] == ["invariants", "determinism"]
    assert all(r.passed and r.steps > 0 for r in two)
