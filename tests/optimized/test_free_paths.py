"""The array paths of freeing (:meth:`optimized.control.block_pool.BlockPool.free_runs` and
the coordinator's row reads), each forced and checked by hand and against the reference:

* the front chain laid out run by run, last run first (:func:`later_runs_first`), in
  Python (a few blocks) and with arrays (many), and the run of each position
  (:class:`RunEnds`, both forms, and its one-walk layout of a few blocks);
* ``free_runs`` with a block repeated across runs (a prefix shared by requests freed
  together): it moves at its last occurrence, to the front or the back;
* ``free_requests`` of a few requests (rows read one by one)
  and of many (one sheet per group: consecutive rows read as views, scattered rows
  gathered), against the reference's successive frees;
* the sheet read skipping the leading columns null in every row, but not when a stale
  leading-null count would hide a block;
* ``remove_requests``: the batched removal the scheduler makes after ``free_requests``.
"""

from __future__ import annotations

import numpy as np
import pytest

from optimized.control.block_pool import BlockPool, RunEnds, later_runs_first
from optimized.control.coordinator import KVCacheCoordinator
from properties.core.engine import FreesInBatch, RequestInput
from properties.core.trace import Step
from properties.engines.optimized import make_engine
from properties.engines.reference import make_engine as make_reference_engine
from properties.runner.scheduler import Scheduler
from properties.tools.bench.engines import build_trace, sweep_recipe
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, SlidingWindowSpec
from tests.optimized.optimized_differential import Pair

# -- front order and runs -----------------------------------------------------------


def test_later_runs_first_in_python_keeps_each_run_in_order() -> None:
    out = later_runs_first(np.array([1, 2, 3, 4]), np.array([0, 0, 1, 3]))
    assert list(out) == [4, 3, 1, 2]


def test_later_runs_first_with_arrays_matches_the_hand_layout() -> None:
    """40 blocks (over the Python limit: the stable sort) in runs 0 (10), 1 (20), 4 (10)."""
    runs = np.array([0] * 10 + [1] * 20 + [4] * 10)
    out = later_runs_first(np.arange(40), runs)
    assert list(out) == [*range(30, 40), *range(10, 30), *range(10)]


def test_later_runs_first_of_many_blocks_matches_the_hand_layout() -> None:
    """Over the stable sort's limit (the linear layout): 1500 blocks in runs 0 (500), 2
    (700) and 5 (300) -> run 5's, then run 2's, then run 0's, each in order."""
    runs = np.array([0] * 500 + [2] * 700 + [5] * 300)
    out = later_runs_first(np.arange(1500), runs)
    assert list(out) == [*range(1200, 1500), *range(500, 1200), *range(500)]


def test_later_runs_first_leaves_one_run_alone() -> None:
    blocks = np.array([9, 3, 5])
    assert later_runs_first(blocks, np.array([2, 2, 2])) is blocks


def test_run_ends_gives_each_position_its_run_in_both_forms() -> None:
    runs_of = RunEnds([2, 0, 3])
    assert list(runs_of(np.array([0, 1, 2, 4]))) == [0, 0, 2, 2]
    lengths = [20, 0, 30]
    many = RunEnds(lengths)(np.arange(50))  # over the Python limit: an array
    assert isinstance(many, np.ndarray)
    assert many.tolist() == [0] * 20 + [2] * 30


def test_run_ends_lays_out_a_few_blocks_last_run_first_in_one_walk() -> None:
    """Lengths 2, 0, 3, 1: positions 0, 1 (run 0), 3 (run 2), 5 (run 3) -> 5's block,
    then 3's, then 0's and 1's; one run alone keeps its order."""
    runs = RunEnds([2, 0, 3, 1])
    assert runs.last_first(np.array([0, 1, 3, 5]), np.array([10, 11, 13, 15])) == [15, 13, 10, 11]
    assert runs.last_first(np.array([2, 4]), np.array([12, 14])) == [12, 14]


