"""The bulk paths of admission and prefill, each forced and checked by hand and against the
reference (:class:`tests.optimized.optimized_differential.Pair`):

* ``popleft_array``: runs of consecutive ids taken with one array test while many
  blocks are left, the rest walked block by block; ``get_new_block_array`` evicts the
  popped blocks' keys;
* ``cache_full_blocks``: the bulk registration (masks, nulls) and its fallbacks (a key
  already cached, a key twice in one call, a block with a shorter key);
* ``_evict_many`` with and without duplicate keys;
* the bulk hit scans (full attention, sliding window, Mamba) against the reference scans
  on random cached sets, alignments and windows;
* the hybrid miss test of ``find_longest_cache_hit`` (first full block missing, too short
  a prompt) and the general search it falls back to;
* the row-less count (against the reference's ``blocks_to_allocate`` on random
  layouts) and refusal of ``allocate_slots`` and the allocation of every group's blocks
  in one pop.
"""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given
from hypothesis import strategies as st

from optimized.control.block_pool import BlockPool, FreeBlockQueue
from optimized.control.coordinator import HybridCoordinator, make_coordinator
from optimized.control.hashing import hashes_at_block_size
from optimized.control.managers import FullAttentionManager, MambaManager, SlidingWindowManager
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.managers.base import blocks_to_allocate
from reference.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from tests.optimized.optimized_differential import Pair, layouts

# -- the free queue and the pool ---------------------------------------------------


def _queue(order: list[int], num_blocks: int = 32) -> FreeBlockQueue:
    """A queue of ``num_blocks`` ids holding exactly ``order`` (front first), popping
    through the numpy walk."""
    queue = FreeBlockQueue(num_blocks, compiled=False)
    queue.popleft_n(num_blocks)
    queue.append_n(np.array(order, dtype=np.int64))
    return queue


def test_popleft_array_takes_runs_and_walks_the_rest() -> None:
    # an ascending run 4..70 (67 ids), then 2 (walked alone), then a descending run of 50
    # ids (more than MIN_RUN_TEST: both runs are tested as runs), then 3
    order = [*range(4, 71), 2, *range(120, 70, -1), 3]
    queue = _queue(order, 128)
    assert queue.popleft_array(68).tolist() == [*range(4, 71), 2]
    assert queue.block_ids() == [*range(120, 70, -1), 3]
    assert queue.num_free_blocks == 51
    # the descending run 120..71 then one more block
    assert queue.popleft_array(51).tolist() == [*range(120, 70, -1), 3]
    assert queue.block_ids() == [] and queue.num_free_blocks == 0


def test_popleft_array_walks_few_blocks_whatever_their_ids() -> None:
    # 20 blocks (at most MIN_RUN_TEST): walked link by link, runs or not
    order = [*range(4, 21), 2, *range(31, 21, -1), 3]
    queue = _queue(order)
    assert queue.popleft_array(18).tolist() == [*range(4, 21), 2]
    assert queue.popleft_array(11).tolist() == [*range(31, 21, -1), 3]
    assert queue.block_ids() == [] and queue.num_free_blocks == 0


def test_popleft_array_of_a_scattered_queue_and_small_pops() -> None:
    order = [9, 3, 17, 5, 12, 1, 30, 8, 21, 14, 2]
    queue = _queue(order)
    assert queue.popleft_array(10).tolist() == order[:10]
    assert queue.popleft_n(1) == [2]  # the scalar path (few blocks)
    queue.append_n(np.array([7, 6, 5, 4, 3, 2, 1, 9, 10], dtype=np.int64))
    assert queue.popleft_n(9) == [7, 6, 5, 4, 3, 2, 1, 9, 10]  # > 8: the array path
    assert queue.popleft_array(0).size == 0


