"""The scenario mix of layouts (:func:`any_layouts`): generated layouts half the time,
model presets and targeted layouts a quarter each, restricted to an engine's spec kinds.

Example: with ``kinds=("full", "sliding_window")`` the presets drawn are mistral-7b,
gpt-oss, gemma2 and gemma3, and only targeted layouts of those two kinds are kept.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from properties.core.constants import SPEC_KINDS
from properties.generate.strategies.generated_layouts import (
    layouts,
    preset_layouts,
    presets_of_kinds,
)
from properties.generate.strategies.targeted import targeted_layouts
from reference.layout import KVCacheLayout


def any_layouts(
    max_len: int = 256, kinds: Sequence[str] = SPEC_KINDS
) -> st.SearchStrategy[KVCacheLayout]:
    """The scenario mix: generated layouts half the time (drawn first: they shrink
    best), presets and :func:`targeted_layouts` a quarter each.

    ``kinds`` (an engine's ``spec_types``) keeps only layouts made of those spec types:
    generated ones of those kinds, the presets made of them (:func:`presets_of_kinds`)
    and, when sliding windows are among them, the targeted layouts that qualify (else
    layouts of those kinds with prefix caching off, which the targeted ones include: an
    engine that keeps caching when told not to is caught whatever it supports). With all
    four kinds the mix (and so every derandomized stream) is the unrestricted one.
    """
    if set(SPEC_KINDS) <= set(kinds):
        generated = layouts(max_len=max_len)
        return st.one_of(
            generated, preset_layouts(max_len=max_len), generated, targeted_layouts(max_len)
        )
    generated = layouts(max_len=max_len, kinds=kinds)
    parts = [generated]
    names = presets_of_kinds(kinds)
    if names:
        parts.append(preset_layouts(names=names, max_len=max_len))
    parts.append(generated)
    if "sliding_window" in kinds:
        allowed = set(kinds)
        parts.append(
            targeted_layouts(max_len).filter(
                lambda layout: {s.type_name for s in layout.specs} <= allowed
            )
        )
    else:  # prefix caching off is drawn for every engine (the targeted mix has it)
        parts.append(layouts(max_len=max_len, kinds=kinds, enable_caching=False))
    return st.one_of(parts)
