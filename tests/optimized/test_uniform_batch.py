"""The decode step of a batch whose items are all alike (:mod:`optimized.control.
uniform_decode`: a batch prefilled together, decoding in lock step), against
a queue worked out by hand and against the reference on drawn layouts and batches.

The hand case counts the uniform path's applied calls with a spy, so a change that stops
taking it (or takes it and gets the queue wrong) fails here, not only in a bench."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import optimized.control.batched_decode as bd
import optimized.control.uniform_decode as ud
from optimized.control.uniformity import same_everywhere
from reference.errors import KVConformError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from tests.optimized.optimized_differential import Pair


def _spy_uniform(monkeypatch) -> list[bool]:
    """Record, per call of ``apply_uniform``, whether it applied the step (not None)."""
    applied: list[bool] = []
    uniform = bd.apply_uniform

    def spy(*args):
        result = uniform(*args)
        applied.append(result is not None)
        return result

    monkeypatch.setattr(bd, "apply_uniform", spy)
    return applied


def _lockstep(pair: Pair, num_requests: int, prompt_len: int, shared: bool, steps: int) -> None:
    """``num_requests`` prompts of ``prompt_len`` tokens (one prompt for all when
    ``shared``) prefilled one after another (until the pool is full), then ``steps``
    plain decode steps over all of them as columns; the pair compares everything after
    each call."""
    ids: list[str] = []
    for i in range(num_requests):
        rid = f"r{i}"
        first = 0 if shared else 1000 * i
        pair.add(rid, list(range(first, first + prompt_len)))
        hit = pair.lookup(rid)
        num_hit = hit[0][1]
        if pair.allocate(rid, prompt_len - num_hit, hit if num_hit else None) is None:
            break  # the pool is full: the batch is the requests admitted so far
        pair.set_computed(rid, prompt_len)
        ids.append(rid)
    for step in range(steps):
        pair.new_step()
        for rid in ids:
            pair.append(rid, [7 + step])
        out = pair.step([(rid, 1, 0) for rid in ids])
        if len(out) < len(ids):  # a full pool: the reference stopped at a None too
            return
        for rid in ids:
            pair.set_computed(rid, pair.ref_reqs[rid].num_computed_tokens + 1)


def test_each_item_pops_the_head_of_its_own_window_run(monkeypatch) -> None:
    """SWA (bs 4, w 4), no prefix cache, 2 requests of 12 tokens: rows ``[1, 2, 3]`` and
    ``[4, 5, 6]``. Decoding token 13: 9 tokens skipped (2 blocks leave each row, tail
    first: runs ``[2, 1]`` and ``[5, 4]``) and each row needs a 4th block. Item 0 frees
    ``[2, 1]`` to the front and pops 2; item 1 frees ``[5, 4]`` and pops 5: the queue
    starts ``[4, 1, 7, ...]``."""
    monkeypatch.setattr(bd, "MIN_UNIFORM_ITEMS", 2)
    applied = _spy_uniform(monkeypatch)
    group = KVCacheGroup(("s",), SlidingWindowSpec(block_size=4, sliding_window=4))
    layout = KVCacheLayout((group,), num_blocks=20, max_model_len=64, enable_caching=False)
    pair = Pair(layout, min_batched_apply=0, columns=True)
    _lockstep(pair, num_requests=2, prompt_len=12, shared=False, steps=1)
    assert applied == [True]
    assert pair.opt.get_block_ids("r0") == ((0, 0, 3, 2),)
    assert pair.opt.get_block_ids("r1") == ((0, 0, 6, 5),)
    assert pair.opt.block_pool.free_block_queue.block_ids()[:3] == [4, 1, 7]


def test_two_window_groups_free_their_runs_last_group_first(monkeypatch) -> None:
    """Two freeing groups (SWA and chunked local) and a full group: each item's run is the
    chunked group's blocks before the window's (its free call comes later), checked
    against the reference over steps that drop blocks, pop and cache."""
    monkeypatch.setattr(bd, "MIN_UNIFORM_ITEMS", 2)
    applied = _spy_uniform(monkeypatch)
    groups = (
        KVCacheGroup(("s",), SlidingWindowSpec(block_size=2, sliding_window=3)),
        KVCacheGroup(("c",), ChunkedLocalAttentionSpec(block_size=2, attention_chunk_size=4)),
        KVCacheGroup(("f",), FullAttentionSpec(block_size=2)),
    )
    for caching in (False, True):
        layout = KVCacheLayout(groups, num_blocks=120, max_model_len=64, enable_caching=caching)
        pair = Pair(layout, min_batched_apply=0, columns=True)
        _lockstep(pair, num_requests=3, prompt_len=9, shared=False, steps=6)
    assert any(applied)


def test_pops_that_would_not_fit_at_a_later_items_turn_are_left_to_the_general_pass(
    monkeypatch,
) -> None:
    """SWA (bs 2, w 2) + full (bs 2), prefix cache on, 10 blocks: 2 requests of 4 tokens
    hold 8 hashed blocks, 1 is free. Decoding token 5, each item frees 1 hashed block (to
    the back) and pops 2. Item 0 fits (1 + 1 free), item 1 does not (1 + 1 - 2 + 1 = 1 <
    2): the uniform path must refuse, and the step stops at item 1's None as the
    reference's does (item 1's window block is freed before its pops are refused)."""
    monkeypatch.setattr(bd, "MIN_UNIFORM_ITEMS", 2)
    applied = _spy_uniform(monkeypatch)
    groups = (
        KVCacheGroup(("s",), SlidingWindowSpec(block_size=2, sliding_window=2)),
        KVCacheGroup(("f",), FullAttentionSpec(block_size=2)),
    )
    layout = KVCacheLayout(groups, num_blocks=10, max_model_len=64, enable_caching=True)
    pair = Pair(layout, min_batched_apply=0, columns=True)
    _lockstep(pair, num_requests=2, prompt_len=4, shared=False, steps=1)
    assert applied == [False]
    # item 0: 1 free + 1 freed - 2 popped; item 1 frees its block, then cannot pop 2
    assert pair.opt.get_num_free_blocks() == 1


def test_rows_whose_window_spans_start_apart_take_the_general_pass(monkeypatch) -> None:
    """SWA (bs 4, w 4), no prefix cache: r0 prefilled in chunks of 8 and 4 tokens (the
    second chunk frees its first block: leading nulls 1), r1 in one chunk of 12 (none).
    Same length, same computed count, but the spans to free start apart: the plan must
    refuse, and the step must match the reference's."""
    monkeypatch.setattr(bd, "MIN_UNIFORM_ITEMS", 2)
    applied = _spy_uniform(monkeypatch)
    group = KVCacheGroup(("s",), SlidingWindowSpec(block_size=4, sliding_window=4))
    layout = KVCacheLayout((group,), num_blocks=20, max_model_len=64, enable_caching=False)
    pair = Pair(layout, min_batched_apply=0, columns=True)
    pair.add("r0", list(range(12)))
    pair.add("r1", list(range(100, 112)))
    pair.allocate("r0", 8)
    pair.set_computed("r0", 8)
    pair.allocate("r0", 4)
    pair.allocate("r1", 12)
    for rid in ("r0", "r1"):
        pair.set_computed(rid, 12)
        pair.append(rid, [7])
    assert pair.opt.get_block_ids("r0")[0][0] == 0 and pair.opt.get_block_ids("r1")[0][0] != 0
    pair.step([("r0", 1, 0), ("r1", 1, 0)])
    assert applied == []  # refused by the plan, before any array is touched


