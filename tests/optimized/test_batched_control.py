"""The batched control plane, hand-valued: ``schedule_columns`` (the step as columns), the
vectorised decode apply with window frees to the front (no pops in the step, or each
item popping only blocks it freed itself) and its fallback to the per-item path (a pop
reaching another item's front free), and the free queue's run pops.

Queue values follow the reference rule (:mod:`reference.block_pool`): a block reaching ref
count 0 unhashed goes to the front, each free call before the earlier ones; pops take the
front."""

from __future__ import annotations

import numpy as np
import pytest

import optimized.control.batched_decode as bd
import optimized.control.kv_cache_manager as kvm
from optimized.control.block_pool import FreeBlockQueue
from optimized.control.kv_cache_manager import KVCacheManager, StepBatch, StepItem
from reference.errors import InvalidRequestError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, SlidingWindowSpec
from tests.optimized.optimized_differential import Pair


def _swa_manager() -> KVCacheManager:
    """One sliding group (bs 4, w 4), no prefix cache: freed blocks go to the front."""
    group = KVCacheGroup(("s",), SlidingWindowSpec(block_size=4, sliding_window=4))
    layout = KVCacheLayout((group,), num_blocks=20, max_model_len=64, enable_caching=False)
    manager = KVCacheManager(layout, max_num_reqs=4, compiled=False)  # the numpy batch
    manager.min_batched_apply = 0  # every working decode item through apply_decode_items
    return manager


def _prefilled(manager: KVCacheManager, lengths: list[int]):
    """Requests of ``lengths`` prompt tokens, prefilled in order and given one output."""
    reqs = []
    for i, n in enumerate(lengths):
        req = manager.make_request(f"r{i}", list(range(100 * i, 100 * i + n)))
        assert manager.allocate_slots(req, n) is not None
        req.num_computed_tokens = n
        req.append_token(7)
        reqs.append(req)
    return reqs


def test_window_frees_to_the_front_in_one_batched_pass(monkeypatch) -> None:
    manager = _swa_manager()
    r0, r1 = _prefilled(manager, [7, 7])  # r0 holds [1, 2], r1 [3, 4]
    assert manager.get_block_ids("r0") == ((1, 2),)
    assert manager.get_block_ids("r1") == ((3, 4),)

    def per_item(*args, **kwargs):
        raise AssertionError("the per-item path ran")

    monkeypatch.setattr(kvm, "apply_decode_item", per_item)
    monkeypatch.setattr(manager, "allocate_slots", per_item)
    # total 7, w 4: 4 tokens skipped -> block 0 of each row leaves; 8 slots: no new block
    out = manager.schedule_columns([r0, r1], [1, 1], [0, 0])
    assert out == [[[]], [[]]]
    assert manager.get_block_ids("r0") == ((0, 2),)
    assert manager.get_block_ids("r1") == ((0, 4),)
    # r0's free call puts 1 first, r1's then puts 3 before it
    assert manager.block_pool.free_block_queue.block_ids() == [3, 1, *range(5, 20)]
    assert manager.block_pool.ref_cnt[[1, 2, 3, 4]].tolist() == [0, 1, 0, 1]


def _spy_batched(monkeypatch) -> list[object]:
    """Record what every ``apply_decode_items`` call returns (None: it refused)."""
    calls: list[object] = []
    batched = kvm.apply_decode_items

    def spy(*args):
        result = batched(*args)
        calls.append(result)
        return result

    monkeypatch.setattr(kvm, "apply_decode_items", spy)
    return calls


def test_a_pop_of_the_items_own_front_free_stays_batched(monkeypatch) -> None:
    manager = _swa_manager()
    r0, r1 = _prefilled(manager, [7, 8])  # r0 holds [1, 2], r1 [3, 4]
    calls = _spy_batched(monkeypatch)
    # r0 frees 1 (front); r1 frees 3 (front, before 1), then needs a block for slot 9:
    # the reference pops 3 again, the item's own block
    out = manager.schedule_columns([r0, r1], [1, 1], [0, 0])
    assert len(calls) == 1 and calls[0] is not None  # applied in the batched pass
    assert [list(map(list, r)) for r in out] == [[[]], [[3]]]
    assert manager.get_block_ids("r1") == ((0, 4, 3),)
    assert manager.block_pool.free_block_queue.block_ids() == [1, *range(5, 20)]


