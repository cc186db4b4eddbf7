"""Targeted layouts: layouts built to reach particular rules on purpose, which the
generic draws of :func:`~properties.generate.strategies.layouts` rarely make.

Sliding windows finer than the hit alignment (:func:`small_block_hybrids`), pools that
hold about one request (:func:`tight_pool_layouts`), chunks that are not a multiple of
their block size (:func:`chunked_layouts`), prefix caching off
(:func:`uncached_layouts`); :func:`targeted_layouts` mixes them, the fine windows three
times in six. Example: full attention bs 8 beside a sliding window bs 2 (w 5): the
window's hit must end on a block whose end is a multiple of 8.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from properties.generate.strategies.generated_layouts import _layout_of, _sized, layouts
from properties.generate.strategies.group_specs import _attention_fields
from properties.generate.strategies.reuse import _integers_either
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec


@st.composite
def small_block_hybrids(draw, max_len: int = 256) -> KVCacheLayout:
    """A hybrid where a windowed group's block size is smaller than the hit alignment.

    One "coarse" group (full attention, or a second sliding window, or nothing) has
    block size ``A`` in ``{4, 8, 16}``; a sliding-window group has ``A / k`` (``k`` in
    ``{2, 4}``), so its hit search must stop at aligned ends and its cached blocks are
    masked per segment; a Mamba group (block size ``gcd``) joins a third of the time.
    Example: full bs 8 + sliding window bs 2 (w 5): alignment 8, the window's hit must
    end on a block whose end is a multiple of 8.
    """
    coarse = draw(st.sampled_from((4, 8, 16)))
    fine = coarse // draw(st.sampled_from((2, 4)))
    partners = (("full",), ("sliding_window",), ("sliding_window", "mamba"), ("full", "mamba"))
    kinds = ["sliding_window", *draw(st.sampled_from(partners))]
    # the partner attention group has the coarse size; Mamba the hash block size
    sizes = [fine, coarse] + [fine] * (len(kinds) - 2)
    if kinds[1] != "sliding_window":  # two windows: the fine one searches first
        order = draw(st.permutations(range(len(kinds))))
        kinds = [kinds[i] for i in order]
        sizes = [sizes[i] for i in order]
    tight = draw(st.booleans())  # eviction takes a segment's blocks tail first
    layout = draw(_layout_of(kinds, sizes, max_len, min_len=2 * coarse))
    # The fine window is either wider than the alignment (every block of a segment is
    # cached, so a hit search can meet a cached block that ends off the alignment) or
    # at most one block past it (only each segment's last block is cached: the mask).
    width = draw(_integers_either((coarse + 1, 3 * coarse), (1, fine + 1)))
    groups = tuple(
        dataclasses.replace(g, spec=dataclasses.replace(g.spec, sliding_window=width))
        if isinstance(g.spec, SlidingWindowSpec) and g.spec.block_size == fine
        else g
        for g in layout.groups
    )
    return draw(_sized(groups, max_len, 2 * coarse, tight_pool=tight))


@st.composite
def tight_pool_layouts(draw, max_len: int = 256) -> KVCacheLayout:
    """One or two groups with a pool that holds about one request: cached blocks must
    be evicted for new ones and hits re-adopted from the free queue (the
    allocation-failure and eviction paths)."""
    kinds = draw(
        st.sampled_from(
            (("full",), ("sliding_window",), ("full", "sliding_window"), ("full", "mamba"))
        )
    )
    bs = draw(st.sampled_from((1, 2, 4)))
    return draw(_layout_of(kinds, [bs] * len(kinds), min(max_len, 48), tight_pool=True))


@st.composite
def chunked_layouts(draw, max_len: int = 256) -> KVCacheLayout:
    """One chunked-local group whose chunk is not a multiple of its block size (the hit
    search must retry from an earlier chunk), alone or beside full attention of the same
    block size. Example: bs 4, chunk 6: a hit search up to 19 starts the chunk at 18,
    inside block 4."""
    bs = draw(st.sampled_from((2, 4, 8)))
    chunk = draw(st.integers(1, 4)) * bs + draw(st.integers(1, bs - 1))
    fields = _attention_fields(bs, 16)
    groups = [
        KVCacheGroup(("layer.0",), ChunkedLocalAttentionSpec(**fields, attention_chunk_size=chunk))
    ]
    if draw(st.booleans()):
        groups.insert(0, KVCacheGroup(("layer.1",), FullAttentionSpec(**fields)))
    return draw(_sized(tuple(groups), max_len, min_len=4 * bs))


def uncached_layouts(max_len: int = 256) -> st.SearchStrategy[KVCacheLayout]:
    """Layouts with prefix caching off (no hits, nothing registered)."""
    return layouts(max_groups=3, max_len=max_len, enable_caching=False)


def targeted_layouts(max_len: int = 256) -> st.SearchStrategy[KVCacheLayout]:
    """Layouts built to reach particular rules on purpose: sliding windows finer than
    the hit alignment, tight pools, prefix caching off."""
    fine = small_block_hybrids(max_len=max_len)
    return st.one_of(
        fine,
        tight_pool_layouts(max_len=max_len),
        fine,
        chunked_layouts(max_len=max_len),
        fine,
        uncached_layouts(max_len=max_len),
    )
