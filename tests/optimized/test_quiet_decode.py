"""Quiet decode items, hand-valued: each group's decode threshold (the least computed count
at which a one-token decode item may change the group), the rows' thresholds after a
step, the quiet items settled without any per-group work, and a step that stops at a
loud item's None with quiet items after it (a regression: the quiet items after the
None were returned too)."""

from __future__ import annotations

import numpy as np

import optimized.control.kv_cache_manager as kvm
from optimized.control.kv_cache_manager import KVCacheManager
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def _manager(*specs, num_blocks: int = 40, caching: bool = True) -> KVCacheManager:
    groups = tuple(KVCacheGroup((f"l{i}",), spec) for i, spec in enumerate(specs))
    layout = KVCacheLayout(groups, num_blocks=num_blocks, max_model_len=256, enable_caching=caching)
    return KVCacheManager(layout, max_num_reqs=4, compiled=False)  # the Python paths


def _set_row(group, row: int, held: int, leading: int, cached: int) -> None:
    group.row_len[row] = held
    group.num_leading_null[row] = leading
    group.num_cached_block[row] = cached


def test_sliding_window_threshold_is_the_first_of_allocation_window_and_caching() -> None:
    # bs 16, w 32, held 3, leading 1, cached 2 (the docstring's example): allocation at
    # 3 * 16 = 48, the window drops block 1 once 32 tokens are skipped (c - 31 >= 32: 63),
    # caching block 2 once c + 1 >= 48: 47 -> 47
    swa = _manager(SlidingWindowSpec(block_size=16, sliding_window=32)).coordinator.managers[0]
    _set_row(swa, 0, held=3, leading=1, cached=2)
    # held no more than leading: the window has nothing left to drop; cached 3: caching at
    # 63; allocation at 48
    _set_row(swa, 1, held=3, leading=3, cached=3)
    assert swa.decode_work_threshold(np.array([0, 1])).tolist() == [47, 48]
    assert [swa.decode_work_threshold_of(0), swa.decode_work_threshold_of(1)] == [47, 48]


def test_rows_alike_share_one_threshold() -> None:
    """Three rows with the docstring's counts (a batch prefilled together): 47 each, from
    one row's figure; a fourth row unlike them takes the per-row form."""
    swa = _manager(SlidingWindowSpec(block_size=16, sliding_window=32)).coordinator.managers[0]
    for row in range(3):
        _set_row(swa, row, held=3, leading=1, cached=2)
    assert swa.decode_work_threshold(np.array([0, 1, 2])).tolist() == [47, 47, 47]
    _set_row(swa, 3, held=3, leading=3, cached=3)
    assert swa.decode_work_threshold(np.array([0, 1, 2, 3])).tolist() == [47, 47, 47, 48]


def test_chunked_threshold_waits_for_the_chunk_that_skips_the_next_block() -> None:
    # C 32, bs 16, leading 0: block 0 leaves once c // 32 * 32 >= 16, first at c = 32;
    # held 4 (allocation at 64), cached 3 (caching at 63) -> 32
    chunked = _manager(ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=32))
    group = chunked.coordinator.managers[0]
    _set_row(group, 0, held=4, leading=0, cached=3)
    assert group.decode_work_threshold(np.array([0])).tolist() == [32]
    assert group.decode_work_threshold_of(0) == 32


def test_full_threshold_without_caching_is_the_allocation_boundary() -> None:
    full = _manager(FullAttentionSpec(block_size=4), caching=False).coordinator.managers[0]
    _set_row(full, 2, held=5, leading=0, cached=-1)
    assert full.decode_work_threshold(np.array([2])).tolist() == [20]
    assert full.decode_work_threshold_of(2) == 20


def test_rows_that_must_always_be_tested_read_zero() -> None:
    # a full group whose block size differs from the hash block size (a partial tail key
    # may be promoted)
    groups = (
        KVCacheGroup(("f",), FullAttentionSpec(block_size=8)),
        KVCacheGroup(("s",), SlidingWindowSpec(block_size=4, sliding_window=8)),
    )
    layout = KVCacheLayout(groups, num_blocks=40, max_model_len=256, enable_caching=True)
    full = KVCacheManager(layout, max_num_reqs=4).coordinator.managers[0]
    assert full.block_size != full.block_pool.hash_block_size
    _set_row(full, 0, held=5, leading=0, cached=2)
    assert full.decode_work_threshold(np.array([0])).tolist() == [0]
    assert full.decode_work_threshold_of(0) == 0


