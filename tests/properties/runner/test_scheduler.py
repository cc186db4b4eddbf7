"""The synchronous scheduler (properties/runner/scheduler.py) driven directly over the
reference engine; every expected value is worked out by hand in the comments."""

from __future__ import annotations

import pytest

from properties.core.engine import RequestInput
from properties.core.modes import ServingMode
from properties.core.trace import Arrive, Preempt, Step
from properties.runner.async_scheduler import AsyncScheduler
from properties.runner.scheduler import Drafts, RequestState, Scheduler
from properties.runner.serving import make_scheduler
from reference.errors import KVConformError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec
from tests.properties.runner.scheduler_support import Recording, full_layout

MAMBA = KVCacheLayout(
    (
        KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),
        KVCacheGroup(("l1",), MambaSpec(block_size=4)),
    ),
    num_blocks=16,
    max_model_len=32,
)


def _items(record) -> list[tuple]:
    return [
        (s.request_id, s.start, s.num_tokens, s.hit_tokens, s.new_block_ids)
        for s in record.scheduled
    ]


def test_two_requests_share_a_block_and_finish() -> None:
    """Full bs 4, blocks 1..5 free. r0 (6 tokens, outputs 7, 8) and r1 (r0's first block
    1 2 3 4, then 9; output 10), budget 8.

    Step 1: r0 is admitted with 6 tokens -> blocks 1 (tokens 0..3, full: cached at
    allocation) and 2; budget 2 left. r1 hits block 1 (4 tokens; its 5th token is new),
    computes 1 token at position 4 -> new block 3. Both reach their last token: r0
    appends 7 (one output left), r1 appends 10 and finishes (freed: block 3 back).
    Step 2: r0 computes position 6 in block 2 (no new block), appends 8 and finishes."""
    layout = full_layout(block_size=4, num_blocks=6)
    engine = Recording(layout)
    scheduler = Scheduler(engine, layout)
    scheduler.apply(Arrive("r0", (1, 2, 3, 4, 5, 6), (7, 8)))
    scheduler.apply(Arrive("r1", (1, 2, 3, 4, 9), (10,)))
    first = scheduler.apply(Step(8))
    assert _items(first) == [("r0", 0, 6, 0, ((1, 2),)), ("r1", 4, 1, 4, ((3,),))]
    assert first.finished == ["r1"] and first.preempted == []
    r0 = scheduler.requests["r0"]
    assert (r0.num_computed_tokens, r0.num_generated, r0.token_ids) == (6, 1, (1, 2, 3, 4, 5, 6, 7))
    assert engine.get_block_ids("r0") == ((1, 2),)
    assert scheduler.running == ["r0"] and "r1" not in scheduler.requests
    engine.take()
    second = scheduler.apply(Step(8))
    assert _items(second) == [("r0", 6, 1, 0, ((),))] and second.finished == ["r0"]
    # rule 4 for r0: computed 7, output 8 appended, freed, forgotten
    assert engine.take() == [
        ("new_step",),
        ("allocate_slots", "r0", 1, 0, None, 0),
        ("set_num_computed_tokens", "r0", 7),
        ("append_output_tokens", "r0", [8]),
        ("free", "r0"),
        ("remove_request", "r0"),
    ]
    assert scheduler.finished == ["r1", "r0"] and scheduler.is_idle()
    assert engine.num_free_blocks() == 5


def test_the_newest_running_request_is_preempted_when_the_pool_runs_out() -> None:
    """Full bs 2, blocks 1..3. r0 (2 tokens, outputs 3 4 5) and r1 (2 tokens, outputs
    8 9 10), budget 8. Step 1: blocks 1 and 2, both decode one token. Step 2: r0's
    position 2 takes block 3; r1's position 2 finds no block, r1 is the newest running
    request: preempted (freed, computed 0, first in the queue), and nothing is admitted.
    Step 3: r0 decodes in block 3; r1 is looked up again (3 tokens: hit 2 on its old
    block 2, still cached) but its position 2 needs a block while r0 holds 1 and 3, so
    it waits; r0 finishes. Step 4: r1 runs from its hit."""
    layout = full_layout(block_size=2, num_blocks=4, max_model_len=16)
    scheduler = Scheduler(Recording(layout), layout)
    scheduler.apply(Arrive("r0", (1, 2), (3, 4, 5)))
    scheduler.apply(Arrive("r1", (6, 7), (8, 9, 10)))
    assert _items(scheduler.apply(Step(8))) == [
        ("r0", 0, 2, 0, ((1,),)),
        ("r1", 0, 2, 0, ((2,),)),
    ]
    second = scheduler.apply(Step(8))
    assert _items(second) == [("r0", 2, 1, 0, ((3,),))] and second.preempted == ["r1"]
    r1 = scheduler.requests["r1"]
    assert (r1.num_computed_tokens, r1.num_preemptions, r1.holds_blocks) == (0, 1, False)
    assert scheduler.waiting == ["r1"] and r1.token_ids == (6, 7, 8)
    third = scheduler.apply(Step(8))
    assert _items(third) == [("r0", 3, 1, 0, ((),))] and third.finished == ["r0"]
    assert scheduler.waiting == ["r1"]
    [item] = scheduler.apply(Step(8)).scheduled
    assert (item.request_id, item.start, item.num_tokens, item.hit_tokens) == ("r1", 2, 1, 2)


