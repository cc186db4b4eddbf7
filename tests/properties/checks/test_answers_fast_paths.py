"""The answer validators' fast paths give what the entry-by-entry path gives: a valid
answer of plain ints comes back as it is, anything else is normalised or named exactly as
before (``properties/checks/answers.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from properties.checks.answers import AnswerError, check_cached_blocks, check_table
from properties.core.engine import CachedBlock
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

LAYOUT = KVCacheLayout(
    groups=(
        KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),
        KVCacheGroup(("l1",), FullAttentionSpec(block_size=4)),
    ),
    num_blocks=8,
    max_model_len=32,
)


class Tagged(CachedBlock):
    """A subclass: valid, but handed back as a plain :class:`CachedBlock`."""


def test_plain_cached_blocks_come_back_as_they_are() -> None:
    value = [CachedBlock(1, 0, 4), CachedBlock(7, 1, 8)]
    out = check_cached_blocks("cached_blocks()", value, LAYOUT)
    assert out == value and out is not value and all(a is b for a, b in zip(out, value))
    assert check_cached_blocks("cached_blocks()", (), LAYOUT) == []


def test_numpy_ints_and_subclasses_are_normalised() -> None:
    out = check_cached_blocks(
        "cached_blocks()", [CachedBlock(np.int64(3), np.int32(1), 4), Tagged(2, 0, 4)], LAYOUT
    )
    assert out == [CachedBlock(3, 1, 4), CachedBlock(2, 0, 4)]
    assert [type(c) for c in out] == [CachedBlock, CachedBlock]
    assert {type(c.block_id) for c in out} == {int} and {type(c.group_id) for c in out} == {int}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (CachedBlock(0, 0, 4), "returned block id 0 at position 1, outside [1, 8)"),
        (CachedBlock(8, 0, 4), "returned block id 8 at position 1, outside [1, 8)"),
        (CachedBlock(2, 2, 4), "at position 1: group must be in [0, 2) and num_tokens >= 1"),
        (CachedBlock(2, -1, 4), "at position 1: group must be in [0, 2) and num_tokens >= 1"),
        (CachedBlock(2, 0, 0), "at position 1: group must be in [0, 2) and num_tokens >= 1"),
        (CachedBlock(True, 0, 4), "returned True at position 1, not an integer"),
        (CachedBlock(2.0, 0, 4), "returned 2.0 at position 1, not an integer (float)"),
        ((2, 0, 4), "returned (2, 0, 4) at position 1, not a CachedBlock"),
    ],
)
def test_a_bad_entry_is_named_after_good_ones(entry, message) -> None:
    with pytest.raises(AnswerError) as caught:
        check_cached_blocks("cached_blocks()", [CachedBlock(1, 0, 4), entry], LAYOUT)
    assert message in str(caught.value)


class Row(tuple):
    """A tuple subclass: a sequence, through the abstract-class check."""


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        (((1, 2), [3]), ((1, 2), (3,))),
        ([Row((1,)), range(2, 4)], ((1,), (2, 3))),
        (Row(((1,), (2,))), ((1,), (2,))),
    ],
)
def test_tables_as_any_sequence_are_normalised(table, expected) -> None:
    assert check_table("get_block_ids('r0')", table, LAYOUT) == expected


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("ab", "returned 'ab', not a sequence of 2 block id lists"),
        ({0: (1,), 1: (2,)}, "not a sequence of 2 block id lists"),
        (((1,), "2"), "returned '2' for group 1, not a sequence of block ids"),
        (((1,), {2: 1}), "returned {2: 1} for group 1, not a sequence of block ids"),
        (((1,), 2), "returned 2 for group 1, not a sequence of block ids"),
    ],
)
def test_a_table_that_is_no_sequence_is_named(table, message) -> None:
    with pytest.raises(AnswerError) as caught:
        check_table("get_block_ids('r0')", table, LAYOUT)
    assert message in str(caught.value)