def test_run_ends_lays_out_many_blocks_one_slice_per_run() -> None:
    """Lengths 30, 0, 40, 10 (a request's groups), every other position kept (40 blocks,
    over the Python limit): run 3's 5 blocks first, then run 2's 20, then run 0's 15,
    each in order; an empty run and a run with no kept position add nothing."""
    runs = RunEnds([30, 0, 40, 10])
    positions = np.arange(0, 80, 2)
    blocks = positions + 1000
    out = runs.last_first(positions, blocks)
    assert isinstance(out, np.ndarray)
    assert out.tolist() == [*range(1070, 1080, 2), *range(1030, 1070, 2), *range(1000, 1030, 2)]
    none_in_last = RunEnds([30, 0, 40, 10]).last_first(positions[:35], blocks[:35])
    assert none_in_last.tolist() == [*range(1030, 1070, 2), *range(1000, 1030, 2)]


def test_run_ends_reads_equal_runs_bottom_up() -> None:
    """Five runs of 8 (twin windows dropping one span), every position kept: run 4's
    blocks first, run 0's last, each in order; one position short, the slices' form."""
    runs = RunEnds([8] * 5)
    positions = np.arange(40)
    blocks = positions + 1000
    out = runs.last_first(positions, blocks)
    assert out.tolist() == [b for r in range(4, -1, -1) for b in range(1000 + 8 * r, 1008 + 8 * r)]
    short = runs.last_first(positions[1:], blocks[1:])
    assert short.tolist() == out.tolist()[: 4 * 8] + list(range(1001, 1008))


# -- free_runs with repeated blocks ---------------------------------------------------


def _pool(held: list[int], hashed: list[int], twice: list[int]) -> BlockPool:
    """A pool of 12 blocks where ``held`` are held once (``twice`` of them twice) and
    ``hashed`` of them registered in group 0; the other blocks are free in order."""
    pool = BlockPool(12, enable_caching=True, hash_block_size=4, compiled=False)
    taken = pool.get_new_blocks(11)  # 1..11, all held
    pool.free_blocks([b for b in reversed(taken) if b not in held])
    for k, b in enumerate(hashed):
        pool.cache_block(b, bytes([k + 1]) * 4, 0, 4)
    pool.touch(twice)
    return pool


def test_a_shared_unhashed_block_moves_with_its_last_run() -> None:
    """Runs ``[1, 3]`` then ``[3, 2]``, 3 held twice, none hashed: run 0 frees 1 (front),
    3 stays; run 1 frees 3 and 2 -> front ``[3, 2]`` before ``[1]``."""
    pool = _pool(held=[1, 2, 3], hashed=[], twice=[3])
    before = pool.free_block_queue.block_ids()
    ids = np.array([1, 3, 3, 2], dtype=np.intp)
    pool.free_runs(ids, RunEnds([2, 2]))
    assert pool.free_block_queue.block_ids() == [3, 2, 1, *before]
    assert pool.ref_cnt[[1, 2, 3]].tolist() == [0, 0, 0]


def test_a_shared_hashed_block_goes_back_at_its_last_occurrence() -> None:
    """Runs ``[3, 1]``, ``[3]``, ``[2]`` all hashed, 3 held twice: back order 1, 3, 2."""
    pool = _pool(held=[1, 2, 3], hashed=[1, 2, 3], twice=[3])
    before = pool.free_block_queue.block_ids()
    pool.free_runs(np.array([3, 1, 3, 2], dtype=np.intp), RunEnds([2, 1, 1]))
    assert pool.free_block_queue.block_ids() == [*before, 1, 3, 2]


def test_a_block_still_held_after_the_runs_stays_out_of_the_queue() -> None:
    """3 held three times, freed twice: it keeps one reference and does not move."""
    pool = _pool(held=[1, 3], hashed=[], twice=[3, 3])
    before = pool.free_block_queue.block_ids()
    pool.free_runs(np.array([3, 1, 0, 3], dtype=np.intp), RunEnds([2, 2]))
    assert pool.free_block_queue.block_ids() == [1, *before]
    assert pool.ref_cnt[3] == 1


def test_free_runs_matches_successive_free_blocks_calls() -> None:
    """Mixed runs (nulls, shared blocks, hashed and not) against ``free_blocks`` per run."""
    lists = [[5, 4, 0, 3], [7, 3, 6], [0, 8, 5], [9, 2, 1]]
    held = sorted({b for run in lists for b in run if b})
    twice = [3, 5]  # each appears in two runs
    one, other = (_pool(held, hashed=[4, 6, 5, 1], twice=twice) for _ in range(2))
    flat = np.array([b for run in lists for b in run], dtype=np.intp)
    one.free_runs(flat, RunEnds([len(r) for r in lists]))
    for run in lists:
        other.free_blocks(run)
    assert one.free_block_queue.block_ids() == other.free_block_queue.block_ids()
    assert one.ref_counts() == other.ref_counts()


