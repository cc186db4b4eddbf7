"""Serving modes (properties/core/modes.py): asynchronous scheduling and the admission
gate, driven by the scheduler on hand-written traces; expected values derived by hand."""

from __future__ import annotations

import pytest

from properties.checks.registry import PropertyViolation
from properties.core.modes import ServingMode, load_fails
from properties.core.trace import Abort, Arrive, ResetPrefixCache, Step
from properties.engines.under_test import resolve_engine
from properties.mutants.reference_mutants import (
    make_admission_cap_ignored,
    make_admission_gate_ignored,
    make_async_optimistic_free,
    make_delay_cache_ignored,
    make_external_counted_twice,
    make_external_window_not_skipped,
    make_local_hit_dropped_on_external,
    make_mamba_leftmost,
)
from properties.runner.config import CheckConfig
from properties.runner.run import TraceRun
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec

ASYNC = ServingMode(async_scheduling=True)


def _layout(spec, num_blocks: int = 32, **kw) -> KVCacheLayout:
    return KVCacheLayout(
        (KVCacheGroup(("l0",), spec),), num_blocks=num_blocks, max_model_len=64, **kw
    )


def _run(layout, mode=ASYNC, factory=None, level="exact") -> TraceRun:
    return TraceRun(CheckConfig(level=level), layout, resolve_engine(factory or "reference"), mode)


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


EXTERNAL = ServingMode(external_hits=True)


def _offloaded_then_reloaded(config: CheckConfig, factory=None) -> TraceRun:
    """r0 (12-token prompt, one output) finishes: its 12 computed tokens go to the host
    tier (bs 4: three blocks); the device cache is reset; r1 shares r0's 12 tokens and
    adds 4: device hit 0, the tier holds 12 -> 12 external tokens, 4 computed."""
    engine = resolve_engine(factory or "reference")
    run = TraceRun(config, _layout(FullAttentionSpec(block_size=4)), engine, EXTERNAL)
    run.apply(Arrive("r0", tuple(range(12)), (1,)))
    run.apply(Step(64))
    run.apply(ResetPrefixCache())
    run.apply(Arrive("r1", tuple(range(12)) + (50, 51, 52, 53), (2, 3)))
    return run


def test_external_hits_come_from_the_host_tier() -> None:
    run = _offloaded_then_reloaded(CheckConfig(level="exact"))
    assert run.scheduler.host_tier is not None and len(run.scheduler.host_tier) == 3
    rec = run.apply(Step(64))
    [item] = rec.scheduled
    assert (item.hit_tokens, item.external_tokens, item.start, item.num_tokens) == (0, 12, 12, 4)
    # 4 blocks: 3 loaded by the connector, then 1 for the computed tokens (the only
    # one allocate_slots returns as new)
    table = run.lockstep.engine.get_block_ids("r1")[0]
    assert len(table) == 4 and len(set(table)) == 4
    assert item.new_block_ids == ((table[3],),)


def test_loaded_content_is_read_back_by_the_attention_check() -> None:
    run = _offloaded_then_reloaded(CheckConfig(level="exact", attention=True))
    run.apply(Step(64))  # the loaded 12 positions are read by tokens 12..15: no mismatch
    # the same trace with a corrupted host copy of position 5: the check fails
    bad = _offloaded_then_reloaded(CheckConfig(level="exact", attention=True))
    host = bad.attention._host
    key = next(k for k in host if k[0] == 0 and len(k[3]) == 6)
    k, v = host[key]
    host[key] = (k + 1.0, v)
    with pytest.raises(PropertyViolation, match="attention"):
        bad.apply(Step(64))


def test_external_counted_twice_is_caught_exactly() -> None:
    run = _offloaded_then_reloaded(CheckConfig(level="exact"), factory=make_external_counted_twice)
    with pytest.raises(PropertyViolation, match="exact_match"):
        run.apply(Step(64))


ASYNC_LOADS = ServingMode(external_hits=True, async_loads=True)


def _loading(config: CheckConfig, factory=None) -> TraceRun:
    """As :func:`_offloaded_then_reloaded`, with an asynchronous load."""
    engine = resolve_engine(factory or "reference")
    run = TraceRun(config, _layout(FullAttentionSpec(block_size=4)), engine, ASYNC_LOADS)
    run.apply(Arrive("r0", tuple(range(12)), (1,)))
    run.apply(Step(64))
    run.apply(ResetPrefixCache())
    run.apply(Arrive("r1", tuple(range(12)) + (50, 51, 52, 53), (2, 3)))
    return run


