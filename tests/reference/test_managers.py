"""Worked examples of each single-type manager's rules at their boundaries (spec 4).

Every block id below is derived by hand: a fresh pool's free queue is ``1..N-1``,
allocation pops from the front, a request is freed tail first, unhashed blocks go
to the front of the queue and hashed ones to the back.
"""

from __future__ import annotations

from properties.core.engine import CachedBlock, RequestInput
from properties.engines.reference import ReferenceEngine
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def _engine(*specs: KVCacheSpec, num_blocks: int = 32, max_model_len: int = 256) -> ReferenceEngine:
    groups = tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))
    return ReferenceEngine(
        KVCacheLayout(groups, num_blocks=num_blocks, max_model_len=max_model_len)
    )


def _write(engine: ReferenceEngine, rid: str, tokens: list[int], free: bool = True) -> None:
    """Compute the whole prompt in one step (caching every full block), then free it."""
    engine.add_request(RequestInput(rid, tuple(tokens)))
    assert engine.allocate_slots(rid, len(tokens)) is not None
    engine.set_num_computed_tokens(rid, len(tokens))
    if free:
        engine.free(rid)


def _lookup(engine: ReferenceEngine, rid: str, tokens: list[int]):
    engine.add_request(RequestInput(rid, tuple(tokens)))
    return engine.get_computed_blocks(rid)


def _cached(engine: ReferenceEngine) -> set[tuple[int, int, int]]:
    return {(c.block_id, c.group_id, c.num_tokens) for c in engine.cached_blocks()}


# -- full attention -----------------------------------------------------------------


def test_full_hit_stops_at_first_miss_and_caps_at_n_minus_one() -> None:
    eng = _engine(FullAttentionSpec(block_size=4))
    _write(eng, "w", list(range(12)))  # blocks 1, 2, 3 cached
    # same 12 tokens: max 11 -> 2 full blocks -> 8 (the last block is recomputed)
    hit = _lookup(eng, "same", list(range(12)))
    assert (hit.num_tokens, hit.block_ids) == (8, ((1, 2),))
    eng.manager.block_pool.evict_blocks([2])
    hit = _lookup(eng, "r", list(range(12)) + [50])
    assert (hit.num_tokens, hit.block_ids) == (4, ((1,),))


def test_full_free_queue_after_free() -> None:
    eng = _engine(FullAttentionSpec(block_size=4), num_blocks=8)
    _write(eng, "w", list(range(10)))  # blocks 1, 2 cached, 3 holds the partial tail
    # tail first: 3 (unhashed) to the front, then 2, 1 to the back
    assert eng.free_queue() == [3, 4, 5, 6, 7, 2, 1]
    assert _cached(eng) == {(1, 0, 4), (2, 0, 8)}


# -- sliding window -----------------------------------------------------------------


def test_swa_window_smaller_than_block() -> None:
    # w 3, bs 4: need = cdiv(2, 4) = 1; the last block before the hit suffices
    eng = _engine(SlidingWindowSpec(block_size=4, sliding_window=3))
    _write(eng, "w", list(range(12)))  # ids 1, 2, 3 all cached (one group)
    eng.manager.block_pool.evict_blocks([1, 2])
    hit = _lookup(eng, "r", list(range(12)) + [50])
    assert (hit.num_tokens, hit.block_ids) == (12, ((0, 0, 3),))


def test_swa_window_one_never_caches_never_hits() -> None:
    eng = _engine(SlidingWindowSpec(block_size=2, sliding_window=1), num_blocks=10)
    _write(eng, "w", list(range(8)))
    assert _cached(eng) == set()
    # the four blocks were unhashed: freed 4, 3, 2, 1 to the front
    assert eng.free_queue() == [4, 3, 2, 1, 5, 6, 7, 8, 9]
    hit = _lookup(eng, "r", list(range(8)) + [50, 51, 52])
    assert (hit.num_tokens, hit.block_ids) == (0, ((),))


def test_swa_window_multiple_of_block_size() -> None:
    # w 4, bs 2: need = cdiv(3, 2) = 2; blocks 0..4 cached, max 13 -> M 6
    eng = _engine(SlidingWindowSpec(block_size=2, sliding_window=4))
    _write(eng, "w", list(range(10)))  # ids 1..5
    hit = _lookup(eng, "r", list(range(10)) + [50, 51, 52, 53])
    assert (hit.num_tokens, hit.block_ids) == (10, ((0, 0, 0, 4, 5),))


def test_swa_docstring_example_blocks_two_and_three() -> None:
    # bs 4, w 8: need 2; only blocks 2, 3 cached, M 4 -> [null, null, b2, b3], hit 16
    eng = _engine(SlidingWindowSpec(block_size=4, sliding_window=8))
    _write(eng, "w", list(range(16)))  # ids 1..4
    eng.manager.block_pool.evict_blocks([1, 2])
    hit = _lookup(eng, "r", list(range(17)))
    assert (hit.num_tokens, hit.block_ids) == (16, ((0, 0, 3, 4),))


