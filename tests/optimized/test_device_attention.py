"""Attention through the device block table (:mod:`optimized.device.table_attention`):
hand-computed outputs on tiny shapes, and agreement with SDPA and FlexAttention over the
same keys laid out densely (no pages, no table)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from optimized.device.table_attention import TableAttentionError, table_attention
from paged.paged_cache import CacheShape, PagedKVCache
from reference.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

BS = 2
FULL = FullAttentionSpec(block_size=BS)
SWA3 = SlidingWindowSpec(block_size=BS, sliding_window=3)
CHUNK4 = ChunkedLocalAttentionSpec(block_size=BS, attention_chunk_size=4)


def _cache_with(rows: dict[int, tuple[list[int], list[float]]], head_size: int = 2):
    """A cache whose request on ``slot`` holds value ``[v, 10 v]`` (zero keys) at each
    position, written page by page through ``row``; returns the cache and the table."""
    cache = PagedKVCache(CacheShape(num_blocks=12, block_size=BS, num_kv_heads=1, head_size=2))
    table = torch.zeros((3, 4), dtype=torch.int32)
    for slot, (row, vals) in rows.items():
        table[slot, : len(row)] = torch.tensor(row, dtype=torch.int32)
        slots = torch.tensor([row[p // BS] * BS + p % BS for p in range(len(vals))])
        value = torch.tensor([[[v, 10 * v]] for v in vals])
        cache.write(slots, torch.zeros_like(value), value)
    return cache, table


@pytest.mark.parametrize("backend", ["torch", "sdpa", "flex"])
@pytest.mark.parametrize(
    ("spec", "decode_mean"),
    [(FULL, 2.5), (SWA3, 4.0), (CHUNK4, 4.5)],  # keys 0..5, 3..5, 4..5 seen from position 5
)
def test_zero_queries_average_the_visible_values(backend: str, spec, decode_mean: float) -> None:
    # slot 1: positions 0..5 in blocks 4, 7, 9 with values 0..5; block 4 is nulled in the
    # sliding table (its keys are out of every window here), which must not matter.
    # slot 2: positions 0..2 in blocks 10, 11 with values 100..102, prefilled this step.
    first = 0 if spec is SWA3 else 4
    cache, table = _cache_with({1: ([4, 7, 9], [0, 1, 2, 3, 4, 5]), 2: ([10, 11], [100, 101, 102])})
    table[1, 0] = first
    queries = torch.zeros((4, 1, 2))
    out = table_attention(
        cache, spec, table, [1, 0, 2], [5, 0, 0], [1, 0, 3], queries, backend=backend
    )
    # slot 2 at positions 0, 1, 2: every spec here sees keys 0..p (w = 3, C = 4)
    want = [decode_mean, 100.0, 100.5, 101.0]
    assert out.shape == (4, 1, 2)
    assert torch.allclose(out[:, 0, 0], torch.tensor(want), atol=1e-5)
    assert torch.allclose(out[:, 0, 1], 10 * torch.tensor(want), atol=1e-4)


def _dense_mask(spec, positions: range, length: int) -> torch.Tensor:
    """Visible keys by hand: full k <= p; window w: p - w < k <= p; chunk C: same chunk."""
    rows = []
    for p in positions:
        if isinstance(spec, SlidingWindowSpec):
            lo = max(0, p - spec.sliding_window + 1)
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            lo = p // spec.attention_chunk_size * spec.attention_chunk_size
        else:
            lo = 0
        rows.append([lo <= k <= p for k in range(length)])
    return torch.tensor(rows)


@pytest.mark.parametrize("spec", [FULL, SWA3, CHUNK4])
def test_paged_table_attention_equals_dense_sdpa_and_flex(spec) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    gen = torch.Generator().manual_seed(0)
    heads, dim = 2, 4
    cache = PagedKVCache(CacheShape(num_blocks=16, block_size=BS, num_kv_heads=heads, head_size=4))
    table = torch.zeros((3, 5), dtype=torch.int32)
    # request a: 9 tokens on slot 2, blocks 3 1 8 5 12 (scattered); schedules 6..8
    # request b: 4 tokens on slot 0, blocks 7 2; schedules 1..3 (a chunk of its prefill)
    reqs = [(2, [3, 1, 8, 5, 12], 9, 6), (0, [7, 2], 4, 1)]
    dense, queries, out_dense_sdpa, out_dense_flex = [], [], [], []
    for slot, row, length, start in reqs:
        table[slot, : len(row)] = torch.tensor(row, dtype=torch.int32)
        k = torch.randn(length, heads, dim, generator=gen)
        v = torch.randn(length, heads, dim, generator=gen)
        q = torch.randn(length - start, heads, dim, generator=gen)
        slots = torch.tensor([row[p // BS] * BS + p % BS for p in range(length)])
        cache.write(slots, k, v)
        mask = _dense_mask(spec, range(start, length), length)
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
        out_dense_sdpa.append(
            F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)[0].transpose(0, 1)
        )

        def score_mod(score, b, h, qi, ki, mask=mask):
            return torch.where(mask[qi, ki], score, -float("inf"))

        out_dense_flex.append(flex_attention(qt, kt, vt, score_mod=score_mod)[0].transpose(0, 1))
        dense.append((slot, start, length - start))
        queries.append(q)
    want = torch.cat(out_dense_sdpa)
    assert torch.allclose(torch.cat(out_dense_flex), want, atol=1e-5)
    slots_, starts, counts = zip(*dense)
    for backend in ("torch", "sdpa", "flex"):
        got = table_attention(
            cache, spec, table, slots_, starts, counts, torch.cat(queries), backend=backend
        )
        assert torch.allclose(got, want, atol=1e-5), backend


def test_bad_inputs_are_one_line_errors() -> None:
    cache, table = _cache_with({1: ([4, 7, 9], [0, 1, 2, 3, 4, 5])})
    q = torch.zeros((1, 1, 2))
    with pytest.raises(TableAttentionError, match="backend must be one of"):
        table_attention(cache, FULL, table, [1], [5], [1], q, backend="cudnn")
    with pytest.raises(TableAttentionError, match="needs 5 block table entries"):
        table_attention(cache, FULL, table, [1], [9], [1], q)
    with pytest.raises(TableAttentionError, match=r"queries must be \[2, 1, 2\]"):
        table_attention(cache, FULL, table, [1], [4], [2], q)
