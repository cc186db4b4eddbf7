"""Which new blocks are zeroed: worked by hand (reference/zeroing.py)."""

from __future__ import annotations

from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from reference.zeroing import blocks_to_zero, needs_zeroing


def _layout(*specs) -> KVCacheLayout:
    groups = tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))
    return KVCacheLayout(groups, num_blocks=32, max_model_len=64)


FULL = FullAttentionSpec(block_size=2)
MAMBA = MambaSpec(block_size=2, shapes=((4,),))


def test_a_mamba_group_needs_zeroing_and_is_never_zeroed_itself() -> None:
    layout = _layout(FULL, MAMBA)
    assert needs_zeroing(layout)
    # r0 adds full (1, 2) and Mamba (3), then r1 full (4) and Mamba (5)
    assert blocks_to_zero(layout, [((1, 2), (3,)), ((4,), (5,))]) == [1, 2, 4]


def test_mixed_precision_needs_zeroing_uniform_does_not() -> None:
    mixed = _layout(FULL, SlidingWindowSpec(block_size=2, sliding_window=4, dtype_bytes=1))
    assert needs_zeroing(mixed)
    # group by group: group 0's blocks of both allocations first, null entries skipped
    assert blocks_to_zero(mixed, [((1,), (0, 2)), ((3,), (4,))]) == [1, 3, 2, 4]
    uniform = _layout(FULL, FullAttentionSpec(block_size=2))
    assert not needs_zeroing(uniform)
    assert blocks_to_zero(uniform, [((1,), (2,))]) == []
