"""The host tier (reference/host_tier.py): the docstring's worked examples, by hand."""

from __future__ import annotations

import pytest

from reference.errors import KVConformError
from reference.host_tier import HostTier

T = tuple(range(100, 120))  # t0..t19


def test_offload_stores_full_blocks_only() -> None:
    tier = HostTier(block_size=4, capacity_blocks=8)
    tier.offload(None, None, T, 10)  # t0..t9: keys of t0..t3 and t0..t7
    assert len(tier) == 2
    assert tier.longest_prefix(None, None, T[:12]) == 8


def test_lookup_examples() -> None:
    tier = HostTier(block_size=4, capacity_blocks=8)
    tier.offload(None, None, T, 8)
    assert tier.num_external_tokens(None, None, T[:12], 4) == 4
    assert tier.num_external_tokens(None, None, T[:9], 0) == 8
    assert tier.num_external_tokens(None, None, T[:8], 0) == 4  # the last token is computed
    assert tier.num_external_tokens(None, None, T[:12], 8) == 0  # the device holds it all


def test_keys_include_salt_and_lora_and_the_whole_prefix() -> None:
    tier = HostTier(block_size=4, capacity_blocks=8)
    tier.offload("s", None, T, 8)
    assert tier.num_external_tokens(None, None, T[:12], 0) == 0
    assert tier.num_external_tokens("s", "lora", T[:12], 0) == 0
    assert tier.num_external_tokens("s", None, T[:12], 0) == 8
    other = (999,) + T[1:12]  # a different first block: no block of it is held
    assert tier.num_external_tokens("s", None, other, 0) == 0


def test_capacity_evicts_least_recently_used_first() -> None:
    a, b = T[:4], T[4:8]
    x = (7, 7, 7, 7)
    tier = HostTier(block_size=4, capacity_blocks=2)
    tier.offload(None, None, a + b, 8)  # keys A, AB
    tier.offload(None, None, x, 4)  # X evicts A
    assert len(tier) == 2
    assert tier.num_external_tokens(None, None, a + b + (1,), 0) == 0  # AB alone is unusable


def test_a_served_hit_becomes_most_recent() -> None:
    a, b = T[:4], T[4:8]
    tier = HostTier(block_size=4, capacity_blocks=2)
    tier.offload(None, None, a, 4)  # A
    tier.offload(None, None, b, 4)  # B
    assert tier.num_external_tokens(None, None, a + (1,), 0) == 4  # A served: B is oldest
    tier.offload(None, None, (7, 7, 7, 7), 4)  # evicts B
    assert tier.num_external_tokens(None, None, a + (1,), 0) == 4
    assert tier.num_external_tokens(None, None, b + (1,), 0) == 0


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(KVConformError, match="block_size"):
        HostTier(block_size=0, capacity_blocks=1)
    with pytest.raises(KVConformError, match="capacity_blocks"):
        HostTier(block_size=4, capacity_blocks=-1)
