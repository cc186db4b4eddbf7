"""The scheduler level: vLLM 0.33.0's own ``Scheduler`` against the reference on its decisions.

Run with ``.engines/vllm/bin/python -m pytest tests/properties/engines/test_vllm_scheduler.py``
(``conftest.py`` skips the module when vLLM is not installed). One hand-built trace
that preempts: expected decisions and block tables are derived by hand below; the two
manager-call mutants of :mod:`properties.mutants.vllm_scheduler_mutants` must fail it,
unmutated vLLM must pass it. The KV connector's tests (hand-built loads, the two
connector mutants) are at the end of the module.

The trace (one full-attention group, block size 2, 6 usable blocks, budget 16):
``r0`` prompt (1, 2, 3, 4) and ``r1`` prompt (4, 3, 2, 1), 6 outputs each.

* step 1: both admitted, 4 tokens each: ``r0`` blocks (1, 2), ``r1`` (3, 4); 2 free.
* step 2: decodes at position 4: ``r0`` gets block 5, ``r1`` block 6; 0 free.
* step 3: decodes at position 5: inside blocks 5 and 6; 0 free.
* step 4: ``r0`` at position 6 needs a block, none is free: vLLM preempts the newest,
  ``r1`` (freed tail first: 6, 4, 3), and ``r0`` takes block 6; 2 free.
"""

from __future__ import annotations

import pytest

from properties.core.decisions import ScheduledDecision
from properties.core.modes import ServingMode
from properties.core.trace import Arrive, ResetPrefixCache, Step, Trace
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

pytestmark = pytest.mark.engine

LAYOUT = KVCacheLayout(
    groups=(KVCacheGroup(("l0",), FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8)),),
    num_blocks=7,
    max_model_len=16,
)
ARRIVALS = (
    Arrive("r0", (1, 2, 3, 4), (5, 6, 7, 8, 9, 10)),
    Arrive("r1", (4, 3, 2, 1), (1, 1, 1, 1, 1, 1)),
)
TRACE = Trace(layout=LAYOUT, operations=ARRIVALS + (Step(16),) * 16)


def test_decisions_and_tables_by_hand() -> None:
    from properties.engines.vllm_scheduler import make_harness

    h = make_harness(LAYOUT)
    for op in ARRIVALS:
        h.arrive(op)
    d1 = h.step(16)
    assert d1.scheduled == (ScheduledDecision("r0", 0, 4), ScheduledDecision("r1", 0, 4))
    assert h.view().block_ids == {"r0": ((1, 2),), "r1": ((3, 4),)}
    h.step(16)
    assert h.view().block_ids == {"r0": ((1, 2, 5),), "r1": ((3, 4, 6),)}
    assert h.view().num_free_blocks == 0
    h.step(16)
    d4 = h.step(16)
    assert d4.scheduled == (ScheduledDecision("r0", 6, 1),)
    assert d4.preempted == ("r1",)
    view = h.view()
    assert view.block_ids == {"r0": ((1, 2, 5, 6),), "r1": ((),)}
    assert view.num_computed_tokens == {"r0": 7, "r1": 0}
    assert view.num_free_blocks == 2


def test_unmutated_vllm_passes() -> None:
    from properties.tools.scheduler_level import run_one

    assert run_one(TRACE) == 16


@pytest.mark.parametrize(
    ("mutant", "message"),
    [
        # step 3: r0 at position 5 reserves slot 6 too, needs a block and preempts r1;
        # the reference (slot 5 only, in block 5) can still run r1
        (
            "lookahead-on-running",
            "step 3 (r0+1@5; preempted r1): the engine scheduled (request, start, tokens) "
            "[('r0', 5, 1)], the reference on the same decisions [('r0', 5, 1), ('r1', 5, 1)]",
        ),
        # step 4: r1's blocks are not back when r0 retries, so r0 preempts itself too;
        # the reference frees r1 and runs r0
        (
            "preemption-frees-late",
            "step 4 (nothing scheduled; preempted r1, r0): the engine scheduled (request, "
            "start, tokens) [], the reference on the same decisions [('r0', 6, 1)]",
        ),
    ],
)
def test_scheduler_mutant_is_caught(mutant: str, message: str) -> None:
    from properties.runner.decided import DecisionMismatch
    from properties.tools.scheduler_level import run_one

    with pytest.raises(DecisionMismatch) as caught:
        run_one(TRACE, mutant)
    assert message in str(caught.value)