def test_each_item_pops_its_own_front_frees_and_leaves_the_rest_in_front(monkeypatch) -> None:
    manager = _swa_manager()
    r0, r1 = _prefilled(manager, [12, 12])  # r0 holds [1, 2, 3], r1 [4, 5, 6]
    calls = _spy_batched(monkeypatch)
    # computed 12, w 4: 9 tokens skipped -> 2 blocks leave each row (tail first); 13 slots
    # need a 4th block. Reference: r0 frees [2, 1] to the front, pops 2; r1 frees [5, 4]
    # before 1, pops 5 -> queue [4, 1, 7, ...]
    out = manager.schedule_columns([r0, r1], [1, 1], [0, 0])
    assert len(calls) == 1 and calls[0] is not None
    assert [list(map(list, r)) for r in out] == [[[2]], [[5]]]
    assert manager.get_block_ids("r0") == ((0, 0, 3, 2),)
    assert manager.get_block_ids("r1") == ((0, 0, 6, 5),)
    assert manager.block_pool.free_block_queue.block_ids() == [4, 1, *range(7, 20)]
    assert manager.block_pool.ref_cnt[[1, 2, 4, 5]].tolist() == [0, 1, 0, 1]


def test_a_pop_past_the_items_own_front_frees_falls_back_to_the_item_path(
    monkeypatch,
) -> None:
    manager = _swa_manager()
    r0, r1 = _prefilled(manager, [7, 4])  # r0 holds [1, 2], r1 [3]
    calls = _spy_batched(monkeypatch)
    # r0 frees 1 (front); r1 frees nothing (4 computed, 1 skipped token) and needs a 2nd
    # block: the reference pops r0's block 1, which the batched pass does not model
    out = manager.schedule_columns([r0, r1], [1, 1], [0, 0])
    assert calls == [None]  # refused, nothing changed, items one by one
    assert [list(map(list, r)) for r in out] == [[[]], [[1]]]
    assert manager.get_block_ids("r0") == ((0, 2),)
    assert manager.get_block_ids("r1") == ((3, 1),)
    assert manager.block_pool.free_block_queue.block_ids() == list(range(4, 20))


def test_the_item_path_pops_every_group_at_once_in_group_order() -> None:
    # full (group 0) + SWA (group 1, w 4), bs 4, prefix cache on; one working item, so it
    # takes the per-item path. Prefill of 8 tokens: full [1, 2], SWA [3, 4]
    groups = (
        KVCacheGroup(("f",), FullAttentionSpec(block_size=4)),
        KVCacheGroup(("s",), SlidingWindowSpec(block_size=4, sliding_window=4)),
    )
    layout = KVCacheLayout(groups, num_blocks=20, max_model_len=64, enable_caching=True)
    manager = KVCacheManager(layout, max_num_reqs=4, compiled=False)  # the numpy batch
    (req,) = _prefilled(manager, [8])
    # every full block is cached (dense retention): full 1, 2 and SWA 3, 4
    assert manager.block_pool.cached_block_entries() == [(1, 0, 4), (2, 0, 8), (3, 1, 4), (4, 1, 8)]
    assert manager.get_block_ids("r0") == ((1, 2), (3, 4))
    # reference: SWA frees 3 (8 - 4 + 1 = 5 tokens skipped; hashed: to the back), then the
    # full group pops 5 and the SWA group pops 6 (9 slots: a 3rd block each)
    out = manager.schedule_columns([req], [1], [0])
    assert [list(map(list, r)) for r in out] == [[[5], [6]]]
    assert manager.get_block_ids("r0") == ((1, 2, 5), (0, 4, 6))
    assert manager.block_pool.free_block_queue.block_ids() == [*range(7, 20), 3]


