"""The scheduler level's serving modes beyond docs/scheduler-level.md's first eight: a KV
connector under asynchronous scheduling (vLLM's deferred block frees).

Run with ``.engines/vllm/bin/python -m pytest tests/properties/engines/
test_vllm_scheduler_modes.py`` (``conftest.py`` skips the module without vLLM). Every
table is derived by hand in its docstring; the harness and the reference on vLLM's
decisions are compared after every operation as well.

Layout: one full-attention group, block size 2, ``max_model_len`` 16, ``NB`` blocks
(block 0 is the null block: ``NB - 1`` usable, free queue ``1..NB-1`` at first).
"""

from __future__ import annotations

import pytest

from properties.core.modes import ServingMode
from properties.core.scheduler_options import (
    DEFAULT_OPTIONS,
    SchedulerOptions,
    connector_saves,
    invalid_load_block,
)
from properties.core.trace import Abort, Arrive, Preempt, ResetPrefixCache, Step
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

pytestmark = pytest.mark.engine

ASYNC_CONNECTOR = ServingMode(async_scheduling=True, external_hits=True)


def _layout(num_blocks: int) -> KVCacheLayout:
    spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8)
    return KVCacheLayout(
        groups=(KVCacheGroup(("l0",), spec),), num_blocks=num_blocks, max_model_len=16
    )


def _replay(
    layout: KVCacheLayout,
    mode: ServingMode,
    ops: tuple,
    mutant: str | None = None,
    options: SchedulerOptions = DEFAULT_OPTIONS,
) -> list[tuple]:
    """``run_decided`` (vLLM's harness and the reference on its decisions, compared after
    every operation); per operation: (operation, vLLM's free blocks, its free queue, live
    block tables), the free queue checked equal to the reference's."""
    from properties.core.trace import Trace
    from properties.runner.decided import run_decided
    from properties.tools.scheduler_level import _harness_factory

    rows = []

    def after(h, ref, op, index) -> None:
        queue = h.scheduler.kv_cache_manager.block_pool.free_block_queue
        ids, block = [], queue.fake_free_list_head.next_free_block
        while block is not None and block is not queue.fake_free_list_tail:
            ids.append(block.block_id)
            block = block.next_free_block
        assert ids == ref.engine.free_queue(), f"free queues differ after {op}"
        view = h.view()
        rows.append((type(op).__name__, view.num_free_blocks, ids, view.block_ids))

    trace = Trace(layout=layout, operations=ops, mode=mode)
    run_decided(trace, _harness_factory(mutant), options, after=after)
    return rows


def test_an_abort_with_tokens_in_flight_frees_when_the_step_is_processed() -> None:
    """NB 8 (7 usable), asynchronous scheduling, a KV connector (vLLM defers block frees
    of a consumer connector). ``r0`` (prompt 1-4, 4 outputs): step 1 plans its prefill
    (blocks 1, 2; in flight); step 2 plans position 4 (block 3) and processes step 1.
    ``Abort r0`` with position 4 in flight: the request ends at once (its connector is
    told blocks (1, 2, 3), the ones covering its 5 computed tokens) but its blocks stay
    out of the pool: 4 free. ``r1`` (prompt of 10 other tokens) arrives; step 3 cannot
    admit it (5 blocks, 4 free), then processes step 2: r0's blocks come back tail
    first: 3 (uncached) to the front, 2 and 1 (cached) to the back: queue
    (3, 4, 5, 6, 7, 2, 1), 7 free. Step 4 admits ``r1`` into 3, 4, 5, 6, 7."""
    ops = (
        Arrive("r0", (1, 2, 3, 4), (5, 6, 7, 8)),
        Step(16),
        Step(16),
        Abort("r0"),
        Arrive("r1", (7, 7, 6, 6, 5, 5, 4, 4, 3, 3), (1,)),
        Step(16),
        Step(16),
    )
    rows = _replay(_layout(8), ASYNC_CONNECTOR, ops)
    assert rows[1] == ("Step", 5, [3, 4, 5, 6, 7], {"r0": ((1, 2),)})
    assert rows[2] == ("Step", 4, [4, 5, 6, 7], {"r0": ((1, 2, 3),)})
    assert rows[3] == ("Abort", 4, [4, 5, 6, 7], {})
    assert rows[5] == ("Step", 7, [3, 4, 5, 6, 7, 2, 1], {"r1": ((),)})
    assert rows[6] == ("Step", 2, [2, 1], {"r1": ((3, 4, 5, 6, 7),)})


ABORT_IN_FLIGHT = (
    Arrive("r0", (1, 2, 3, 4), (5, 6, 7, 8)),
    Step(16),
    Step(16),
    Abort("r0"),
    Arrive("r1", (7, 7, 6, 6, 5, 5, 4, 4, 3, 3), (1,)),
    Step(16),
    Step(16),
)


