"""Asynchronous scheduling, drafts, the admission gate and external computed tokens
(spec sections 1.2, 4.1, 5, 6.3). Expected values are derived by hand in the comments.
"""

from __future__ import annotations

import pytest

from reference.errors import InvalidRequestError
from reference.kv_cache_manager import KVCacheManager
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


def _manager(
    *specs: KVCacheSpec,
    num_blocks: int = 32,
    max_model_len: int = 64,
    max_in_flight_tokens: int | None = None,
) -> KVCacheManager:
    groups = tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))
    return KVCacheManager(
        KVCacheLayout(
            groups,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            max_in_flight_tokens=max_in_flight_tokens,
        )
    )


def _ids(blocks) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(b.block_id for b in group) for group in blocks)


SWA4 = SlidingWindowSpec(block_size=2, sliding_window=4)


# -- asynchronous scheduling -------------------------------------------------------------


def test_async_frees_on_the_processed_basis() -> None:
    m = _manager(SWA4)
    req = m.make_request("r", list(range(10)))
    # step 1 plans 8 tokens: 4 blocks [1..4]; 31 -> 27 free
    assert _ids(m.allocate_slots(req, 8)) == ((1, 2, 3, 4),)
    req.num_computed_tokens, req.num_in_flight_tokens = 8, 8
    # step 2 is planned before step 1's output: processed 8 - 8 = 0 -> nothing freed
    # (synchronously, skipped(8) = 8 - 4 + 1 = 5 would free blocks 0, 1); slots 10 ->
    # one new block 5
    assert _ids(m.allocate_slots(req, 2)) == ((5,),)
    assert m.get_block_ids("r") == ((1, 2, 3, 4, 5),)
    assert m.get_num_free_blocks() == 26
    req.num_computed_tokens, req.num_in_flight_tokens = 10, 10
    req.num_output_placeholders = 1
    # step 1's output is processed: 8 tokens leave the flight -> 2 in flight
    req.num_in_flight_tokens = 2
    # step 3 schedules the placeholder's position 10: processed 10 - 2 = 8 -> skipped 5
    # -> blocks 0, 1 freed (descending: ids 2, 1; hashed -> back); slots 11 -> 6 blocks
    assert _ids(m.allocate_slots(req, 1)) == ((6,),)
    assert m.get_block_ids("r") == ((0, 0, 3, 4, 5, 6),)
    assert m.get_num_free_blocks() == 27
    assert m.block_pool.free_block_queue.block_ids()[-2:] == [2, 1]


def test_pending_tokens_bound_the_step() -> None:
    m = _manager(SWA4)
    req = m.make_request("r", [1, 2, 3, 4])
    req.num_computed_tokens = 4
    # nothing pending: a 5th token does not exist
    with pytest.raises(InvalidRequestError, match="exceeds the request's 4 tokens"):
        m.allocate_slots(req, 1)
    # one placeholder (async) and two drafts: up to 4 + 1 + 2 = 7 tokens
    req.num_output_placeholders = 1
    req.spec_token_ids = [9, 9]
    assert m.allocate_slots(req, 3) is not None
    with pytest.raises(InvalidRequestError, match=r"\+ 3 in flight or draft"):
        m.allocate_slots(req, 4)


# -- drafts ---------------------------------------------------------------------------------


def test_rejected_drafts_roll_back_and_are_never_cached() -> None:
    m = _manager(FullAttentionSpec(block_size=2))
    req = m.make_request("r", [10, 11, 12, 13])
    assert _ids(m.allocate_slots(req, 4)) == ((1, 2),)
    req.num_computed_tokens = 4
    req.append_output_token_ids([14])
    # decode with 2 drafts: positions 4..6, 7 slots -> blocks 3, 4; cached up to
    # min(4 + 3, num_tokens 5) = 5 -> still only blocks 0, 1 (block 2 is not full)
    req.spec_token_ids = [15, 16]
    assert _ids(m.allocate_slots(req, 3)) == ((3, 4),)
    cached = {b.block_id for e in m.block_pool.cached.values() for b in e.values()}
    assert cached == {1, 2}
    # one draft accepted, one rejected: computed 7 - 1 = 6; accepted 15 + bonus 17
    req.num_computed_tokens = 6
    req.spec_token_ids = []
    req.append_output_token_ids([15, 17])
    # the scheduler commits the processed tokens: block 2 (tokens 4, 5) is cached
    m.cache_blocks(req, req.num_computed_tokens - req.num_in_flight_tokens)
    cached = {b.block_id for e in m.block_pool.cached.values() for b in e.values()}
    assert cached == {1, 2, 3}
    # the next step needs no block: slots 7 -> 4 blocks held
    assert _ids(m.allocate_slots(req, 1)) == ((),)


