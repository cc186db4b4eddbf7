"""The array paths of the batched decode step and of ``free``, each forced and checked by
hand and against the reference (:class:`tests.optimized.optimized_differential.Pair`):

* the repeat test of a step's freed blocks (a mark array over the pool, no sort);
* the window spans freed on the first decode step after a batch prefilled together: the
  padded 2-D gather (:func:`optimized.control.batched_decode._freed_padded`) and the
  general one (:func:`~optimized.control.batched_decode._freed_spans`) give the same
  blocks in the same order;
* the own-front pops with frees already in run order (no sort) and out of it;
* one request's ``free`` over several groups (``free_block_lists``): all hashed, all
  unhashed over several lists, a block still held by another request, nulls.
"""

from __future__ import annotations

import numpy as np
import pytest

import optimized.control.batched_decode as bd
from optimized.control.block_pool import BlockPool
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, SlidingWindowSpec
from tests.optimized.optimized_differential import Pair


class _Rows:
    """A manager as ``_freed_*`` sees it: a block table."""

    def __init__(self, table: list[list[int]]) -> None:
        self.table = np.array(table, dtype=np.int32)


def test_has_repeats_finds_a_block_freed_twice() -> None:
    pool = BlockPool(10, enable_caching=False, hash_block_size=4, compiled=False)
    assert pool.has_repeats(np.array([4, 7, 4]))
    assert not pool.has_repeats(np.array([4, 7]))
    assert not pool.has_repeats(np.array([], dtype=np.int64))
    assert pool.has_repeats(np.array([9, 1, 2, 3, 1]))  # the mark array is reused
    assert not pool.has_repeats(np.array([1, 2, 3, 9]))


def test_padded_and_general_span_gathers_agree_by_hand() -> None:
    # 2 items (rows 0, 1), 2 groups; spans per item and group (first, last):
    # item 0: group 0 frees cols 1..2 of [0 4 6 8], group 1 frees col 0 of [5 9 0 0]
    # item 1: group 0 frees col 0..2 of [3 2 1 0], group 1 frees nothing
    managers = [_Rows([[0, 4, 6, 8], [3, 2, 1, 0]]), _Rows([[5, 9, 0, 0], [7, 0, 0, 0]])]
    rows = np.array([0, 1])
    first = np.array([[1, 0], [0, 0]])
    last = np.array([[3, 1], [3, 0]])
    span = last - first
    expected_blocks = [6, 4, 5, 1, 2, 3]  # item 0: group 0 tail first, group 1; item 1
    expected_items = [0, 0, 0, 1, 1, 1]
    expected_calls = [0, 0, 1, 2, 2, 2]  # item * 2 + group
    padded = bd._freed_padded(managers, rows, last, span, span.max(axis=0))
    general = bd._freed_spans(managers, rows, last, span)
    for blocks, items, calls in (padded, general):
        assert blocks.tolist() == expected_blocks
        assert items.tolist() == expected_items
        assert calls.tolist() == expected_calls


@pytest.mark.parametrize("groups", [1, 2])
def test_own_front_pops_in_and_out_of_run_order(groups: int) -> None:
    # 2 items; item 0 frees [5, 4] and pops 1, item 1 frees [9, 8] and pops 1 (one group):
    # pops [5, 9], front [8, 4] (the module's example). With 2 groups item 0's blocks come
    # from group 0 ([5]) and group 1 ([4]): group 1's call prepends last, so item 0's run
    # is [4, 5]: it pops 4 and leaves 5.
    if groups == 1:
        blocks, items, calls = [5, 4, 9, 8], [0, 0, 1, 1], [0, 0, 1, 1]
        pops, front = [5, 9], [8, 4]
    else:
        blocks, items, calls = [5, 4, 9, 8], [0, 0, 1, 1], [0, 1, 2, 2]
        pops, front = [4, 9], [8, 5]
    out = bd._pops_from_own_front(
        np.array(blocks), np.array(items), np.array(calls), np.array([1, 1]), groups
    )
    assert out is not None
    assert out[0].tolist() == pops
    assert out[1].tolist() == front


def test_own_front_pops_when_the_caller_knows_one_group_frees() -> None:
    # the caller's flag skips the run-order test: 2 layouts with 3 groups where only
    # group 2 frees (calls item * 3 + 2): item 0 frees [7, 6] and pops 2, item 1 frees
    # [3] and pops 0 -> pops [7, 6], front [3]
    blocks, items, calls = [7, 6, 3], [0, 0, 1], [2, 2, 5]
    for one_group in (True, False):
        out = bd._pops_from_own_front(
            np.array(blocks), np.array(items), np.array(calls), np.array([2, 0]), 3, one_group
        )
        assert out is not None
        assert out[0].tolist() == [7, 6]
        assert out[1].tolist() == [3]