def test_the_plan_refuses_an_item_popping_two_blocks_in_a_group() -> None:
    """Rows of 3 blocks (bs 4, 12 tokens) asked for 20 slots would pop 2 blocks each: the
    uniform step writes one new block per group, so the plan is None."""
    group = KVCacheGroup(("f",), FullAttentionSpec(block_size=4))
    layout = KVCacheLayout((group,), num_blocks=40, max_model_len=64, enable_caching=False)
    pair = Pair(layout)
    for rid in ("r0", "r1"):
        pair.add(rid, list(range(12)))
        pair.allocate(rid, 12)
    rows = np.array([pair.opt.coordinator.row(r) for r in ("r0", "r1")])
    managers = pair.opt.coordinator.managers
    assert ud.uniform_plan(managers, rows, total=12, slots=16) == [(1, 3, 0, 0, -1)]
    assert ud.uniform_plan(managers, rows, total=12, slots=20) is None


@st.composite
def _batch_layouts(draw) -> KVCacheLayout:
    """1 to 3 attention groups (full, sliding window, chunked local), pools from tight
    (pops refused mid-step) to roomy, with or without the prefix cache."""
    groups = []
    for gid in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["full", "swa", "chunked"]))
        bs = draw(st.sampled_from([1, 2, 4]))
        if kind == "full":
            spec = FullAttentionSpec(block_size=bs)
        elif kind == "swa":
            spec = SlidingWindowSpec(block_size=bs, sliding_window=draw(st.integers(1, 12)))
        else:
            spec = ChunkedLocalAttentionSpec(
                block_size=bs, attention_chunk_size=draw(st.integers(1, 12))
            )
        groups.append(KVCacheGroup((f"l{gid}",), spec))
    try:
        return KVCacheLayout(
            tuple(groups),
            num_blocks=draw(st.integers(20, 200)),
            max_model_len=64,
            enable_caching=draw(st.booleans()),
        )
    except KVConformError:  # (a layout the engines reject: chunked with odd block sizes)
        assume(False)
        raise


