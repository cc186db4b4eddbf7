"""Decode and prefill context parallelism (vLLM 0.33: ``dcp_world_size``,
``pcp_world_size``): which layouts take them and the sizes that follow, worked out by hand
from ``resolve_kv_cache_block_sizes``, ``HybridKVCacheCoordinator.__init__`` and
``partial_hash_hits_enabled``. The layout's block sizes are the managers' (a full-attention
group of block size 8 with DCP 2 is vLLM's spec of 4 tokens per rank)."""

from __future__ import annotations

import pytest

from reference.errors import InvalidLayoutError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec


def _layout(*specs, dcp: int = 1, pcp: int = 1) -> KVCacheLayout:
    groups = tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))
    return KVCacheLayout(
        groups, num_blocks=16, max_model_len=64, dcp_world_size=dcp, pcp_world_size=pcp
    )


def test_one_full_group() -> None:
    # vLLM: one group -> cache_config.block_size (4) * dcp (2) = 8 for both sizes
    layout = _layout(FullAttentionSpec(block_size=8), dcp=2)
    assert (layout.scheduler_block_size, layout.hash_block_size) == (8, 8)
    assert layout.cache_hit_alignment == 8
    assert "dcp=2" in layout.describe()


def test_full_and_mamba() -> None:
    # full 8 (4 per rank, scaled) + Mamba 8 (replicated, not scaled): lcm 8, gcd 8; with
    # DCP a Mamba group of the hash block size (8 >= 8) enables partial hits
    layout = _layout(FullAttentionSpec(block_size=8), MambaSpec(block_size=8), dcp=2)
    assert (layout.scheduler_block_size, layout.hash_block_size) == (8, 8)
    assert layout.partial_hits_enabled
    without = _layout(FullAttentionSpec(block_size=8), MambaSpec(block_size=8))
    assert not without.partial_hits_enabled


@pytest.mark.parametrize(
    ("specs", "dcp", "pcp", "field"),
    [
        ((SlidingWindowSpec(block_size=8, sliding_window=4),), 2, 1, "dcp_world_size"),
        ((FullAttentionSpec(block_size=6),), 4, 1, "dcp_world_size"),  # 6 % 4
        ((FullAttentionSpec(block_size=8), MambaSpec(block_size=8)), 1, 2, "pcp_world_size"),
        ((FullAttentionSpec(block_size=8),), 0, 1, "dcp_world_size"),
    ],
)
def test_refused(specs, dcp: int, pcp: int, field: str) -> None:
    with pytest.raises(InvalidLayoutError) as info:
        _layout(*specs, dcp=dcp, pcp=pcp)
    assert field in str(info.value)


def test_prefill_context_parallel_full_only() -> None:
    layout = _layout(FullAttentionSpec(block_size=4), FullAttentionSpec(block_size=8), pcp=2)
    assert layout.pcp_world_size == 2 and layout.scheduler_block_size == 8