def test_schedule_columns_is_schedule_step_of_the_same_items() -> None:
    a, b = _swa_manager(), _swa_manager()
    ra, rb = _prefilled(a, [7, 8]), _prefilled(b, [7, 8])
    out_a = a.schedule_columns(ra, [1, 1], [0, 2])
    out_b = b.schedule_step([StepItem(r, 1, 0, None, k) for r, k in zip(rb, (0, 2))])
    assert [list(map(list, r)) for r in out_a] == [list(map(list, r)) for r in out_b]
    assert a.get_block_ids("r1") == b.get_block_ids("r1") == ((0, 4, 3),)
    assert StepBatch(ra, [1, 1], [0, 2])[1] == StepItem(ra[1], 1, 0, None, 2)


def test_schedule_columns_errors() -> None:
    manager = _swa_manager()
    r0, r1 = _prefilled(manager, [7, 7])
    with pytest.raises(InvalidRequestError, match="columns of unequal lengths 2, 1, 2"):
        manager.schedule_columns([r0, r1], [1], [0, 0])
    with pytest.raises(InvalidRequestError, match="'r0' appears twice"):
        manager.schedule_columns([r0, r0], [1, 1], [0, 0])
    with pytest.raises(InvalidRequestError, match=r"computed 7 \+ hit 0 \+ new 2 exceeds"):
        manager.schedule_columns([r0, r1], [1, 2], [0, 0])
    assert manager.get_block_ids("r0") == ((1, 2),)  # nothing applied


def test_free_queue_pops_ascending_and_descending_runs() -> None:
    queue = FreeBlockQueue(40)
    assert queue.popleft_n(1) == [0]
    assert queue.popleft_n(30) == list(range(1, 31))
    queue.prepend_n(np.arange(30, 10, -1))  # a request's blocks back, tail first
    want = [*range(30, 10, -1), *range(31, 40)]
    assert queue.block_ids() == want
    assert queue.popleft_n(25) == want[:25]
    assert queue.block_ids() == want[25:]
    assert queue.num_free_blocks == 4


def test_freed_blocks_of_long_spans_in_call_order_tail_first() -> None:
    # 2 items (rows 1 and 0), 2 groups; spans [[2, 0], [1, 3]]; null cells (0) skipped
    class Table:
        def __init__(self, table: list[list[int]]) -> None:
            self.table = np.array(table, dtype=np.int32)

    g0 = Table([[0, 11, 12, 0], [0, 21, 22, 23]])
    g1 = Table([[31, 0, 33, 34], [41, 42, 43, 44]])
    rows = np.array([1, 0])
    first = np.array([[1, 0], [0, 0]])
    last = np.array([[3, 0], [1, 3]])
    blocks, items, calls = bd._freed_blocks([g0, g1], rows, first, last)
    # item 0 (row 1): group 0 cells 2, 1 -> 22, 21; item 1 (row 0): group 0 cell 0 (null),
    # group 1 cells 2, 1, 0 -> 33, (null), 31
    assert blocks.tolist() == [22, 21, 33, 31]
    assert items.tolist() == [0, 0, 1, 1]
    assert calls.tolist() == [0, 0, 3, 3]


def test_an_item_completing_a_block_beside_one_that_does_not_is_cached() -> None:
    """Full attention bs 4, prefix cache on: r0 computed 10 tokens (2 blocks cached), r1
    7 (1 cached). A decode step caches 11 and 8 tokens: r0 nothing new (11 // 4 = 2),
    r1 its block 1 (8 // 4 = 2 > 1). The most any item caches (2 blocks) is within r0's
    cached count but not r1's, so the step must still cache r1's block, as the
    reference does."""
    group = KVCacheGroup(("f",), FullAttentionSpec(block_size=4))
    layout = KVCacheLayout((group,), num_blocks=20, max_model_len=64, enable_caching=True)
    pair = Pair(layout, min_batched_apply=0, columns=True)
    for rid, first, length in (("r0", 0, 10), ("r1", 100, 7)):
        pair.add(rid, list(range(first, first + length)))
        assert pair.allocate(rid, length) is not None
        pair.set_computed(rid, length)
        pair.append(rid, [7])
    pair.step([("r0", 1, 0), ("r1", 1, 0)])
    r1_blocks = pair.opt.get_block_ids("r1")[0]
    cached = {b for b, _, _ in pair.opt.block_pool.cached_block_entries()}
    assert r1_blocks[1] in cached
