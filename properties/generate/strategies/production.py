"""Production layouts: the production property's base layouts
(:func:`production_base_layouts`) and the settings drawn on top of them
(:func:`production_layouts`: EAGLE, the retention interval, the Mamba settings, the
admission cap).

Example: gpt-oss (SWA + full) may come out sparse, EAGLE on the full group only,
``L = 0``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hypothesis import strategies as st

from properties.core.constants import SPEC_KINDS
from properties.core.modes import PRODUCTION_SETTINGS
from properties.generate.strategies.edges import edge_case_kinds, edge_layouts
from properties.generate.strategies.generated_layouts import _blocks_one_request_needs
from properties.generate.strategies.mamba_modes import mamba_settings
from properties.generate.strategies.scenario_mix import any_layouts
from properties.generate.strategies.swarm import swarm_layouts
from properties.generate.strategies.tiers import SMALL, TIERS
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def retention_intervals(layout: KVCacheLayout) -> st.SearchStrategy[int | None]:
    """A retention interval valid for ``layout``: dense (``None``, the shrink target),
    sparse (``0``) or ``k * S`` for ``k`` in 1..3 (``S`` the scheduler block size; only
    with a sliding-window or Mamba group, as vLLM requires)."""
    sparse_groups = any(isinstance(s, (SlidingWindowSpec, MambaSpec)) for s in layout.specs)
    unit = layout.scheduler_block_size
    if not sparse_groups:
        return st.sampled_from((None, 0))
    return st.sampled_from((None, 0, 0, unit, 2 * unit, 3 * unit))


def _without_chunked(layout: KVCacheLayout) -> KVCacheLayout:
    """``layout`` with its chunked-local groups left out (one full-attention group of the
    smallest block size when nothing is left): vLLM runs EAGLE without chunked local
    attention (it turns the hybrid manager off)."""
    kept = tuple(g for g in layout.groups if not isinstance(g.spec, ChunkedLocalAttentionSpec))
    if len(kept) == len(layout.groups):
        return layout
    if not kept:
        bs = min(layout.block_sizes)
        kept = (KVCacheGroup(("layer.0",), FullAttentionSpec(block_size=bs)),)
    return dataclasses.replace(layout, groups=kept, name="")


#: Whether a production layout runs EAGLE, drawn from these: two in three when it has no
#: chunked-local group, one in four when EAGLE would take its chunked-local groups away
#: (:func:`production_layouts`).
_EAGLE_ODDS_PLAIN = (False, True, True)


_EAGLE_ODDS_WITH_CHUNKED = (False, False, False, True)


@st.composite
def production_layouts(
    draw,
    base: st.SearchStrategy[KVCacheLayout],
    max_len: int = 128,
    settings: frozenset[str] = PRODUCTION_SETTINGS,
) -> KVCacheLayout:
    """``base`` with the production settings drawn on top, each with its own draws
    (after the base layout's, so the base stays as it was):

    * EAGLE: ``use_eagle``, the groups flagged as EAGLE groups (none flagged: all
      drop), and lookahead hashes ``L`` in ``{0, 1, 2}``, 0 half the time (``L > 0``
      turns the drop off). vLLM turns the hybrid manager off with chunked local
      attention and EAGLE, so chunked-local groups are left out of an EAGLE layout; it
      is drawn two times in three on a layout without them, one time in four on a
      layout with them (three in four keep them, so they meet the other settings:
      swarm testing counts pairs);
    * the retention interval (:func:`retention_intervals`);
    * a Mamba group's caching mode, speculative blocks and prefill checkpoint blocks
      (:func:`properties.generate.strategies.mamba_modes.mamba_settings`; nothing is
      drawn without a Mamba group);
    * ``max_in_flight_tokens`` (``None``, or 1 or 2 scheduler blocks): the bound of
      the per-request admission caps of windowed groups (the pool is then redrawn
      with those bounds, as vLLM sizes it at startup).

    Only the ``settings`` named (:data:`properties.core.modes.PRODUCTION_SETTINGS`: the
    ones the engine declares) are drawn. Example: gpt-oss (SWA + full) may come out
    sparse, EAGLE on the full group only, ``L = 0``.
    """
    layout = draw(base)
    plain = _without_chunked(layout) is layout
    odds = _EAGLE_ODDS_PLAIN if plain else _EAGLE_ODDS_WITH_CHUNKED
    eagle = "eagle" in settings and draw(st.sampled_from(odds), label="eagle")
    if eagle:
        layout = _without_chunked(layout)
    if "retention" in settings:
        retention = draw(retention_intervals(layout), label="retention interval")
        layout = dataclasses.replace(layout, prefix_cache_retention_interval=retention)
    if "mamba_modes" in settings:
        layout = draw(mamba_settings(layout))
    unit = layout.scheduler_block_size
    in_flight = None
    if "admission_cap" in settings:
        in_flight = draw(
            st.sampled_from((unit, None, 2 * unit, unit)), label="max in-flight tokens"
        )
        layout = dataclasses.replace(layout, max_in_flight_tokens=in_flight)
    if in_flight is not None:
        # a tight pool sized as vLLM sizes it: one request of max_model_len fits with
        # its windowed groups at their admission bound, two do not
        need = _blocks_one_request_needs(layout)
        layout = dataclasses.replace(
            layout,
            num_blocks=draw(st.integers(max(5, need + 1), max(5, 2 * need + 2)), label="pool"),
        )
    if eagle:
        flags = [draw(st.booleans(), label="is_eagle_group") for _ in layout.groups]
        layout = dataclasses.replace(
            layout,
            groups=tuple(
                dataclasses.replace(g, is_eagle_group=f) for g, f in zip(layout.groups, flags)
            ),
            use_eagle=True,
            num_hash_lookahead_tokens=draw(st.sampled_from((0, 1, 0, 2)), label="lookahead hashes"),
        )
    return layout


def production_base_layouts(
    max_len: int = 128,
    kinds: Sequence[str] = SPEC_KINDS,
    settings: frozenset[str] = frozenset(),
) -> st.SearchStrategy[KVCacheLayout]:
    """The small tier's layouts of the production property, before its settings
    (:func:`production_layouts`), one branch each (Hypothesis flattens the nested
    choices): the scenario mix's generated layouts, presets and targeted layouts
    (:func:`any_layouts`), a swarm layout of the small tier (:func:`swarm_layouts`: each
    group type and pool pressure an independent switch, so that every serving mode and
    setting meets every group type), and two branches of :func:`edge_layouts` (where one
    of its cases is made of ``kinds``, with the engine's production ``settings``), so
    that the settings meet the hit rules' edges (an EAGLE drop re-aligning a fine
    window's hit, a retention interval of one Mamba block): two branches of six with
    every kind.
    Example: a swarm draw with chunked local and Mamba switched on -> a two-group
    layout of at most ``max_len`` tokens."""
    small = dataclasses.replace(TIERS[SMALL], max_len=max_len)
    mixed = any_layouts(max_len=max_len, kinds=kinds)
    swarm = swarm_layouts(small, kinds)
    if not edge_case_kinds(kinds):
        return st.one_of(mixed, swarm)
    # Hypothesis flattens nested ``one_of``s into one list of branches and drops a
    # branch object it has seen: two separate edge strategies weigh two branches
    edges = [edge_layouts(max_len=max_len, kinds=kinds, settings=settings) for _ in range(2)]
    return st.one_of(mixed, swarm, *edges)
