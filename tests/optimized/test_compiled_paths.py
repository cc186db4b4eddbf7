"""The compiled loops (numba) and their Python forms: the decode step's loud-item pass
(:mod:`optimized.control.compiled_decode`), the free queue's pop and the freeing of whole
rows (:mod:`optimized.control.compiled_pool`).

Each compiled function is plain Python too, so the rules are checked here without numba
(hand-valued cases, and the Python form of the pass against the reference on random
layouts); with numba installed (the ``jit`` extra, as in CI) the compiled forms are
checked against the numpy paths and the reference as well."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimized.control.block_pool import FreeBlockQueue
from optimized.control.compiled_decode import LoudPass, compiled_pass, loud_pass
from optimized.control.compiled_pool import compiled_pop_front, free_rows, pop_front
from optimized.control.kv_cache_manager import KVCacheManager
from reference.errors import KVConformError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, SlidingWindowSpec
from tests.optimized.optimized_differential import Pair, layouts, run_trace

needs_numba = pytest.mark.skipif(
    compiled_pass is None, reason="numba is not installed (the jit extra) or KVCONFORM_JIT=0"
)


def _queue_holding(order: list[int], num_blocks: int, compiled: bool) -> FreeBlockQueue:
    queue = FreeBlockQueue(num_blocks, compiled=compiled)
    queue.popleft_n(num_blocks)
    if order:
        queue.append_n(np.array(order, dtype=np.int64))
    return queue


def test_pop_front_unlinks_the_first_blocks_in_order() -> None:
    queue = _queue_holding([7, 3, 9, 4], 12, compiled=False)
    out = np.zeros(3, dtype=np.int64)
    pop_front(queue.next_free, queue.prev_free, queue.head, 3, out)  # the Python form
    assert out.tolist() == [7, 3, 9]
    queue.num_free_blocks -= 3
    assert queue.block_ids() == [4]
    assert queue.prev_free[4] == queue.head
    assert [queue.next_free[b] for b in (7, 3, 9)] == [-1, -1, -1]


@needs_numba
@settings(max_examples=50, deadline=None)
@given(
    order=st.permutations(list(range(1, 40))),
    pops=st.lists(st.integers(0, 39), min_size=1, max_size=4),
)
def test_compiled_pop_matches_the_numpy_walk(order: list[int], pops: list[int]) -> None:
    """Any queue order (runs of consecutive ids or not), any pop sizes: the same blocks
    and the same queue after."""
    numpy_walk = _queue_holding(order, 40, compiled=False)
    compiled = _queue_holding(order, 40, compiled=True)
    assert compiled._pop_front is compiled_pop_front
    for n in pops:
        n = min(n, numpy_walk.num_free_blocks)
        assert compiled.popleft_array(n).tolist() == numpy_walk.popleft_array(n).tolist()
        assert compiled.block_ids() == numpy_walk.block_ids()
        assert compiled.num_free_blocks == numpy_walk.num_free_blocks


def test_free_rows_frees_each_group_tail_first_and_releases_the_row() -> None:
    """Row 0 holds ``[4, 5]`` in group 0 and ``[6, 0, 8]`` in group 1 (a null skipped);
    block 4 is hashed, 8 is held twice. Group 0's call: 5 to the front, 4 to the back;
    group 1's call: 8 drops to one reference (stays), 6 to the front before 5."""
    queue = _queue_holding([1, 2], 12, compiled=False)
    # two groups' rows stacked (as a RowStore holds them): group g's row r at [g, r]
    tables = np.zeros((2, 2, 4), dtype=np.int32)
    tables[0, 0, :2] = [4, 5]
    tables[1, 0, :3] = [6, 0, 8]
    row_lens = np.array([[2, 0], [3, 0]], dtype=np.int32)
    leading = np.array([[0, 0], [1, 0]], dtype=np.int32)
    cached = np.array([[2, -1], [3, -1]], dtype=np.int32)
    dirty = np.zeros((2, 2), dtype=bool)
    retired = np.array([[0, 0], [2, 0]], dtype=np.int32)  # (a Mamba group's, reset too)
    last_state = np.array([[-1, -1], [1, -1]], dtype=np.int32)
    ref_cnt = np.zeros(12, dtype=np.int32)
    ref_cnt[[4, 5, 6]] = 1
    ref_cnt[8] = 2
    block_group = np.full(12, -1, dtype=np.int32)
    block_group[4] = 0
    state = np.array([queue.head, queue.tail, queue.num_free_blocks], dtype=np.int64)
    bad = free_rows(
        np.array([0]),
        tables,
        row_lens,
        leading,
        cached,
        dirty,
        retired,
        last_state,
        ref_cnt,
        block_group,
        queue.prev_free,
        queue.next_free,
        state,
    )
    assert bad == -1
    queue.num_free_blocks = int(state[2])
    assert queue.block_ids() == [6, 5, 1, 2, 4]
    assert queue.num_free_blocks == 5
    assert ref_cnt[[4, 5, 6, 8]].tolist() == [0, 0, 0, 1]
    assert not tables[:, 0].any()
    assert row_lens[:, 0].tolist() == [0, 0] and cached[:, 0].tolist() == [-1, -1]
    assert leading[:, 0].tolist() == [0, 0] and dirty[:, 0].all()
    assert retired[:, 0].tolist() == [0, 0] and last_state[:, 0].tolist() == [-1, -1]