# -- admission gate -------------------------------------------------------------------------


def test_admission_cap_values_from_the_spec() -> None:
    # spec 1.2 check values: w 1024, bs 16, len 16384 -> IFT 1024: 129, 2048: 193
    swa = SlidingWindowSpec(block_size=16, sliding_window=1024)
    assert swa.max_admission_blocks(1024, 16384) == 129
    assert swa.max_admission_blocks(2048, 16384) == 193


def test_full_sequence_gate_caps_sliding_window_groups() -> None:
    # SWA w 4, bs 2, IFT 4: cap cdiv(min(3 + 4, 64), 2) + 1 = 5. A 20-token request
    # needs 10 blocks uncapped, 5 capped; 6 free -> admitted, its first chunk of 4
    # tokens takes 2 blocks.
    m = _manager(SWA4, num_blocks=7, max_in_flight_tokens=4)
    req = m.make_request("r", list(range(20)))
    assert _ids(m.allocate_slots(req, 4, full_sequence_must_fit=True)) == ((1, 2),)
    # no IFT given: cap cdiv(min(3 + 64, 64), 2) + 1 = 33 -> 10 > 6 -> refused, and
    # nothing changed
    m = _manager(SWA4, num_blocks=7)
    req = m.make_request("r", list(range(20)))
    assert m.allocate_slots(req, 4, full_sequence_must_fit=True) is None
    assert m.get_num_free_blocks() == 6
    # without the gate the first chunk fits
    assert m.allocate_slots(req, 4) is not None


def test_full_sequence_gate_in_a_hybrid() -> None:
    # full bs 2 + SWA w 4 bs 2, IFT 4, 12 tokens: full 6 + SWA min(6, 5) = 11 blocks
    full = FullAttentionSpec(block_size=2)
    m = _manager(full, SWA4, num_blocks=12, max_in_flight_tokens=4)
    assert m.allocate_slots(m.make_request("a", list(range(12))), 2, full_sequence_must_fit=True)
    m = _manager(full, SWA4, num_blocks=11, max_in_flight_tokens=4)
    assert (
        m.allocate_slots(m.make_request("a", list(range(12))), 2, full_sequence_must_fit=True)
        is None
    )


# -- external computed tokens ------------------------------------------------------------


def test_external_tokens_two_phase_adoption() -> None:
    # full bs 2 + SWA w 3 bs 2, 31 free. 12 tokens, no local hit, 8 loaded by a
    # connector, 4 new. Estimate: full 6; SWA skipped(8) = 6 -> 3 blocks, 6 - 3 = 3 -> 9.
    # Phase 1: full [], SWA [0, 0, 0]. Phase 2: full cdiv(8, 2) = 4 blocks (1..4), SWA
    # external min(8 - 6, 8) = 2 -> 4 - 3 = 1 block (5). New: full 6, 7; SWA 8, 9.
    swa3 = SlidingWindowSpec(block_size=2, sliding_window=3)
    m = _manager(FullAttentionSpec(block_size=2), swa3)
    req = m.make_request("r", list(range(100, 112)))
    new = m.allocate_slots(req, 4, num_external_computed_tokens=8)
    assert _ids(new) == ((6, 7), (8, 9))
    assert m.get_block_ids("r") == ((1, 2, 3, 4, 6, 7), (0, 0, 0, 5, 8, 9))
    assert m.get_num_free_blocks() == 31 - 9
    # cached up to 12: full blocks 0..5, SWA blocks 3..5 (need 1, A 2: every block)
    cached = sorted(b.block_id for e in m.block_pool.cached.values() for b in e.values())
    assert cached == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_delayed_caching_while_a_load_is_in_flight() -> None:
    m = _manager(FullAttentionSpec(block_size=2))
    req = m.make_request("r", list(range(100, 108)))
    # 6 external tokens and 0 new: 3 blocks, nothing cached yet
    assert _ids(
        m.allocate_slots(req, 0, num_external_computed_tokens=6, delay_cache_blocks=True)
    ) == ((),)
    assert m.get_block_ids("r") == ((1, 2, 3),)
    assert not m.block_pool.cached
    # the load finished: computed 6; the next step caches blocks 0..2 and adds block 4
    req.num_computed_tokens = 6
    assert _ids(m.allocate_slots(req, 2)) == ((4,),)
    assert len(m.block_pool.cached) == 4