def test_unknown_mutant_is_one_line() -> None:
    from properties.mutants.vllm_scheduler_mutants import mutant_class

    with pytest.raises(KeyError, match="unknown vLLM scheduler mutant 'nope'"):
        mutant_class("nope")


@pytest.mark.parametrize(
    "mutant",
    [
        "lookahead-on-running",
        "preemption-frees-late",
        "connector-told-new-blocks",
        "connector-end-keeps-skipped-blocks",
    ],
)
def test_generated_traces_catch_each_mutant(mutant: str) -> None:
    """The ci profile's draws (not only the hand-built trace) find each mutant."""
    from properties.tools.scheduler_level import EXAMPLES, search

    n, _, trace, message = search(EXAMPLES["ci"], mutant=mutant)
    assert trace is not None, f"{mutant} survived {n} generated traces"
    # the message names where: a step's decisions ("step N (...)") or the state after an
    # operation ("operation i (Step|Preempt|...)")
    assert message is not None and message.startswith(("step ", "operation "))


#: issue 38's scheduler mutants and the level mode whose ci draws must catch each
MODE_OF_MUTANT = {
    "deferred-free-ignored": "async_scheduling external_hits async_loads load_failures / default",
    "encoder-cut-after-allocation": (
        "sync / encoder_budget=10 report_finished=True v1_model_runner=True / images"
    ),
    "priority-victim-frees-late": "sync / policy=priority",
    "connector-delay-ignored": (
        "external_hits / delayed_frees=True reset_connector=True stats=False"
    ),
    "invalid-block-off-by-one": "external_hits / invalid_blocks=True",
    "grammar-error-keeps-blocks": (
        "drafts=2 / structured_output=True report_finished=True stats=False"
    ),
    "reset-delivers-stale-output": "async_scheduling / max_loras=1 reset_running=True / loras",
}


@pytest.mark.parametrize("mutant", sorted(MODE_OF_MUTANT))
def test_generated_traces_of_its_mode_catch_each_new_mutant(mutant: str) -> None:
    """The ci draws of the mutant's mode (as many as the ci profile gives each mode)
    find it."""
    from properties.tools.scheduler_level import EXAMPLES, _modes, modes_described, search

    modes = modes_described(MODE_OF_MUTANT[mutant])
    per_mode = EXAMPLES["ci"] // len(_modes())
    n, _, trace, message = search(per_mode, mutant=mutant, modes=modes)
    assert trace is not None, f"{mutant} survived {n} generated traces"
    assert message is not None and message.startswith(("step ", "operation "))


def test_asynchronous_scheduling_agrees_on_a_short_trace() -> None:
    """vLLM's AsyncScheduler: step 1 plans the 3-token prefill (computed 3 at once, blocks
    (1, 2) of size 2); step 2 plans position 3 (block 2 still) before step 1's output is
    processed; the reference's asynchronous scheduler agrees at every step."""
    from properties.core.modes import ServingMode
    from properties.engines.vllm_scheduler import make_harness
    from properties.tools.scheduler_level import run_one

    h = make_harness(LAYOUT, asynchronous=True)
    h.arrive(Arrive("r0", (1, 2, 3), (5, 6)))
    assert h.step(16).scheduled == (ScheduledDecision("r0", 0, 3),)
    assert h.view().block_ids == {"r0": ((1, 2),)}
    assert h.view().num_computed_tokens == {"r0": 3}
    assert h.step(16).scheduled == (ScheduledDecision("r0", 3, 1),)
    assert h.view().block_ids == {"r0": ((1, 2),)}
    trace = Trace(
        layout=LAYOUT,
        operations=(Arrive("r0", (1, 2, 3), (5, 6)),) + (Step(16),) * 5,
        mode=ServingMode(async_scheduling=True),
    )
    assert run_one(trace) == 5


