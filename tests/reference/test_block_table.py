"""Worker block tables (spec section 7): slot mapping, append-only rows, nulling view."""

from __future__ import annotations

import pytest

from reference.block_table import (
    PAD_SLOT_ID,
    BlockTable,
    BlockTableError,
    MultiGroupBlockTable,
    num_nulled_entries,
)
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def test_slot_is_block_times_size_plus_offset() -> None:
    t = BlockTable(block_size=4)
    t.add_row("a", [7, 2])
    assert t.slot("a", 0) == 28
    assert t.slot("a", 3) == 31
    assert t.slot("a", 4) == 8
    assert t.slot("a", 5) == 9


def test_slot_mapping_pads_with_minus_one() -> None:
    t = BlockTable(block_size=4)
    t.add_row("a", [7, 2])
    t.add_row("b", [5])
    assert PAD_SLOT_ID == -1
    assert t.slot_mapping(["a", "a", "b"], [3, 4, 2], pad_to=6) == [31, 8, 22, -1, -1, -1]
    assert t.slot_mapping(["b"], [0]) == [20]


def test_append_row_extends_and_add_row_resets() -> None:
    t = BlockTable(block_size=4)
    t.add_row("a", [7])
    t.append_row("a", [2, 5])
    assert t.row("a") == (7, 2, 5)
    assert t.slot("a", 9) == 21
    t.add_row("a", [11])
    assert t.row("a") == (11,)
    assert t.slot("a", 1) == 45


def test_rows_are_append_only_the_worker_keeps_stale_ids() -> None:
    # The manager nulls block 7 of an SWA request; the worker only ever appends.
    t = BlockTable(block_size=2)
    t.add_row("a", [7, 8])
    t.append_row("a", [9])
    assert t.row("a") == (7, 8, 9)


def test_several_groups_with_different_block_sizes() -> None:
    layout = KVCacheLayout(
        groups=(
            KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),
            KVCacheGroup(("l1",), SlidingWindowSpec(block_size=2, sliding_window=3)),
            KVCacheGroup(("l2",), MambaSpec(block_size=8)),
        ),
        num_blocks=32,
        max_model_len=64,
        enable_caching=False,
    )
    tables = MultiGroupBlockTable.for_layout(layout)
    tables.add_row("a", [[3, 4], [5, 6, 7, 8], [9]])
    full, swa, mamba = tables.tables
    # position 5: full -> block 4 offset 1 = 17; SWA bs 2 -> column 2 (block 7) offset 1 = 15
    assert full.slot_mapping(["a"], [5]) == [17]
    assert swa.slot_mapping(["a"], [5]) == [15]
    assert swa.slot_mapping(["a", "a"], [6, 7], pad_to=3) == [16, 17, -1]
    assert not mamba.uses_slot_mapping
    with pytest.raises(BlockTableError, match="Mamba"):
        mamba.slot("a", 0)
    tables.append_row("a", [[10], [11], []])
    assert full.row("a") == (3, 4, 10)
    assert swa.row("a") == (5, 6, 7, 8, 11)
    assert mamba.row("a") == (9,)
    tables.remove_row("a")
    assert not full.has_row("a")


def test_nulling_view_sliding_window() -> None:
    spec = SlidingWindowSpec(block_size=4, sliding_window=5)  # reach 4
    t = BlockTable.for_spec(spec)
    t.add_row("a", [3, 8, 9])
    assert t.nulled_row("a", spec, 7) == (3, 8, 9)  # (7 - 4) // 4 = 0
    assert t.nulled_row("a", spec, 8) == (0, 8, 9)  # (8 - 4) // 4 = 1
    assert t.nulled_row("a", spec, 10) == (0, 8, 9)
    assert t.nulled_row("a", spec, 12) == (0, 0, 9)  # (12 - 4) // 4 = 2
    assert t.row("a") == (3, 8, 9)  # the view does not change the row


def test_nulling_view_window_one_has_no_reach() -> None:
    spec = SlidingWindowSpec(block_size=4, sliding_window=1)
    assert num_nulled_entries(spec, 9) == 0


def test_nulling_view_chunked_local() -> None:
    spec = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8)
    t = BlockTable.for_spec(spec)
    t.add_row("a", [1, 2, 3, 4, 5])
    assert t.nulled_row("a", spec, 7) == (1, 2, 3, 4, 5)  # chunk [0, 8)
    assert t.nulled_row("a", spec, 15) == (0, 0, 3, 4, 5)  # chunk [8, 16) starts at block 2
    assert t.nulled_row("a", spec, 17) == (0, 0, 0, 0, 5)  # chunk [16, 24) starts at block 4


def test_nulling_view_full_and_mamba_unchanged() -> None:
    full = FullAttentionSpec(block_size=2)
    mamba = MambaSpec(block_size=2)
    assert num_nulled_entries(full, 100) == 0
    assert num_nulled_entries(mamba, 100) == 0


def test_errors_name_the_field() -> None:
    t = BlockTable(block_size=4)
    with pytest.raises(BlockTableError, match="no row for request 'x'"):
        t.row("x")
    t.add_row("a", [1])
    with pytest.raises(BlockTableError, match="needs column 1"):
        t.slot("a", 4)
    with pytest.raises(BlockTableError, match="ints >= 0, got -3"):
        t.append_row("a", [-3])
    with pytest.raises(BlockTableError, match="2 rows and 1 positions"):
        t.slot_mapping(["a", "a"], [0])
    with pytest.raises(BlockTableError, match="pad_to must be >= the number of tokens 2"):
        t.slot_mapping(["a", "a"], [0, 1], pad_to=1)
    with pytest.raises(BlockTableError, match="first_pos must be >= 0"):
        num_nulled_entries(FullAttentionSpec(block_size=4), -1)
