"""A4 (the blocks an allocation estimates equal the blocks it pulls), A5 (no stray blocks:
a table covers exactly the slots asked for) and C1 (a committed block holds only verified
tokens): the check functions on hand-built events, then the machine on hand traces, each
with expected values derived by hand."""

from __future__ import annotations

import pytest

from properties.checks import invariants as inv
from properties.checks.answers import AnswerError, check_estimate
from properties.checks.registry import PropertyViolation
from properties.checks.state import AllocateEvent, CheckState, TrackedRequest
from properties.core.engine import ReportsAllocationEstimate, RequestInput
from properties.core.modes import SYNC, ServingMode
from properties.core.trace import Arrive, Step
from properties.engines.reference import make_engine
from properties.engines.under_test import resolve_engine
from properties.mutants.reference_mutants import (
    make_estimate_without_evictable_hits,
    make_rejected_drafts_committed,
    make_rolled_back_slots_reallocated,
)
from properties.runner.config import CheckConfig
from properties.runner.run import TraceRun
from properties.runner.scheduler import Drafts
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, SlidingWindowSpec

FULL = KVCacheLayout(
    (KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),), num_blocks=16, max_model_len=64
)
HYBRID = KVCacheLayout(
    (
        KVCacheGroup(("f",), FullAttentionSpec(block_size=4)),
        KVCacheGroup(("s",), SlidingWindowSpec(block_size=4, sliding_window=4)),
    ),
    num_blocks=16,
    max_model_len=64,
)
SWA = KVCacheLayout(
    (KVCacheGroup(("s",), SlidingWindowSpec(block_size=2, sliding_window=3)),),
    num_blocks=16,
    max_model_len=64,
)


class _TablesOnly:
    """An engine that answers only its requests' tables."""

    def __init__(self, tables) -> None:
        self.tables = dict(tables)

    def num_free_blocks(self) -> int:
        return 0

    def get_block_ids(self, request_id: str):
        return self.tables[request_id]


def _state(layout, tables) -> CheckState:
    """What the check functions read: the layout, one shared pool, every table (each
    request holding blocks)."""
    state = CheckState(_TablesOnly(tables), layout)
    for rid in tables:
        state.requests[rid] = TrackedRequest(rid, [], None, None, holds_blocks=True)
    return state


def _event(table, before=None, slots=0, main=0, estimate=None, rid="a", max_model_len=64):
    req = TrackedRequest(rid, [], None, None)
    return AllocateEvent(req, table, before, slots, main, estimate, max_model_len)


# -- A4 on hand-built events ----------------------------------------------------------


def test_pulls_count_new_blocks_and_unheld_hit_blocks() -> None:
    # the docstring's example: fresh request "a", hit of 8 tokens ((5, 6), (0, 7)), 4 new
    # tokens; request "b" holds block 5. Pulled: 6 (evictable hit), 8 (new), 7
    # (evictable hit), 9 (new); 5 is shared, index 0 of the window group is null.
    table = ((5, 6, 8), (0, 7, 9))
    state = _state(HYBRID, {"a": table, "b": ((5,), (0,))})
    event = _event(table, None, 12, 12, 4)
    assert inv.pulled_blocks(state, event) == [(0, 1, 6), (0, 2, 8), (1, 1, 7), (1, 2, 9)]
    assert inv.estimate_matches_pulls(state, event) is None
    low = _event(table, None, 12, 12, 2)  # an estimate without the evictable hits
    message = inv.estimate_matches_pulls(state, low)
    assert message is not None and "estimated 2 blocks but took 4" in message


def test_a_block_freed_below_the_window_and_taken_again_is_a_pull() -> None:
    # SWA w 3, bs 2: the call frees block 2 (index 1) below the window, then takes it
    # again for index 3: one pull, although block 2 was in the table before
    before, after = ((0, 2, 3),), ((0, 0, 3, 2),)
    state = _state(SWA, {"a": after})
    event = _event(after, before, 8, 8, 1)
    assert inv.pulled_blocks(state, event) == [(0, 3, 2)]
    assert inv.estimate_matches_pulls(state, event) is None


def test_reused_draft_slots_pull_nothing() -> None:
    table = ((1, 2, 3, 4),)
    state = _state(FULL, {"a": table})
    assert inv.pulled_blocks(state, _event(table, table, 15, 15, 0)) == []
    message = inv.estimate_matches_pulls(state, _event(table, table, 15, 15, 1))
    assert message is not None and "estimated 1 blocks but took 0" in message
    assert inv.estimate_matches_pulls(state, _event(table, table, 15, 15, None)) is None


