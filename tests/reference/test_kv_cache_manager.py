"""Worked examples of the request-level API (spec 5 and 6.3): whole scenarios with
exact tables, hits, free counts and free-queue order, all derived by hand."""

from __future__ import annotations

from properties.core.engine import RequestInput
from properties.engines.reference import ReferenceEngine
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def _engine(*specs: KVCacheSpec, num_blocks: int, max_model_len: int = 256) -> ReferenceEngine:
    groups = tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))
    return ReferenceEngine(
        KVCacheLayout(groups, num_blocks=num_blocks, max_model_len=max_model_len)
    )


def _cached(engine: ReferenceEngine) -> set[tuple[int, int, int]]:
    return {(c.block_id, c.group_id, c.num_tokens) for c in engine.cached_blocks()}


# -- sliding window in kv_cache_manager (the seed scenario) ---------------------------


def test_sliding_window_chunked_prefill_then_decode() -> None:
    # w 1000, bs 1, prompt 4000 in chunks of 2000; 6000 blocks -> 5999 free.
    eng = _engine(
        SlidingWindowSpec(block_size=1, sliding_window=1000), num_blocks=6000, max_model_len=8192
    )
    eng.add_request(RequestInput("r", tuple(range(4000))))

    new = eng.allocate_slots("r", 2000)
    assert new == (tuple(range(1, 2001)),)
    assert eng.get_block_ids("r") == (tuple(range(1, 2001)),)
    assert eng.num_free_blocks() == 3999
    eng.set_num_computed_tokens("r", 2000)

    # total 2000: skipped 2000 - 1000 + 1 = 1001 tokens -> positions [0, 1001) freed
    # (hashed, to the back, tail first), then 2000 new blocks 2001..4000.
    new = eng.allocate_slots("r", 2000)
    assert new == (tuple(range(2001, 4001)),)
    table = eng.get_block_ids("r")[0]
    assert len(table) == 4000
    assert table[:1001] == (0,) * 1001
    assert table[1001:] == tuple(range(1002, 4001))
    assert eng.num_free_blocks() == 3000
    assert eng.free_queue() == list(range(4001, 6000)) + list(range(1001, 0, -1))
    eng.set_num_computed_tokens("r", 4000)

    # first decode: skipped 3001 -> positions [1001, 3001) freed; one block, 4001.
    eng.append_output_tokens("r", [7])
    assert eng.allocate_slots("r", 1) == ((4001,),)
    table = eng.get_block_ids("r")[0]
    assert len(table) == 4001
    assert table[:3001] == (0,) * 3001
    assert table[3001:] == tuple(range(3002, 4002))
    assert eng.num_free_blocks() == 4999
    assert eng.free_queue() == (
        list(range(4002, 6000)) + list(range(1001, 0, -1)) + list(range(3001, 1001, -1))
    )


def test_sliding_window_prefix_hit_needs_only_the_window() -> None:
    # w 2, bs 1: a hit at L needs token L-1 only. ABCDEF with only D, E cached:
    # max 5 -> block 4 (E) cached -> hit 5 (ABCDE) through E alone.
    a, b, c, d, e, f = 11, 12, 13, 14, 15, 16
    eng = _engine(SlidingWindowSpec(block_size=1, sliding_window=2), num_blocks=16)
    eng.add_request(RequestInput("w", (a, b, c, d, e, f)))
    assert eng.allocate_slots("w", 6) == ((1, 2, 3, 4, 5, 6),)
    eng.set_num_computed_tokens("w", 6)
    eng.free("w")
    assert eng.free_queue() == list(range(7, 16)) + [6, 5, 4, 3, 2, 1]
    eng.manager.block_pool.evict_blocks([1, 2, 3, 6])
    assert _cached(eng) == {(4, 0, 4), (5, 0, 5)}

    eng.add_request(RequestInput("r", (a, b, c, d, e, f)))
    hit = eng.get_computed_blocks("r")
    assert (hit.num_tokens, hit.block_ids) == (5, ((0, 0, 0, 0, 5),))
    # adopting it touches only E; F gets the front block 7
    assert eng.allocate_slots("r", 1, 5, hit) == ((7,),)
    assert eng.get_block_ids("r") == ((0, 0, 0, 0, 5, 7),)
    assert eng.num_free_blocks() == 13
    assert eng.ref_counts()[5] == 1 and eng.ref_counts()[4] == 0