def test_swa_short_run_reaching_block_zero_is_a_hit() -> None:
    # w 7, bs 2: need 3; only blocks 0, 1 cached, max 9 -> run of 2 from block 0 -> 4
    eng = _engine(SlidingWindowSpec(block_size=2, sliding_window=7))
    _write(eng, "w", [1, 2, 3, 4])  # ids 1, 2
    hit = _lookup(eng, "r", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert (hit.num_tokens, hit.block_ids) == (4, ((1, 2),))


def test_swa_short_run_not_reaching_block_zero_misses() -> None:
    eng = _engine(SlidingWindowSpec(block_size=2, sliding_window=7))
    _write(eng, "w", [1, 2, 3, 4, 5, 6])  # ids 1, 2, 3
    eng.manager.block_pool.evict_blocks([1])
    hit = _lookup(eng, "r", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert (hit.num_tokens, hit.block_ids) == (0, ((),))


def test_swa_first_chunk_gets_every_block() -> None:
    # No skipping at allocation: 13 tokens, bs 2 -> 7 blocks, none null.
    eng = _engine(SlidingWindowSpec(block_size=2, sliding_window=4))
    eng.add_request(RequestInput("r", tuple(range(13))))
    assert eng.allocate_slots("r", 13) == ((1, 2, 3, 4, 5, 6, 7),)
    assert eng.get_block_ids("r") == ((1, 2, 3, 4, 5, 6, 7),)
    assert eng.num_free_blocks() == 31 - 7


def test_swa_run_must_end_on_aligned_boundary_in_hybrid() -> None:
    # full bs 4 + SWA bs 2 w 10 (need 5), A 4. SWA blocks 0, 1, 2 cached, 3 evicted:
    # block 2 ends at 6 (not aligned) -> skipped; run 1, 0 reaches block 0 -> 4.
    eng = _engine(
        FullAttentionSpec(block_size=4), SlidingWindowSpec(block_size=2, sliding_window=10)
    )
    _write(eng, "w", list(range(8)))  # full ids 1, 2; SWA ids 3, 4, 5, 6
    assert _cached(eng) == {(1, 0, 4), (2, 0, 8), (3, 1, 2), (4, 1, 4), (5, 1, 6), (6, 1, 8)}
    eng.manager.block_pool.evict_blocks([6])
    hit = _lookup(eng, "r", list(range(8)) + [50, 51, 52, 53])
    assert (hit.num_tokens, hit.block_ids) == (4, ((1,), (3, 4)))


def test_swa_cacheable_mask_in_hybrid() -> None:
    # full bs 4 + SWA bs 2 w 3: A 4, per segment 2, need 1 -> only odd SWA blocks.
    # Prompt 11: cached tokens rounded down to 8.
    eng = _engine(
        FullAttentionSpec(block_size=4), SlidingWindowSpec(block_size=2, sliding_window=3)
    )
    eng.add_request(RequestInput("w", tuple(range(11))))
    assert eng.allocate_slots("w", 11) == ((1, 2, 3), (4, 5, 6, 7, 8, 9))
    assert _cached(eng) == {(1, 0, 4), (2, 0, 8), (5, 1, 4), (7, 1, 8)}
    eng.free("w")
    # free: full 3 (unhashed) front, 2, 1 back; SWA 9, 8 front then 7 back, 6 front ...
    assert eng.free_queue() == [9, 8, 6, 4, 3] + list(range(10, 32)) + [2, 1, 7, 5]


def test_swa_cacheable_mask_whole_prompt_hit() -> None:
    eng = _engine(
        FullAttentionSpec(block_size=4), SlidingWindowSpec(block_size=2, sliding_window=3)
    )
    _write(eng, "w", list(range(11)))
    # max 11 -> full hit 8 (blocks 1, 2); SWA asked for <= 8: block 3 (id 7) -> 8
    hit = _lookup(eng, "r", list(range(11)) + [50])
    assert (hit.num_tokens, hit.block_ids) == (8, ((1, 2), (0, 0, 0, 7)))


def test_swa_out_of_window_blocks_freed_at_next_allocation() -> None:
    eng = _engine(SlidingWindowSpec(block_size=2, sliding_window=4), num_blocks=12)
    eng.add_request(RequestInput("r", tuple(range(12))))
    assert eng.allocate_slots("r", 5) == ((1, 2, 3),)
    eng.set_num_computed_tokens("r", 5)
    # total 5: skipped max(0, 5 - 3) = 2 tokens -> block 0 (id 1, hashed) freed
    assert eng.allocate_slots("r", 5) == ((4, 5),)
    assert eng.get_block_ids("r") == ((0, 2, 3, 4, 5),)
    assert eng.free_queue() == [6, 7, 8, 9, 10, 11, 1]
    eng.set_num_computed_tokens("r", 10)
    # total 10: skipped 7 -> blocks 0..2; walk 2, 1 then stop at the null at 0
    assert eng.allocate_slots("r", 2) == ((6,),)
    assert eng.get_block_ids("r") == ((0, 0, 0, 4, 5, 6),)
    assert eng.free_queue() == [7, 8, 9, 10, 11, 1, 3, 2]
    assert eng.num_free_blocks() == 8


# -- chunked local ------------------------------------------------------------------


def test_chunked_fresh_prompt_hits_whole_chunks_of_nulls() -> None:
    # C 8, bs 4, nothing cached, max 13: start 8 -> [null, null], block 2 misses -> 8
    eng = _engine(ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8))
    hit = _lookup(eng, "r", list(range(14)))
    assert (hit.num_tokens, hit.block_ids) == (8, ((0, 0),))
    # C 4, bs 2: 9 tokens -> max 8 -> 8; 11 tokens -> max 10, block 4 misses -> 8
    eng = _engine(ChunkedLocalAttentionSpec(block_size=2, attention_chunk_size=4))
    hit = _lookup(eng, "a", list(range(9)))
    assert (hit.num_tokens, hit.block_ids) == (8, ((0, 0, 0, 0),))
    hit = _lookup(eng, "b", list(range(11)))
    assert (hit.num_tokens, hit.block_ids) == (8, ((0, 0, 0, 0),))
    # max below one chunk: start 0, nothing cached -> 0
    hit = _lookup(eng, "c", [1, 2, 3, 4])
    assert (hit.num_tokens, hit.block_ids) == (0, ((),))


def test_chunked_hit_extends_inside_current_chunk() -> None:
    eng = _engine(ChunkedLocalAttentionSpec(block_size=2, attention_chunk_size=4))
    _write(eng, "w", list(range(11)))  # ids 1..6, full blocks 1..5 cached
    # 12 tokens: max 11, start 8 -> nulls for blocks 0..3, block 4 (id 5) hits -> 10
    hit = _lookup(eng, "r", list(range(11)) + [50])
    assert (hit.num_tokens, hit.block_ids) == (10, ((0, 0, 0, 0, 5),))


def test_chunked_chunks_free_previous_chunk() -> None:
    eng = _engine(ChunkedLocalAttentionSpec(block_size=2, attention_chunk_size=4), num_blocks=17)
    eng.add_request(RequestInput("r", tuple(range(11))))
    assert eng.allocate_slots("r", 5) == ((1, 2, 3),)
    assert eng.num_free_blocks() == 13
    eng.set_num_computed_tokens("r", 5)
    # total 5: skipped 4 -> blocks 1, 0 (ids 2, 1; hashed) freed to the back first
    assert eng.allocate_slots("r", 6) == ((4, 5, 6),)
    assert eng.get_block_ids("r") == ((0, 0, 3, 4, 5, 6),)
    assert eng.num_free_blocks() == 12
    assert eng.free_queue() == list(range(7, 17)) + [2, 1]


# -- Mamba --------------------------------------------------------------------------


def test_mamba_rightmost_cached_state() -> None:
    eng = _engine(MambaSpec(block_size=4), num_blocks=8)
    eng.add_request(RequestInput("w", tuple(range(8))))
    assert eng.allocate_slots("w", 4) == ((1,),)
    eng.set_num_computed_tokens("w", 4)
    assert eng.allocate_slots("w", 4) == ((2,),)
    assert eng.get_block_ids("w") == ((1, 2),)
    assert _cached(eng) == {(1, 0, 4), (2, 0, 8)}
    eng.set_num_computed_tokens("w", 8)
    eng.free("w")
    assert eng.free_queue() == [3, 4, 5, 6, 7, 2, 1]
    # max 11: states at 8 and 4 are cached -> the rightmost, 8: [null, b2]
    hit = _lookup(eng, "r", list(range(8)) + [50, 51, 52, 53])
    assert (hit.num_tokens, hit.block_ids) == (8, ((0, 2),))
    # without the state at 8 the state at 4 serves
    eng.manager.block_pool.evict_blocks([2])
    hit = _lookup(eng, "s", list(range(8)) + [60])
    assert (hit.num_tokens, hit.block_ids) == (4, ((1,),))


def test_mamba_one_step_prefill_caches_no_unaligned_state() -> None:
    eng = _engine(MambaSpec(block_size=4))
    eng.add_request(RequestInput("w", tuple(range(9))))
    assert eng.allocate_slots("w", 9) == ((1,),)
    assert eng.get_block_ids("w") == ((0, 0, 1),)
    assert _cached(eng) == set()


def test_mamba_refuses_a_state_cached_this_step() -> None:
    eng = _engine(FullAttentionSpec(block_size=4), MambaSpec(block_size=4), num_blocks=16)
    eng.add_request(RequestInput("a", tuple(range(8))))
    assert eng.allocate_slots("a", 8) == ((1, 2), (3,))
    assert eng.get_block_ids("a") == ((1, 2), (0, 3))
    eng.set_num_computed_tokens("a", 8)
    hit = _lookup(eng, "b", list(range(8)) + [50, 51])
    assert (hit.num_tokens, hit.block_ids) == (8, ((1, 2), (0, 3)))
    refs = eng.ref_counts()
    queue = eng.free_queue()
    assert eng.allocate_slots("b", 2, 8, hit) is None
    assert eng.num_free_blocks() == 12
    assert eng.ref_counts() == refs
    assert eng.free_queue() == queue
    assert eng.get_block_ids("b") == ((), ())
    eng.new_step()
    hit = eng.get_computed_blocks("b")
    assert eng.allocate_slots("b", 2, 8, hit) == ((4,), (5,))
    assert eng.get_block_ids("b") == ((1, 2, 4), (0, 3, 5))
    assert eng.num_free_blocks() == 10
    assert eng.ref_counts()[3] == 2


def test_mamba_row_through_chunks_and_decode() -> None:
    eng = _engine(FullAttentionSpec(block_size=4), MambaSpec(block_size=4))
    eng.add_request(RequestInput("r", tuple(range(20))))
    steps = [  # (new tokens, new blocks, full row, Mamba row) after each step
        (8, ((1, 2), (3,)), (1, 2), (0, 3)),
        (8, ((4, 5), (6,)), (1, 2, 4, 5), (0, 3, 0, 6)),
        (4, ((7,), (8,)), (1, 2, 4, 5, 7), (0, 0, 0, 6, 8)),
    ]
    computed = 0
    for n, new, full_row, mamba_row in steps:
        eng.new_step()
        assert eng.allocate_slots("r", n) == new
        assert eng.get_block_ids("r") == (full_row, mamba_row)
        computed += n
        eng.set_num_computed_tokens("r", computed)
    decode = [  # tokens 20 -> 26, one per step
        (((9,), (10,)), (0, 0, 0, 0, 8, 10)),
        (((), ()), (0, 0, 0, 0, 0, 10)),
        (((), ()), (0, 0, 0, 0, 0, 10)),
        (((), ()), (0, 0, 0, 0, 0, 10)),
        (((11,), (12,)), (0, 0, 0, 0, 0, 10, 12)),
        (((), ()), (0, 0, 0, 0, 0, 0, 12)),
    ]
    for new, mamba_row in decode:
        eng.new_step()
        eng.append_output_tokens("r", [100 + computed])
        assert eng.allocate_slots("r", 1) == new
        assert eng.get_block_ids("r")[1] == mamba_row
        computed += 1
        eng.set_num_computed_tokens("r", computed)
    assert eng.get_block_ids("r")[0] == (1, 2, 4, 5, 7, 9, 11)
    # Mamba states were registered at 8, 16, 20 and 24 tokens (ids 3, 6, 8, 10)
    assert {c for c in _cached(eng) if c[1] == 1} == {
        (3, 1, 8),
        (6, 1, 16),
        (8, 1, 20),
        (10, 1, 24),
    }
    # freed states 3, 6, 8, 10 (all hashed) went to the back in that order
    assert eng.free_queue() == list(range(13, 32)) + [3, 6, 8, 10]


def test_cached_blocks_reports_group_and_tokens() -> None:
    eng = _engine(FullAttentionSpec(block_size=2))
    _write(eng, "w", [5, 6, 7, 8, 9])
    assert sorted(eng.cached_blocks(), key=lambda c: c.block_id) == [
        CachedBlock(1, 0, 2),
        CachedBlock(2, 0, 4),
    ]


def test_external_tokens_move_the_skip_boundary_past_a_window_s_hit_blocks() -> None:
    from reference.managers.base import num_skipped_hit_blocks

    window = SlidingWindowSpec(block_size=2, sliding_window=4)
    # local 6 (hit [null, 3, 4]): skipped max(0, 6 - 4 + 1) = 3 tokens -> 1 block
    assert num_skipped_hit_blocks(window, 6, 0) == 1
    # 4 external tokens more: 10 computed, skipped 7 tokens -> 3 blocks: the hit's
    # blocks 3 and 4 (indexes 1 and 2) are never adopted
    assert num_skipped_hit_blocks(window, 6, 4) == 3
    assert num_skipped_hit_blocks(FullAttentionSpec(block_size=2), 6, 4) == 0