def test_blocks_being_loaded_are_not_hit_by_other_requests() -> None:
    run = _loading(CheckConfig(level="exact"))
    run.apply(Arrive("r2", tuple(range(12)) + (60, 61), (4,)))
    rec = run.apply(Step(64))
    # r2 finds no device hit (r1's blocks are not cached while loading) but loads the
    # same 12 tokens from the host tier itself
    assert rec.scheduled == [] and run.scheduler.connector.loading == ["r1", "r2"]
    assert run.scheduler.connector.loaded["r2"] == (0, 12)


def test_async_load_waits_a_step_then_runs_from_the_loaded_prefix() -> None:
    run = _loading(CheckConfig(level="exact", attention=True))
    rec = run.apply(Step(64))  # the load starts: 3 blocks, nothing scheduled
    assert rec.scheduled == [] and run.scheduler.connector.loading == ["r1"]
    assert len(run.lockstep.engine.get_block_ids("r1")[0]) == 3
    rec = run.apply(Step(64))  # the load completed: r1 computes 12..15, reading it
    [item] = rec.scheduled
    assert (item.hit_tokens, item.external_tokens, item.start, item.num_tokens) == (0, 12, 12, 4)
    assert run.scheduler.connector.loading == []


def test_abort_during_an_async_load_frees_once_it_completes() -> None:
    run = _loading(CheckConfig(level="exact"))
    run.apply(Step(64))
    run.apply(Abort("r1"))  # the load is in flight: the blocks stay
    assert len(run.lockstep.engine.get_block_ids("r1")[0]) == 3
    run.apply(Step(64))
    assert "r1" not in run.scheduler.requests
    assert run.lockstep.num_free_blocks() == 31


def test_delay_cache_ignored_is_caught_exactly() -> None:
    # r2 shares the prefix r1 is loading: its lookup in the same step must not find
    # r1's blocks (their content has not arrived); the mutant has cached them
    run = _loading(CheckConfig(level="exact"), factory=make_delay_cache_ignored)
    run.apply(Arrive("r2", tuple(range(12)) + (60, 61), (4,)))
    with pytest.raises(PropertyViolation, match="exact_match"):
        run.apply(Step(64))


# -- the host tier fed by detach and release; combined device + tier hits ----------------

WINDOWED = KVCacheLayout(
    (
        KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),
        KVCacheGroup(("l1",), SlidingWindowSpec(block_size=4, sliding_window=4)),
    ),
    num_blocks=40,
    max_model_len=64,
)


def test_window_blocks_detach_to_the_tier_while_the_request_runs() -> None:
    """Full + window w 4 (bs 4), a 16-token prompt computed in chunks of 8: after the
    first chunk (8 processed, skip 8 - 4 + 1 = 5) window block 0 is detached; after the
    second (16 processed, skip 13) blocks 1 and 2 as well. Nothing of the full group
    enters before the request is freed."""
    run = TraceRun(CheckConfig(level="exact"), WINDOWED, resolve_engine("reference"), EXTERNAL)
    tier = run.scheduler.host_tier
    prompt = tuple(range(16))
    run.apply(Arrive("r0", prompt, (1, 2)))
    run.apply(Step(8))
    assert [tier.holds(1, None, None, prompt, k) for k in range(4)] == [1, 0, 0, 0]
    assert not any(tier.holds(0, None, None, prompt, k) for k in range(4))
    run.apply(Step(8))
    assert [tier.holds(1, None, None, prompt, k) for k in range(4)] == [1, 1, 1, 0]
    assert len(tier) == 3
    run.apply(Step(8))  # decodes position 16, then finishes at the next step
    run.apply(Step(8))
    assert not run.scheduler.requests  # freed: every full computed block is in the tier
    seen = prompt + (1,)
    assert all(tier.holds(0, None, None, seen, k) for k in range(4))
    assert tier.holds(1, None, None, seen, 3)


def _combined(factory=None, attention: bool = False) -> TraceRun:
    """One full group bs 4: r0 (12 tokens) is offloaded when it finishes; the device cache
    is reset; r1 puts the first block back on the device; r2 (r0's 12 tokens and 4 new)
    then hits 4 tokens on the device and loads 8 from the tier."""
    layout = _layout(FullAttentionSpec(block_size=4))
    config = CheckConfig(level="universal", attention=attention)
    run = TraceRun(config, layout, resolve_engine(factory or "reference"), EXTERNAL)
    prompt = tuple(range(12))
    run.apply(Arrive("r0", prompt, (1,)))
    run.apply(Step(64))
    run.apply(ResetPrefixCache())
    run.apply(Arrive("r1", prompt[:4] + (90, 91, 92), (1,)))
    run.apply(Step(64))
    run.apply(Arrive("r2", prompt + (50, 51, 52, 53), (2, 3)))
    return run