# -- A5 on hand-built events ----------------------------------------------------------


def test_a_table_covers_exactly_the_highest_slot_asked_for() -> None:
    state = _state(FULL, {})
    # 13 slots after 11 rolled back: the 4 blocks held cover 16 >= 15 slots
    assert inv.table_covers_slots(state, _event(((1, 2, 3, 4),), ((1, 2, 3, 4),), 15)) is None
    # 17 slots need a 5th block
    assert inv.table_covers_slots(state, _event(((1, 2, 3, 4, 5),), ((1, 2, 3, 4),), 17)) is None
    stray = inv.table_covers_slots(state, _event(((1, 2, 3, 4, 5),), ((1, 2, 3, 4),), 15))
    assert stray is not None and "with 5 blocks, expected max(4 before, cdiv(15, 4)) = 4" in stray
    short = inv.table_covers_slots(state, _event(((1, 2),), None, 9))
    assert short is not None and "with 2 blocks, expected max(0 before, cdiv(9, 4)) = 3" in short
    # lookahead past max_model_len 8: 6 + 1 + 2 = 9 slots asked, vLLM gives 8 (2 blocks),
    # an engine may give 9 (3 blocks), never 4 blocks
    capped = [_event(((1,) * n,), None, 9, 7, max_model_len=8) for n in (2, 3, 4)]
    assert [inv.table_covers_slots(state, e) is None for e in capped] == [True, True, False]
    assert "expected max(0 before, cdiv(8, 4)) = 2 to 3" in inv.table_covers_slots(state, capped[2])


def test_no_lookahead_for_a_non_final_chunk_when_the_engine_says_so() -> None:
    """bs 4, a 20-token prompt, a first chunk of 8 with 2 lookahead slots (10 slots,
    main 8). A strict engine needs 3 blocks; one declaring
    ``lookahead_on_prefill_chunks = False`` (LMDeploy) may hold 2, never 4; the last
    chunk (main 20 = every token) still needs its lookahead."""
    state = _state(FULL, {})
    state.lookahead_on_prefill_chunks = False
    prompt = list(range(20))

    def chunk(blocks: int, slots: int, main: int) -> AllocateEvent:
        req = TrackedRequest("a", prompt, None, None)
        return AllocateEvent(req, ((1,) * blocks,), None, slots, main, None, 64)

    assert inv.table_covers_slots(state, chunk(2, 10, 8)) is None
    assert inv.table_covers_slots(state, chunk(3, 10, 8)) is None
    assert inv.table_covers_slots(state, chunk(4, 10, 8)) is not None
    assert inv.table_covers_slots(state, chunk(5, 22, 20)) is not None  # 6 needed
    assert inv.table_covers_slots(state, chunk(6, 22, 20)) is None
    strict = _state(FULL, {})
    assert "cdiv(10, 4)) = 3" in inv.table_covers_slots(strict, chunk(2, 10, 8))


# -- the answer of the capability -------------------------------------------------------


def test_the_estimate_answer_is_none_or_a_count() -> None:
    assert check_estimate("e", None) is None
    assert check_estimate("e", 3) == 3
    for bad in (-1, True, 2.0, "3"):
        with pytest.raises(AnswerError):
            check_estimate("e", bad)


def test_the_reference_reports_its_estimate() -> None:
    engine = make_engine(FULL)
    assert isinstance(engine, ReportsAllocationEstimate)
    engine.add_request(RequestInput("r", tuple(range(9))))
    assert engine.allocate_slots("r", 9) == ((1, 2, 3),)
    assert engine.last_allocation_estimate() == 3  # cdiv(9, 4) blocks, nothing held


# -- the machine on hand traces ---------------------------------------------------------


def _run(layout, factory=None, mode=SYNC, level="universal", at_boundaries=False) -> TraceRun:
    engine = resolve_engine(factory or "reference")
    return TraceRun(CheckConfig(level=level), layout, engine, mode, at_boundaries=at_boundaries)


def test_an_estimate_without_evictable_hits_is_reported() -> None:
    # r0 computes 9 tokens (blocks 1, 2, 3; 0, 1 cached) and is freed; r1, the same prompt,
    # hits 8 tokens on blocks 1, 2 (evictable) and needs 1 new block: estimate 3
    trace = [Arrive("r0", tuple(range(9))), Step(16), Arrive("r1", tuple(range(9))), Step(16)]
    run = _run(FULL)
    for op in trace:
        run.apply(op)
    assert run.lockstep.engine.last_allocation_estimate() == 3
    run = _run(FULL, make_estimate_without_evictable_hits)
    with pytest.raises(PropertyViolation) as caught:
        for op in trace:
            run.apply(op)
    assert caught.value.name == "estimate_matches_pulls"
    assert "allocate_slots('r1') estimated 1 blocks but took 3" in caught.value.message


