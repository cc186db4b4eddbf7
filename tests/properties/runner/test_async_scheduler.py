"""Asynchronous scheduling (properties/runner/async_scheduler.py) driven directly over the
reference engine: a step's output is processed one step later; values worked out by hand."""

from __future__ import annotations

from properties.core.modes import ServingMode
from properties.core.trace import Abort, Arrive, Preempt, Step
from properties.runner.async_scheduler import AsyncRequestState, AsyncScheduler
from properties.runner.serving import make_scheduler
from tests.properties.runner.scheduler_support import Recording, full_layout

ASYNC = ServingMode(async_scheduling=True)


def _scheduler(num_blocks: int = 8, block_size: int = 4) -> tuple[AsyncScheduler, Recording]:
    layout = full_layout(block_size=block_size, num_blocks=num_blocks)
    engine = Recording(layout)
    scheduler = make_scheduler(engine, layout, ASYNC)
    assert isinstance(scheduler, AsyncScheduler)
    return scheduler, engine


def test_a_step_is_processed_one_step_later() -> None:
    """Full bs 4; r0: prompt 6, outputs (1, 2); budget 8.

    Step 1 plans the prefill: computed 6, 6 in flight, its last token samples an output
    (pending 1); nothing is processed yet (no output appended). Step 2 may reach the
    known tokens plus the pending one (7): it plans position 6 (computed 7, in flight 7,
    pending 2), then processes step 1: 6 tokens leave the flight, output 1 is appended,
    the processed tokens 7 - 1 = 6 are committed. Step 3 may reach nothing more (both
    outputs sampled): it plans nothing, processes step 2 (output 2, commit 7) and frees
    r0, which has all its outputs and nothing in flight."""
    scheduler, engine = _scheduler()
    scheduler.apply(Arrive("r0", (10, 11, 12, 13, 14, 15), (1, 2)))
    first = scheduler.apply(Step(8))
    assert [(s.start, s.num_tokens, s.samples) for s in first.scheduled] == [(0, 6, True)]
    state = scheduler.requests["r0"]
    assert isinstance(state, AsyncRequestState)
    assert (state.num_computed_tokens, state.num_in_flight, state.num_pending) == (6, 6, 1)
    assert state.num_generated == 0 and scheduler.in_flight is first
    engine.take()
    second = scheduler.apply(Step(8))
    assert [(s.start, s.num_tokens, s.samples) for s in second.scheduled] == [(6, 1, True)]
    assert engine.take() == [
        ("new_step",),
        ("allocate_slots", "r0", 1, 0, None, 0),
        # plan step 2
        ("set_in_flight", "r0", 7, 2),
        ("set_num_computed_tokens", "r0", 7),
        # process step 1
        ("append_output_tokens", "r0", [1]),
        ("set_in_flight", "r0", 1, 1),
        ("cache_blocks", "r0", 6),
    ]
    assert (state.num_generated, state.num_in_flight, state.num_pending) == (1, 1, 1)
    assert scheduler.in_flight_requests() == ["r0"] and not scheduler.is_idle()
    third = scheduler.apply(Step(8))
    assert third.scheduled == [] and third.finished == ["r0"]
    assert engine.take() == [
        ("new_step",),
        ("append_output_tokens", "r0", [2]),
        ("set_in_flight", "r0", 0, 0),
        ("cache_blocks", "r0", 7),
        ("free", "r0"),
        ("remove_request", "r0"),
    ]
    assert scheduler.is_idle() and engine.num_free_blocks() == 7


def test_preempt_and_abort_wait_for_the_flight() -> None:
    """r0 (prompt 4, outputs 1 2 3) after step 1: 4 tokens in flight. A Preempt is
    ignored (no call); an Abort is deferred (release "abort", out of the running queue,
    blocks kept); step 2 plans nothing for it and processes step 1: the sampled token is
    dropped (no append, no commit), and r0 is freed."""
    scheduler, engine = _scheduler()
    scheduler.apply(Arrive("r0", (10, 11, 12, 13), (1, 2, 3)))
    scheduler.apply(Step(8))
    engine.take()
    scheduler.apply(Preempt("r0"))
    assert engine.take() == [] and scheduler.running == ["r0"]
    scheduler.apply(Abort("r0"))
    state = scheduler.requests["r0"]
    assert isinstance(state, AsyncRequestState)
    assert state.release == "abort" and scheduler.running == [] and engine.take() == []
    second = scheduler.apply(Step(8))
    assert second.scheduled == [] and second.finished == []  # aborted, not finished
    assert engine.take() == [
        ("new_step",),
        ("set_in_flight", "r0", 0, 0),
        ("free", "r0"),
        ("remove_request", "r0"),
    ]
    assert "r0" not in scheduler.requests and scheduler.is_idle()


def test_the_victim_has_nothing_in_flight() -> None:
    """Full bs 2, blocks 1..3; a (prompt 2) and b (prompt 2), 3 outputs each, budget 8.
    Step 1 plans both prefills (blocks 1, 2; both in flight). Step 2: each may reach its
    pending token (position 2): a takes block 3; b finds no block, and every running
    request has tokens in flight, so there is no victim: b waits (nothing preempted),
    and step 1 is processed."""
    scheduler, _ = _scheduler(num_blocks=4, block_size=2)
    scheduler.apply(Arrive("a", (1, 2), (3, 4, 5)))
    scheduler.apply(Arrive("b", (6, 7), (8, 9, 10)))
    scheduler.apply(Step(8))
    second = scheduler.apply(Step(8))
    assert [(s.request_id, s.start, s.new_block_ids) for s in second.scheduled] == [
        ("a", 2, ((3,),))
    ]
    assert second.preempted == [] and scheduler.running == ["a", "b"]
    b = scheduler.requests["b"]
    assert isinstance(b, AsyncRequestState)
    # b: step 1 processed (its output 8 appended), nothing new planned
    assert (b.num_computed_tokens, b.num_in_flight, b.num_generated) == (2, 0, 1)