# -- asynchronous scheduling: preemption of a request with tokens in flight --------------
# The module's trace (ARRIVALS, block size 2, 6 usable blocks, budget 16) under vLLM's
# AsyncScheduler: step N is scheduled, then step N - 1's output is processed.
#
# step | scheduled        | preempted | r0 blocks    | r1 blocks | computed | free | outputs
#  1   | r0 0+4, r1 0+4   |           | 1 2          | 3 4       | 4, 4     | 2    | 0, 0
#  2   | r0 4+1, r1 4+1   |           | 1 2 5        | 3 4 6     | 5, 5     | 0    | 1, 1
#  3   | r0 5+1, r1 5+1   |           | 1 2 5        | 3 4 6     | 6, 6     | 0    | 2, 2
#  4   | r0 6+1           | r1        | 1 2 5 6      | -         | 7, 0     | 2    | 3, 3
#
# Step 4: r0 at position 6 needs a block and none is free; vLLM preempts r1 although
# its step-3 token (position 5) is still in flight: r1's blocks go back at once, tail
# first (6, 4, 3), r0 takes block 6, 2 free (4, 3). Step 3's output is processed after
# step 4 is scheduled: r1's token is stale but still delivered (outputs 3), nothing is
# committed, and r1 waits with nothing in flight. Step 5: r1 (7 tokens) hits its prompt
# blocks 3 and 4 (the 2 free ones) and needs 2 more blocks: it is not admitted; r0 runs
# position 7 in block 6.
ASYNC_TABLES = (
    ((("r0", 0, 4), ("r1", 0, 4)), (), {"r0": ((1, 2),), "r1": ((3, 4),)}, {"r0": 4, "r1": 4}, 2),
    (
        (("r0", 4, 1), ("r1", 4, 1)),
        (),
        {"r0": ((1, 2, 5),), "r1": ((3, 4, 6),)},
        {"r0": 5, "r1": 5},
        0,
    ),
    (
        (("r0", 5, 1), ("r1", 5, 1)),
        (),
        {"r0": ((1, 2, 5),), "r1": ((3, 4, 6),)},
        {"r0": 6, "r1": 6},
        0,
    ),
    ((("r0", 6, 1),), ("r1",), {"r0": ((1, 2, 5, 6),), "r1": ((),)}, {"r0": 7, "r1": 0}, 2),
    ((("r0", 7, 1),), (), {"r0": ((1, 2, 5, 6),), "r1": ((),)}, {"r0": 8, "r1": 0}, 2),
)


def test_async_preemption_with_tokens_in_flight_by_hand() -> None:
    """vLLM and the reference (on vLLM's decisions) both follow ASYNC_TABLES; r1's stale
    output is delivered on both sides and nothing of it is in flight after step 4."""
    from properties.core.modes import ServingMode
    from properties.engines.reference import make_engine
    from properties.engines.vllm_scheduler import make_harness
    from properties.runner.decided import compare_views, decided_scheduler, reference_view

    h = make_harness(LAYOUT, asynchronous=True)
    ref = decided_scheduler(make_engine(LAYOUT), LAYOUT, ServingMode(async_scheduling=True))
    for op in ARRIVALS:
        h.arrive(op)
        ref.arrive(op)
    for k, (scheduled, preempted, blocks, computed, free) in enumerate(ASYNC_TABLES, 1):
        if k == 4:  # r1 has its step-3 token in flight when vLLM picks it as the victim
            assert h.scheduler.requests["r1"].num_in_flight_tokens == 1
            assert ref.requests["r1"].num_in_flight == 1
        d = h.step(16)
        ref.step_as(d, 16)
        assert [(s.request_id, s.start, s.num_tokens) for s in d.scheduled] == list(scheduled)
        assert d.preempted == preempted
        view = h.view()
        assert (view.block_ids, view.num_computed_tokens) == (blocks, computed)
        assert view.num_free_blocks == free
        compare_views(view, reference_view(ref), f"step {k}")
        if k == 4:
            r1 = ref.requests["r1"]
            assert (r1.num_generated, r1.num_in_flight, r1.num_stale) == (3, 0, 0)
            assert h.scheduler.requests["r1"].num_output_tokens == 3
            assert ref.waiting == ["r1"]
    trace = Trace(
        layout=LAYOUT,
        operations=ARRIVALS + (Step(16),) * 16,
        mode=ServingMode(async_scheduling=True),
    )
    from properties.tools.scheduler_level import run_one

    assert run_one(trace) == 16


