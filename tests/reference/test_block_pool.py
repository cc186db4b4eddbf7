"""Block pool rules (spec 2.5 and 3): null block, free-queue order, lazy eviction."""

from __future__ import annotations

import pytest

from reference.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock, PoolExhaustedError
from reference.errors import KVConformError
from reference.hashing import cache_key

H0, H1, H2 = (bytes([i]) * 32 for i in range(1, 4))


def _pool(n: int = 8) -> BlockPool:
    return BlockPool(n, enable_caching=True, hash_block_size=4)


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_fresh_pool() -> None:
    pool = _pool(8)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 4, 5, 6, 7]
    assert pool.get_num_free_blocks() == 7
    assert pool.get_usage() == 0.0


def test_prepend_test_vector() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeBlockQueue([blocks[0]])
    queue.prepend_n([blocks[4], blocks[5]])
    assert queue.block_ids() == [4, 5, 0]
    queue.prepend_n([blocks[1], blocks[2]])
    assert queue.block_ids() == [1, 2, 4, 5, 0]
    queue.append_n([blocks[3]])
    assert queue.block_ids() == [1, 2, 4, 5, 0, 3]
    queue.remove(blocks[5])
    assert queue.block_ids() == [1, 2, 4, 0, 3]
    assert queue.popleft().block_id == 1
    assert queue.num_free_blocks == 4


def test_remove_unlinked_block_raises() -> None:
    queue = FreeBlockQueue([KVCacheBlock(1)])
    with pytest.raises(KVConformError):
        queue.remove(KVCacheBlock(9))


def test_allocation_pops_front_and_sets_ref_one() -> None:
    pool = _pool(8)
    got = pool.get_new_blocks(3)
    assert _ids(got) == [1, 2, 3]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.free_block_queue.block_ids() == [4, 5, 6, 7]
    assert pool.get_usage() == pytest.approx(3 / 7)


def test_free_unhashed_front_hashed_back() -> None:
    pool = _pool(8)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_full_block(b, H0, 0, 4)
    pool.cache_full_block(d, H1, 0, 8)
    # freed tail first: d (hashed), c, b (hashed), a
    pool.free_blocks([d, c, b, a])
    assert pool.free_block_queue.block_ids() == [3, 1, 5, 6, 7, 4, 2]
    assert all(x.ref_cnt == 0 for x in (a, b, c, d))


def test_null_block_is_skipped_by_free_and_touch() -> None:
    pool = _pool(4)
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 0
    assert pool.free_block_queue.block_ids() == [1, 2, 3]
    pool.cache_full_block(pool.null_block, H0, 0, 4)
    assert pool.null_block.cache_key is None
    assert pool.cached == {}


def test_free_below_zero_raises() -> None:
    pool = _pool(4)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(KVConformError):
        pool.free_blocks([a])


def test_touch_revives_a_cached_free_block() -> None:
    pool = _pool(6)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, H0, 0, 4)
    pool.free_blocks([b, a])
    assert pool.free_block_queue.block_ids() == [2, 3, 4, 5, 1]
    pool.touch([a])
    assert a.ref_cnt == 1
    assert pool.free_block_queue.block_ids() == [2, 3, 4, 5]
    pool.touch([a])
    assert a.ref_cnt == 2
    assert pool.get_cached_block(H0, [0]) == [a]


def test_lazy_eviction_on_reallocation() -> None:
    pool = _pool(3)  # free: 1, 2
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, H0, 0, 4)
    pool.cache_full_block(b, H1, 0, 8)
    pool.free_blocks([b, a])  # both hashed: appended b, a
    assert pool.free_block_queue.block_ids() == [2, 1]
    assert pool.get_cached_block(H1, [0]) == [b]  # still cached while free
    (got,) = pool.get_new_blocks(1)
    assert got is b
    assert b.cache_key is None
    assert pool.get_cached_block(H1, [0]) is None
    assert pool.get_cached_block(H0, [0]) == [a]


def test_get_new_blocks_too_many_raises_and_changes_nothing() -> None:
    pool = _pool(4)
    with pytest.raises(PoolExhaustedError):
        pool.get_new_blocks(4)
    assert pool.free_block_queue.block_ids() == [1, 2, 3]


