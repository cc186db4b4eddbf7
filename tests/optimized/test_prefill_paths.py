"""The prefill shortcuts of the optimized manager, forced and checked by hand and against
the reference (:class:`tests.optimized.optimized_differential.Pair`):

* a new request's hit counted and adopted at once (``count_hit_admission``,
  ``adopt_hit``, ``BlockPool.touch_array``): free hit blocks counted as taken, a
  refusal that changes nothing, window blocks skipped as nulls, nulls and repeated blocks
  in a hand-made hit.
"""

from __future__ import annotations

import numpy as np

from optimized.control.block_pool import BlockPool
from optimized.control.kv_cache_manager import ComputedBlocks
from optimized.control.kv_cache_manager import KVCacheManager as OptimizedManager
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, SlidingWindowSpec
from tests.optimized.optimized_differential import Pair


def _full_and_window(num_blocks: int, window: int = 8) -> KVCacheLayout:
    """Full attention bs 4 + a sliding window of ``window`` tokens bs 4."""
    return KVCacheLayout(
        (
            KVCacheGroup(("full",), FullAttentionSpec(block_size=4)),
            KVCacheGroup(("w",), SlidingWindowSpec(block_size=4, sliding_window=window)),
        ),
        num_blocks=num_blocks,
        max_model_len=128,
        enable_caching=True,
    )


# -- touch_array -------------------------------------------------------------------


def test_touch_array_by_hand() -> None:
    pool = BlockPool(12, enable_caching=True, hash_block_size=4)
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
    pool.cache_full_blocks([1, 2, 3], [b"a", b"b", b"c"], 0, 0, 4)
    pool.cache_full_blocks([4, 5], [b"d", b"e"], 1, 2, 4)
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