def test_preempt_of_a_request_that_is_not_running_does_nothing() -> None:
    layout = full_layout(block_size=4, num_blocks=6)
    engine = Recording(layout)
    scheduler = Scheduler(engine, layout)
    scheduler.apply(Arrive("r0", (1, 2, 3), (4,)))
    engine.take()
    scheduler.apply(Preempt("r0"))  # waiting, not running
    scheduler.apply(Preempt("nobody"))
    assert engine.take() == [] and scheduler.waiting == ["r0"]


def _decoding(prompt: int, outputs: int, generated: int) -> RequestState:
    """A request whose every token but the last is computed (a decode step is next)."""
    state = RequestState(RequestInput("r0", tuple(range(prompt))), tuple(range(outputs)))
    state.num_generated = generated
    state.num_computed_tokens = prompt + generated - 1
    return state


class _Calls:
    """An engine stub for the drafts hook: records every call ``(method, *args)``."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args: self.calls.append((name, *args))


def test_drafts_are_bounded_by_the_outputs_left_and_the_budget() -> None:
    """k 3, a decode of 1 token: drafts = min(k, outputs left after this one, budget - 1)
    (``max_model_len - tokens`` never binds: an arrival fits prompt and outputs)."""
    layout = full_layout(block_size=4, num_blocks=6, max_model_len=16)
    engine = _Calls()
    drafts = Drafts(engine, layout, 3)
    # prompt 8, 6 outputs, 1 generated: 4 outputs left after this token -> k = 3
    assert drafts.propose(_decoding(8, 6, 1), 1, 64) == 3
    assert drafts.propose(_decoding(8, 6, 1), 1, 3) == 2  # budget 3: 1 + 2 drafts
    assert drafts.propose(_decoding(8, 3, 1), 1, 64) == 1  # outputs: 3 - 1 - 1
    assert drafts.propose(_decoding(8, 6, 5), 1, 64) == 0  # the last output
    assert drafts.propose(_decoding(8, 6, 1), 2, 64) == 0  # not a 1-token decode
    assert drafts.propose(_decoding(8, 6, 0), 1, 64) == 0  # prefill, nothing generated
    # announced as pending tokens, only when there are drafts
    assert engine.calls == [("set_in_flight", "r0", 0, k) for k in (3, 2, 1)]
    assert Drafts(engine, MAMBA, 3).propose(_decoding(8, 6, 1), 1, 64) == 0  # Mamba: none


def test_settled_drafts_roll_back_the_rejected_ones() -> None:
    """Decode at position 8 with 2 drafts; a = sha256("r0:8")[:4] mod 3 are accepted:
    computed 8 + 1 + a, a + 1 outputs appended (hashlib computes a here, as the rule
    says, not through the code under test)."""
    import hashlib

    from properties.runner.scheduler import ScheduledRequest

    a = int.from_bytes(hashlib.sha256(b"r0:8").digest()[:4], "big") % 3
    layout = full_layout(block_size=4, num_blocks=6)
    engine = _Calls()
    state = _decoding(8, 6, 1)
    item = ScheduledRequest("r0", 8, 3, 0, ((),), num_drafts=2)
    assert Drafts(engine, layout, 2).settle(item, state) is False
    assert (state.num_computed_tokens, state.num_generated) == (9 + a, 2 + a)
    assert engine.calls == [
        ("set_num_computed_tokens", "r0", 9 + a),
        ("set_in_flight", "r0", 0, 0),
        ("append_output_tokens", "r0", list(range(1, 2 + a))),
        ("cache_blocks", "r0", 9 + a),
    ]


def test_make_scheduler_picks_the_parts() -> None:
    layout = full_layout(block_size=4, num_blocks=6)
    engine = Recording(layout)
    plain = make_scheduler(engine, layout)
    assert type(plain) is Scheduler and plain.connector is None and plain.drafts is None
    assert type(make_scheduler(engine, layout, ServingMode(async_scheduling=True))) is (
        AsyncScheduler
    )
    drafted = make_scheduler(engine, layout, ServingMode(num_draft_tokens=2))
    assert drafted.drafts is not None and drafted.drafts.num_draft_tokens == 2
    external = make_scheduler(engine, layout, ServingMode(external_hits=True))
    # the host tier holds twice the pool: 2 * 6 blocks
    assert external.connector is not None and external.host_tier.capacity_blocks == 12
    # no connector with a Mamba group (loaded Mamba states are not modelled)
    assert (
        make_scheduler(Recording(MAMBA), MAMBA, ServingMode(external_hits=True)).connector is None
    )


def test_a_scheduler_refuses_a_mode_without_its_parts() -> None:
    layout = full_layout(block_size=4, num_blocks=6)
    engine = Recording(layout)
    with pytest.raises(KVConformError, match="asynchronous scheduling is AsyncScheduler's"):
        Scheduler(engine, layout, ServingMode(async_scheduling=True))
    with pytest.raises(KVConformError, match="needs a Connector"):
        Scheduler(engine, layout, ServingMode(external_hits=True))
