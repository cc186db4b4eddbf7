"""Generated and preset layouts: block sizes, pools, :func:`layouts` and
:func:`preset_layouts`, and the sizing helpers the targeted and edge layouts share.

:func:`layouts` draws 1 to 6 groups in any order, block sizes 1..32 with ``lcm <= 64``
and pools from tiny to roomy; always a valid ``KVCacheLayout``, shrinking toward one
full-attention group with block size 1. Worked example of the block-size rule: sizes
``(16, 4)`` give ``lcm = 16`` and ``gcd = 4``; a Mamba group in that layout gets block
size 4 (= hash block size), so partial prefix hits stay disabled as the layout requires.
:func:`preset_layouts` takes a model preset (:mod:`properties.generate.presets`) with
windows scaled down so that they slide within a short trace.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from hypothesis import strategies as st

from properties.core.constants import SPEC_KINDS
from properties.generate.presets import PRESETS
from properties.generate.strategies.group_specs import _kind_specs
from properties.generate.strategies.reuse import _integers_either, _reused, _sampled_list
from reference.layout import KVCacheGroup, KVCacheLayout

#: Largest block size of one group.
MAX_BLOCK_SIZE = 32


#: Largest ``lcm`` of the group block sizes (the scheduler block size).
MAX_LCM = 64


#: Presets in shrinking order (fewest, simplest groups first).
PRESET_ORDER = ("mistral-7b", "gpt-oss", "gemma2", "gemma3", "llama4-scout", "qwen3-next", "jamba")


@_reused
@st.composite
def block_size_lists(draw, num_groups: int) -> list[int]:
    """``num_groups`` block sizes in ``1..MAX_BLOCK_SIZE`` with ``lcm <= MAX_LCM``.

    A quarter of the time every group shares one size (mixed sizes are where hybrid
    alignment bugs live). Otherwise each next size is drawn
    from the sizes that keep the running lcm within bounds: after 16, size 12 fits
    (lcm 48) but 5 does not (lcm 80 > 64).
    """
    first = draw(st.integers(1, MAX_BLOCK_SIZE))
    if draw(st.integers(0, 3)) == 0:
        return [first] * num_groups
    sizes = [first]
    running = first
    for _ in range(num_groups - 1):
        fits = [d for d in range(1, MAX_BLOCK_SIZE + 1) if math.lcm(running, d) <= MAX_LCM]
        size = draw(_sampled_list(tuple(fits)))
        running = math.lcm(running, size)
        sizes.append(size)
    return sizes


def _blocks_one_request_needs(layout: KVCacheLayout) -> int:
    return layout.blocks_per_request()


@_reused
@st.composite
def pool_sizes(
    draw, layout: KVCacheLayout, min_blocks: int = 5, max_blocks: int | None = None
) -> int:
    """``num_blocks`` from tiny to roomy for ``layout``.

    ``need`` = blocks one request of ``max_model_len`` tokens pins (summed over
    groups). Tiny pools hold ``need + 1 .. 2 * need + 2`` blocks (one full-length
    request fits, two do not: eviction and ``None`` allocations); roomy pools up
    to ``8 * need``. Never below ``min_blocks``; ``max_blocks`` caps everything
    (then even one request may not fit).
    """
    if max_blocks is not None and max_blocks < max(2, min_blocks):
        raise ValueError(
            f"pool_sizes(max_blocks=...) must be >= max(2, min_blocks={min_blocks}), "
            f"got {max_blocks}"
        )
    need = _blocks_one_request_needs(layout)
    lo = max(min_blocks, need + 1)
    hi_tiny = max(lo, 2 * need + 2)
    hi_roomy = max(hi_tiny, 8 * need)
    if max_blocks is not None:
        lo, hi_tiny, hi_roomy = (min(v, max_blocks) for v in (lo, hi_tiny, hi_roomy))
    return draw(_integers_either((lo, hi_tiny), (hi_tiny, hi_roomy)))


@st.composite
def layouts(
    draw,
    max_groups: int = 6,
    min_blocks: int = 5,
    max_blocks: int | None = None,
    max_len: int = 256,
    kinds: Sequence[str] = SPEC_KINDS,
    enable_caching: bool = True,
    group_kinds: Sequence[str] | None = None,
    block_sizes: Sequence[int] | None = None,
    window_sizes: Sequence[int] | None = None,
) -> KVCacheLayout:
    """A valid ``KVCacheLayout`` of 1..``max_groups`` groups of the given ``kinds``.

    The larger scale tiers (:class:`ScaleTier`) pass ``group_kinds`` (exactly these
    groups, in this order), ``block_sizes`` (each group's size drawn from them) and
    ``window_sizes`` (windows and chunks drawn from them); left at ``None`` (the small
    tier) nothing else is drawn, so the small tier's stream is today's.

    Rules: group kinds in any order (interleaved); block sizes from
    :func:`block_size_lists`; each Mamba group gets block size ``gcd`` of all sizes
    (= hash block size, so no partial hits), each chunked-local group of a multi-group
    layout the lcm (vLLM requires it); every page is ``64 * lcm`` bytes
    (attention head size ``16 * lcm / bs``, Mamba padded) as after vLLM's page
    unification; ``max_model_len`` in ``[lcm, max(lcm, max_len)]``; ``num_blocks``
    from :func:`pool_sizes`. Shrinks toward one full group with block size 1.
    """
    if max_groups < 1:
        raise ValueError(f"layouts(max_groups=...) must be >= 1, got {max_groups}")
    unknown = [k for k in kinds if k not in SPEC_KINDS]
    if not kinds or unknown:
        raise ValueError(
            f"layouts(kinds=...) must be a non-empty subset of {SPEC_KINDS}, got {tuple(kinds)!r}"
        )
    # hybrids of 2-4 groups drawn as often as any count (they are where bugs live);
    # still shrinks toward 1 group
    if group_kinds is None:
        num_groups = draw(
            _integers_either((1, max_groups), (min(2, max_groups), min(4, max_groups)))
        )
        group_kinds = draw(
            st.lists(st.sampled_from(tuple(kinds)), min_size=num_groups, max_size=num_groups)
        )
    num_groups = len(group_kinds)
    if block_sizes is None:
        sizes = draw(block_size_lists(num_groups))
    else:
        sizes = [draw(st.sampled_from(tuple(block_sizes))) for _ in group_kinds]
    hash_size = math.gcd(*sizes)
    sizes = [hash_size if k == "mamba" else s for k, s in zip(group_kinds, sizes)]
    lcm = math.lcm(*sizes)
    if num_groups > 1 and enable_caching:
        # vLLM's chunked-local hit search needs the group's block size to be the LCM
        sizes = [lcm if k == "chunked_local" else s for k, s in zip(group_kinds, sizes)]
    page = 64 * lcm
    groups = tuple(
        KVCacheGroup((f"layer.{i}",), draw(_kind_specs(kind, bs, page, window_sizes)))
        for i, (kind, bs) in enumerate(zip(group_kinds, sizes))
    )
    max_model_len = draw(st.integers(lcm, max(lcm, max_len)))
    sizing = KVCacheLayout(
        groups=groups, num_blocks=2, max_model_len=max_model_len, enable_caching=enable_caching
    )
    num_blocks = draw(pool_sizes(sizing, min_blocks, max_blocks))
    return dataclasses.replace(sizing, num_blocks=num_blocks)


#: :func:`preset_layouts`' block sizes, the first the shrink target.
PRESET_BLOCK_SIZES: tuple[int, ...] = (4, 1, 2, 8, 16)


@st.composite
def preset_layouts(
    draw,
    names: Sequence[str] | None = None,
    max_len: int = 256,
    min_blocks: int = 5,
    max_blocks: int | None = None,
    served: bool = False,
    block_sizes: Sequence[int] = PRESET_BLOCK_SIZES,
) -> KVCacheLayout:
    """A preset's layout with a small block size (one of ``block_sizes``, the first the
    shrink target) and windows scaled to a few blocks; dense retention unless ``served``
    (then the retention the family is served with).

    ``scale_windows = max(1, largest window // target)`` with ``target`` drawn in
    ``1..8 * bs``: gemma3 (w=1024) with bs 4 and target 16 gets w = 1024 // 64 = 16.
    """
    chosen = tuple(PRESET_ORDER if names is None else names)
    missing = [n for n in chosen if n not in PRESETS]
    if not chosen or missing:
        raise ValueError(
            f"preset_layouts(names=...) must name presets of {sorted(PRESETS)}, got {chosen!r}"
        )
    preset = PRESETS[draw(st.sampled_from(chosen))]
    block_size = draw(st.sampled_from(tuple(block_sizes)))
    target = draw(st.integers(1, 8 * block_size))
    largest = max(preset.windows, default=1)
    scale = max(1, largest // target)
    max_model_len = draw(st.integers(block_size, max(block_size, max_len)))
    sizing = preset.layout(2, max_model_len, block_size=block_size, scale_windows=scale)
    num_blocks = draw(pool_sizes(sizing, min_blocks, max_blocks))
    # ``served``: the retention the family is served with (sparse); else the textbook
    # dense retention (the production property draws retention on top)
    retention = sizing.prefix_cache_retention_interval if served else None
    return dataclasses.replace(
        sizing, num_blocks=num_blocks, prefix_cache_retention_interval=retention
    )


@st.composite
def _layout_of(
    draw,
    kinds: Sequence[str],
    sizes: Sequence[int],
    max_len: int,
    min_len: int = 1,
    enable_caching: bool = True,
    tight_pool: bool = False,
) -> KVCacheLayout:
    """A layout with these group kinds and block sizes (pages unified as in
    :func:`layouts`); ``tight_pool`` draws only pools that fit about one request."""
    page = 64 * math.lcm(*sizes)
    groups = tuple(
        KVCacheGroup((f"layer.{i}",), draw(_kind_specs(kind, bs, page)))
        for i, (kind, bs) in enumerate(zip(kinds, sizes))
    )
    return draw(_sized(groups, max_len, min_len, enable_caching, tight_pool))


@st.composite
def _sized(
    draw,
    groups: tuple[KVCacheGroup, ...],
    max_len: int,
    min_len: int = 1,
    enable_caching: bool = True,
    tight_pool: bool = False,
) -> KVCacheLayout:
    """``groups`` with a ``max_model_len`` in ``[max(lcm, min_len), max_len]`` and a pool
    from :func:`pool_sizes` (``tight_pool``: room for about one request only)."""
    lcm = math.lcm(*(g.spec.block_size for g in groups))
    low = max(lcm, min(min_len, max_len))
    max_model_len = draw(st.integers(low, max(low, max_len)))
    sizing = KVCacheLayout(
        groups=groups, num_blocks=2, max_model_len=max_model_len, enable_caching=enable_caching
    )
    if tight_pool:
        need = _blocks_one_request_needs(sizing)
        num_blocks = draw(st.integers(max(5, need + 1), max(5, need + 3)))
    else:
        num_blocks = draw(pool_sizes(sizing))
    return dataclasses.replace(sizing, num_blocks=num_blocks)


def presets_of_kinds(kinds: Sequence[str] = SPEC_KINDS) -> tuple[str, ...]:
    """The presets (in :data:`PRESET_ORDER`) whose layers are all of ``kinds``:
    ``("full", "sliding_window")`` -> mistral-7b, gpt-oss, gemma2, gemma3."""
    return tuple(
        name for name in PRESET_ORDER if {k.kind for k in PRESETS[name].pattern} <= set(kinds)
    )
