"""Mamba settings a deployed vLLM 0.33 builds its Mamba groups with, drawn on top of a
layout (:func:`mamba_settings`, the production property's ``mamba_modes`` setting):
the caching mode, the speculative blocks of MTP / EAGLE drafts and the prefill
checkpoint blocks of backends that export a state from inside a chunk.

Example: full + Mamba (bs 4) with prefix caching on may come out in ``"align"`` mode
with 2 speculative blocks and one prefill checkpoint block of alignment 1; with
prefix caching off it may come out in ``"none"`` mode with 4 speculative blocks and its
block size raised to ``max_model_len``.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from properties.core.modes import MAX_DRAFT_TOKENS
from reference.layout import KVCacheLayout
from reference.specs import MambaSpec

#: Speculative block counts (vLLM: the speculative token count; 0 without drafts), the
#: shrink target first; drafts on a Mamba layout are capped by it, so most are > 0.
SPECULATIVE_BLOCKS: tuple[int, ...] = (MAX_DRAFT_TOKENS, 2, 0, 1, 3)


@st.composite
def mamba_settings(draw, layout: KVCacheLayout) -> KVCacheLayout:
    """``layout`` with its Mamba groups' settings drawn (nothing drawn, the layout as
    given, without a Mamba group): the caching mode (``"none"`` half the time when prefix
    caching is off, as vLLM forces it then; ``"align"`` otherwise), the speculative block
    count (:data:`SPECULATIVE_BLOCKS`, one for every Mamba group as vLLM's one cache
    config gives), and in ``"align"`` mode, half the time, one prefill checkpoint block
    with an alignment of 1 token or one Mamba block (the backends vLLM ships: Mamba2
    exports at any token, GDN and KDA on their block grid). The pool grows by the extra
    blocks (speculative and checkpoint) of two requests. Mode ``"none"`` is drawn only
    where every other group's block size divides ``max_model_len``: its state lives in
    one block of ``max_model_len`` tokens, as vLLM sizes it."""
    if not any(isinstance(s, MambaSpec) for s in layout.specs):
        return layout
    mode = "align"
    mml = layout.max_model_len
    retention = layout.prefix_cache_retention_interval
    if (
        not layout.enable_caching
        and all(mml % s.block_size == 0 for s in layout.specs if not isinstance(s, MambaSpec))
        and (not retention or retention % mml == 0)
    ):
        mode = draw(st.sampled_from(("align", "none")), label="mamba cache mode")
    speculative = draw(st.sampled_from(SPECULATIVE_BLOCKS), label="speculative blocks")
    checkpoints = mode == "align" and draw(st.booleans(), label="prefill checkpoints")
    coarse = checkpoints and draw(st.booleans(), label="checkpoint on the block grid")

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
    return dataclasses.replace(layout, groups=groups, num_blocks=layout.num_blocks + 2 * extra)