def test_many_front_blocks_over_run_ends_match_successive_frees() -> None:
    """40 unhashed blocks in runs of 15, 0, 25 (over the one-walk limit: the array
    layout) against ``free_blocks`` run by run: ``[26..50]`` then ``[11..25]`` first."""
    pools = []
    for _ in range(2):
        pool = BlockPool(60, enable_caching=True, hash_block_size=4, compiled=False)
        pool.get_new_blocks(59)  # 1..59, all held
        pool.free_blocks(list(range(59, 50, -1)))  # 51..59 back to the queue
        pools.append(pool)
    runs = [list(range(11, 26)), [], list(range(26, 51))]
    pools[0].free_runs(np.array(runs[0] + runs[2], dtype=np.intp), RunEnds([15, 0, 25]))
    for run in runs:
        pools[1].free_blocks(run)
    expected = [*range(26, 51), *range(11, 26), *range(59, 50, -1)]
    assert pools[0].free_block_queue.block_ids() == expected
    assert pools[1].free_block_queue.block_ids() == expected


def test_free_runs_refuses_a_block_that_is_not_held() -> None:
    """Block 4 is free (count 0): freeing it again is an error, as in the reference."""
    pool = _pool(held=[1, 2], hashed=[], twice=[])
    with pytest.raises(Exception, match="block 4 freed more often than allocated"):
        pool.free_runs(np.array([1, 2, 4], dtype=np.intp), RunEnds([2, 1]))


def test_free_block_each_frees_one_block_at_a_time_in_order() -> None:
    """Windows each dropping one block: blocks 4 and 6 unhashed, 9 hashed, 5 held twice;
    each goes alone, so the unhashed ones end up at the front in reverse order, the
    hashed one at the back, 5 stays held (count 1) and the null is skipped."""
    pool = BlockPool(12, enable_caching=True, hash_block_size=4, compiled=False)
    taken = pool.get_new_blocks(11)  # 1..11, all held
    assert taken == list(range(1, 12))
    pool.cache_block(9, b"k9", 0, 4)
    pool.touch([5])
    pool.free_block_each([4, 0, 9, 5, 6])
    assert pool.free_block_queue.block_ids() == [6, 4, 9]
    assert pool.ref_counts()[5] == 1
    with pytest.raises(Exception, match="block 4 freed more often than allocated"):
        pool.free_block_each([4])


# -- free_requests against the reference ------------------------------------------------


def _window_layout(caching: bool = True) -> KVCacheLayout:
    """Full (bs 2) + sliding window (bs 2, w 4): window rows start with null columns."""
    groups = (
        KVCacheGroup(("f",), FullAttentionSpec(block_size=2)),
        KVCacheGroup(("s",), SlidingWindowSpec(block_size=2, sliding_window=4)),
    )
    return KVCacheLayout(groups, num_blocks=60, max_model_len=64, enable_caching=caching)


def _engines_with(prompts: dict[str, list[int]], caching: bool):
    """The optimized and reference engines with each prompt allocated whole (hits taken),
    computed, and one output token appended (window blocks leave the window)."""
    layout = _window_layout(caching)
    engines = (make_engine(layout), make_reference_engine(layout))
    for engine in engines:
        for rid, prompt in prompts.items():
            engine.add_request(RequestInput(rid, tuple(prompt)))
            hit = engine.get_computed_blocks(rid)
            new = len(prompt) - hit.num_tokens
            engine.allocate_slots(rid, new, hit.num_tokens, hit if hit.num_tokens else None, 0)
            engine.set_num_computed_tokens(rid, len(prompt))
            engine.append_output_tokens(rid, [99])
            engine.allocate_slots(rid, 1, 0, None, 0)
    return engines


PROMPTS = {
    "a": list(range(1, 14)),
    "b": list(range(1, 9)) + [50, 51, 52],  # shares 4 full blocks with a
    "c": [70, 71, 72, 73, 74],
    "d": list(range(1, 14)) + [80],  # shares a's prompt
}