# -- hybrid: five groups with interleaved types and block sizes ------------------------

# g0 SWA(w 3, bs 2), g1 full(bs 2), g2 Mamba(bs 2), g3 chunked(C 8, bs 4), g4 SWA(w 6, bs 4):
# LCM 4 (chunked bs equals it), gcd 2 (Mamba bs equals it), hash block size 2.
HYBRID = (
    SlidingWindowSpec(block_size=2, sliding_window=3),
    FullAttentionSpec(block_size=2),
    MambaSpec(block_size=2),
    ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8),
    SlidingWindowSpec(block_size=4, sliding_window=6),
)
PROMPT = tuple(range(100, 116))

# After the writer computes PROMPT in chunks of 4 and is freed (see the derivation in
# _written_hybrid): block id, group, tokens of every cached block.
HYBRID_CACHED = {
    (2, 0, 4),
    (8, 0, 8),
    (14, 0, 12),
    (20, 0, 16),  # SWA w3: odd blocks only
    (3, 1, 2),
    (4, 1, 4),
    (9, 1, 6),
    (10, 1, 8),
    (15, 1, 10),
    (16, 1, 12),
    (21, 1, 14),
    (22, 1, 16),
    (5, 2, 4),
    (11, 2, 8),
    (17, 2, 12),
    (23, 2, 16),  # Mamba states at chunk ends
    (6, 3, 4),
    (12, 3, 8),
    (18, 3, 12),
    (24, 3, 16),
    (7, 4, 4),
    (13, 4, 8),
    (19, 4, 12),
    (25, 4, 16),
}


def _written_hybrid() -> ReferenceEngine:
    """The writer computes PROMPT in four chunks of 4 tokens, then is freed.

    Step 1: g0 [1,2], g1 [3,4], g2 [0,5], g3 [6], g4 [7].
    Step 2: g0 frees 1 (unhashed, front) -> g0 [0,2,1,8], g1 +[9,10], g2 [0,5,0,11],
            g3 +[12], g4 +[13].
    Step 3: g0 frees 1 (front), 2; g2 frees 5; g3 frees 12, 6 -> g0 [0,0,0,8,1,14],
            g1 +[15,16], g2 [0,0,0,11,0,17], g3 [0,0,18], g4 +[19].
    Step 4: g0 frees 1 (front), 8; g2 frees 11; g4 frees 7 -> g0 [...,14,1,20],
            g1 +[21,22], g2 [...,17,0,23], g3 [0,0,18,24], g4 [0,13,19,25].
    """
    eng = _engine(*HYBRID, num_blocks=64)
    eng.add_request(RequestInput("w", PROMPT))
    expected_new = [
        ((1, 2), (3, 4), (5,), (6,), (7,)),
        ((1, 8), (9, 10), (11,), (12,), (13,)),
        ((1, 14), (15, 16), (17,), (18,), (19,)),
        ((1, 20), (21, 22), (23,), (24,), (25,)),
    ]
    expected_free = [56, 50, 48, 45]
    for step, (new, free) in enumerate(zip(expected_new, expected_free)):
        eng.new_step()
        assert eng.allocate_slots("w", 4) == new, step
        assert eng.num_free_blocks() == free, step
        eng.set_num_computed_tokens("w", 4 * (step + 1))
    assert eng.get_block_ids("w") == (
        (0, 0, 0, 0, 0, 14, 1, 20),
        (3, 4, 9, 10, 15, 16, 21, 22),
        (0, 0, 0, 0, 0, 17, 0, 23),
        (0, 0, 18, 24),
        (0, 13, 19, 25),
    )
    eng.free("w")
    eng.new_step()
    return eng


