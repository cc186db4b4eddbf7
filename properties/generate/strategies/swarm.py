"""Swarm layouts (:func:`swarm_layouts`): each group type and pool pressure switched on
independently, at any scale tier, so that every serving mode and setting meets every
group type.

Example: production, sliding window and Mamba drawn -> two groups, block sizes from
16/32/64.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hypothesis import strategies as st

from properties.core.constants import SPEC_KINDS
from properties.generate.strategies.generated_layouts import _blocks_one_request_needs, layouts
from properties.generate.strategies.tiers import ScaleTier
from reference.layout import KVCacheLayout
from reference.specs import ChunkedLocalAttentionSpec


@st.composite
def swarm_layouts(draw, scale: ScaleTier, kinds: Sequence[str] = SPEC_KINDS) -> KVCacheLayout:
    """A layout of tier ``scale`` whose group types are switched on independently (each of
    ``kinds``, at least one; full attention when none is drawn), with pool pressure as a
    feature too. A tier with a ``max_blocks`` bound (medium, offline, production): under pressure
    the pool holds ``min_blocks..2 * min_blocks`` blocks, else up to ``max_blocks``. The
    small tier (no bound; pools are sized by the request, :func:`pool_sizes`): under
    pressure the pool holds one request of ``max_model_len`` but not two
    (``need + 1..2 * need`` blocks, at least ``min_blocks``), else :func:`pool_sizes`
    draws it, and chunked-local chunks are a multiple of their block size
    (:func:`_chunks_aligned`: every engine takes those; the scenario mix's targeted
    layouts draw the other chunks). Example: production, sliding window and Mamba drawn -> two
    groups (a window from :data:`PRESET_WINDOWS`), block sizes from 16/32/64; small, full
    attention of block size 4 and ``max_model_len`` 32 under pressure -> 9..16 blocks."""
    chosen = [k for k in kinds if draw(st.booleans(), label=f"group {k}")]
    if not chosen:
        chosen = ["full"] if "full" in kinds else [kinds[0]]
    if chosen == ["mamba"]:
        chosen = ["full", "mamba"] if "full" in kinds else chosen
    chosen = list(draw(st.permutations(chosen)))
    pressure = draw(st.booleans())
    if scale.max_blocks is None:
        cap = None
    else:
        cap = min(scale.max_blocks, 2 * scale.min_blocks) if pressure else scale.max_blocks
    layout = draw(
        layouts(
            min_blocks=scale.min_blocks,
            max_blocks=cap,
            max_len=scale.max_len,
            kinds=kinds,
            group_kinds=chosen,
            block_sizes=scale.block_sizes,
            window_sizes=scale.window_sizes,
        )
    )
    if scale.max_blocks is None and "chunked_local" in chosen:
        layout = _chunks_aligned(layout)
    if pressure and scale.max_blocks is None:
        need = _blocks_one_request_needs(layout)
        low = max(scale.min_blocks, need + 1)
        pool = draw(st.integers(low, max(low, 2 * need)), label="pool under pressure")
        layout = dataclasses.replace(layout, num_blocks=pool)
    return layout


def _chunks_aligned(layout: KVCacheLayout) -> KVCacheLayout:
    """``layout`` with every chunked-local chunk rounded up to a multiple of its group's
    block size (as deployed models have them: llama4's 8192 over blocks of 16 to 64; an
    engine may refuse other chunks). Example: chunk 6 over blocks of 4 -> 8; chunk 1 ->
    4; chunk 8 stays 8."""
    groups = tuple(
        dataclasses.replace(
            g,
            spec=dataclasses.replace(
                g.spec,
                attention_chunk_size=-(-g.spec.attention_chunk_size // g.spec.block_size)
                * g.spec.block_size,
            ),
        )
        if isinstance(g.spec, ChunkedLocalAttentionSpec)
        else g
        for g in layout.groups
    )
    return dataclasses.replace(layout, groups=groups)
