"""Edge layouts (:func:`edge_layouts`): layouts at the edges of the hit rules, one case
of :data:`_EDGE_CASES` per draw, only the cases made of an engine's spec kinds.

Example: ``edge_case_kinds(("full", "sliding_window"))`` is ``(3,)`` (full attention of
block size ``2b`` beside a finer sliding window); with all four kinds, all four cases.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from hypothesis import strategies as st

from properties.core.constants import SPEC_KINDS
from properties.generate.strategies.generated_layouts import _sized
from properties.generate.strategies.group_specs import _kind_specs
from reference.layout import KVCacheGroup, KVCacheLayout

#: The cases of :func:`edge_layouts`: (group kinds, block size of each as a multiple of
#: the base size ``b``: 2 for the coarse full group beside a fine window).
_EDGE_CASES: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...] = (
    (("chunked_local",), (1,)),
    (("full", "chunked_local"), (1, 1)),
    (("full", "mamba"), (1, 1)),
    (("full", "sliding_window"), (2, 1)),
)


def edge_case_kinds(kinds: Sequence[str]) -> tuple[int, ...]:
    """The indexes of :data:`_EDGE_CASES` made only of ``kinds``.

    Example: ``("full", "sliding_window")`` -> ``(3,)``; all four kinds -> ``(0, 1, 2, 3)``.
    """
    return tuple(i for i, (case, _) in enumerate(_EDGE_CASES) if set(case) <= set(kinds))


@st.composite
def edge_layouts(
    draw,
    max_len: int = 128,
    kinds: Sequence[str] = SPEC_KINDS,
    settings: frozenset[str] = frozenset(),
) -> KVCacheLayout:
    """Layouts at the edges of the hit rules that the generic draws rarely make (only
    the cases made of ``kinds``, at least one must be):

    * chunked-local attention alone or beside full attention of the same block size
      ``b`` in ``{2, 4}``, with a chunk of 2..4 blocks: a lookup whose range ends past
      the chunk's first block stops at the first uncached block of its chunk (bs 4,
      chunk 8, a fresh 16-token prompt: the search bound 15 starts the chunk at block
      2, uncached, so the hit is the 8 tokens of the two null blocks before it);
    * full attention + Mamba, both of block size ``b`` (the scheduler block size): a
      retention interval of one scheduler block then makes every Mamba block a segment
      boundary (the production property draws that interval one time in six);
    * (drawn twice as often) full attention of block size ``2b`` beside a sliding
      window of block size ``b`` wider than the hit alignment (``w`` in ``3b+2 .. 8b``):
      a hit shorter than the window's run ends on an aligned block, and under EAGLE
      lower; with 2 lookahead hashes the full group's view of the hashes can end
      before the lookup bound. That edge needs EAGLE, so where ``settings`` (the
      production settings the engine declares) has ``"eagle"``, this case comes with
      ``use_eagle`` on and lookahead hashes ``L`` in ``{0, 0, 2}`` (the settings that
      :func:`production_layouts` draws on top may replace them; drawn alone, they
      would meet this case rarely: Hypothesis' generation keeps the settings of a few
      draws).

    ``max_model_len`` is at least 4 alignments (``_sized``); pools from tiny to roomy.
    Example: ``settings={"eagle"}``, the fine window drawn with ``b = 2``: full
    attention bs 4, a window bs 2 of ``w = 11``, EAGLE on, ``L = 0``.
    """
    cases = edge_case_kinds(kinds)
    if not cases:
        raise ValueError(f"edge_layouts(kinds=...) has no case made of {tuple(kinds)!r}")
    # the fine window counts twice: its edge needs EAGLE (drawn on top) as well
    weighted = cases + tuple(i for i in cases if _EDGE_CASES[i][0] == ("full", "sliding_window"))
    group_kinds, multiples = _EDGE_CASES[draw(st.sampled_from(weighted), label="edge case")]
    base = draw(st.sampled_from((2, 4)), label="edge block size")
    sizes = [m * base for m in multiples]
    page = 64 * math.lcm(*sizes)
    if "chunked_local" in group_kinds:
        extent = draw(st.integers(2, 4)) * base  # the chunk
    elif "sliding_window" in group_kinds:
        extent = draw(st.integers(3 * base + 2, 8 * base))  # the window
    else:
        extent = None
    windows_of = None if extent is None else (extent,)
    groups = tuple(
        KVCacheGroup((f"layer.{i}",), draw(_kind_specs(kind, bs, page, windows_of)))
        for i, (kind, bs) in enumerate(zip(group_kinds, sizes))
    )
    layout = draw(_sized(groups, max_len, 4 * math.lcm(*sizes)))
    if group_kinds == ("full", "sliding_window") and "eagle" in settings:
        lookahead = draw(st.sampled_from((0, 0, 2)), label="edge lookahead hashes")
        layout = dataclasses.replace(layout, use_eagle=True, num_hash_lookahead_tokens=lookahead)
    return layout