@settings(max_examples=60, deadline=None)
@given(
    layout=_batch_layouts(),
    num_requests=st.integers(8, 12),
    prompt_len=st.integers(1, 30),
    shared=st.booleans(),
    steps=st.integers(1, 10),
)
def test_lockstep_batches_match_reference(layout, num_requests, prompt_len, shared, steps):
    """Batches prefilled together and decoded in lock step (the uniform path's case; a
    shared prompt holds blocks twice, which it must leave to the general pass) give the
    reference's tables, queue, counts and cache after every step."""
    pair = Pair(layout, min_batched_apply=0, columns=True)
    _lockstep(pair, num_requests, prompt_len, shared, steps)


def test_same_everywhere_compares_entries_or_rows() -> None:
    assert same_everywhere(np.array([5, 5, 5])) and not same_everywhere(np.array([5, 6]))
    assert same_everywhere(np.array([[1, 0], [1, 0]]))
    assert not same_everywhere(np.array([[1, 0], [0, 1]]))


def test_runs_alike_counts_each_rows_front_blocks() -> None:
    """Rows with one mask, rows with other masks but equal counts, unequal counts."""
    assert ud._runs_alike(np.array([[True, False], [True, False]]))
    assert ud._runs_alike(np.array([[True, False], [False, True]]))
    assert not ud._runs_alike(np.array([[True, True], [False, True]]))


def test_append_uniform_writes_each_popping_groups_column_at_the_shared_length() -> None:
    """Groups popping 1, 0, 1 block, rows 0 and 1 of length 2, 2 and 3: popped
    ``[[4, 5], [6, 7]]`` -> group 0 gets 4 and 6 at column 2, group 2 gets 5 and 7 at
    column 3, group 1 nothing."""

    class Rows:
        def __init__(self) -> None:
            self.table = np.zeros((4, 8), dtype=np.int32)
            self.row_len = np.zeros(4, dtype=np.int32)
            self.dirty_rows = np.zeros(4, dtype=bool)

    groups = [Rows(), Rows(), Rows()]
    plan = [ud.UniformGroupPlan(1, 2, 0, 0, 0), ud.UniformGroupPlan(0, 2, 0, 0, 0)]
    plan.append(ud.UniformGroupPlan(1, 3, 0, 0, 0))
    out = ud._append_uniform(groups, slice(0, 2), plan, np.array([[4, 5], [6, 7]]))
    assert out == [[[4], [], [5]], [[6], [], [7]]]
    assert groups[0].table[:2, 2].tolist() == [4, 6] and groups[2].table[:2, 3].tolist() == [5, 7]
    assert groups[0].row_len[:2].tolist() == [3, 3] and groups[2].row_len[:2].tolist() == [4, 4]
    assert not groups[1].table.any() and not groups[1].dirty_rows.any()
    assert groups[0].dirty_rows[:2].all() and not groups[0].dirty_rows[2:].any()
