"""The one-pass free of a few rows
(:meth:`optimized.control.coordinator.KVCacheCoordinator._free_few_rows`) and its pieces,
each checked against queues worked out by hand:

* :func:`front_chain`: the unhashed blocks of runs laid end to end, the last run first;
* :meth:`FreeBlockQueue.prepend_append`: a front chain and a back chain linked at once
  (and the two-call form for a queue of fewer than two blocks);
* ``free`` of one row and ``free_many`` of two rows on hand-built tables (hashed and
  unhashed blocks in both groups), a stale leading-null count (the row is read whole),
  a block held twice, a prefix shared by two rows freed together (repeats counted in the
  same pass), and a block freed more often than held (an error).
"""

from __future__ import annotations

import numpy as np
import pytest

from optimized.control.block_pool import FreeBlockQueue
from optimized.control.coordinator import KVCacheCoordinator, front_chain
from properties.engines.optimized import make_engine
from reference.errors import KVConformError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, SlidingWindowSpec

# -- front_chain ----------------------------------------------------------------------


def test_front_chain_takes_the_last_run_first_each_in_order() -> None:
    """Lengths 2, 0, 3: position 1 in run 0, positions 2 and 4 in run 2 -> run 2's
    blocks (8, 9) then run 0's (7)."""
    assert front_chain([1, 2, 4], [7, 8, 9], [2, 0, 3]) == [8, 9, 7]


def test_front_chain_of_one_run_or_none() -> None:
    assert front_chain([0, 1], [5, 6], [2, 0, 3]) == [5, 6]  # run 0 only
    assert front_chain([3, 4], [5, 6], [2, 0, 3]) == [5, 6]  # the last run only
    assert front_chain([], [], [2, 3]) == []


# -- prepend_append -------------------------------------------------------------------


def _walk_back(queue: FreeBlockQueue) -> list[int]:
    """The queue read from the tail to the head over the ``prev`` links, reversed."""
    out = []
    block = int(queue.prev_free[queue.tail])
    while block != queue.head:
        out.append(block)
        block = int(queue.prev_free[block])
    return out[::-1]


def _queue_holding(left: int) -> FreeBlockQueue:
    """A queue of blocks 0..9 with the first ``10 - left`` popped: ``[10 - left .. 9]``."""
    queue = FreeBlockQueue(10)
    queue.popleft_n(10 - left)
    return queue


def test_prepend_append_links_both_chains_around_the_old_queue() -> None:
    """Queue ``[6, 7, 8, 9]``, front ``[2, 1]``, back ``[4, 5]`` -> ``[2, 1, 6, 7, 8, 9,
    4, 5]``, the same read forwards and backwards; 8 blocks free."""
    queue = _queue_holding(4)
    queue.prepend_append([2, 1], np.array([4, 5], dtype=np.intp))
    expected = [2, 1, 6, 7, 8, 9, 4, 5]
    assert queue.block_ids() == expected
    assert _walk_back(queue) == expected
    assert queue.num_free_blocks == 8


@pytest.mark.parametrize(
    ("left", "expected"),
    [(1, [2, 9, 4, 5]), (0, [2, 4, 5]), (2, [2, 8, 9, 4, 5])],
    ids=["one-block-queue", "empty-queue", "two-block-queue"],
)
def test_prepend_append_around_a_short_queue(left: int, expected: list[int]) -> None:
    """A queue of one block or none (the two-call form) and of two blocks (the joint
    writes, the old ends adjacent): front ``[2]``, back ``[4, 5]``."""
    queue = _queue_holding(left)
    queue.prepend_append([2], np.array([4, 5], dtype=np.intp))
    assert queue.block_ids() == expected
    assert _walk_back(queue) == expected
    assert queue.num_free_blocks == len(expected)


# -- the coordinator's one-pass free ---------------------------------------------------