def test_get_new_block_array_evicts_the_keys_of_popped_blocks() -> None:
    pool = BlockPool(12, enable_caching=True, hash_block_size=4, num_groups=2, compiled=False)
    blocks = pool.get_new_blocks(11)  # 1..11
    assert blocks == list(range(1, 12))
    pool.cache_full_blocks([1, 2, 3], [b"a", b"b", b"c"], 0, 0, 4)
    pool.cache_full_blocks([4, 5], [b"a", b"e"], 1, 0, 4)
    # freed tail first: the unhashed 11..6 go to the front as one chain, the hashed back
    pool.free_blocks(list(range(11, 0, -1)))
    assert pool.free_block_queue.block_ids() == [11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
    got = pool.get_new_block_array(9)  # evicts 5 ("e", group 1), 4 ("a", group 1), 3 ("c")
    assert got.tolist() == [11, 10, 9, 8, 7, 6, 5, 4, 3]
    assert pool.cached == [{b"a": 1, b"b": 2}, {}]
    assert pool.cached_block_entries() == [(1, 0, 4), (2, 0, 8)]
    assert pool.ref_cnt[got].tolist() == [1] * 9


def test_evict_many_promotes_duplicates_in_registration_order() -> None:
    pool = BlockPool(10, enable_caching=True, hash_block_size=4, compiled=False)
    pool.get_new_blocks(9)
    for b in (3, 5, 7):  # key k on 3 (head), then 5 and 7
        pool.cache_block(b, b"k", 0, 4)
    pool.cache_block(8, b"m", 0, 4)
    pool._evict_many(np.array([8, 3], dtype=np.int64))
    assert pool.cached == [{b"k": 5}]
    assert pool.duplicates == [{b"k": [7]}]
    assert pool.index.block_hash[3] is None and pool.index.block_hash[8] is None
    pool._evict_many(np.array([7, 5], dtype=np.int64))
    assert pool.cached == [{}] and pool.duplicates == [{}]
    assert pool.cached_block_entries() == []


def test_cache_full_blocks_bulk_with_mask_and_nulls() -> None:
    pool = BlockPool(16, enable_caching=True, hash_block_size=4, compiled=False)
    pool.get_new_blocks(15)
    # first index 2, bs 4: positions 0..4 cover 12, 16, 20, 24, 28 tokens; the null at
    # position 1 and the masked position 3 are skipped
    pool.cache_full_blocks(
        np.array([7, 0, 9, 10, 11], dtype=np.int32),
        [b"p", b"q", b"r", b"s", b"t"],
        0,
        2,
        4,
        [True, True, True, False, True],
    )
    assert pool.cached == [{b"p": 7, b"r": 9, b"t": 11}]
    assert pool.cached_block_entries() == [(7, 0, 12), (9, 0, 20), (11, 0, 28)]


def test_cache_full_blocks_bulk_paths_by_hand() -> None:
    pool = BlockPool(64, enable_caching=True, hash_block_size=2, compiled=False)
    pool.get_new_blocks(63)
    keys = [bytes([k]) for k in range(12)]
    # no mask: the keys written at once
    pool.cache_full_blocks(np.arange(10, 22, dtype=np.int32), keys, 0, 0, 2)
    assert pool.index.block_hash[10:22].tolist() == keys
    assert pool.cached_block_entries()[0] == (10, 0, 2)
    assert pool.cached_block_entries()[-1] == (21, 0, 24)
    # a mask keeping 10 of 12 blocks (more than a few): positions 1 and 6 skipped, the
    # others registered over (first index 3 + k + 1) * 2 tokens
    pool.cache_full_blocks(
        np.arange(40, 52, dtype=np.int32),
        [bytes([100 + k]) for k in range(12)],
        0,
        3,
        2,
        [k not in (1, 6) for k in range(12)],
    )
    entries = [e for e in pool.cached_block_entries() if e[0] >= 40]
    assert [e[0] for e in entries] == [40, 42, 43, 44, 45, 47, 48, 49, 50, 51]
    assert [e[2] for e in entries] == [8, 12, 14, 16, 18, 22, 24, 26, 28, 30]
    assert pool.cached[0][bytes([107])] == 47 and bytes([101]) not in pool.cached[0]


def test_cache_full_blocks_fallbacks_match_the_block_by_block_rule() -> None:
    pool = BlockPool(16, enable_caching=True, hash_block_size=4, compiled=False)
    pool.get_new_blocks(15)
    pool.cache_full_blocks([1, 2], [b"a", b"b"], 0, 0, 4)
    # a key already cached: 3 becomes a duplicate of "a", 4 registers "x"
    pool.cache_full_blocks([3, 4], [b"a", b"x"], 0, 0, 4)
    assert pool.cached == [{b"a": 1, b"b": 2, b"x": 4}]
    assert pool.duplicates == [{b"a": [3]}]
    # a key twice in one call: the bulk update is undone, the rule registers 5 then 6
    pool.cache_full_blocks([5, 6, 7], [b"y", b"y", b"z"], 0, 0, 4)
    assert pool.cached[0][b"y"] == 5 and pool.cached[0][b"z"] == 7
    assert pool.duplicates[0][b"y"] == [6]
    assert [e for e in pool.cached_block_entries() if e[0] in (5, 6, 7)] == [
        (5, 0, 4),
        (6, 0, 8),
        (7, 0, 12),
    ]
    # a block with a shorter key is promoted; one with a key as long is kept
    pool.cache_full_blocks([1, 8], [b"a2", b"w"], 0, 1, 4)  # 1 had 4 tokens, now 8
    assert pool.cached[0][b"a2"] == 1 and pool.cached[0][b"a"] == 3
    assert pool.cached_block_entries()[0] == (1, 0, 8)


# -- the coordinator and the manager, against the reference ---------------------------


def _hybrid(num_blocks: int) -> KVCacheLayout:
    return KVCacheLayout(
        (
            KVCacheGroup(("full",), FullAttentionSpec(block_size=4)),
            KVCacheGroup(("w0",), SlidingWindowSpec(block_size=4, sliding_window=8)),
            KVCacheGroup(("w1",), SlidingWindowSpec(block_size=4, sliding_window=8)),
        ),
        num_blocks=num_blocks,
        max_model_len=128,
        enable_caching=True,
    )


def test_hybrid_miss_test_and_the_general_search() -> None:
    pair = Pair(_hybrid(80))
    coordinator = pair.opt.coordinator
    assert isinstance(coordinator, HybridCoordinator)
    pair.add("a", list(range(40)))
    pair.allocate("a", 40)  # 10 blocks per group, 30 in all: one bulk pop
    assert pair.opt.get_block_ids("a")[0] == tuple(range(1, 11))
    assert pair.opt.get_block_ids("a")[1] == tuple(range(11, 21))
    # a prompt whose first block differs: settled by the miss test
    pair.add("b", [99, *range(1, 40)])
    assert coordinator.find_longest_cache_hit(pair.opt_reqs["b"].block_hashes, 39) == (
        [[], [], []],
        0,
        0,
    )
    pair.lookup("b")
    # too short to reach one full block: no hit
    pair.add("c", [0, 1, 2])
    pair.lookup("c")
    # the same first 36 tokens: the general search (hit 36 in the full group, the windows
    # need the blocks before 36 that the retention kept)
    pair.add("d", [*range(36), 7, 7, 7, 7, 7])
    (_, rn), (_, on) = hit = pair.lookup("d")
    assert rn == on == 36
    pair.allocate("d", 41 - rn, hit)
    pair.free("a")
    pair.free("d")


@given(
    layout=layouts(),
    num_tokens=st.integers(1, 200),
    computed=st.one_of(st.just(0), st.integers(0, 64)),
)
def test_count_for_a_new_request_matches_the_reference_rule(
    layout: KVCacheLayout, num_tokens: int, computed: int
) -> None:
    """``num_blocks_for_new_request`` (its nothing-computed shortcut included) is the sum
    of the reference's ``blocks_to_allocate`` over the groups, nothing held, no hit."""
    coordinator = make_coordinator(layout)
    assume(coordinator.plain_counts)
    expected = sum(
        blocks_to_allocate(g.spec, num_tokens, 0, False, (), computed, lambda block: False)
        for g in layout.groups
    )
    assert coordinator.num_blocks_for_new_request(num_tokens, computed) == expected


def test_row_less_refusal_takes_no_row_and_matches_the_reference() -> None:
    pair = Pair(_hybrid(24))  # 23 usable blocks
    pair.add("a", list(range(32)))
    assert pair.allocate("a", 32) is None  # 8 blocks per group: 24 > 23 free
    assert pair.opt.last_num_blocks_to_allocate == 24
    assert "a" not in pair.opt.coordinator.row_of
    pair.add("b", list(range(100, 128)))
    pair.allocate("b", 28)  # 7 blocks per group: 21 blocks, one bulk pop
    assert pair.opt.coordinator.row_of["b"] == 0
    pair.free("a")  # freeing a refused request: nothing to free
    pair.allocate("a", 8)  # 2 blocks per group: 6 > the 2 left, refused again
    pair.free("b")
    assert pair.allocate("a", 28) is not None  # 21 blocks: now it fits
    pair.free("a")


def test_mamba_layouts_count_per_group_and_pop_at_once() -> None:
    layout = KVCacheLayout(
        (
            KVCacheGroup(("full",), FullAttentionSpec(block_size=4)),
            KVCacheGroup(("m",), MambaSpec(block_size=4)),
        ),
        num_blocks=60,
        max_model_len=128,
        enable_caching=True,
    )
    pair = Pair(layout)
    assert not pair.opt.coordinator.plain_counts
    pair.add("a", list(range(48)))
    pair.allocate("a", 48)  # 12 full blocks, one state block
    pair.add("b", list(range(48)))
    pair.allocate("b", 48 - pair.lookup("b")[0][1], pair.lookup("b"))
    pair.free("a")
    pair.free("b")


# -- the bulk hit scans against the reference scans -----------------------------------


@st.composite
def _scan_cases(draw):
    """A pool with random cached blocks over a chain of hashes in 1-2 groups, and a
    manager class, spec, alignment and max length to search with."""
    hash_block = draw(st.sampled_from([1, 2, 4]))
    bs = hash_block * draw(st.sampled_from([1, 2]))
    kind = draw(st.sampled_from(["full", "swa", "mamba"]))
    if kind == "full":
        cls, spec = FullAttentionManager, FullAttentionSpec(block_size=bs)
    elif kind == "swa":
        window = draw(st.integers(1, 6 * bs))
        cls, spec = SlidingWindowManager, SlidingWindowSpec(block_size=bs, sliding_window=window)
    else:
        cls, spec = MambaManager, MambaSpec(block_size=bs)
    alignment = bs * draw(st.sampled_from([1, 2, 3]))
    num_hashes = draw(st.integers(0, 24))
    hashes = [bytes([i]) for i in range(num_hashes)]
    group_ids = [0] if draw(st.booleans()) else [0, 1]
    pool = BlockPool(
        2 * num_hashes + 2, True, hash_block_size=hash_block, num_groups=2, compiled=False
    )
    pool.get_new_blocks(2 * num_hashes + 1)
    k = bs // hash_block
    for g in group_ids:
        for i in range(k - 1, num_hashes, k):
            if draw(st.integers(0, 3)):  # cached 3 times in 4
                pool.cache_block(1 + g * num_hashes + i, hashes[i], g, (i + 1) * hash_block)
    max_length = draw(st.integers(0, num_hashes * hash_block + 2))
    return cls, spec, pool, hashes, group_ids, alignment, max_length


@given(case=_scan_cases())
def test_bulk_scans_match_the_reference_scans(case) -> None:
    cls, spec, pool, hashes, group_ids, alignment, max_length = case
    fast = cls.find_longest_cache_hit(hashes, max_length, group_ids, pool, spec, alignment)
    coarse = hashes_at_block_size(hashes, pool.hash_block_size, spec.block_size)
    expected = cls.scan(
        coarse, max_length, len(group_ids), spec, alignment, pool.lookup(group_ids), 0
    )
    assert fast == expected


def test_window_scan_by_hand() -> None:
    # bs 2, w 5 -> need 2; alignment 4: a run must end on an even block count
    pool = BlockPool(20, enable_caching=True, hash_block_size=2, compiled=False)
    pool.get_new_blocks(19)
    hashes = [bytes([i]) for i in range(8)]
    for i in (0, 1, 2, 4, 5, 6):
        pool.cache_block(10 + i, hashes[i], 0, 2 * (i + 1))
    spec = SlidingWindowSpec(block_size=2, sliding_window=5)
    # from the right: 7 misses; 6 ends at 14 (not aligned: skipped); 5 ends at 12 ->
    # run 5, 4: hit 12 = blocks [0, 0, 0, 0, b4, b5]
    blocks, hit = SlidingWindowManager.find_longest_cache_hit(hashes, 16, [0], pool, spec, 4)
    assert (blocks, hit) == ([[0, 0, 0, 0, 14, 15]], 12)
    # w 9 -> need 4: no run that long; the run reaching block 0 is 0..2 (ends at 6, cut
    # to 4 tokens: [b0, b1])
    spec = SlidingWindowSpec(block_size=2, sliding_window=9)
    blocks, hit = SlidingWindowManager.find_longest_cache_hit(hashes, 16, [0], pool, spec, 4)
    assert (blocks, hit) == ([[10, 11]], 4)


def test_touch_in_bulk_takes_free_blocks_out_once() -> None:
    pool = BlockPool(20, enable_caching=True, hash_block_size=4, compiled=False)
    pool.get_new_blocks(19)
    pool.cache_full_blocks(list(range(1, 11)), [bytes([k]) for k in range(10)], 0, 0, 4)
    pool.free_blocks(list(range(10, 0, -1)))  # hashed: to the back, 10 first
    pool.free_blocks([19])  # unhashed: to the front
    assert pool.free_block_queue.block_ids() == [19, *range(10, 0, -1)]
    # 10 blocks (more than a few), 5 given twice, the null skipped, 11 already held
    pool.touch([0, 1, 2, 3, 4, 5, 5, 6, 7, 11])
    assert pool.free_block_queue.block_ids() == [19, 10, 9, 8]
    assert pool.ref_cnt[[1, 4, 5, 7, 11]].tolist() == [1, 1, 2, 1, 2]
    assert pool.get_num_free_blocks() == 4


def test_a_hit_on_free_blocks_counts_them_as_taken() -> None:
    layout = KVCacheLayout(
        (KVCacheGroup(("full",), FullAttentionSpec(block_size=4)),),
        num_blocks=11,  # 10 usable
        max_model_len=64,
        enable_caching=True,
    )
    pair = Pair(layout)
    pair.add("a", list(range(32)))
    pair.allocate("a", 32)  # 8 blocks, all cached
    pair.free("a")
    # 44 tokens: hit 32 (8 free cached blocks) + 3 new blocks = 11 > 10 free: refused
    pair.add("b", list(range(44)))
    hit = pair.lookup("b")
    assert hit[1][1] == 32
    assert pair.allocate("b", 12, hit) is None
    assert pair.opt.last_num_blocks_to_allocate == 11
    # 40 tokens: 8 + 2 = 10: admitted
    pair.add("c", list(range(40)))
    hit = pair.lookup("c")
    assert pair.allocate("c", 8, hit) is not None