def test_async_preempt_op_holds_stale_request_and_abort_frees_at_once() -> None:
    """ARRIVALS with 8 usable blocks (free queue 5..8), asynchronous. Steps 1-3 as in
    ASYNC_TABLES but with 2 more free blocks: r0 (1, 2, 5), r1 (3, 4, 6), 2 free (7, 8).
    A trace's ``Preempt`` of r1 (its position-5 token in flight): its blocks go back at
    once, 5 free; block 6 is not cached (only position 4 of 4-5 is processed), so it goes
    to the front, 3 and 4 (cached) to the back: queue 6, 7, 8, 4, 3.
    Step 4: r0 at position 6 takes block 6 (4 free); r1 would fit (hit 3, 4 and one new
    block) but its stale token is in flight: not re-admitted. Step 3's output is then
    processed (r1's stale token delivered: 3 outputs).
    ``Abort`` of r0 (its position-6 token in flight): blocks freed at once, 8 free; 6 (not
    cached) to the front: queue 6, 7, 8, 4, 3, 5, 2, 1.
    Step 5: r1 (7 tokens) hits 3, 4 and takes 6, 7 for positions 4-6: (3, 4, 6, 7), 4 free.
    """
    from dataclasses import replace

    from properties.core.modes import ServingMode
    from properties.core.trace import Abort, Preempt
    from properties.engines.reference import make_engine
    from properties.engines.vllm_scheduler import make_harness
    from properties.runner.decided import compare_views, decided_scheduler, reference_view

    layout = replace(LAYOUT, num_blocks=9)
    mode = ServingMode(async_scheduling=True)
    h = make_harness(layout, asynchronous=True)
    ref = decided_scheduler(make_engine(layout), layout, mode)
    for op in ARRIVALS:
        h.arrive(op)
        ref.arrive(op)
    for _ in range(3):
        ref.step_as(h.step(16), 16)
    assert h.view().block_ids == {"r0": ((1, 2, 5),), "r1": ((3, 4, 6),)}
    assert h.view().num_free_blocks == 2
    h.preempt("r1")
    ref.preempt("r1")
    assert h.view().num_free_blocks == 5
    assert (ref.requests["r1"].num_stale, ref.requests["r1"].num_in_flight) == (1, 1)
    compare_views(h.view(), reference_view(ref), "preempt")
    d = h.step(16)
    ref.step_as(d, 16)
    assert [(s.request_id, s.start, s.num_tokens) for s in d.scheduled] == [("r0", 6, 1)]
    assert h.view().block_ids == {"r0": ((1, 2, 5, 6),), "r1": ((),)}
    assert h.view().num_free_blocks == 4
    assert (ref.requests["r1"].num_generated, ref.requests["r1"].num_stale) == (3, 0)
    compare_views(h.view(), reference_view(ref), "step 4")
    h.abort("r0")
    ref.abort("r0")
    assert h.view().num_free_blocks == 8
    compare_views(h.view(), reference_view(ref), "abort")
    d = h.step(16)
    ref.step_as(d, 16)
    assert [(s.request_id, s.start, s.num_tokens) for s in d.scheduled] == [("r1", 4, 3)]
    assert h.view().block_ids == {"r1": ((3, 4, 6, 7),)}
    assert h.view().num_free_blocks == 4
    compare_views(h.view(), reference_view(ref), "step 5")
    trace = Trace(
        layout=layout,
        operations=ARRIVALS
        + (Step(16),) * 3
        + (Preempt("r1"), Step(16), Abort("r0"))
        + (Step(16),) * 12,
        mode=mode,
    )
    from properties.tools.scheduler_level import run_one

    assert run_one(trace) == 16


def test_self_preemption_of_a_sub_block_mamba_chunk() -> None:
    """Full + Mamba groups of block size 22, 19 usable blocks, asynchronous. ``r0``
    (prompt 175) and ``r1`` (prompt 131) prefill over steps 1-3 (budgets 306, 46, 233).
    Step 4 (budget 20): ``r0`` decodes at 176 and takes the last free block; ``r1``
    (computed 110) has 19 tokens of budget left, less than one Mamba block, so vLLM
    advances it sub-block (kvconform's own Mamba rule would cut the chunk to 0), finds no
    block and preempts ``r1`` itself. The reference, on vLLM's decisions, must try the
    uncut 19 tokens and fail the same way (before the fix: "the engine preempted
    ['r1'] although the reference had room")."""
    from properties.core.modes import ServingMode
    from properties.engines.vllm_scheduler import make_harness
    from properties.tools.scheduler_level import run_one
    from reference.specs import MambaSpec

    layout = KVCacheLayout(
        groups=(
            KVCacheGroup(("l0",), FullAttentionSpec(block_size=22, num_kv_heads=1, head_size=16)),
            KVCacheGroup(
                ("l1",), MambaSpec(block_size=22, shapes=((4, 8),), page_size_padded=1408)
            ),
        ),
        num_blocks=20,
        max_model_len=233,
    )
    ops = (Arrive("r0", (1,) * 175, (3,) * 29), Arrive("r1", (2,) * 131, (5,) * 45))
    budgets = (306, 46, 233, 20)
    h = make_harness(layout, asynchronous=True)
    for op in ops:
        h.arrive(op)
    decisions = [h.step(b) for b in budgets]
    assert [(s.request_id, s.start, s.num_tokens) for s in decisions[3].scheduled] == [
        ("r0", 176, 1)
    ]
    assert decisions[3].preempted == ("r1",)
    trace = Trace(
        layout=layout,
        operations=ops + tuple(Step(b) for b in budgets),
        mode=ServingMode(async_scheduling=True),
    )
    assert run_one(trace) == 4