def test_free_rows_names_a_block_freed_more_often_than_allocated() -> None:
    queue = _queue_holding([], 6, compiled=False)
    tables = np.zeros((1, 1, 2), dtype=np.int32)
    tables[0, 0, 0] = 3  # held in the table, ref count 0
    state = np.array([queue.head, queue.tail, 0], dtype=np.int64)
    zeros = np.zeros((1, 1), dtype=np.int32)
    bad = free_rows(
        np.array([0]),
        tables,
        np.ones((1, 1), dtype=np.int32),
        zeros,
        zeros,
        np.zeros((1, 1), dtype=bool),
        zeros,
        zeros,
        np.zeros(6, dtype=np.int32),
        np.full(6, -1, dtype=np.int32),
        queue.prev_free,
        queue.next_free,
        state,
    )
    assert bad == 3


def _gemma_like(num_blocks: int = 200) -> KVCacheLayout:
    """A full group and two twin windows (w 8), bs 4, prefix cache on."""
    groups = (
        KVCacheGroup(("f",), FullAttentionSpec(block_size=4)),
        KVCacheGroup(("s0",), SlidingWindowSpec(block_size=4, sliding_window=8)),
        KVCacheGroup(("s1",), SlidingWindowSpec(block_size=4, sliding_window=8)),
    )
    return KVCacheLayout(groups, num_blocks=num_blocks, max_model_len=128, enable_caching=True)


def test_the_python_pass_drops_pops_and_sets_the_threshold_by_hand() -> None:
    """One request of 12 prompt tokens (3 blocks per group), then decode steps through the
    Python form of the pass. At 12 computed the next slot needs block 3 in each group: 3
    pops. The windows (w 8) skip ``12 - 8 + 1 = 5`` tokens -> block 0 leaves each window.
    The row's threshold is then the least of: full group next block at 16, windows' next
    drop at ``(1 + 1) * 4 + 8 - 1 = 15``, caching of block 3 once ``c + 1 >= 16`` -> 15."""
    manager = KVCacheManager(_gemma_like(), max_num_reqs=2, compiled=False)
    manager._compiled = LoudPass(manager, run=loud_pass)
    request = manager.make_request("r", list(range(12)))
    computed = manager.allocate_slots(request, 12)
    assert computed is not None
    request.num_computed_tokens = 12
    request.append_token(99)
    row = manager.coordinator.row_of["r"]
    before = manager.get_block_ids("r")
    free_before = manager.block_pool.get_num_free_blocks()
    out = manager.schedule_columns([request], [1], [0])
    new = out[0]
    assert [len(blocks) for blocks in new] == [1, 1, 1]
    after = manager.get_block_ids("r")
    assert after[0] == (*before[0], new[0][0])
    for g in (1, 2):  # block 0 of each window nulled, the new block appended
        assert after[g] == (0, *before[g][1:], new[g][0])
    assert manager.block_pool.get_num_free_blocks() == free_before - 3 + 2
    assert manager._next_work[row] == 15


@settings(max_examples=40, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**32 - 1))
def test_the_python_pass_matches_reference(layout, seed) -> None:
    """The pass as plain Python (no numba needed) on random layouts (Mamba groups
    included) and plain decode steps: every table, queue, count and cached entry as the
    reference's."""
    pair = Pair(layout, columns=True)
    opt = pair.opt
    opt._compiled = LoudPass(opt, run=loud_pass)
    counts = run_trace(pair, seed, num_steps=30, batched=True, plain_decode=True)
    assert counts["steps"] == 30


@needs_numba
def test_a_manager_whose_groups_are_replaced_leaves_the_pass() -> None:
    """A group replaced by a subclass (as a mutant does) takes the Python paths."""
    from optimized.control.managers import SlidingWindowManager

    class OwnWindow(SlidingWindowManager):
        pass

    manager = KVCacheManager(_gemma_like(), max_num_reqs=2)
    assert manager._compiled is not None and manager._compiled.usable()
    coord = manager.coordinator
    old = coord.managers[1]
    coord.managers = [
        *coord.managers[:1],
        OwnWindow(
            old.spec,
            old.block_pool,
            old.group_id,
            old.enable_caching,
            old.cache_hit_alignment,
            128,
            coord.max_num_reqs,
            old.retention_interval,
            old.scheduler_block_size,
        ),
        *coord.managers[2:],
    ]
    assert not manager._compiled.usable()