def test_one_group_freeing_the_same_columns_of_every_row_by_hand() -> None:
    # the one-slice-per-row path: group 0 frees cols 1..2 of both rows, group 1 nothing
    managers = [_Rows([[0, 2, 3, 4], [0, 6, 7, 8]]), _Rows([[9, 0, 0, 0], [10, 0, 0, 0]])]
    rows, last = np.array([1, 0]), np.array([[3, 0], [3, 0]])
    span = np.array([[2, 0], [2, 0]])
    for blocks, items, calls in (
        bd._freed_padded(managers, rows, last, span, span.max(axis=0)),
        bd._freed_spans(managers, rows, last, span),
    ):
        assert blocks.tolist() == [7, 6, 3, 2]  # row 1 first (item 0), tail first
        assert items.tolist() == [0, 0, 1, 1]
        assert calls.tolist() == [0, 0, 2, 2]  # item * 2 + group 0


def test_own_front_pops_of_unequal_runs_by_hand() -> None:
    # item 0 frees [5, 4, 3] and pops 1, item 1 frees [9, 8] and pops 1: pops [5, 9]; the
    # front is item 1's leftover [8], then item 0's [4, 3]
    out = bd._pops_from_own_front(
        np.array([5, 4, 3, 9, 8]),
        np.array([0, 0, 0, 1, 1]),
        np.array([0, 0, 0, 1, 1]),
        np.array([1, 1]),
        1,
    )
    assert out is not None
    assert out[0].tolist() == [5, 9]
    assert out[1].tolist() == [8, 4, 3]


def test_own_front_pops_refused_past_the_items_own_blocks() -> None:
    out = bd._pops_from_own_front(
        np.array([5, 9]), np.array([0, 1]), np.array([0, 1]), np.array([2, 0]), 1
    )
    assert out is None


def _pool_with(blocks: list[int], hashed: list[int]) -> BlockPool:
    """A pool of 12 blocks where ``blocks`` are held once (popped in that order) and
    ``hashed`` of them registered in group 0."""
    pool = BlockPool(12, enable_caching=True, hash_block_size=4, compiled=False)
    taken = pool.get_new_blocks(11)  # 1..11, all held
    pool.free_blocks([b for b in reversed(taken) if b not in blocks])  # keep ``blocks``
    for k, b in enumerate(hashed):
        pool.cache_block(b, bytes([k + 1]) * 4, 0, 4)
    return pool


def test_free_block_lists_all_hashed_go_back_in_list_order() -> None:
    pool = _pool_with([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], hashed=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    before = pool.free_block_queue.block_ids()  # [11]
    pool.free_block_lists([np.array([3, 2, 1, 4, 5, 6]), np.array([10, 9, 8, 7])])
    assert pool.free_block_queue.block_ids() == before + [3, 2, 1, 4, 5, 6, 10, 9, 8, 7]
    assert pool.ref_cnt[1:11].tolist() == [0] * 10


def test_free_block_lists_unhashed_later_list_first_and_held_block_stays() -> None:
    pool = _pool_with([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], hashed=[5])
    pool.touch([4])  # block 4 is shared: one free leaves it held
    pool.free_block_lists([np.array([3, 2, 1, 0, 4]), np.array([0, 10, 9, 5]), np.array([8, 7, 6])])
    # front: list 2 [8, 7, 6], list 1 [10, 9], list 0 [3, 2, 1]; back: hashed 5
    assert pool.free_block_queue.block_ids() == [8, 7, 6, 10, 9, 3, 2, 1, 11, 5]
    assert pool.ref_cnt[4] == 1


def test_free_block_lists_all_unhashed_held_once_link_the_last_list_first() -> None:
    pool = _pool_with([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], hashed=[])
    before = pool.free_block_queue.block_ids()  # [11]
    pool.free_block_lists([np.array([3, 2, 1]), np.array([6, 5, 4]), np.array([10, 9, 8, 7])])
    assert pool.free_block_queue.block_ids() == [10, 9, 8, 7, 6, 5, 4, 3, 2, 1] + before
    assert pool.ref_cnt[1:11].tolist() == [0] * 10


@pytest.mark.parametrize(
    ("hashed", "shared", "lists"),
    [
        ([], [], [[3, 2, 1], [6, 5, 4], [10, 9, 8, 7]]),  # all unhashed, held once
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [], [[3, 2, 1, 4], [10, 9, 8, 7, 6, 5]]),  # all hashed
        ([2, 9], [], [[3, 2, 1], [6, 5, 4], [10, 9, 8, 7]]),  # a mix
        ([], [5], [[3, 2, 1], [6, 5, 4], [10, 9, 8, 7]]),  # a block held twice
        ([], [], [[0, 3, 2, 1], [6, 5, 4], [0, 10, 9, 8, 7]]),  # nulls (window gaps)
    ],
)
def test_free_block_lists_is_the_successive_free_blocks(hashed, shared, lists) -> None:
    """Whatever path it takes, one pass gives the counts and the queue of
    ``free_blocks(lists[0]); free_blocks(lists[1]); ...``."""
    pools = [_pool_with([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], hashed=hashed) for _ in range(2)]
    for pool in pools:
        pool.touch(shared)
    pools[0].free_block_lists([np.array(ids) for ids in lists])
    for ids in lists:
        pools[1].free_blocks(ids)
    assert pools[0].free_block_queue.block_ids() == pools[1].free_block_queue.block_ids()
    assert pools[0].ref_cnt.tolist() == pools[1].ref_cnt.tolist()