def test_a_hit_combines_device_blocks_and_tier_blocks() -> None:
    run = _combined(attention=True)
    [item] = run.apply(Step(64)).scheduled
    assert (item.hit_tokens, item.external_tokens, item.start) == (4, 8, 12)
    run.apply(Step(64))  # the loaded and the device positions are read back: no mismatch


def test_local_hit_dropped_on_external_is_caught() -> None:
    run = _combined(make_local_hit_dropped_on_external)
    with pytest.raises(PropertyViolation, match="window_liveness"):
        run.apply(Step(64))


def test_external_window_not_skipped_is_caught_by_the_estimate() -> None:
    """Full + window w 4: r1 loads 16 tokens; the window needs only block 3 (skip 13),
    the mutant allocates blocks 0..3 of the window group as well: 3 more than it
    estimated (7: 4 + 1 blocks of the full group, 1 + 1 of the window group)."""
    for factory, fails in ((None, False), (make_external_window_not_skipped, True)):
        engine = resolve_engine(factory or "reference")
        run = TraceRun(CheckConfig(level="universal"), WINDOWED, engine, EXTERNAL)
        prompt = tuple(range(16))
        run.apply(Arrive("r0", prompt, (1,)))
        run.apply(Step(64))
        run.apply(ResetPrefixCache())
        run.apply(Arrive("r1", prompt + (50, 51, 52, 53), (2,)))
        if fails:
            with pytest.raises(PropertyViolation, match="estimated 7 blocks but took 10"):
                run.apply(Step(64))
        else:
            [item] = run.apply(Step(64)).scheduled
            assert (item.hit_tokens, item.external_tokens) == (0, 16)


def test_x1_refuses_a_load_of_a_block_the_tier_does_not_hold() -> None:
    """The same load, with the window group's block 3 evicted from the tier before r1
    arrives: the tier then serves only 12 tokens (block 2 held: skip(12) = 9)."""
    run = TraceRun(CheckConfig(level="universal"), WINDOWED, resolve_engine("reference"), EXTERNAL)
    prompt = tuple(range(16))
    run.apply(Arrive("r0", prompt, (1,)))
    run.apply(Step(64))
    run.apply(ResetPrefixCache())
    tier = run.scheduler.host_tier
    del tier._keys[tier.key(1, None, None, prompt, 3)]
    run.apply(Arrive("r1", prompt + (50, 51, 52, 53), (2,)))
    [item] = run.apply(Step(64)).scheduled
    assert (item.hit_tokens, item.external_tokens) == (0, 12)


FAILING_LOADS = ServingMode(external_hits=True, async_loads=True, load_failures=True)


def _failing_load(factory=None) -> TraceRun:
    """r0 (12 tokens) is offloaded when it finishes, the device cache is reset; r2 (r0's
    12 tokens and 4 new; ``load_fails("r2", 0)``: its first load fails) loads 12
    external tokens asynchronously."""
    assert load_fails("r2", 0) and not load_fails("r2", 1)
    layout = _layout(FullAttentionSpec(block_size=4))
    engine = resolve_engine(factory or "reference")
    run = TraceRun(CheckConfig(level="exact", attention=True), layout, engine, FAILING_LOADS)
    run.apply(Arrive("r0", tuple(range(12)), (1,)))
    run.apply(Step(64))
    run.apply(ResetPrefixCache())
    run.apply(Arrive("r2", tuple(range(12)) + (50, 51, 52, 53), (2,)))
    assert not run.apply(Step(64)).scheduled  # admitted as loading: 3 blocks
    return run


def test_a_failed_load_frees_its_blocks_and_the_retry_loads_again() -> None:
    run = _failing_load()
    free_while_loading = run.lockstep.num_free_blocks()
    rec = run.apply(Step(64))  # the load fails: freed, looked up again, loading again
    assert not rec.scheduled and run.scheduler.connector.loading == ["r2"]
    state = run.scheduler.requests["r2"]
    assert run.scheduler.connector.num_load_attempts["r2"] == 1
    assert state.num_computed_tokens == 12
    assert run.lockstep.num_free_blocks() == free_while_loading  # the same 3 blocks again
    [item] = run.apply(Step(64)).scheduled  # the retry completes: 12 loaded, 4 computed
    assert (item.hit_tokens, item.external_tokens, item.start, item.num_tokens) == (0, 12, 12, 4)


def test_delay_cache_ignored_is_caught_after_a_failed_load() -> None:
    """The mutant cached the loading blocks at allocation: after the failure they stay
    cached with content that never arrived, the retry hits them on the device and reads
    them."""
    run = _failing_load(make_delay_cache_ignored)
    with pytest.raises(PropertyViolation, match="exact_match|attention"):
        run.apply(Step(64))
        run.apply(Step(64))