@pytest.mark.parametrize("caching", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize(
    "order",
    [["a", "b", "c", "d"], ["d", "b", "a"], ["c", "a"], ["b", "d"]],
    ids=["consecutive", "reversed", "scattered", "pair"],
)
@pytest.mark.parametrize("threshold", [2, 100], ids=["sheets", "row-by-row"])
def test_free_requests_matches_the_reference(caching, order, threshold, monkeypatch) -> None:
    """Rows 0..3 in arrival order: the batch reads consecutive rows as views
    ("consecutive"), others by gathering; with a threshold of 100 one row at a time."""
    monkeypatch.setattr(KVCacheCoordinator, "min_batched_free", threshold)
    ours, ref = _engines_with(PROMPTS, caching)
    assert ours.manager.coordinator.row_of == {"a": 0, "b": 1, "c": 2, "d": 3}
    ours.free_requests(order)
    for rid in order:
        ref.free(rid)
    assert ours.free_queue() == ref.free_queue()
    assert ours.ref_counts() == ref.ref_counts()
    assert ours.num_free_blocks() == ref.num_free_blocks()
    for rid in PROMPTS:
        assert ours.get_block_ids(rid) == ref.get_block_ids(rid)


def test_one_free_over_window_rows_matches_the_reference() -> None:
    """``free`` of each request (the one-row path) in turn, the window rows holding nulls."""
    pair = Pair(_window_layout(True))
    for rid, prompt in PROMPTS.items():
        pair.add(rid, prompt)
        pair.allocate(rid, len(prompt))
        pair.set_computed(rid, len(prompt))
        pair.append(rid, [99])
        pair.allocate(rid, 1)
    for rid in ["b", "a", "d", "c"]:
        pair.free(rid)


def test_rows_held_skips_null_leading_columns_but_not_a_stale_count() -> None:
    """Window rows ``[0, 0, 7, 9]`` and ``[0, 0, 0, 5]`` (leading 2 and 3): columns 0-1 are
    null in both -> read from column 2; with a real block in column 0 of the first row
    (a stale count) the whole rows are read."""
    engine = make_engine(_window_layout())
    window = engine.manager.coordinator.managers[1]
    window.table[0, :4] = [0, 0, 7, 9]
    window.table[1, :4] = [0, 0, 0, 5]
    window.row_len[:2] = 4
    window.num_leading_null[:2] = [2, 3]
    rows = np.array([0, 1])
    assert window.rows_held(rows).tolist() == [[7, 9], [0, 5]]
    assert window.rows_held(slice(0, 2)).tolist() == [[7, 9], [0, 5]]
    window.table[0, 0] = 4
    assert window.rows_held(rows).tolist() == [[4, 0, 7, 9], [0, 0, 0, 5]]


# -- remove_requests --------------------------------------------------------------------


def test_remove_requests_forgets_each_id_and_skips_unknown_ones() -> None:
    ours, _ = _engines_with({"a": PROMPTS["a"], "c": PROMPTS["c"]}, caching=True)
    assert isinstance(ours, FreesInBatch)
    ours.free_requests(["a", "c"])
    ours.remove_requests(["a", "c", "gone"])
    assert ours.requests == {}
    with pytest.raises(Exception, match="unknown request 'a'"):
        ours.free("a")


def test_the_scheduler_removes_a_finished_batch_in_one_call() -> None:
    """A trace where several requests end in one step: one ``remove_requests`` per
    ``free_requests``, no per-request ``remove_request`` for them, the same steps as the
    reference and no request left in the engine at the end."""
    trace = build_trace(sweep_recipe(24, 64))  # requests arriving and ending together
    engine = make_engine(trace.layout)
    calls: dict[str, int] = {"free_requests": 0, "remove_requests": 0, "remove_request": 0}
    for name in calls:
        inner = getattr(engine, name)

        def counted(arg, _inner=inner, _name=name):
            calls[_name] += 1
            return _inner(arg)

        setattr(engine, name, counted)
    ours = Scheduler(engine, trace.layout)
    ref = Scheduler(make_reference_engine(trace.layout), trace.layout)
    for op in trace.operations:
        a, b = ours.apply(op), ref.apply(op)
        if isinstance(op, Step):
            assert a == b
    assert calls["free_requests"] >= 1
    assert calls["remove_requests"] == calls["free_requests"]
    assert engine.requests == {}
    assert ours.finished == ref.finished