def test_hybrid_writer_caches_and_frees() -> None:
    eng = _written_hybrid()
    assert _cached(eng) == HYBRID_CACHED
    assert eng.num_free_blocks() == 63
    assert eng.free_queue() == (
        [1]
        + list(range(26, 64))
        + [2, 5, 12, 6, 8, 11, 7]  # freed out of window during the prefill
        + [20, 14]  # g0 tail first (1 was unhashed: front)
        + [22, 21, 16, 15, 10, 9, 4, 3]  # g1
        + [23, 17]
        + [24, 18]
        + [25, 19, 13]
    )


def test_hybrid_resent_prompt_hit_is_capped_and_aligned() -> None:
    # max 15 -> full: 7 blocks = 14 tokens, aligned down to 12; every other group
    # serves 12: g0 block 5 (12 ends on an A boundary), Mamba state at 12, chunked
    # start 8 -> [null, null] + block 2, SWA w6 needs 2 blocks: 1, 2.
    eng = _written_hybrid()
    eng.add_request(RequestInput("r", PROMPT))
    hit = eng.get_computed_blocks("r")
    assert hit.num_tokens == 12
    assert hit.block_ids == (
        (0, 0, 0, 0, 0, 14),
        (3, 4, 9, 10, 15, 16),
        (0, 0, 0, 0, 0, 17),
        (0, 0, 18),
        (0, 13, 19),
    )
    # need: g0 2 new + 1 evictable, g1 2 + 6, g2 1 + 1, g3 1 + 1, g4 1 + 2 = 18
    assert eng.allocate_slots("r", 4, 12, hit) == ((1, 26), (27, 28), (29,), (30,), (31,))
    assert eng.get_block_ids("r") == (
        (0, 0, 0, 0, 0, 14, 1, 26),
        (3, 4, 9, 10, 15, 16, 27, 28),
        (0, 0, 0, 0, 0, 17, 0, 29),
        (0, 0, 18, 30),
        (0, 13, 19, 31),
    )
    assert eng.num_free_blocks() == 63 - 18
    refs = eng.ref_counts()
    assert [refs[i] for i in (14, 3, 16, 17, 18, 13, 19)] == [1] * 7
    assert [refs[i] for i in (2, 20, 5, 23, 6, 24, 7, 25)] == [0] * 8


def test_hybrid_evicted_block_in_one_group_lowers_the_hit() -> None:
    # SWA w6 loses block 1 (id 13): at 12 it finds only block 2 then a miss; the run
    # from block 0 gives 4. Second pass at 4: every group serves 4.
    eng = _written_hybrid()
    eng.manager.block_pool.evict_blocks([13])
    eng.add_request(RequestInput("r", PROMPT))
    hit = eng.get_computed_blocks("r")
    assert (hit.num_tokens, hit.block_ids) == (4, ((0, 2), (3, 4), (0, 5), (6,), (7,)))


def test_hybrid_evicted_chunked_block_lowers_the_hit_to_the_chunk_start() -> None:
    # chunked loses block 2 (id 18): at 12 it answers 8 ([null, null]); at 8 every
    # group serves: SWA w3 block 3, Mamba state at 8, SWA w6 blocks 0, 1.
    eng = _written_hybrid()
    eng.manager.block_pool.evict_blocks([18])
    eng.add_request(RequestInput("r", PROMPT))
    hit = eng.get_computed_blocks("r")
    assert hit.num_tokens == 8
    assert hit.block_ids == ((0, 0, 0, 8), (3, 4, 9, 10), (0, 0, 0, 11), (0, 0), (7, 13))