DRAFTS = ServingMode(num_draft_tokens=3)
#: prompt 9 (one output decoded by the prefill step), then decodes with 3 drafts each
DRAFT_TRACE = [Arrive("r0", tuple(range(9)), tuple(range(100, 108))), Step(16), Step(16)]


def test_draft_trace_is_the_one_computed_by_hand() -> None:
    # step 2 schedules position 9 + 3 drafts (slots 13: blocks 1..4); 1 draft is accepted
    assert Drafts.accepted_drafts("r0", 9, 3) == 1
    run = _run(FULL, mode=DRAFTS, level="exact")
    for op in [*DRAFT_TRACE, Step(16)]:
        run.apply(op)
    # step 3 at 11 computed (12 tokens) asks for 11 + 4 = 15 slots: no new block
    assert run.lockstep.engine.get_block_ids("r0") == ((1, 2, 3, 4),)


def test_rolled_back_slots_taken_again_are_stray_blocks() -> None:
    run = _run(FULL, make_rolled_back_slots_reallocated, DRAFTS)
    with pytest.raises(PropertyViolation) as caught:
        for op in [*DRAFT_TRACE, Step(16)]:
            run.apply(op)
    assert caught.value.name == "table_covers_slots"
    assert "with 5 blocks, expected max(4 before, cdiv(15, 4)) = 4" in caught.value.message


def test_a_committed_block_holding_a_rejected_draft_is_reported() -> None:
    # after step 2: computed 11, 12 tokens (the bonus token at 11 is computed in step 3;
    # its slot holds the rejected draft). cache_blocks('r0', 11) may not register block 3
    # (index 2, positions 8..11); the mutant commits 12 tokens and does.
    run = _run(FULL, make_rejected_drafts_committed, DRAFTS)
    with pytest.raises(PropertyViolation) as caught:
        for op in DRAFT_TRACE:
            run.apply(op)
    assert caught.value.name == "committed_blocks_verified"
    message = caught.value.message
    assert "block 3 (group 0) is cached for 12 tokens after cache_blocks('r0', 11)" in message
    assert "(position 11) holds the KV of a rejected draft token (rolled back)" in message


def test_at_the_large_tiers_the_commit_is_checked_at_the_step_boundary() -> None:
    """The same commit, checked when the next step starts (the large tiers read the
    cached blocks once a step): the same message; nothing before the boundary."""
    run = _run(FULL, make_rejected_drafts_committed, DRAFTS, at_boundaries=True)
    for op in DRAFT_TRACE:
        run.apply(op)  # step 2 committed 12 tokens: not checked yet
    with pytest.raises(PropertyViolation) as caught:
        run.finish()  # the trace ends: the deferred checks run
    assert caught.value.name == "committed_blocks_verified"
    message = caught.value.message
    assert "block 3 (group 0) is cached for 12 tokens after cache_blocks('r0', 11)" in message
    assert "(position 11) holds the KV of a rejected draft token (rolled back)" in message
    run = _run(FULL, make_rejected_drafts_committed, DRAFTS, at_boundaries=True)
    with pytest.raises(PropertyViolation, match="committed_blocks_verified"):
        for op in [*DRAFT_TRACE, Step(16)]:  # or when the next step starts
            run.apply(op)
    run = _run(FULL, mode=DRAFTS, at_boundaries=True)  # the reference commits right
    for op in [*DRAFT_TRACE, Step(16), Step(16)]:
        run.apply(op)
    run.finish()


def test_the_large_tiers_read_the_cached_blocks_once_for_a_steps_commits() -> None:
    """Three requests decoding with drafts commit in each step: the small tier reads the
    cached blocks at each commit, the large tiers once a step."""
    reads = {}
    for at_boundaries in (False, True):
        run = _run(FULL, mode=DRAFTS, at_boundaries=at_boundaries)
        engine = run.lockstep.engine.inner
        calls = []
        original = engine.cached_blocks
        engine.cached_blocks = lambda calls=calls, original=original: calls.append(1) or original()
        for i in range(3):
            run.apply(Arrive(f"r{i}", tuple(range(i, i + 9)), tuple(range(100, 108))))
        for _ in range(4):
            run.apply(Step(64))
        run.finish()
        reads[at_boundaries] = len(calls)
    assert reads[True] <= 4 < 3 * 3 <= reads[False]