# -- KV connector ----------------------------------------------------------------------
# One full-attention group, block size 2, 8 usable blocks (ids 1..8). vLLM's free queue:
# a request's blocks are freed tail first, those without a hash (a partial block, the
# blocks of a load that was never cached) to the queue's head, hashed ones to its tail;
# a reset of the prefix cache drops the hashes and keeps the order.
CONNECTOR_LAYOUT = KVCacheLayout(
    groups=(KVCacheGroup(("l0",), FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8)),),
    num_blocks=9,
    max_model_len=16,
)


def _store_of_4(request_id: str, token_ids: tuple[int, ...], num_computed_tokens: int) -> int:
    """A store holding the first 4 tokens of every request."""
    return max(0, 4 - num_computed_tokens)


def test_connector_synchronous_load_by_hand() -> None:
    """``r1`` (7 prompt tokens, 1 output) with nothing on the device and 4 tokens in the
    store: vLLM admits it from position 4 with 3 new tokens; the connector is told the
    whole table: 2 blocks for the external tokens, then 2 for positions 4..6 (the free
    queue's first four, 1-4), and at the end (7 computed tokens, cdiv(7, 2) = 4 blocks)
    the same four."""
    from properties.core.decisions import ALLOCATED, ConnectorEvent
    from properties.engines.vllm_scheduler import make_harness

    h = make_harness(CONNECTOR_LAYOUT, lookup=_store_of_4)
    h.arrive(Arrive("r1", (1, 2, 3, 4, 5, 6, 7), (8,)))
    d = h.step(16)
    assert d.scheduled == (ScheduledDecision("r1", 4, 3),)
    assert d.connector_events == (ConnectorEvent(ALLOCATED, "r1", 4, False, ((1, 2, 3, 4),)),)
    assert h.told_at_end == {"r1": ((1, 2, 3, 4),)}
    assert h.view().num_free_blocks == 8


def test_connector_asynchronous_failed_load_by_hand() -> None:
    """``r0`` (7 prompt tokens, 2 outputs) loads 4 tokens asynchronously; its first load
    fails (``load_fails("r0", 0)``), a retry never:

    * step 1: the load starts into blocks (1, 2) (the external tokens only, nothing
      scheduled); the worker reports it failed: computed tokens 0, blocks still held;
    * step 2: vLLM completes the load: it frees (2, 1) uncached (to the queue's head),
      looks ``r0`` up anew and starts a second load into (2, 1);
    * step 3: the load completes (cached), ``r0`` runs from 4 with 3 tokens: blocks 3, 4;
    * step 4: the last output; ``r0`` ends with 8 computed tokens: 4 blocks told."""
    from properties.core.decisions import ALLOCATED, PROMOTE, ConnectorEvent
    from properties.core.modes import load_fails
    from properties.engines.vllm_scheduler import make_harness

    assert load_fails("r0", 0) and not load_fails("r0", 1)
    h = make_harness(CONNECTOR_LAYOUT, lookup=_store_of_4, async_loads=True, load_failures=True)
    h.arrive(Arrive("r0", (1, 2, 3, 4, 5, 6, 7), (8, 9)))
    d1 = h.step(16)
    assert d1.scheduled == ()
    assert d1.connector_events == (ConnectorEvent(ALLOCATED, "r0", 4, True, ((1, 2),)),)
    assert (h.view().block_ids, h.view().num_computed_tokens) == ({"r0": ((1, 2),)}, {"r0": 0})
    d2 = h.step(16)
    assert d2.connector_events == (
        ConnectorEvent(PROMOTE, "r0"),
        ConnectorEvent(ALLOCATED, "r0", 4, True, ((2, 1),)),
    )
    assert h.view().num_computed_tokens == {"r0": 4}
    d3 = h.step(16)
    assert d3.scheduled == (ScheduledDecision("r0", 4, 3),)
    assert d3.connector_events == (
        ConnectorEvent(PROMOTE, "r0"),
        ConnectorEvent(ALLOCATED, "r0", 0, False, ((2, 1, 3, 4),)),
    )
    h.step(16)
    assert h.told_at_end == {"r0": ((2, 1, 3, 4),)}
    assert h.view().num_free_blocks == 8