def test_admission_cap_ignored_is_caught_exactly() -> None:
    """SWA w 4, bs 2, IFT 4 (cap cdiv(min(3 + 4, 64), 2) + 1 = 5 blocks), 7 blocks (6
    free), the gate on: a 20-token request needs 10 blocks uncapped, 5 capped, so the
    gate admits it and its first chunk of 4 tokens takes 2 blocks; the mutant (no cap)
    refuses it."""
    layout = _layout(SlidingWindowSpec(block_size=2, sliding_window=4), 7, max_in_flight_tokens=4)
    gate = ServingMode(admission_gate=True)
    ok = _run(layout, gate)
    ok.apply(Arrive("r0", tuple(range(20)), ()))
    assert [s.num_tokens for s in ok.apply(Step(4)).scheduled] == [4]
    bad = _run(layout, gate, factory=make_admission_cap_ignored)
    bad.apply(Arrive("r0", tuple(range(20)), ()))
    with pytest.raises(PropertyViolation, match="exact_match"):
        bad.apply(Step(4))


def test_mamba_leftmost_is_caught_by_hit_maximality() -> None:
    """Full + Mamba (bs 4): r0's 13-token prompt is computed 4 tokens a step, so states are
    cached at 4, 8 and 12; r1 (the same 13 tokens and 3 more) hits 12 tokens (the
    rightmost state at most 15). The mutant returns the leftmost state: a hit of 4 while
    12 is servable."""
    layout = KVCacheLayout(
        (
            KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),
            KVCacheGroup(("l1",), MambaSpec(block_size=4)),
        ),
        num_blocks=40,
        max_model_len=64,
    )
    prompt = tuple(range(13))
    for factory in (None, make_mamba_leftmost):
        run = TraceRun(
            CheckConfig(level="universal"), layout, resolve_engine(factory or "reference")
        )
        run.apply(Arrive("r0", prompt, (1,)))
        for _ in range(5):
            run.apply(Step(4))
        run.apply(Arrive("r1", prompt + (1, 7, 7), (2,)))
        if factory is None:
            [item] = run.apply(Step(64)).scheduled
            assert (item.hit_tokens, item.num_tokens) == (12, 4)
        else:
            with pytest.raises(PropertyViolation, match="hit 4 tokens, but every group can"):
                run.apply(Step(64))


def test_a_mamba_state_replaced_in_the_step_serves_no_hit() -> None:
    """Full + Mamba (bs 1), 8 blocks: r0 (prompt ``[5]``) decodes, so its state of ``[5]``
    (block 2) is freed, still keyed, at the queue's tail. The next step pops it for r1's
    Mamba state (prompt ``[3]``), evicting ``[5]``; r2 (``[5, 1]``) then finds ``[5]``
    in the full group only, so its hit is 0. The shadow learns r1's state only when the
    step runs, so block 2 still shows the state of ``[5]`` and is cached over 1 token:
    ``hit_maximality`` once took it as a servable hit of 1 (found by a nightly fuzz,
    seed 20261128, on the reference, vLLM and the optimized engine alike)."""
    layout = KVCacheLayout(
        (
            KVCacheGroup(("l0",), FullAttentionSpec(block_size=1)),
            KVCacheGroup(("l1",), MambaSpec(block_size=1)),
        ),
        num_blocks=8,
        max_model_len=16,
    )
    for engine in ("reference", "optimized"):
        run = TraceRun(CheckConfig(level="exact"), layout, resolve_engine(engine))
        run.apply(Arrive("r0", (5,), tuple(range(10))))
        run.apply(Step(8))
        run.apply(Step(8))
        run.apply(Arrive("r1", (3,), ()))
        run.apply(Arrive("r2", (5, 1), ()))
        record = run.apply(Step(8))  # no PropertyViolation
        assert [(s.request_id, s.new_block_ids) for s in record.scheduled] == [
            ("r0", ((5,), (6,))),
            ("r1", ((7,), (2,))),
        ]


def test_admission_gate_ignored_is_caught_exactly() -> None:
    """Full bs 2, 7 blocks (6 free), the gate on: a 20-token request needs 10 blocks
    whole, so the reference refuses it; the mutant admits its first chunk (2 blocks)."""
    layout = _layout(FullAttentionSpec(block_size=2), num_blocks=7)
    run = _run(layout, ServingMode(admission_gate=True), factory=make_admission_gate_ignored)
    run.apply(Arrive("r0", tuple(range(20)), ()))
    with pytest.raises(PropertyViolation, match="exact_match"):
        run.apply(Step(4))