def test_a_block_freed_too_often_in_the_pass_is_named() -> None:
    """The pass meets a window block whose ref count is already 0 (a corrupted count): the
    step raises naming it, as the Python path's ``free_blocks`` does."""
    manager = KVCacheManager(_gemma_like(), max_num_reqs=2, compiled=False)
    manager._compiled = LoudPass(manager, run=loud_pass)
    request = manager.make_request("r", list(range(12)))
    assert manager.allocate_slots(request, 12) is not None
    request.num_computed_tokens = 12
    request.append_token(99)
    dropped = manager.get_block_ids("r")[1][0]  # the first window's block 0 leaves at 12
    manager.block_pool.ref_cnt[dropped] = 0
    with pytest.raises(KVConformError, match=f"block {dropped} freed more often"):
        manager.schedule_columns([request], [1], [0])


def _two_at_a_boundary(manager: KVCacheManager) -> list:
    """Requests ``a`` and ``b`` of 12 prompt tokens each, computed, one output token: on
    ``_gemma_like`` each holds 3 blocks per group and its next slot needs a fourth."""
    reqs = []
    for k, rid in enumerate(("a", "b")):
        req = manager.make_request(rid, list(range(100 * k, 100 * k + 12)))
        assert manager.allocate_slots(req, 12) is not None
        req.num_computed_tokens = 12
        req.append_token(7)
        reqs.append(req)
    return reqs


def test_a_full_pool_stops_the_pass_after_the_items_frees() -> None:
    """19 usable blocks, 18 held: item ``a`` frees block 0 of both windows (w 8 skips 5
    tokens) and pops 3 (1 + 2 free); item ``b`` frees its two but finds 2 < 3 free: its
    result is None, its frees stay, as on the Python path (same results, tables, queue,
    thresholds)."""
    passes: list[int] = []

    def counted(first, items, *args):
        passes.append(items.shape[0] - first)
        return loud_pass(first, items, *args)

    layout = _gemma_like(num_blocks=20)
    ours = KVCacheManager(layout, max_num_reqs=2, compiled=False)
    ours._compiled = LoudPass(ours, run=counted)
    python = KVCacheManager(layout, max_num_reqs=2, compiled=False)
    seen = []
    for m in (ours, python):
        reqs = _two_at_a_boundary(m)
        assert m.block_pool.get_num_free_blocks() == 1
        out = m.schedule_columns(reqs, [1, 1], [0, 0])
        assert len(out) == 2 and out[0] is not None and out[1] is None
        assert [len(blocks) for blocks in out[0]] == [1, 1, 1]
        assert m.block_pool.get_num_free_blocks() == 2  # b's two window blocks
        seen.append(
            (
                [None if r is None else [list(g) for g in r] for r in out],
                m.get_block_ids("a"),
                m.get_block_ids("b"),
                m.block_pool.free_block_queue.block_ids(),
                [m._next_work[m.coordinator.row_of[rid]] for rid in ("a", "b")],
            )
        )
    assert seen[0] == seen[1]
    assert passes == [0, 2]  # the warm-up on no item, then both items in one pass


def test_free_rows_python_form_through_the_coordinator() -> None:
    """The coordinator's row freeing run as Python (no numba needed): a request's 3 groups
    freed and its row released, the queue and counts as the numpy path leaves them."""
    from optimized.control.compiled_pool import free_rows as python_free_rows
    from optimized.control.row_freeing import RowFreeing

    calls: list[int] = []

    def counted(rows, *args):
        calls.append(len(rows))
        return python_free_rows(rows, *args)

    layout = _gemma_like()
    ours = KVCacheManager(layout, max_num_reqs=2, compiled=False)
    ours.coordinator._row_freeing = RowFreeing(ours.coordinator, run=counted)
    numpy_paths = KVCacheManager(layout, max_num_reqs=2, compiled=False)
    for m in (ours, numpy_paths):
        a, b = _two_at_a_boundary(m)
        m.free(a)
        assert m.coordinator.row_of.keys() == {"b"}
    assert ours.block_pool.free_block_queue.block_ids() == (
        numpy_paths.block_pool.free_block_queue.block_ids()
    )
    assert ours.block_pool.ref_counts() == numpy_paths.block_pool.ref_counts()
    assert ours.get_block_ids("b") == numpy_paths.get_block_ids("b")
    assert calls == [0, 1]  # the warm-up call, then the freed row
