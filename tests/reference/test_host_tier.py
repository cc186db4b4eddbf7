"""The host tier (reference/host_tier.py): the docstring's worked examples, by hand."""

from __future__ import annotations

import pytest

from reference.errors import KVConformError
from reference.host_tier import HostTier, num_detached_blocks
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

T = tuple(range(100, 120))  # t0..t19
FULL = FullAttentionSpec(block_size=4)
WINDOW = SlidingWindowSpec(block_size=4, sliding_window=4)


def _layout(*specs) -> KVCacheLayout:
    groups = tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))
    return KVCacheLayout(groups, num_blocks=32, max_model_len=64)


def _store(tier: HostTier, group: int, tokens, blocks, salt=None, lora=None) -> None:
    for k in blocks:
        tier.offload(group, salt, lora, tokens, k)


def test_keys_are_per_group_and_whole_prefix() -> None:
    tier = HostTier(_layout(FULL, WINDOW), capacity_blocks=8)
    assert tier.key(0, "s", None, T, 1) == (0, "s", None, T[:8])
    _store(tier, 1, T, [1])
    assert tier.holds(1, None, None, T, 1)
    assert not tier.holds(0, None, None, T, 1)
    with pytest.raises(KVConformError, match="past the 6 known tokens"):
        tier.key(0, None, None, T[:6], 1)  # a partial block is never stored


def test_lookup_examples_one_full_group() -> None:
    tier = HostTier(_layout(FULL), capacity_blocks=8)
    _store(tier, 0, T, [0, 1])  # t0..t3 and t0..t7
    assert tier.num_external_tokens(None, None, T[:12], 4) == 4
    assert tier.num_external_tokens(None, None, T[:9], 0) == 8
    assert tier.num_external_tokens(None, None, T[:8], 0) == 4  # the last token is computed
    assert tier.num_external_tokens(None, None, T[:12], 8) == 0  # the device holds it all


def test_full_attention_needs_every_block_from_the_device_hit() -> None:
    tier = HostTier(_layout(FULL), capacity_blocks=8)
    _store(tier, 0, T, [1, 2])  # block 0 missing
    assert tier.num_external_tokens(None, None, T[:13], 0) == 0
    assert tier.num_external_tokens(None, None, T[:13], 4) == 8  # the device serves block 0


def test_a_ring_is_never_stored_nor_needed() -> None:
    """A circular buffer's ring (outside prefix caching) takes no part in the tier: its
    block is not stored, and the full group's keys alone serve a hit."""
    tier = HostTier(_layout(FULL, CircularBufferSpec(block_size=4)), capacity_blocks=8)
    _store(tier, 0, T, [0, 1])  # the full group's t0..t3 and t0..t7
    _store(tier, 1, T, [0])  # the ring: nothing stored
    assert len(tier) == 2 and not tier.holds(1, None, None, T, 0)
    assert tier.num_external_tokens(None, None, T[:12], 0) == 8


def test_a_window_needs_only_its_last_blocks() -> None:
    """The docstring's example: full + window w 4 (bs 4); the window group holds only
    block 1 of t0..t7, the full group blocks 0 and 1: L = 8 is servable."""
    tier = HostTier(_layout(FULL, WINDOW), capacity_blocks=8)
    _store(tier, 0, T, [0, 1])
    _store(tier, 1, T, [1])
    assert list(tier.needed_blocks(1, 0, 8)) == [1]  # skip 8 - 4 + 1 = 5 -> block 1
    assert list(tier.needed_blocks(0, 0, 8)) == [0, 1]
    assert tier.num_external_tokens(None, None, T[:12], 0) == 8
    # with the window group's block 0 instead, only L = 4 is servable (skip 1 -> block 0)
    tier2 = HostTier(_layout(FULL, WINDOW), capacity_blocks=8)
    _store(tier2, 0, T, [0, 1])
    _store(tier2, 1, T, [0])
    assert tier2.num_external_tokens(None, None, T[:12], 0) == 4


def test_the_largest_servable_length_is_served_not_the_first() -> None:
    """Window only (w 4, bs 4): blocks 2 and 3 held, 0 and 1 not: L = 4 and 8 are not
    servable, L = 12 is (needs block 2: skip 9 -> block 2), L = 16 needs block 3: held."""
    tier = HostTier(_layout(WINDOW), capacity_blocks=8)
    _store(tier, 0, T, [2, 3])
    assert tier.num_external_tokens(None, None, T[:17], 0) == 16
    assert tier.num_external_tokens(None, None, T[:13], 0) == 12


def test_chunked_local_needs_the_current_chunk_only() -> None:
    """Chunk 8, bs 4: L = 12 reads [8, 12): block 2; L = 8 starts a chunk: needs nothing."""
    chunked = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8)
    tier = HostTier(_layout(chunked), capacity_blocks=8)
    assert list(tier.needed_blocks(0, 0, 12)) == [2]
    assert list(tier.needed_blocks(0, 0, 8)) == []
    _store(tier, 0, T, [2])
    assert tier.num_external_tokens(None, None, T[:14], 0) == 12


def test_keys_include_salt_and_lora() -> None:
    tier = HostTier(_layout(FULL), capacity_blocks=8)
    _store(tier, 0, T, [0, 1], salt="s")
    assert tier.num_external_tokens(None, None, T[:12], 0) == 0
    assert tier.num_external_tokens("s", "lora", T[:12], 0) == 0
    assert tier.num_external_tokens("s", None, T[:12], 0) == 8
    other = (999,) + T[1:12]  # a different first block: no block of it is held
    assert tier.num_external_tokens("s", None, other, 0) == 0


def test_capacity_evicts_least_recently_used_first() -> None:
    a, b = T[:4], T[4:8]
    x = (7, 7, 7, 7)
    tier = HostTier(_layout(FULL), capacity_blocks=2)
    _store(tier, 0, a + b, [0, 1])  # keys A, AB
    _store(tier, 0, x, [0])  # X evicts A
    assert len(tier) == 2
    assert tier.num_external_tokens(None, None, a + b + (1,), 0) == 0  # AB alone is unusable


def test_a_served_hit_becomes_most_recent() -> None:
    a, b = T[:4], T[4:8]
    tier = HostTier(_layout(FULL), capacity_blocks=2)
    _store(tier, 0, a, [0])
    _store(tier, 0, b, [0])
    assert tier.num_external_tokens(None, None, a + (1,), 0) == 4  # A served: B is oldest
    _store(tier, 0, (7, 7, 7, 7), [0])  # evicts B
    assert tier.num_external_tokens(None, None, a + (1,), 0) == 4
    assert tier.num_external_tokens(None, None, b + (1,), 0) == 0


def test_num_detached_blocks() -> None:
    window = SlidingWindowSpec(block_size=2, sliding_window=4)
    layout = _layout(FULL, window)
    assert num_detached_blocks(layout, 1, 9) == 3  # skip 9 - 4 + 1 = 6 -> 3 blocks
    assert num_detached_blocks(layout, 1, 4) == 0  # skip 1: block 0 still has token 1
    assert num_detached_blocks(layout, 0, 60) == 0  # full attention never detaches


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(KVConformError, match="capacity_blocks"):
        HostTier(_layout(FULL), capacity_blocks=-1)
    mamba = MambaSpec(block_size=4)
    with pytest.raises(KVConformError, match="Mamba"):
        HostTier(_layout(FULL, mamba), capacity_blocks=4)