def test_shared_key_map_check_values() -> None:
    # blocks with keys [h0, h1, h2, h0] -> {h0: {b1, b4}, h1: b2, h2: b3}
    pool = _pool(6)
    b1, b2, b3, b4 = pool.get_new_blocks(4)
    for block, h in zip((b1, b2, b3, b4), (H0, H1, H2, H0)):
        pool.cache_full_block(block, h, 0, 4)
    k0, k1, k2 = (cache_key(h, 0) for h in (H0, H1, H2))
    assert {k: sorted(v) for k, v in pool.cached.items()} == {k0: [1, 4], k1: [2], k2: [3]}
    assert pool.get_cached_block(H0, [0]) == [b1]  # the earliest inserted
    pool.evict_blocks([2])
    assert k1 not in pool.cached
    pool.evict_blocks([1])
    assert {k: sorted(v) for k, v in pool.cached.items()} == {k0: [4], k2: [3]}
    assert pool.get_cached_block(H0, [0]) == [b4]
    pool.evict_blocks([3, 4])
    assert pool.cached == {}
    # eviction keeps ref counts and the queue
    assert [b.ref_cnt for b in (b1, b2, b3, b4)] == [1, 1, 1, 1]
    assert pool.free_block_queue.block_ids() == [5]


def test_get_cached_block_needs_every_group() -> None:
    pool = _pool(6)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, H0, 0, 4)
    pool.cache_full_block(b, H0, 2, 4)
    assert pool.get_cached_block(H0, [0, 2]) == [a, b]
    assert pool.get_cached_block(H0, [0, 1]) is None
    assert pool.get_cached_block(H0, [1]) is None


def test_cache_full_block_promotes_a_partial_entry() -> None:
    pool = _pool(4)
    (a,) = pool.get_new_blocks(1)
    assert pool.cache_partial_block(a, H0, 0, 4) == cache_key(H0, 0)  # 4 of its 8 tokens
    assert (a.cache_key, a.num_cached_tokens) == (cache_key(H0, 0), 4)
    pool.cache_full_block(a, H1, 0, 8)  # promoted to the 8-token key
    assert a.cache_key == cache_key(H1, 0)
    assert a.num_cached_tokens == 8
    assert pool.get_cached_block(H0, [0]) is None
    assert pool.get_cached_block(H1, [0]) == [a]


def test_partial_entry_on_a_block_cached_in_full_is_a_secondary_key() -> None:
    # vLLM 0.33 BlockPool.cache_partial_block: the primary key (8 tokens) is not shorter
    pool = _pool(4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, H1, 0, 8)
    assert pool.cache_partial_block(a, H0, 0, 4) == cache_key(H0, 0)
    assert (a.cache_key, a.num_cached_tokens) == (cache_key(H1, 0), 8)
    assert a.secondary_keys == [cache_key(H0, 0)]
    assert pool.get_cached_block(H0, [0]) == [a] == pool.get_cached_block(H1, [0])
    # registering it again changes nothing
    pool.cache_partial_block(a, H0, 0, 4)
    assert a.secondary_keys == [cache_key(H0, 0)]
    # eviction on reuse drops every key
    pool.free_blocks([a])
    (again,) = pool.get_new_blocks(3)[-1:]
    assert again is a and pool.cached == {} and a.secondary_keys == []


def test_partial_entry_replacing_the_content_drops_every_key() -> None:
    pool = _pool(4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, H1, 0, 8)
    pool.cache_partial_block(a, H0, 0, 4, replace_existing=True)
    assert (a.cache_key, a.num_cached_tokens, a.secondary_keys) == (cache_key(H0, 0), 4, [])
    assert pool.get_cached_block(H1, [0]) is None


def test_a_longer_partial_entry_supersedes_a_shorter_one() -> None:
    pool = _pool(4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_partial_block(a, H0, 0, 4)
    pool.cache_partial_block(a, H2, 0, 12)
    assert (a.cache_key, a.num_cached_tokens) == (cache_key(H2, 0), 12)
    assert pool.get_cached_block(H0, [0]) is None


def test_move_keys_repoints_every_key() -> None:
    pool = _pool(6)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(a, H1, 0, 8)
    pool.cache_partial_block(a, H0, 0, 4)
    pool.cache_full_block(c, H0, 0, 4)  # another block under H0, inserted later
    pool.move_keys(a, b)
    assert (a.cache_key, a.secondary_keys) == (None, [])
    assert (b.cache_key, b.num_cached_tokens, b.secondary_keys) == (
        cache_key(H1, 0),
        8,
        [cache_key(H0, 0)],
    )
    assert pool.get_cached_block(H1, [0]) == [b]
    assert pool.get_cached_block(H0, [0]) == [c]  # c was indexed before b


def test_null_block_takes_no_partial_entry() -> None:
    pool = _pool(4)
    assert pool.cache_partial_block(pool.null_block, H0, 0, 4) is None
    assert pool.cached == {}


def test_reset_prefix_cache_only_when_nothing_held() -> None:
    pool = _pool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, H0, 0, 4)
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(H0, [0]) == [a]
    pool.free_blocks([b])
    assert pool.free_block_queue.block_ids() == [2, 3, 1]
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert a.cache_key is None
    assert pool.free_block_queue.block_ids() == [2, 3, 1]