def _window_pair(min_batched_apply: int, caching: bool = True, windows: int = 1) -> Pair:
    """Full (bs 4) + sliding window (bs 4, w 8); without prefix caching the window's
    blocks go to the front of the queue and the step's pops come from them."""
    groups = (KVCacheGroup(("f",), FullAttentionSpec(block_size=4)),) + tuple(
        KVCacheGroup((f"s{k}",), SlidingWindowSpec(block_size=4, sliding_window=8))
        for k in range(windows)
    )
    layout = KVCacheLayout(groups, num_blocks=80, max_model_len=64, enable_caching=caching)
    return Pair(layout, min_batched_apply=min_batched_apply)


def _prefill_then_decode(pair: Pair, prompts: list[int], steps: int) -> None:
    """Prefill every prompt in one go, then decode them together for ``steps`` steps."""
    rids = [f"r{i}" for i in range(len(prompts))]
    for i, (rid, n) in enumerate(zip(rids, prompts)):
        pair.add(rid, [1000 * i + t for t in range(n)])
        pair.allocate(rid, n)
        pair.set_computed(rid, n)
        pair.append(rid, [7])
    for k in range(steps):
        pair.step([(rid, 1, 0) for rid in rids])
        for i, rid in enumerate(rids):
            pair.set_computed(rid, prompts[i] + k + 1)
            pair.append(rid, [8 + k])
    for rid in rids:
        pair.free(rid)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("path", ["padded", "general"])
def test_first_decode_after_a_batch_prefill_matches_the_reference(
    monkeypatch, path: str, caching: bool
) -> None:
    """Every request's window drops several blocks on its first decode step; prompts of
    equal length take the padded gather, the general one is forced by replacing it."""
    used = []
    padded, general = bd._freed_padded, bd._freed_spans

    def spy_general(*args):
        used.append("general")
        return general(*args)

    def spy_padded(*args):
        used.append("padded")
        if path == "general":
            managers, rows, last_free, span, _ = args
            return spy_general(managers, rows, last_free, span)
        return padded(*args)

    monkeypatch.setattr(bd, "_freed_padded", spy_padded)
    monkeypatch.setattr(bd, "_freed_spans", spy_general)
    own_front = []
    pops = bd._pops_from_own_front

    def spy_pops(*args):
        own_front.append(pops(*args))
        return own_front[-1]

    monkeypatch.setattr(bd, "_pops_from_own_front", spy_pops)
    _prefill_then_decode(_window_pair(0, caching), [24, 24, 24, 24], steps=6)
    assert used and used[0] == "padded"
    # without caching the first step's pops come from the items' own front frees
    assert (len(own_front) > 0 and own_front[0] is not None) == (not caching)
    if path == "general":
        assert "general" in used


def test_decode_after_unequal_prefills_matches_the_reference() -> None:
    """Spans of very different widths (the general gather) and the per-item path."""
    for caching in (True, False):
        _prefill_then_decode(_window_pair(0, caching), [40, 9, 12, 33], steps=9)
        _prefill_then_decode(_window_pair(100, caching), [40, 9, 12, 33], steps=9)


def test_twin_windows_share_one_pending_work_test_and_match_the_reference() -> None:
    """Two identical windows (gemma-like): the second group's test is the first's."""
    pair = _window_pair(0, caching=True, windows=2)
    assert pair.opt._twin_of == (0, 1, 1)
    _prefill_then_decode(pair, [40, 9, 12, 33], steps=9)
    _prefill_then_decode(_window_pair(100, caching=False, windows=2), [24, 24, 5], steps=9)


@pytest.mark.parametrize("caching", [True, False])
def test_twin_windows_dropping_many_blocks_one_item_at_a_time_match_the_reference(
    caching: bool,
) -> None:
    """Three identical windows, requests decoded one by one (the per-item path): on the
    first decode step after a long prompt each window drops the same columns (one span
    for the class, its runs freed in one pass); queue, counts, keys and tables match the
    reference."""
    pair = _window_pair(100, caching=caching, windows=3)
    assert pair.opt._twin_of == (0, 1, 1, 1)
    _prefill_then_decode(pair, [24, 13], steps=9)