def test_the_deferred_free_ignored_mutant_is_caught() -> None:
    """The mutant frees r0's blocks at the abort: 7 free on vLLM, 4 on the reference."""
    from properties.runner.decided import DecisionMismatch

    with pytest.raises(DecisionMismatch, match="free blocks differ: engine 7, reference 4"):
        _replay(_layout(8), ASYNC_CONNECTOR, ABORT_IN_FLIGHT, "deferred-free-ignored")


def test_without_a_connector_the_abort_frees_at_once() -> None:
    """The same trace without a connector: the abort frees r0's blocks at once (3 to the
    front, 2 and 1 to the back: 7 free), and step 3 admits ``r1``."""
    ops = (
        Arrive("r0", (1, 2, 3, 4), (5, 6, 7, 8)),
        Step(16),
        Step(16),
        Abort("r0"),
        Arrive("r1", (7, 7, 6, 6, 5, 5, 4, 4, 3, 3), (1,)),
        Step(16),
    )
    rows = _replay(_layout(8), ServingMode(async_scheduling=True), ops)
    assert rows[3] == ("Abort", 7, [3, 4, 5, 6, 7, 2, 1], {})
    assert rows[5] == ("Step", 2, [2, 1], {"r1": ((3, 4, 5, 6, 7),)})


def test_a_preempt_with_tokens_in_flight_is_deferred_too() -> None:
    """NB 8, asynchronous with a connector. Steps 1-2 as above (``r0`` in 1, 2, 3;
    position 4 in flight). ``Preempt r0``: its table is empty at once, the 3 blocks
    stay out of the pool (4 free); step 3 processes step 2 (r0's stale token is
    delivered, nothing cached): 3, 2, 1 come back (7 free) after the step was
    scheduled, so r0 (waiting behind its stale token until then) is not re-admitted
    in it."""
    ops = (
        Arrive("r0", (1, 2, 3, 4), (5, 6, 7, 8)),
        Step(16),
        Step(16),
        Preempt("r0"),
        Step(16),
    )
    rows = _replay(_layout(8), ASYNC_CONNECTOR, ops)
    assert rows[3] == ("Preempt", 4, [4, 5, 6, 7], {"r0": ((),)})
    assert rows[4] == ("Step", 7, [3, 4, 5, 6, 7, 2, 1], {"r0": ((),)})


# -- a connector that saves: delayed frees ----------------------------------------------
SAVES = SchedulerOptions(delayed_frees=True)
SAVING_TRACE = (
    Arrive("r0", (1, 2, 3, 4), (9,)),
    Arrive("r3", (5, 6, 7, 8), (9,)),
    Step(16),
    Step(16),
)


def test_the_saved_requests_the_tables_assume() -> None:
    assert (connector_saves("r0"), connector_saves("r3")) == (True, False)


def test_a_saved_request_keeps_its_blocks_until_the_save_is_reported() -> None:
    """NB 8, synchronous with a connector that saves ``r0`` and not ``r3``. Step 1:
    ``r0`` (blocks 1, 2) and ``r3`` (3, 4) compute their prompts, sample their one
    output and end. ``r3``'s blocks go back at once, tail first (4, 3: cached, to the
    back): queue (5, 6, 7, 4, 3), 5 free; ``r0``'s stay while its connector saves them.
    Step 2 schedules nothing; its output reports the save done: 2, 1 go back: queue
    (5, 6, 7, 4, 3, 2, 1), 7 free."""
    rows = _replay(_layout(8), ServingMode(external_hits=True), SAVING_TRACE, options=SAVES)
    assert rows[2] == ("Step", 5, [5, 6, 7, 4, 3], {})
    assert rows[3] == ("Step", 7, [5, 6, 7, 4, 3, 2, 1], {})


def test_the_connector_delay_ignored_mutant_is_caught() -> None:
    from properties.runner.decided import DecisionMismatch

    with pytest.raises(DecisionMismatch, match="free blocks differ: engine 7, reference 5"):
        _replay(
            _layout(8),
            ServingMode(external_hits=True),
            SAVING_TRACE,
            "connector-delay-ignored",
            SAVES,
        )


# -- block-level load failures ------------------------------------------------------------
# r0 (prompt 1-8, one output) computes and ends: its 4 blocks go to the connector's store
# (the host tier); the prefix cache is reset; r1 (the same 8 tokens, then 10, 11) finds no
# device hit and loads 8 tokens synchronously, its block 2 of the load invalid.
RELOAD = (
    Arrive("r0", (1, 2, 3, 4, 5, 6, 7, 8), (9,)),
    Step(16),
    ResetPrefixCache(),
    Arrive("r1", (1, 2, 3, 4, 5, 6, 7, 8, 10, 11), (12, 13)),
    Step(16),
    Step(16),
)