def _layout(num_blocks: int = 20, max_model_len: int = 16) -> KVCacheLayout:
    """Full (bs 2) + sliding window (bs 2, w 4), caching on."""
    groups = (
        KVCacheGroup(("f",), FullAttentionSpec(block_size=2)),
        KVCacheGroup(("s",), SlidingWindowSpec(block_size=2, sliding_window=4)),
    )
    return KVCacheLayout(groups, num_blocks, max_model_len=max_model_len, enable_caching=True)


def _coordinator(
    rows: dict[str, tuple[list[int], list[int], int]],
    hashed: list[int],
    layout: KVCacheLayout | None = None,
) -> KVCacheCoordinator:
    """A coordinator whose requests hold, per id, a full row, a window row and the window
    row's leading-null count; every block in the rows is popped (held once; the queue
    keeps the others in order) and ``hashed`` are registered in their row's group."""
    coord = make_engine(layout or _layout()).manager.coordinator
    pool = coord.block_pool
    held = max(b for full, window, _ in rows.values() for b in full + window)
    assert pool.get_new_blocks(held) == list(range(1, held + 1))
    for rid, (full, window, leading) in rows.items():
        row = coord.row(rid)
        for g, (m, blocks) in enumerate(zip(coord.managers, (full, window))):
            m.table[row, : len(blocks)] = blocks
            m.row_len[row] = len(blocks)
            m.num_cached_block[row] = 0
            for b in blocks:
                if b in hashed:
                    pool.cache_block(b, bytes([g, b]).ljust(32, b"."), g, 2)  # a 32-byte key
        coord.managers[1].num_leading_null[row] = leading
    return coord


def _assert_released(coord: KVCacheCoordinator, rows: list[int]) -> None:
    for m in coord.managers:
        assert not m.table[rows].any()
        assert m.row_len[rows].tolist() == [0] * len(rows)
        assert m.num_cached_block[rows].tolist() == [-1] * len(rows)
        assert m.num_leading_null[rows].tolist() == [0] * len(rows)


def test_one_row_frees_every_group_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Full row ``[1, 2, 3]``, window row ``[0, 0, 4, 5]`` (leading 2), 1 and 4 hashed:
    tail first the runs are ``[3, 2, 1]`` and ``[5, 4]``; the unhashed go to the front,
    the window's first -> ``[5, 3, 2]``; the hashed to the back in run order ->
    ``[1, 4]``; the queue was ``[6 .. 19]``."""
    coord = _coordinator({"x": ([1, 2, 3], [0, 0, 4, 5], 2)}, hashed=[1, 4])
    coord.free("x")
    pool = coord.block_pool
    assert pool.free_block_queue.block_ids() == [5, 3, 2, *range(6, 20), 1, 4]
    assert _walk_back(pool.free_block_queue) == [5, 3, 2, *range(6, 20), 1, 4]
    assert pool.ref_cnt[1:6].tolist() == [0] * 5
    assert pool.get_num_free_blocks() == 19
    assert coord.row_of == {}
    _assert_released(coord, [0])


def test_a_stale_leading_count_does_not_hide_a_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Window row ``[6, 0, 4, 5]`` with a leading count of 2 (stale: 6 is real): the row
    is read whole, so 6 is freed too: runs ``[3, 2, 1]``, ``[5, 4, 6]`` -> front ``[5, 6,
    3, 2]``, back ``[1, 4]``."""
    coord = _coordinator({"x": ([1, 2, 3], [6, 0, 4, 5], 2)}, hashed=[1, 4])
    coord.free("x")
    assert coord.block_pool.free_block_queue.block_ids() == [5, 6, 3, 2, *range(7, 20), 1, 4]
    _assert_released(coord, [0])


