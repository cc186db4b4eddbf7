"""Paged cache writes through the slot mapping, and paged attention against the dense path."""

from __future__ import annotations

import math

import pytest
import torch

from paged.paged_attention import PagedAttentionError, RequestQueries, paged_attention
from paged.paged_cache import CacheShape, PagedCacheError, PagedKVCache, PagedStateCache
from reference.attention import dense_attention
from reference.content import ContentModel
from reference.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec


def test_write_lands_at_block_and_offset_and_skips_padding() -> None:
    cache = PagedKVCache(CacheShape(num_blocks=4, block_size=4, num_kv_heads=1, head_size=2))
    k = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    v = torch.tensor([[[5.0, 6.0]], [[7.0, 8.0]]])
    cache.write(torch.tensor([9, -1]), k, v)  # slot 9 = block 2, offset 1
    assert cache.key[2, 1, 0].tolist() == [1.0, 2.0]
    assert cache.value[2, 1, 0].tolist() == [5.0, 6.0]
    assert int(torch.isnan(cache.key).sum()) == 4 * 4 * 2 - 2  # nothing else written
    assert bool(torch.isnan(cache.key[0]).all())  # the null block stays NaN


def test_write_refuses_null_block_and_out_of_range() -> None:
    cache = PagedKVCache(CacheShape(num_blocks=2, block_size=2, num_kv_heads=1, head_size=1))
    one = torch.zeros((1, 1, 1))
    with pytest.raises(PagedCacheError, match="slot 1 is in the null block"):
        cache.write(torch.tensor([1]), one, one)
    with pytest.raises(PagedCacheError, match="slot 4"):
        cache.write(torch.tensor([4]), one, one)
    with pytest.raises(PagedCacheError, match="one K and V row per slot"):
        cache.write(torch.tensor([2, 3]), one, one)


def test_state_cache_read_write() -> None:
    states = PagedStateCache(num_blocks=3, state_size=2)
    assert bool(torch.isnan(states.read(0)).all())
    states.write(2, torch.tensor([0.5, -0.5]))
    assert states.read(2).tolist() == [0.5, -0.5]
    with pytest.raises(PagedCacheError, match="null block 0"):
        states.write(0, torch.tensor([0.0, 0.0]))
    with pytest.raises(PagedCacheError, match=r"\[0, 3\), got 3"):
        states.read(3)


def _fill(
    cache: PagedKVCache, m: ContentModel, hashes: list[int], row: list[int], positions: range
) -> None:
    bs = cache.block_size
    slots = [row[p // bs] * bs + p % bs for p in positions]
    cache.write(
        torch.tensor(slots),
        torch.tensor([m.key(hashes, p, 0) for p in positions], dtype=torch.float64),
        torch.tensor([m.value(hashes, p, 0) for p in positions], dtype=torch.float64),
    )


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
@pytest.mark.parametrize(
    "spec",
    [
        FullAttentionSpec(block_size=4),
        SlidingWindowSpec(block_size=4, sliding_window=4),
        ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8),
    ],
    ids=["full", "swa", "chunked"],
)
def test_paged_matches_dense_and_masked_nan_does_not_leak(spec, backend) -> None:
    m = ContentModel(num_kv_heads=2, head_size=4)
    tokens = list(range(40, 60))
    hashes = m.prefix_hashes(tokens)
    cache = PagedKVCache(CacheShape(16, 4, 2, 4), dtype=torch.float64)
    row = [7, 3, 9, 5, 11]  # 20 tokens
    _fill(cache, m, hashes, row, range(20))
    positions = tuple(range(14, 20))
    if isinstance(spec, SlidingWindowSpec):
        # Positions 8..10 (block 9, offsets 0..2) are gathered (the view nulls only
        # (14 - 3) // 4 = 2 entries) but no query in 14..19 sees them (first key 11).
        cache.key[9, :3] = math.nan
        cache.value[9, :3] = math.nan
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        # Block 3 (positions 4..7) lies before chunk [8, 16): not gathered at all.
        cache.key[3] = math.nan
        cache.value[3] = math.nan
    q = torch.tensor([m.query(hashes, p, 0) for p in positions], dtype=torch.float64)
    (out,) = paged_attention(
        cache, spec, [RequestQueries(tuple(row), positions, q)], backend=backend
    )
    expected = torch.tensor(dense_attention(m, spec, hashes, positions, 0), dtype=torch.float64)
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)


def test_needed_null_page_shows_as_nan() -> None:
    spec = SlidingWindowSpec(block_size=4, sliding_window=4)
    m = ContentModel()
    hashes = m.prefix_hashes(range(12))
    cache = PagedKVCache(CacheShape(8, 4, 1, 8))
    _fill(cache, m, hashes, [1, 2, 3], range(12))
    q = torch.tensor([m.query(hashes, 9, 0)])
    # Query 9 sees [6, 9]: column 1 is needed; a 0 there reads the NaN null page.
    (bad,) = paged_attention(cache, spec, [RequestQueries((1, 0, 3), (9,), q)])
    assert bool(torch.isnan(bad).all())
    # Column 0 is not needed (nulling view: (9 - 3) // 4 = 1 entry), so a 0 there is fine.
    (good,) = paged_attention(cache, spec, [RequestQueries((0, 2, 3), (9,), q)])
    assert not bool(torch.isnan(good).any())


def test_unknown_backend_and_short_row() -> None:
    spec = FullAttentionSpec(block_size=4)
    cache = PagedKVCache(CacheShape(4, 4, 1, 2))
    q = torch.zeros((1, 1, 2))
    with pytest.raises(PagedAttentionError, match="backend must be one of"):
        paged_attention(cache, spec, [], backend="flash")
    with pytest.raises(PagedAttentionError, match="needs 2 block table entries"):
        paged_attention(cache, spec, [RequestQueries((1,), (4,), q)])