def test_the_invalid_block_the_tables_assume() -> None:
    assert invalid_load_block("r1", 0) == 2
    assert invalid_load_block("r1", 1) is None


def test_an_invalid_loaded_block_sets_the_request_back_to_its_start() -> None:
    """NB 8, synchronous, ``invalid_blocks``, ``recompute``. Step 1: ``r0`` in blocks
    1-4, ends; they go back tail first (all cached): queue (5, 6, 7, 4, 3, 2, 1). Step 2:
    ``r1`` loads 8 tokens and computes 2 (positions 8, 9): blocks (5, 6, 7, 4, 3). The
    worker reports block 7 (index 2 of the load) invalid: ``r1`` falls back to 2 * 2 = 4
    computed tokens and skips its output. Step 3 recomputes positions 4-9 in the blocks
    it holds."""
    options = SchedulerOptions(invalid_blocks=True)
    rows = _replay(_layout(8), ServingMode(external_hits=True), RELOAD, options=options)
    assert rows[4] == ("Step", 2, [2, 1], {"r1": ((5, 6, 7, 4, 3),)})


def test_under_the_fail_policy_the_request_ends_and_the_blocks_lose_their_hashes() -> None:
    """The same trace under ``fail``: in step 2 blocks 7, 4, 3 (the invalid one and those
    after it) lose their hashes and ``r1`` ends with an error: its blocks go back tail
    first, 3, 4, 7 (uncached now) to the front, 6, 5 to the back: queue
    (3, 4, 7, 2, 1, 6, 5), 7 free."""
    options = SchedulerOptions(invalid_blocks=True, fail_on_load_errors=True)
    rows = _replay(_layout(8), ServingMode(external_hits=True), RELOAD, options=options)
    assert rows[4] == ("Step", 7, [3, 4, 7, 2, 1, 6, 5], {})


def test_the_invalid_block_off_by_one_mutant_is_caught() -> None:
    from properties.runner.decided import DecisionMismatch

    options = SchedulerOptions(invalid_blocks=True)
    with pytest.raises(
        DecisionMismatch, match="r1's computed tokens differ: engine 6, reference 4"
    ):
        _replay(
            _layout(8), ServingMode(external_hits=True), RELOAD, "invalid-block-off-by-one", options
        )


# -- a reset of the prefix cache that preempts the running requests -----------------------
RESET_TRACE = (
    Arrive("r0", (1, 2, 3, 4), (5, 6, 7, 8)),
    Step(16),
    Step(16),
    ResetPrefixCache(),
    Step(16),
)


def test_a_reset_preempting_running_requests_drops_their_in_flight_output() -> None:
    """NB 8, asynchronous, ``reset_running``. Step 1 plans ``r0``'s prefill (blocks 1,
    2); step 2 plans position 4 (block 3) and processes step 1 (token 5 appended). The
    reset preempts ``r0`` with position 4 in flight, its output to be dropped: its
    blocks go back (3 not full to the front, then 2, 1), the hashes are forgotten:
    7 free. Step 3 admits ``r0`` again at once (a dropped stale output does not hold it
    back): 5 tokens (prompt and token 5) in 3, 4, 5; then step 2's output is processed
    and dropped (token 6 is not appended)."""
    rows = _replay(
        _layout(8),
        ServingMode(async_scheduling=True),
        RESET_TRACE,
        options=SchedulerOptions(reset_running=True),
    )
    assert rows[3] == ("ResetPrefixCache", 7, [3, 4, 5, 6, 7, 2, 1], {"r0": ((),)})
    assert rows[4] == ("Step", 4, [6, 7, 2, 1], {"r0": ((3, 4, 5),)})


def test_a_plain_reset_cannot_run_while_a_request_holds_blocks() -> None:
    """The same trace without ``reset_running``: the reset fails (``r0`` holds blocks)
    and step 3 plans position 5."""
    rows = _replay(_layout(8), ServingMode(async_scheduling=True), RESET_TRACE)
    assert rows[4][3] == {"r0": ((1, 2, 3),)}


def test_the_reset_delivers_stale_output_mutant_is_caught() -> None:
    """The mutant holds ``r0`` back in step 3 (its stale output not drained): the
    reference, which may admit it, has its 5 tokens' blocks; the engine none."""
    from properties.runner.decided import DecisionMismatch

    with pytest.raises(DecisionMismatch):
        _replay(
            _layout(8),
            ServingMode(async_scheduling=True),
            RESET_TRACE + (Step(16), Step(16)),
            "reset-delivers-stale-output",
            SchedulerOptions(reset_running=True),
        )
