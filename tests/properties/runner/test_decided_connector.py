"""DecidedScheduler with a KV connector: the engine's connector events replayed on the reference.

No engine is needed: the decisions are written by hand. Layout: one full-attention
group, block size 2, 8 usable blocks (ids 1..8, handed out in order from a fresh pool).
The host tier holds the first two blocks of the prompt ``1 2 3 4 ...``, so a request
with that prefix and nothing on the device gets 4 external tokens.
"""

from __future__ import annotations

import pytest

from properties.core.decisions import (
    ALLOCATED,
    PROMOTE,
    ConnectorEvent,
    ScheduledDecision,
    StepDecisions,
)
from properties.core.modes import ServingMode
from properties.core.trace import Arrive
from properties.engines.reference import make_engine
from properties.runner.decided import DecidedScheduler, DecisionMismatch, decided_scheduler
from reference.host_tier import HostTier
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

LAYOUT = KVCacheLayout(
    groups=(KVCacheGroup(("l0",), FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8)),),
    num_blocks=9,
    max_model_len=16,
)
PROMPT = (1, 2, 3, 4, 5, 6, 7)


def scheduler(mode: ServingMode) -> DecidedScheduler:
    tier = HostTier(LAYOUT, 16)
    for k in (0, 1):  # blocks (1, 2) and (3, 4) of the prompt
        tier.offload(0, None, None, PROMPT, k)
    s = decided_scheduler(make_engine(LAYOUT), LAYOUT, mode, tier)
    s.arrive(Arrive("r1", PROMPT, (8,)))
    return s


SYNC_LOAD = StepDecisions(
    scheduled=(ScheduledDecision("r1", 4, 3),),
    connector_events=(ConnectorEvent(ALLOCATED, "r1", 4, False, ((1, 2, 3, 4),)),),
)


def test_synchronous_load_replayed_and_its_end_checked() -> None:
    """``r1`` loads positions 0..3 (blocks 1, 2) and computes 4..6 (blocks 3, 4); it
    samples its one output and ends with 7 computed tokens: cdiv(7, 2) = 4 blocks told."""
    s = scheduler(ServingMode(external_hits=True))
    s.told_at_end = {"r1": ((1, 2, 3, 4),)}
    record = s.step_as(SYNC_LOAD, 16)
    assert [(x.request_id, x.start, x.num_tokens, x.external_tokens) for x in record.scheduled] == [
        ("r1", 4, 3, 4)
    ]
    assert record.finished == ["r1"]
    assert s.engine.num_free_blocks() == 8


def test_told_blocks_that_are_not_the_table_are_a_mismatch() -> None:
    s = scheduler(ServingMode(external_hits=True))
    wrong = StepDecisions(
        scheduled=SYNC_LOAD.scheduled,
        connector_events=(ConnectorEvent(ALLOCATED, "r1", 4, False, ((3, 4),)),),
    )
    with pytest.raises(DecisionMismatch, match=r"\(4, False, \(\(3, 4\),\)\), the reference's "):
        s.step_as(wrong, 16)


def test_blocks_told_at_the_end_are_checked() -> None:
    s = scheduler(ServingMode(external_hits=True))
    s.told_at_end = {"r1": ((1, 2, 3),)}
    with pytest.raises(DecisionMismatch, match="at r1's end the engine told its connector"):
        s.step_as(SYNC_LOAD, 16)


def test_asynchronous_load_completes_at_the_engines_promotion() -> None:
    """Step 1: ``r1`` starts loading into blocks (1, 2) (nothing scheduled). Step 2 has
    no event: the load waits. Step 3: vLLM completes it and admits ``r1`` from 4."""
    mode = ServingMode(external_hits=True, async_loads=True)
    s = scheduler(mode)
    start = StepDecisions(connector_events=(ConnectorEvent(ALLOCATED, "r1", 4, True, ((1, 2),)),))
    assert s.step_as(start, 16).scheduled == []
    assert s.connector is not None and s.connector.loading == ["r1"]
    s.step_as(StepDecisions(), 16)
    assert s.connector.loading == ["r1"] and s.requests["r1"].num_computed_tokens == 4
    s.told_at_end = {"r1": ((1, 2, 3, 4),)}
    run = StepDecisions(
        scheduled=(ScheduledDecision("r1", 4, 3),),
        connector_events=(
            ConnectorEvent(PROMOTE, "r1"),
            ConnectorEvent(ALLOCATED, "r1", 0, False, ((1, 2, 3, 4),)),
        ),
    )
    assert [(x.request_id, x.start) for x in s.step_as(run, 16).scheduled] == [("r1", 4)]


def test_a_promotion_of_a_request_not_loading_is_a_mismatch() -> None:
    s = scheduler(ServingMode(external_hits=True, async_loads=True))
    with pytest.raises(DecisionMismatch, match="completed r1's load, which the reference"):
        s.step_as(StepDecisions(connector_events=(ConnectorEvent(PROMOTE, "r1"),)), 16)
