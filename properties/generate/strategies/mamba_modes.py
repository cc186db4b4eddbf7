"""Mamba settings a deployed vLLM 0.33 builds its Mamba groups with, drawn on top of a
layout (:func:`mamba_settings`, the production property's ``mamba_modes`` setting):
the caching mode, the speculative blocks of MTP / EAGLE drafts and the prefill
checkpoint blocks of backends that export a state from inside a chunk.

Example: full + Mamba (bs 4) may come out in ``"align"`` mode with 2 speculative blocks
and one prefill checkpoint block of alignment 1, or in ``"none"`` mode (prefix caching
off) with 4 speculative blocks and its block size raised to ``max_model_len``.
"""

from __future__ import annotations

import dataclasses
import math

from hypothesis import strategies as st

from properties.core.modes import MAX_DRAFT_TOKENS
from reference.layout import KVCacheLayout
from reference.specs import MambaSpec

#: Speculative block counts (vLLM: the speculative token count; 0 without drafts), the
#: shrink target first; drafts on a Mamba layout are capped by it, so most are > 0.
SPECULATIVE_BLOCKS: tuple[int, ...] = (MAX_DRAFT_TOKENS, 2, 0, 1, 3)


#: The caching mode of a Mamba layout: ``"align"`` (prefix caching as drawn) two times in
#: three, ``"none"`` (a deployment without prefix caching) one time in three.
CACHE_MODES: tuple[str, ...] = ("align", "none", "align")


@st.composite
def mamba_settings(draw, layout: KVCacheLayout) -> KVCacheLayout:
    """``layout`` with its Mamba groups' settings drawn (nothing drawn, the layout as
    given, without a Mamba group):

    * the caching mode (:data:`CACHE_MODES`): ``"none"`` is a deployment without prefix
      caching (vLLM forces that mode then), so it turns caching off, gives the Mamba
      groups one block of ``max_model_len`` tokens (as vLLM sizes them), with
      ``max_model_len`` rounded down to a multiple of the other groups' block sizes
      (their lcm, then the scheduler block size) and a positive retention interval that
      is no longer a multiple of it dropped;
    * the speculative block count (:data:`SPECULATIVE_BLOCKS`, one for every Mamba group
      as vLLM's one cache config gives);
    * in ``"align"`` mode, half the time, one prefill checkpoint block with an alignment
      of 1 token or one Mamba block (the backends vLLM ships: Mamba2 exports at any token,
      GDN and KDA on their block grid).

    The pool grows by the extra blocks (speculative and checkpoint) of two requests.
    Example: full bs 16 + Mamba bs 16, ``max_model_len`` 100, drawn ``"none"`` with 2
    speculative blocks: ``max_model_len`` 96, Mamba bs 96, caching off, 8 more blocks."""
    if not any(isinstance(s, MambaSpec) for s in layout.specs):
        return layout
    mode = draw(st.sampled_from(CACHE_MODES), label="mamba cache mode")
    speculative = draw(st.sampled_from(SPECULATIVE_BLOCKS), label="speculative blocks")
    checkpoints = mode == "align" and draw(st.booleans(), label="prefill checkpoints")
    coarse = checkpoints and draw(st.booleans(), label="checkpoint on the block grid")
    mml = layout.max_model_len
    if mode == "none":
        others = math.lcm(*(s.block_size for s in layout.specs if not isinstance(s, MambaSpec)))
        mml = mml // others * others

    def settled(spec: MambaSpec) -> MambaSpec:
        alignment = (spec.block_size if coarse else 1) if checkpoints else None
        return dataclasses.replace(
            spec,
            block_size=mml if mode == "none" else spec.block_size,
            mamba_cache_mode=mode,
            num_speculative_blocks=speculative,
            num_prefill_checkpoint_blocks=int(checkpoints),
            prefill_checkpoint_alignment=alignment,
        )

    groups = tuple(
        dataclasses.replace(g, spec=settled(g.spec)) if isinstance(g.spec, MambaSpec) else g
        for g in layout.groups
    )
    # the pool grows by what two requests' extra blocks take (it was drawn for plain
    # Mamba groups): pool pressure stays what it was, requests still run
    extra = (speculative + int(checkpoints)) * sum(isinstance(g.spec, MambaSpec) for g in groups)
    changes: dict = {"groups": groups, "num_blocks": layout.num_blocks + 2 * extra}
    if mode == "none":
        retention = layout.prefix_cache_retention_interval
        changes.update(enable_caching=False, max_model_len=mml)
        if retention and retention % mml:
            changes["prefix_cache_retention_interval"] = None
    return dataclasses.replace(layout, **changes)