def test_two_rows_are_freed_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """``free_many(["y", "x"])`` of x (full ``[1, 2]``, window ``[0, 3]``) and y (full
    ``[4, 5]``, window ``[0, 6]``), 1 and 4 hashed: runs y.full ``[5, 4]``, y.window
    ``[6]``, x.full ``[2, 1]``, x.window ``[3]`` -> front ``[3, 2, 6, 5]``, back ``[4,
    1]``, as ``free(y); free(x)`` gives."""
    coord = _coordinator({"x": ([1, 2], [0, 3], 1), "y": ([4, 5], [0, 6], 1)}, hashed=[1, 4])
    coord.free_many(["y", "x"])
    queue = coord.block_pool.free_block_queue
    assert queue.block_ids() == [3, 2, 6, 5, *range(7, 20), 4, 1]
    assert _walk_back(queue) == [3, 2, 6, 5, *range(7, 20), 4, 1]
    assert coord.block_pool.ref_cnt[1:7].tolist() == [0] * 6
    assert sorted(coord._free_rows)[:2] == [0, 1]
    _assert_released(coord, [0, 1])


def test_a_block_held_twice_stays_out_of_the_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block 2 held twice (another request shares it): the same pass counts it, 2 keeps
    one reference and stays out of the queue: front ``[5, 3]``, back ``[1, 4]``."""
    coord = _coordinator({"x": ([1, 2, 3], [0, 0, 4, 5], 2)}, hashed=[1, 4])
    coord.block_pool.touch([2])
    coord.free("x")
    pool = coord.block_pool
    assert pool.free_block_queue.block_ids() == [5, 3, *range(6, 20), 1, 4]
    assert pool.ref_cnt[1:6].tolist() == [0, 1, 0, 0, 0]
    _assert_released(coord, [0])


def test_a_prefix_shared_by_rows_freed_together_moves_at_its_last_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """x (full ``[1, 2]``, window ``[0, 3]``) and y (full ``[1, 4]``, window ``[0, 5]``)
    share the hashed block 1 (held twice). ``free(x)``: 2 and 3 to the front, 1 keeps a
    reference; ``free(y)``: 4 and 5 to the front, 1 reaches 0 and goes to the back. One
    pass over both rows gives the same: front ``[5, 4, 3, 2]``, back ``[1]``."""
    coord = _coordinator({"x": ([1, 2], [0, 3], 1), "y": ([1, 4], [0, 5], 1)}, hashed=[1])
    coord.block_pool.touch([1])
    assert coord.block_pool.ref_cnt[1] == 2
    coord.free_many(["x", "y"])
    queue = coord.block_pool.free_block_queue
    assert queue.block_ids() == [5, 4, 3, 2, *range(6, 20), 1]
    assert _walk_back(queue) == [5, 4, 3, 2, *range(6, 20), 1]
    assert coord.block_pool.ref_cnt[1:6].tolist() == [0] * 5
    _assert_released(coord, [0, 1])


def test_a_block_freed_more_often_than_held_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block 2 in the row but not held (ref count 0): freeing the row is an error naming
    the block."""
    coord = _coordinator({"x": ([1, 2, 3], [0, 0, 4, 5], 2)}, hashed=[])
    coord.block_pool.ref_cnt[2] = 0
    with pytest.raises(KVConformError, match="block 2 freed more often than allocated"):
        coord.free("x")


@pytest.mark.parametrize(
    ("hashed", "front", "back"),
    [
        ([], [*range(40, 20, -1), *range(20, 0, -1)], []),
        ([1, 21], [*range(40, 21, -1), *range(20, 1, -1)], [1, 21]),
    ],
    ids=["all-unhashed", "two-hashed"],
)
def test_many_unhashed_blocks_take_the_array_layout(
    hashed: list[int], front: list[int], back: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Full row ``[1 .. 20]``, window row ``[0] * 5 + [21 .. 40]`` (over the list limit
    of the front chain): the window's blocks tail first, then the full row's, at the
    front; the hashed ones (if any) at the back; the queue was ``[41 .. 59]``."""
    full, window = list(range(1, 21)), [0] * 5 + list(range(21, 41))
    coord = _coordinator({"x": (full, window, 5)}, hashed, _layout(60, 64))
    coord.free("x")
    queue = coord.block_pool.free_block_queue
    assert queue.block_ids() == [*front, *range(41, 60), *back]
    assert _walk_back(queue) == [*front, *range(41, 60), *back]
    assert queue.num_free_blocks == 59
    _assert_released(coord, [0])
