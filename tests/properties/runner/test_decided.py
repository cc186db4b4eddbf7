"""DecidedScheduler: kvconform's scheduler on decisions taken from an engine's scheduler.

No engine is needed: the decisions are written by hand and replayed on the reference.
Layout: one full-attention group, block size 2, 4 usable blocks (ids 1..4).
"""

from __future__ import annotations

import pytest

from properties.core.decisions import ScheduledDecision, StepDecisions
from properties.core.modes import ServingMode
from properties.core.trace import Arrive
from properties.engines.reference import make_engine
from properties.runner.decided import (
    DecidedScheduler,
    DecisionMismatch,
    View,
    compare_views,
    reference_view,
)
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

LAYOUT = KVCacheLayout(
    groups=(KVCacheGroup(("l0",), FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8)),),
    num_blocks=5,
    max_model_len=16,
)


def scheduler(*arrivals: Arrive) -> DecidedScheduler:
    s = DecidedScheduler(make_engine(LAYOUT), LAYOUT, ServingMode())
    for op in arrivals:
        s.arrive(op)
    return s


def test_decided_chunks_not_the_budget_rule() -> None:
    # the budget rule would admit all 6 prompt tokens; the decision says 4
    s = scheduler(Arrive("r0", (1, 2, 3, 4, 5, 6), (7,)))
    s.step_as(StepDecisions((ScheduledDecision("r0", 0, 4),)), 16)
    view = reference_view(s)
    assert view.block_ids == {"r0": ((1, 2),)}
    assert view.num_computed_tokens == {"r0": 4}
    assert view.num_free_blocks == 2


def test_a_hit_of_another_length_is_a_mismatch() -> None:
    s = scheduler(Arrive("r0", (1, 2, 3, 4), (5,)))
    # the engine claims r0 started at 2 (a 2-token hit); the reference has no hit
    with pytest.raises(
        DecisionMismatch, match=r"\[\('r0', 2, 2\)\], the reference .* \[\('r0', 0, 2\)\]"
    ):
        s.step_as(StepDecisions((ScheduledDecision("r0", 2, 2),)), 16)


def test_a_victim_the_reference_does_not_need_is_a_mismatch() -> None:
    s = scheduler(Arrive("r0", (1, 2), (3, 4)), Arrive("r1", (5, 6), (7, 8)))
    s.step_as(StepDecisions((ScheduledDecision("r0", 0, 2), ScheduledDecision("r1", 0, 2))), 16)
    # 2 blocks free: r0's decode at position 2 fits without preempting r1
    decisions = StepDecisions((ScheduledDecision("r0", 2, 1),), preempted=("r1",))
    with pytest.raises(DecisionMismatch, match="reference"):
        s.step_as(decisions, 16)


def test_compare_views_names_the_first_difference() -> None:
    ref = View({"r0": ((1, 2),)}, {"r0": 4}, 2)
    engine = View({"r0": ((1, 3),)}, {"r0": 4}, 2)
    with pytest.raises(DecisionMismatch, match=r"r0's block ids differ: engine \(\(1, 3\),\)"):
        compare_views(engine, ref, "step 1")
    compare_views(View({"r0": ((1, 2),)}, {"r0": 4}, 2), ref, "step 1")  # equal: no error
