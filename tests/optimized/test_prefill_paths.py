"""The prefill shortcuts of the optimized manager, forced and checked by hand and against
the reference (:class:`tests.optimized.optimized_differential.Pair`):

* a new request's hit counted and adopted at once (``count_hit_admission``,
  ``adopt_hit``, ``BlockPool.touch_array``): free hit blocks counted as taken, a
  refusal that changes nothing, window blocks skipped as nulls, nulls and repeated blocks
  in a hand-made hit;
* the free queue's scalar ``remove_each``;
* a window's few tail blocks registered inline (``_cache_few``);
* an admitted hit's new blocks, and those of a fresh row with no hit, registered from
  their list (``cache_new_blocks``, ``BlockPool.cache_fresh_blocks``: inline, in bulk,
  from the popped array, at positions, with a key twice, a key already there and
  twice); a window's kept positions (``cacheable_block_positions``) against the
  reference's mask;
* a one-group window scan looking blocks up from the right (``_scan_one_group``);
* the one-pass hit search of one full-attention spec group and one other
  (``_two_spec_hit``) against the reference's general search.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from optimized.control.block_pool import BlockPool, FreeBlockQueue
from optimized.control.kv_cache_manager import ComputedBlocks
from optimized.control.kv_cache_manager import KVCacheManager as OptimizedManager
from optimized.control.managers import SlidingWindowManager
from reference.coordinator import hybrid_coordinator_hit
from reference.errors import KVConformError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.managers.sliding_window import window_cache_mask
from reference.specs import FullAttentionSpec, SlidingWindowSpec
from tests.optimized.optimized_differential import Pair


def _keys(*names: bytes) -> list[bytes]:
    """Block hashes named by hand, padded to the 32 bytes of the engine's own (the
    array key index takes those only)."""
    return [name.ljust(32, b".") for name in names]


def _full_and_window(
    num_blocks: int, window: int = 8, retention: int | None = None
) -> KVCacheLayout:
    """Full attention bs 4 + a sliding window of ``window`` tokens bs 4."""
    return KVCacheLayout(
        (
            KVCacheGroup(("full",), FullAttentionSpec(block_size=4)),
            KVCacheGroup(("w",), SlidingWindowSpec(block_size=4, sliding_window=window)),
        ),
        num_blocks=num_blocks,
        max_model_len=128,
        enable_caching=True,
        prefix_cache_retention_interval=retention,
    )


# -- touch_array -------------------------------------------------------------------


def test_touch_array_by_hand() -> None:
    pool = BlockPool(12, enable_caching=True, hash_block_size=4, compiled=False)
    pool.get_new_blocks(11)  # 1..11 held once
    pool.cache_full_blocks([1, 2, 3], [b"a", b"b", b"c"], 0, 0, 4)
    pool.free_blocks([3, 2, 1])  # hashed: to the back, 3 first
    pool.free_blocks([9])  # unhashed: to the front
    assert pool.free_block_queue.block_ids() == [9, 3, 2, 1]
    # distinct: 1 and 3 leave the queue, 5 (held) goes to 2
    pool.touch_array(np.array([1, 3, 5], dtype=np.intp), True)
    assert pool.free_block_queue.block_ids() == [9, 2]
    assert pool.ref_cnt[[1, 2, 3, 5]].tolist() == [1, 0, 1, 2]
    # repeated: 2 given twice leaves the queue once and counts twice
    pool.touch_array(np.array([2, 4, 2], dtype=np.intp), False)
    assert pool.free_block_queue.block_ids() == [9]
    assert pool.ref_cnt[[2, 4]].tolist() == [2, 2]
    assert pool.get_num_free_blocks() == 1


# -- a new request's hit, counted and adopted at once --------------------------------


def test_hit_on_free_blocks_counted_then_adopted_like_the_reference() -> None:
    pair = Pair(_full_and_window(40))
    assert pair.opt.coordinator.plain_hits
    pair.add("a", list(range(40)))
    pair.allocate("a", 40)  # 10 blocks per group
    pair.free("a")  # every block cached and free
    # 46 tokens, the first 40 shared: hit 40 (full: 10 blocks; window w 8: the last 2)
    pair.add("b", [*range(40), 50, 51, 52, 53, 54, 55])
    hit = pair.lookup("b")
    assert hit[1][1] == 40
    before = pair.opt.get_num_free_blocks()
    assert pair.allocate("b", 6, hit) is not None
    # per group: cdiv(46, 4) = 12 blocks; full: 12 - 10 = 2 new + 10 free hit blocks;
    # window: 40 computed skip 33 tokens = 8 blocks, 12 - 10 = 2 new + the 2 hit blocks
    # past the skipped ones (free)
    assert pair.opt.last_num_blocks_to_allocate == pair.ref.last_num_blocks_to_allocate == 16
    assert before - pair.opt.get_num_free_blocks() == 16
    row = pair.opt.coordinator.row_of["b"]
    window = pair.opt.coordinator.managers[1]
    assert window.num_leading_null[row] == 8 and window.row_len[row] == 12
    assert window.num_cached_block[row] == 11  # 44 tokens cached: 10 adopted + 1 new
    pair.free("b")


def test_refused_hit_admission_changes_nothing_but_the_row() -> None:
    pair = Pair(_full_and_window(24))  # 23 usable blocks
    pair.add("a", list(range(40)))
    pair.allocate("a", 40)  # 20 blocks
    pair.free("a")
    pair.add("b", [*range(40), *range(60, 80)])  # 60 tokens: 15 blocks per group
    hit = pair.lookup("b")
    queue = pair.opt.block_pool.free_block_queue.block_ids()
    refs = pair.opt.block_pool.ref_counts()
    # hit 40 either way. c, 64 slots (16 blocks per group): full 16 - 10 + 10 free hit
    # blocks = 16; window: 40 computed skip 33 tokens = 8 blocks, 16 - 10 + the 2 free
    # hit blocks past them = 8 -> 24 > 23: refused. b, 60 slots: 15 + 7 = 22: admitted
    pair.add("c", [*range(40), *range(60, 84)])
    hit_c = pair.lookup("c")
    assert pair.allocate("c", 24, hit_c) is None
    assert pair.opt.last_num_blocks_to_allocate == pair.ref.last_num_blocks_to_allocate == 24
    assert pair.opt.block_pool.free_block_queue.block_ids() == queue
    assert pair.opt.block_pool.ref_counts() == refs
    assert pair.allocate("b", 20, hit) is not None
    assert pair.opt.last_num_blocks_to_allocate == 22
    pair.free("b")
    pair.free("c")


def test_hand_made_hit_with_nulls_and_a_repeated_block() -> None:
    layout = _full_and_window(30)
    manager = OptimizedManager(layout)
    pool = manager.block_pool
    pool.get_new_blocks(6)  # 1..6
    pool.cache_full_blocks([1, 2, 3], _keys(b"a", b"b", b"c"), 0, 0, 4)
    pool.cache_full_blocks([4, 5], _keys(b"d", b"e"), 1, 2, 4)
    pool.free_blocks([3, 2, 1])
    pool.free_blocks([5, 4])
    free_before = pool.get_num_free_blocks()  # 23 + 5 = 28
    request = manager.make_request("r", list(range(30)))
    # 12 computed tokens: the window (w 8) skips 5 tokens = 1 block; its hit keeps a
    # null after the skipped column; the full hit repeats block 2
    hit = ComputedBlocks(((1, 2, 2), (9, 0, 5)))
    new = manager.allocate_slots(request, 4, 12, hit)
    # full: cdiv(16, 4) = 4 - 3 = 1 new, plus 1, 2, 2 free (counted per occurrence): 4;
    # window: 4 - max(1, 3) = 1 new, plus 5 free past the skipped column: 2 -> 6
    assert manager.last_num_blocks_to_allocate == 6
    assert pool.get_num_free_blocks() == free_before - 3 - 2  # 1, 2, 5 taken; 2 new
    assert pool.ref_cnt[[1, 2, 5]].tolist() == [1, 2, 1]
    row = manager.coordinator.row_of["r"]
    full, window = manager.coordinator.managers
    assert full.blocks(row) == [1, 2, 2, new[0][0]]
    assert window.blocks(row) == [0, 0, 5, new[1][0]]
    assert window.num_leading_null[row] == 2
    assert full.num_leading_null[row] == 0
    assert len(new[0]) == len(new[1]) == 1


def test_hand_made_hit_sharing_a_free_block_between_groups() -> None:
    """Both groups' hits hold block 3 (free): counted once per group, taken out of the
    queue once and held twice, as a touch per group leaves it."""
    manager = OptimizedManager(_full_and_window(30))
    pool = manager.block_pool
    pool.get_new_blocks(3)  # 1..3
    pool.cache_full_blocks([1, 2, 3], _keys(b"a", b"b", b"c"), 0, 0, 4)
    pool.free_blocks([3, 2, 1])
    free_before = pool.get_num_free_blocks()  # 29
    request = manager.make_request("r", list(range(30)))
    # 12 computed: the window (w 8) skips 5 tokens = 1 block, keeps [0, 3]
    new = manager.allocate_slots(request, 4, 12, ComputedBlocks(((1, 2, 3), (9, 0, 3))))
    # full: 4 - 3 = 1 new + 3 free hit blocks; window: 4 - max(1, 3) = 1 new + block 3
    assert manager.last_num_blocks_to_allocate == 6
    assert pool.get_num_free_blocks() == free_before - 3 - 2
    assert pool.ref_cnt[[1, 2, 3]].tolist() == [1, 1, 2]
    assert 3 not in pool.free_block_queue.block_ids()
    row = manager.coordinator.row_of["r"]
    full, window = manager.coordinator.managers
    assert full.blocks(row) == [1, 2, 3, new[0][0]]
    assert window.blocks(row) == [0, 0, 3, new[1][0]]
    assert window.num_leading_null[row] == 2


# -- the free queue's scalar removal --------------------------------------------------


def test_remove_each_unlinks_in_any_order_and_refuses_a_block_not_queued() -> None:
    queue = FreeBlockQueue(10)
    queue.popleft_n(10)
    queue.append_n(np.array([4, 5, 6, 7, 8], dtype=np.int64))
    queue.remove_each([6, 4, 8])
    assert queue.block_ids() == [5, 7]
    assert queue.num_free_blocks == 2
    with pytest.raises(KVConformError):
        queue.remove_each([7, 3])  # 7 leaves, 3 is not queued
    assert queue.block_ids() == [5]
    assert queue.num_free_blocks == 1


# -- a window's few tail blocks registered inline --------------------------------------


def test_cache_few_by_hand() -> None:
    pool = BlockPool(16, enable_caching=True, hash_block_size=4, compiled=False)
    pool.get_new_blocks(15)
    pool.cache_block(3, b"x", 0, 4)  # 3 already carries a shorter key
    pool.cache_block(5, b"q", 0, 4)  # q already has a head
    # first index 2, bs 4: positions 0..4 cover 12, 16, 20, 24, 28 tokens; mask keeps 1..4
    pool.cache_full_blocks(
        [9, 7, 0, 3, 6], [b"p", b"q", b"r", b"s", b"t"], 0, 2, 4, [False, True, True, True, True]
    )
    # 7 becomes a duplicate of q; the null is skipped; 3 is promoted from x (4 tokens) to
    # s (24 tokens); 6 is registered under t over 28 tokens; 9 (masked out) stays unhashed
    assert pool.cached == [{b"q": 5, b"s": 3, b"t": 6}]
    assert pool.duplicates == [{b"q": [7]}]
    assert sorted(pool.cached_block_entries()) == [(3, 0, 24), (5, 0, 4), (6, 0, 28), (7, 0, 16)]
    assert pool.index.block_hash[9] is None


# -- one full-attention spec group and one other: the one-pass search ------------------


@st.composite
def _two_spec_cases(draw):
    """A full (bs 4) + window (bs 4, w drawn) layout whose pool caches random blocks of
    one chain in each group, and a max length to search with."""
    window = draw(st.integers(1, 24))
    layout = _full_and_window(64, window)
    manager = OptimizedManager(layout)
    pool = manager.block_pool
    num_hashes = draw(st.integers(1, 12))
    hashes = _keys(*(bytes([i]) for i in range(num_hashes)))
    pool.get_new_blocks(2 * num_hashes)
    for g in (0, 1):
        for i in range(num_hashes):
            if draw(st.integers(0, 4)):  # cached 4 times in 5
                pool.cache_block(1 + g * num_hashes + i, hashes[i], g, 4 * (i + 1))
    return manager.coordinator, hashes, draw(st.integers(0, 4 * num_hashes + 2))


@given(case=_two_spec_cases())
def test_two_spec_search_matches_the_general_search(case) -> None:
    coordinator, hashes, max_length = case
    assert coordinator._two_specs
    expected = hybrid_coordinator_hit(coordinator, hashes, max_length)
    assert coordinator._two_spec_hit(hashes, max_length) == expected
    assert coordinator.find_longest_cache_hit(hashes, max_length) == expected


def test_two_spec_search_by_hand() -> None:
    # full bs 4 caches blocks 0..3, the window (w 8: 2 blocks) caches 1, 2 only; max 15
    manager = OptimizedManager(_full_and_window(30))
    pool = manager.block_pool
    pool.get_new_blocks(8)
    hashes = _keys(b"a", b"b", b"c", b"d")
    for i, h in enumerate(hashes):
        pool.cache_block(1 + i, h, 0, 4 * (i + 1))
    pool.cache_block(6, hashes[1], 1, 8)
    pool.cache_block(7, hashes[2], 1, 12)
    # full: 3 blocks fit 15 tokens -> 12; the window asked for <= 12: run 1, 2 ends at 12
    # -> hit 12 with [0, b1, b2]; full cut to 3 blocks; uncached 0
    assert manager.coordinator.find_longest_cache_hit(hashes, 15) == (
        [[1, 2, 3], [0, 6, 7]],
        12,
        0,
    )
    # max 19: full 16 (4 blocks); the window's block 3 is missing, so it answers 12:
    # the full list cut to 3 blocks, uncached 16 - 12 = 4
    assert manager.coordinator.find_longest_cache_hit(hashes, 19) == (
        [[1, 2, 3], [0, 6, 7]],
        12,
        4,
    )


# -- an admitted hit's new blocks registered from their list ---------------------------


def test_cache_fresh_blocks_by_hand() -> None:
    pool = BlockPool(40, enable_caching=True, hash_block_size=4, num_groups=2, compiled=False)
    pool.get_new_blocks(39)
    pool.cache_block(1, b"k2", 0, 4)  # k2 already has a head
    keys = [b"k%d" % i for i in range(12)]
    # a few: inline; first index 1, bs 4 -> 8, 12, 16 tokens
    pool.cache_fresh_blocks([5, 6, 7], keys[:3], 0, 1, 4)
    assert sorted(pool.cached_block_entries()) == [(1, 0, 4), (5, 0, 8), (6, 0, 12), (7, 0, 16)]
    assert pool.duplicates[0] == {b"k2": [7]}  # k2's head is 1
    # many (12 > 8): in bulk; in group 1 every key is new
    pool.cache_fresh_blocks(list(range(20, 32)), keys, 1, 0, 4)
    assert pool.cached[1] == {k: 20 + i for i, k in enumerate(keys)}
    # in group 0, k0..k2 already have heads (5, 6, 1): 8, 9, 10 queue as duplicates
    pool.cache_fresh_blocks(list(range(8, 20)), keys, 0, 0, 4)
    assert pool.duplicates[0] == {b"k0": [8], b"k1": [9], b"k2": [7, 10]}
    assert pool.cached[0][b"k3"] == 11 and pool.num_cached_tokens[19] == 48
    assert pool.block_group[8:20].tolist() == [0] * 12


def test_cache_fresh_blocks_at_positions_and_with_a_key_twice() -> None:
    pool = BlockPool(40, enable_caching=True, hash_block_size=4, num_groups=2, compiled=False)
    pool.get_new_blocks(39)
    keys = [b"m%d" % i for i in range(20)]
    kept = list(range(1, 20, 2))  # 10 kept: the bulk path at positions
    pool.cache_fresh_blocks([1 + k for k in kept], [keys[k] for k in kept], 0, 2, 4, kept)
    # kept positions 1, 3, ..., 19: blocks 2, 4, ..., 20 over (2 + k + 1) * 4 tokens
    assert sorted(pool.cached_block_entries()) == [(2 + 2 * j, 0, 16 + 8 * j) for j in range(10)]
    # a few at positions (one block at a time): 31 at position 0, 33 at position 5
    pool.cache_fresh_blocks([31, 33], [b"x", b"y"], 0, 2, 4, [0, 5])
    assert pool.num_cached_tokens[[31, 33]].tolist() == [12, 32]
    assert pool.cached[0][b"y"] == 33 and pool.block_group[33] == 0
    # a key twice in one call: the block-by-block rule (the first block is the head)
    twice = [b"t%d" % i for i in range(9)] + [b"t0"]
    pool.cache_fresh_blocks(list(range(21, 31)), twice, 1, 0, 4)
    assert pool.cached[1][b"t0"] == 21 and pool.duplicates[1] == {b"t0": [30]}
    assert pool.num_cached_tokens[30] == 40


def test_cache_fresh_blocks_with_a_key_already_there_and_twice() -> None:
    pool = BlockPool(40, enable_caching=True, hash_block_size=4, compiled=False)
    pool.get_new_blocks(39)
    pool.cache_block(1, b"a", 0, 4)  # a's head is 1
    keys = [b"a", b"b", b"b", *(b"c%d" % i for i in range(7))]
    blocks = list(range(10, 20))
    # from the popped array too; first index 0, bs 4: 10 over 4 tokens, ..., 19 over 40
    pool.cache_fresh_blocks(blocks, keys, 0, 0, 4, None, np.array(blocks, dtype=np.intp))
    # block by block: 10 queues behind a's head 1, 11 heads b, 12 queues behind 11
    assert pool.cached[0][b"a"] == 1 and pool.cached[0][b"b"] == 11
    assert pool.duplicates[0] == {b"a": [10], b"b": [12]}
    assert pool.num_cached_tokens[10:20].tolist() == [4 * (k + 1) for k in range(10)]
    assert pool.index.block_hash[12] == b"b" and pool.block_group[19] == 0


def test_fresh_rows_cache_their_new_blocks_like_the_reference() -> None:
    for retention in (None, 0, 16):
        pair = Pair(_full_and_window(120, 8, retention))
        # no hit: 48 tokens, 12 blocks per group (the bulk paths), then 8 (inline)
        pair.add("a", list(range(48)))
        pair.allocate("a", 48)
        pair.add("b", list(range(100, 108)))
        pair.allocate("b", 8)
        # a chunked prefill: the second chunk goes to a row that is no longer fresh
        pair.add("c", list(range(300, 360)))
        pair.allocate("c", 36)
        pair.set_computed("c", 36)
        pair.allocate("c", 24)
        # a prompt sharing a's first 40 tokens hits them; another with no hit reuses
        # a's freed blocks (their keys evicted as they are popped)
        pair.free("a")
        pair.add("d", [*range(40), *range(500, 520)])
        hit = pair.lookup("d")
        assert pair.allocate("d", 60 - hit[1][1], hit) is not None
        pair.add("e", list(range(700, 760)))
        assert pair.allocate("e", 60) is not None
        for rid in ("b", "c", "d", "e"):
            pair.free(rid)


@given(
    block_size=st.sampled_from([1, 2, 4]),
    window=st.integers(1, 24),
    scale=st.sampled_from([1, 2, 4]),
    prompt=st.integers(1, 80),
    junction=st.integers(0, 80),
    span=st.tuples(st.integers(0, 30), st.integers(0, 30)),
    retention=st.sampled_from([None, 0, 1, 2]),
)
def test_window_cache_positions_match_the_reference_mask(
    block_size: int, window: int, scale: int, prompt: int, junction: int, span, retention
) -> None:
    """A window's ``cacheable_block_positions`` (its sparse case computed without a
    mask) are the kept entries of the reference's ``window_cache_mask``; alignment
    ``scale * bs`` (a full group of a larger block size sets it), retention dense, sparse
    or an interval of scheduler blocks."""
    layout = KVCacheLayout(
        (
            KVCacheGroup(("full",), FullAttentionSpec(block_size=block_size * scale)),
            KVCacheGroup(("w",), SlidingWindowSpec(block_size=block_size, sliding_window=window)),
        ),
        num_blocks=16,
        max_model_len=128,
        enable_caching=True,
    )
    if retention is not None:
        interval = retention * layout.scheduler_block_size
        layout = dataclasses.replace(layout, prefix_cache_retention_interval=interval)
    swa = OptimizedManager(layout).coordinator.managers[1]
    assert swa._sparse_mask == (retention == 0)
    request = OptimizedManager(layout).make_request("r", list(range(prompt)))
    request.shared_prefix_boundary = junction
    start, end = min(span), max(span)
    mask = window_cache_mask(swa, request, start, end)
    expected = None if mask is None else [k for k, keep in enumerate(mask) if keep]
    kept = swa.cacheable_block_positions(request, start, end)  # a list, or one run's range
    assert (None if kept is None else list(kept)) == expected


def test_cache_new_blocks_falls_back_on_another_row_shape() -> None:
    manager = OptimizedManager(
        KVCacheLayout(
            (KVCacheGroup(("full",), FullAttentionSpec(block_size=4)),),
            num_blocks=20,
            max_model_len=64,
            enable_caching=True,
        )
    )
    request = manager.make_request("r", list(range(16)))
    manager.allocate_slots(request, 6)  # 2 blocks, 1 cached (6 tokens)
    full = manager.coordinator.managers[0]
    row = manager.coordinator.row_of["r"]
    assert full.num_cached_block[row] == 1
    # the row's second block is not in new_blocks (none given): the general rule caches it
    full.cache_new_blocks(request, row, 8, [])
    assert full.num_cached_block[row] == 2
    assert sorted(manager.block_pool.cached_block_entries()) == [(1, 0, 4), (2, 0, 8)]


def test_admitted_hits_cache_their_new_blocks_like_the_reference() -> None:
    for retention in (None, 0, 16):
        pair = Pair(_full_and_window(120, 8, retention))
        pair.add("a", list(range(40)))
        pair.allocate("a", 40)
        # a hit of 40 tokens, then 48 (12 blocks per group: the bulk paths) or 8 new
        for rid, extra in (("b", 48), ("c", 8)):
            pair.add(rid, [*range(40), *range(200 + extra, 200 + 2 * extra)])
            hit = pair.lookup(rid)
            hit_tokens = hit[1][1]  # 40, or less where the retention kept fewer window blocks
            assert hit_tokens > 0
            assert pair.allocate(rid, 40 + extra - hit_tokens, hit) is not None
        pair.free("a")
        pair.free("b")
        pair.free("c")


# -- a one-group window scan, looked up from the right --------------------------------


class _CountingDict(dict):
    """A cache map counting its ``get`` calls."""

    gets = 0

    def get(self, key, default=None):
        type(self).gets += 1
        return super().get(key, default)


def test_one_group_window_scan_looks_up_from_the_right_only() -> None:
    pool = BlockPool(40, enable_caching=True, hash_block_size=4, compiled=False)
    pool.get_new_blocks(39)
    hashes = [bytes([i]) for i in range(16)]
    for i in (3, 4, 14, 15):
        pool.cache_block(20 + i, hashes[i], 0, 4 * (i + 1))
    pool.index.cached[0] = _CountingDict(pool.index.cached[0])  # (the dict form)
    spec = SlidingWindowSpec(block_size=4, sliding_window=8)  # need 2
    # blocks 14, 15 end the rightmost run: two lookups
    blocks, hit = SlidingWindowManager.find_longest_cache_hit(hashes, 64, [0], pool, spec, 4)
    assert (blocks, hit) == ([[0] * 14 + [34, 35]], 64) and _CountingDict.gets == 2
    # max 60 (15 blocks): 14 alone is too short, 13..5 miss, 4 and 3 make the run
    blocks, hit = SlidingWindowManager.find_longest_cache_hit(hashes, 60, [0], pool, spec, 4)
    assert (blocks, hit) == ([[0, 0, 0, 23, 24]], 20) and _CountingDict.gets == 2 + 12
    # w 16 (need 4): no run that long; the run reaching block 0 is none (0 misses)
    spec = SlidingWindowSpec(block_size=4, sliding_window=16)
    blocks, hit = SlidingWindowManager.find_longest_cache_hit(hashes, 64, [0], pool, spec, 4)
    assert (blocks, hit) == ([[]], 0)
