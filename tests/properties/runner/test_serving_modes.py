"""Serving modes (properties/core/modes.py): asynchronous scheduling and the admission
gate, driven by the scheduler on hand-written traces; expected values derived by hand."""

from __future__ import annotations

import pytest

from properties.checks.registry import PropertyViolation
from properties.core.modes import ServingMode
from properties.core.trace import Abort, Arrive, Step
from properties.mutants.reference_mutants import make_async_optimistic_free
from properties.runner.config import CheckConfig
from properties.runner.machine import TraceRun
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, SlidingWindowSpec

ASYNC = ServingMode(async_scheduling=True)


def _layout(spec, num_blocks: int = 32, **kw) -> KVCacheLayout:
    return KVCacheLayout(
        (KVCacheGroup(("l0",), spec),), num_blocks=num_blocks, max_model_len=64, **kw
    )


def _run(layout, mode=ASYNC, factory=None, level="exact") -> TraceRun:
    return TraceRun(CheckConfig(level=level), layout, factory, mode)


def test_async_steps_plan_ahead_and_finish_after_the_last_output() -> None:
    run = _run(_layout(FullAttentionSpec(block_size=4)))
    run.apply(Arrive("r0", tuple(range(12)), (1, 2)))
    # step 1 plans the prefill: computed 12, in flight 12, one output pending
    rec = run.apply(Step(64))
    assert [(s.start, s.num_tokens, s.samples) for s in rec.scheduled] == [(0, 12, True)]
    state = run.scheduler.requests["r0"]
    assert (state.num_computed_tokens, state.num_in_flight, state.num_pending) == (12, 12, 1)
    # step 2 plans position 12 (the pending token) before step 1 is processed; then
    # step 1's output is appended: in flight 1, pending 1 (step 2's own sample)
    rec = run.apply(Step(64))
    assert [(s.start, s.num_tokens, s.samples) for s in rec.scheduled] == [(12, 1, True)]
    assert (state.num_generated, state.num_in_flight, state.num_pending) == (1, 1, 1)
    # every output is sampled: step 3 schedules nothing, processes step 2, finishes r0
    rec = run.apply(Step(64))
    assert rec.scheduled == [] and rec.finished == ["r0"]
    assert run.lockstep.num_free_blocks() == 31


def test_async_abort_waits_for_the_flight() -> None:
    run = _run(_layout(FullAttentionSpec(block_size=4)))
    run.apply(Arrive("r0", tuple(range(8)), (1, 2, 3)))
    run.apply(Step(64))
    run.apply(Abort("r0"))  # 8 tokens in flight: the release is deferred
    assert run.lockstep.engine.get_block_ids("r0") == ((1, 2),)
    run.apply(Step(64))  # step 1 processed: released now
    assert "r0" not in run.scheduler.requests
    assert run.lockstep.num_free_blocks() == 31


def test_optimistic_free_is_caught_by_the_in_flight_invariant() -> None:
    # SWA w 4, bs 2, prompt 10 in chunks of 8 and 2: the second chunk is planned while
    # the first (tokens 0..7) is in flight; they read blocks 0..3. Freeing on the
    # optimistic 8 computed tokens (skipped 5 -> blocks 0, 1) releases blocks they read.
    layout = _layout(SlidingWindowSpec(block_size=2, sliding_window=4))
    run = _run(layout, factory=make_async_optimistic_free, level="universal")
    run.apply(Arrive("r0", tuple(range(10)), (1,)))
    run.apply(Step(8))
    with pytest.raises(PropertyViolation, match="in_flight_reads_held"):
        run.apply(Step(8))
    # the reference frees on the processed basis (8 - 8 = 0): nothing
    ok = _run(layout)
    ok.apply(Arrive("r0", tuple(range(10)), (1,)))
    ok.apply(Step(8))
    ok.apply(Step(8))
    assert ok.lockstep.engine.get_block_ids("r0") == ((1, 2, 3, 4, 5),)


def test_admission_gate_refuses_what_cannot_fit_whole() -> None:
    # full bs 2, 7 blocks (6 free): a 20-token request needs 10 blocks whole -> refused
    # by the gate (it would be admitted chunk by chunk without it)
    layout = _layout(FullAttentionSpec(block_size=2), num_blocks=7)
    gated = _run(layout, ServingMode(admission_gate=True))
    gated.apply(Arrive("r0", tuple(range(20)), ()))
    assert gated.apply(Step(4)).scheduled == []
    plain = _run(layout, ServingMode())
    plain.apply(Arrive("r0", tuple(range(20)), ()))
    assert [s.num_tokens for s in plain.apply(Step(4)).scheduled] == [4]


def test_drafts_roll_back_rejected_tokens() -> None:
    import hashlib

    # full bs 4, prompt 8, 4 outputs, 2 drafts per decode step. Step 1 prefills 8 and
    # appends output 0. Step 2 schedules position 8 + 2 drafts (3 tokens, slots up to
    # 11 -> 3 blocks). The rule: a = sha256("r0:8")[:4] mod 3 drafts are accepted;
    # computed becomes 8 + 1 + a, and a + 1 outputs are appended.
    a = int.from_bytes(hashlib.sha256(b"r0:8").digest()[:4], "big") % 3
    run = _run(_layout(FullAttentionSpec(block_size=4)), ServingMode(num_draft_tokens=2))
    run.apply(Arrive("r0", tuple(range(8)), (1, 2, 3, 4)))
    run.apply(Step(64))
    rec = run.apply(Step(64))
    assert [(s.start, s.num_tokens, s.num_drafts) for s in rec.scheduled] == [(8, 3, 2)]
    state = run.scheduler.requests["r0"]
    assert state.num_computed_tokens == 9 + a
    assert state.num_generated == 1 + a + 1
    assert run.lockstep.engine.get_block_ids("r0") == ((1, 2, 3),)


def test_production_settings_are_opt_in() -> None:
    from properties.core.engine import load_engine_factory
    from properties.core.modes import PRODUCTION_SETTINGS, production_settings
    from reference.errors import KVConformError

    def bare(layout):  # an engine that declares nothing gets none of them
        raise AssertionError

    assert production_settings(bare) == frozenset()
    assert production_settings(load_engine_factory("reference")) == PRODUCTION_SETTINGS
    bare.production_settings = {"retention", "speculative"}
    with pytest.raises(KVConformError, match="unknown settings \\['speculative'\\]"):
        production_settings(bare)


def test_async_never_preempts_a_request_scheduled_earlier_in_the_step() -> None:
    # full bs 2, 5 blocks (4 free): two requests that decode until the pool runs out.
    # Under asynchronous scheduling a request scheduled earlier in a step has no tokens
    # in flight yet while the step is being planned; it must still never be chosen as
    # the victim of a later allocation failure of the same step (its planned tokens
    # would read freed blocks).
    layout = _layout(FullAttentionSpec(block_size=2), num_blocks=5)
    run = _run(layout)
    run.apply(Arrive("a", (1, 2), (3, 4, 5, 6)))
    run.apply(Arrive("b", (1, 2, 3, 4), (5, 6, 7, 8)))
    for _ in range(6):
        rec = run.apply(Step(8))
        scheduled = {s.request_id for s in rec.scheduled}
        assert not scheduled & set(rec.preempted)