def test_hybrid_three_groups_probe_values() -> None:
    # full bs 2 + SWA(bs 2, w 3) + SWA(bs 2, w 7): 12-token prompt cached, 13-token
    # request -> hit 12.
    eng = _engine(
        FullAttentionSpec(block_size=2),
        SlidingWindowSpec(block_size=2, sliding_window=3),
        SlidingWindowSpec(block_size=2, sliding_window=7),
        num_blocks=32,
    )
    eng.add_request(RequestInput("w", tuple(range(12))))
    assert eng.allocate_slots("w", 12) == (
        (1, 2, 3, 4, 5, 6),
        (7, 8, 9, 10, 11, 12),
        (13, 14, 15, 16, 17, 18),
    )
    eng.set_num_computed_tokens("w", 12)
    eng.free("w")
    eng.add_request(RequestInput("r", tuple(range(13))))
    hit = eng.get_computed_blocks("r")
    assert hit.num_tokens == 12
    assert hit.block_ids == ((1, 2, 3, 4, 5, 6), (0, 0, 0, 0, 0, 12), (0, 0, 0, 16, 17, 18))


# -- free-queue order, eviction order, refused allocations -----------------------------


def test_free_queue_order_after_free_two_groups() -> None:
    # full bs 2 + SWA bs 2 w 4, one 13-token step: 12 tokens cached per group; the
    # partial last blocks 7 and 14 are unhashed and go to the front, later group first.
    eng = _engine(
        FullAttentionSpec(block_size=2),
        SlidingWindowSpec(block_size=2, sliding_window=4),
        num_blocks=20,
    )
    eng.add_request(RequestInput("r", tuple(range(13))))
    assert eng.allocate_slots("r", 13) == ((1, 2, 3, 4, 5, 6, 7), (8, 9, 10, 11, 12, 13, 14))
    eng.free("r")
    assert eng.free_queue() == (
        [14, 7, 15, 16, 17, 18, 19, 6, 5, 4, 3, 2, 1] + [13, 12, 11, 10, 9, 8]
    )
    assert eng.num_free_blocks() == 19


def test_deferred_free_frees_tail_first_over_all_groups() -> None:
    # the layout and step of the test above; the blocks are popped (a deferred free),
    # then freed in one call, 14 down to 1: the unhashed 14 and 7 go to the front in
    # that order; the hashed ones to the back, group 1's (13..8) before group 0's (6..1)
    eng = _engine(
        FullAttentionSpec(block_size=2),
        SlidingWindowSpec(block_size=2, sliding_window=4),
        num_blocks=20,
    )
    eng.add_request(RequestInput("r", tuple(range(13))))
    eng.allocate_slots("r", 13)
    popped = eng.pop_blocks_for_free("r")
    assert [b.block_id for b in popped] == list(range(1, 15))
    assert eng.num_free_blocks() == 5
    assert eng.get_block_ids("r") == ((), ())
    eng.free_popped_blocks(popped)
    assert eng.free_queue() == (
        [14, 7, 15, 16, 17, 18, 19] + [13, 12, 11, 10, 9, 8] + [6, 5, 4, 3, 2, 1]
    )
    assert eng.num_free_blocks() == 19


def test_eviction_reuses_the_tail_of_the_oldest_chain_first() -> None:
    eng = _engine(FullAttentionSpec(block_size=2), num_blocks=5)
    eng.add_request(RequestInput("a", (1, 2, 3, 4)))
    assert eng.allocate_slots("a", 4) == ((1, 2),)
    eng.set_num_computed_tokens("a", 4)
    eng.free("a")
    assert eng.free_queue() == [3, 4, 2, 1]
    # b needs 3 blocks: 3, 4 (never cached), then 2 (a's tail) is evicted
    eng.add_request(RequestInput("b", (7, 8, 9, 10, 11, 12)))
    assert eng.allocate_slots("b", 6) == ((3, 4, 2),)
    assert eng.free_queue() == [1]
    assert _cached(eng) == {(1, 0, 2), (3, 0, 2), (4, 0, 4), (2, 0, 6)}
    # a's head survived: resending a's prompt hits block 1 only
    eng.add_request(RequestInput("c", (1, 2, 3, 4, 5)))
    hit = eng.get_computed_blocks("c")
    assert (hit.num_tokens, hit.block_ids) == (2, ((1,),))