def test_a_mamba_rows_threshold_is_its_next_state_retirement_or_cached_block() -> None:
    """bs 4. Row 0: 5 columns held, 1 retired, 2 cached: a new state block at ``c >= 20``
    (``cdiv(c + 1, 4) > 5``), the next retirement at ``(1 + 1) * 4 + 1 = 9`` (``(c - 1)
    // 4 > 1``), the next cached block at ``2 * 4 + 3 = 11`` -> 9. Row 1: 3 held, 3
    retired, 3 cached: the state block at 12, retirement past 17, caching at 15 -> 12.
    Without a prefix cache row 0 still reads 9."""
    mamba = _manager(MambaSpec(block_size=4)).coordinator.managers[0]
    assert not mamba.always_tested()
    mamba.row_len[:2] = [5, 3]
    mamba.num_retired_blocks[:2] = [1, 3]
    mamba.num_cached_block[:2] = [2, 3]
    assert mamba.decode_work_threshold(np.array([0, 1])).tolist() == [9, 12]
    assert [mamba.decode_work_threshold_of(0), mamba.decode_work_threshold_of(1)] == [9, 12]
    plain = _manager(MambaSpec(block_size=4), caching=False).coordinator.managers[0]
    plain.row_len[0], plain.num_retired_blocks[0] = 5, 1
    assert plain.decode_work_threshold_of(0) == 9


def _ids(out) -> list:
    """A step's answer as plain lists (``[]`` per group for an item with no new block)."""
    return [None if r is None else [list(g) for g in r] for r in out]


def _decoding(manager: KVCacheManager, rid: str, prompt: int, computed: int):
    """A request whose prompt of ``prompt`` tokens is allocated, ``computed`` computed."""
    req = manager.make_request(rid, list(range(prompt)))
    assert manager.allocate_slots(req, prompt) is not None
    req.num_computed_tokens = computed
    return req


def test_quiet_items_skip_the_per_group_work_and_thresholds_follow_the_rows(monkeypatch) -> None:
    # one full group, bs 4, no prefix cache: r0 holds 2 blocks (8 slots), r1 2 blocks
    manager = _manager(FullAttentionSpec(block_size=4), caching=False)
    r0 = _decoding(manager, "r0", 8, 6)
    r1 = _decoding(manager, "r1", 6, 4)
    rows = [manager.coordinator.row_of["r0"], manager.coordinator.row_of["r1"]]
    # allocate_slots gives a row it takes its threshold: held 2 * bs 4
    assert [manager._next_work[r] for r in rows] == [8, 8]
    assert _ids(manager.schedule_columns([r0, r1], [1, 1], [0, 0])) == [[[]], [[]]]
    assert [manager._next_work[r] for r in rows] == [8, 8]
    applied: list[str] = []
    item = kvm.apply_decode_item

    def spy(mgr, request, *args):
        applied.append(request.request_id)
        return item(mgr, request, *args)

    monkeypatch.setattr(kvm, "apply_decode_item", spy)
    r0.num_computed_tokens, r1.num_computed_tokens = 7, 5
    assert manager.schedule_columns([r0, r1], [1, 1], [0, 0]) == [manager.no_new_blocks] * 2
    assert applied == []  # both below 8: settled from the thresholds alone
    r0.append_token(1)  # 9 tokens; computed 8 reaches the threshold: slot 9 needs block 3
    r0.num_computed_tokens, r1.num_computed_tokens = 8, 5
    out = manager.schedule_columns([r0, r1], [1, 1], [0, 0])
    assert applied == ["r0"]
    assert _ids(out) == [[[5]], [[]]]
    assert manager.get_block_ids("r0") == ((1, 2, 5),)
    assert [manager._next_work[r] for r in rows] == [12, 8]


def test_a_step_stops_at_a_loud_items_none_before_the_quiet_ones() -> None:
    # 4 usable blocks, all held: r0 (2 blocks) reaches its boundary with none free
    manager = _manager(FullAttentionSpec(block_size=4), num_blocks=5, caching=False)
    r0 = _decoding(manager, "r0", 8, 7)
    r1 = _decoding(manager, "r1", 6, 4)
    assert manager.get_num_free_blocks() == 0
    manager.schedule_columns([r0, r1], [1, 1], [0, 0])  # both idle: thresholds 8 and 8
    r0.append_token(1)
    r0.num_computed_tokens, r1.num_computed_tokens = 8, 5
    # r0 is loud and gets None; r1 (quiet) comes after it and is not part of the answer
    assert manager.schedule_columns([r0, r1], [1, 1], [0, 0]) == [None]
    assert _ids(manager.schedule_columns([r1, r0], [1, 1], [0, 0])) == [[[]], None]
    assert manager.get_block_ids("r0") == ((1, 2),)
    assert manager.get_block_ids("r1") == ((3, 4),)