#: ``r0`` ends (its two full blocks go to the host tier), the device cache is reset, and
#: ``r1`` (the same 4 tokens first) loads them synchronously.
CONNECTOR_TRACE = Trace(
    layout=CONNECTOR_LAYOUT,
    operations=(
        Arrive("r0", (1, 2, 3, 4, 5), (6,)),
        Step(16),
        ResetPrefixCache(),
        Arrive("r1", (1, 2, 3, 4, 5, 6, 7), (8,)),
        Step(16),
    ),
    mode=ServingMode(external_hits=True),
)


def test_connector_trace_agrees_and_the_told_blocks_mutant_is_caught() -> None:
    """Unmutated, both steps agree. ``r0``'s blocks (1, 2, 3) are freed tail first: the
    partial 3 to the head, 2 and 1 to the tail; after the reset ``r1`` takes 3, 4 for
    its 4 external tokens and 5, 6 for positions 4..6. The mutant tells the connector
    the blocks ``allocate_slots`` returned, (5, 6)."""
    from properties.runner.decided import DecisionMismatch
    from properties.tools.scheduler_level import run_one

    assert run_one(CONNECTOR_TRACE) == 2
    with pytest.raises(DecisionMismatch) as caught:
        run_one(CONNECTOR_TRACE, "connector-told-new-blocks")
    assert (
        "step 2 (r1+3@4; r1 loads 4 tokens synchronously): r1's admission told the engine's "
        "connector (external tokens, asynchronous, block ids) (4, False, ((5, 6),)), the "
        "reference's (4, False, ((3, 4, 5, 6),))"
    ) in str(caught.value)


def test_connector_with_asynchronous_scheduling_defers_block_frees() -> None:
    """vLLM defers a consumer connector's frees under asynchronous scheduling (the
    reference models it: tests/properties/engines/test_vllm_scheduler_modes.py)."""
    from properties.engines.vllm_scheduler import make_harness

    h = make_harness(CONNECTOR_LAYOUT, lookup=_store_of_4, asynchronous=True)
    assert h.scheduler.defer_block_free


def test_end_with_a_connector_frees_skipped_blocks_first_and_the_mutant_is_caught() -> None:
    """A sliding window ``w = 2`` (bs 2): ``r0`` (6 prompt tokens, 1 output) computes its
    prompt in blocks (1, 2, 3) and ends. Its end first frees the blocks below the window
    on the processed basis: ``6 - 2 + 1 = 5`` skipped tokens -> blocks 0 and 1 become
    null, so the connector is told ``(0, 0, 3)``. The mutant skips that: it tells
    ``(1, 2, 3)``."""
    from properties.runner.decided import DecisionMismatch
    from properties.tools.scheduler_level import run_one
    from reference.specs import SlidingWindowSpec

    spec = SlidingWindowSpec(block_size=2, num_kv_heads=1, head_size=8, sliding_window=2)
    layout = KVCacheLayout(groups=(KVCacheGroup(("l0",), spec),), num_blocks=9, max_model_len=16)
    trace = Trace(
        layout=layout,
        operations=(
            Arrive("r0", (1, 2, 3, 4, 5, 6), (7,)),
            Step(16),
            Arrive("r1", (9, 9, 9, 9), (1,)),
            Step(16),
        ),
        mode=ServingMode(external_hits=True),
    )
    assert run_one(trace) == 2
    with pytest.raises(DecisionMismatch) as caught:
        run_one(trace, "connector-end-keeps-skipped-blocks")
    assert str(caught.value) == (
        "step 1: at r0's end the engine told its connector block ids ((1, 2, 3),), the "
        "reference's blocks covering its 6 computed tokens are ((0, 0, 3),)"
    )