def test_lru_order_across_requests() -> None:
    eng = _engine(FullAttentionSpec(block_size=2), num_blocks=6)
    for rid, tokens in (("a", (1, 2, 3, 4)), ("b", (5, 6, 7, 8))):
        eng.add_request(RequestInput(rid, tokens))
        eng.allocate_slots(rid, 4)
        eng.set_num_computed_tokens(rid, 4)
    eng.free("a")
    eng.free("b")
    assert eng.free_queue() == [5, 2, 1, 4, 3]
    eng.add_request(RequestInput("c", (9, 10, 11, 12, 13, 14, 15, 16)))
    # 5 first, then a's chain tail first (2, 1), then b's 4
    assert eng.allocate_slots("c", 8) == ((5, 2, 1, 4),)
    assert _cached(eng) == {(3, 0, 2), (5, 0, 2), (2, 0, 4), (1, 0, 6), (4, 0, 8)}


def test_refused_allocation_has_no_side_effects() -> None:
    eng = _engine(FullAttentionSpec(block_size=2), num_blocks=6)
    eng.add_request(RequestInput("a", (1, 2, 3, 4, 5, 6)))
    assert eng.allocate_slots("a", 6) == ((1, 2, 3),)
    eng.set_num_computed_tokens("a", 6)
    eng.free("a")
    assert eng.free_queue() == [4, 5, 3, 2, 1]
    eng.add_request(RequestInput("b", (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)))
    hit = eng.get_computed_blocks("b")
    assert (hit.num_tokens, hit.block_ids) == (6, ((1, 2, 3),))
    # need: cdiv(11, 2) = 6 - 3 hit = 3 new, + 3 evictable hit blocks = 6 > 5 free
    assert eng.allocate_slots("b", 5, 6, hit) is None
    assert eng.free_queue() == [4, 5, 3, 2, 1]
    assert eng.ref_counts() == {1: 0, 2: 0, 3: 0, 4: 0, 5: 0}
    assert eng.get_block_ids("b") == ((),)
    assert eng.num_free_blocks() == 5
    # 3 new tokens: 2 new + 3 evictable = 5 -> fits exactly
    hit = eng.get_computed_blocks("b")
    assert eng.allocate_slots("b", 3, 6, hit) == ((4, 5),)
    assert eng.get_block_ids("b") == ((1, 2, 3, 4, 5),)
    assert eng.num_free_blocks() == 0
    assert eng.ref_counts() == {1: 1, 2: 1, 3: 1, 4: 1, 5: 1}


def test_refused_allocation_still_frees_out_of_window_blocks() -> None:
    eng = _engine(SlidingWindowSpec(block_size=2, sliding_window=4), num_blocks=9)
    eng.add_request(RequestInput("r", tuple(range(16))))
    assert eng.allocate_slots("r", 8) == ((1, 2, 3, 4),)
    eng.set_num_computed_tokens("r", 8)
    eng.add_request(RequestInput("q", (90, 91, 92, 93, 94, 95, 96, 97)))
    assert eng.allocate_slots("q", 8) == ((5, 6, 7, 8),)
    assert eng.num_free_blocks() == 0
    # total 8: skipped 5 -> blocks 1, 0 (ids 2, 1, hashed) freed first; then 4 > 2
    assert eng.allocate_slots("r", 8) is None
    assert eng.get_block_ids("r") == ((0, 0, 3, 4),)
    assert eng.free_queue() == [2, 1]
    assert eng.num_free_blocks() == 2
    assert eng.ref_counts() == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1, 8: 1}


def test_reset_prefix_cache_refused_while_held() -> None:
    eng = _engine(FullAttentionSpec(block_size=2), num_blocks=6)
    eng.add_request(RequestInput("a", (1, 2, 3, 4)))
    eng.allocate_slots("a", 4)
    assert eng.reset_prefix_cache() is False
    assert _cached(eng) == {(1, 0, 2), (2, 0, 4)}
    eng.free("a")
    assert eng.reset_prefix_cache() is True
    assert _cached(eng) == set()
    assert eng.free_queue() == [3, 4, 5, 2, 1]
