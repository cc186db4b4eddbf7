"""Realistic bugs of an SGLang-like engine with separate full and SWA pools.

Each mutant is the SGLang adapter (:mod:`properties.engines.sglang`) with one accounting
mistake that the shared-pool checks cannot see: with separate pools ``num_free_blocks()``
is the smaller pool's figure, so an error in the larger pool hides behind it, and I1/A2
(one shared pool) do not run. The per-pool checks S1-S3 must catch them at the universal
level (``tests/properties/engines/test_sglang_adapter.py``); they need SGLang installed
(``ci/engines/sglang``).
"""

from __future__ import annotations

from properties.engines.sglang import SGLangEngine, sglang_layouts
from reference.layout import KVCacheLayout


class SWALockedPagesCountedFree(SGLangEngine):
    """The SWA pool counts the tree pages requests have locked (SGLang's
    ``swa_protected_size``) as obtainable, as if a request's SWA pages outside its window
    could always be dropped. A request that adopted a prefix hit then holds SWA pages the
    pool also reports free: S1 (free + held > capacity in the SWA pool). The full pool
    frees no out-of-window pages, so it is the smaller pool and ``num_free_blocks()``
    stays right."""

    def _obtainable_slots(self) -> tuple[int, int]:
        full, swa = super()._obtainable_slots()
        return full, swa + self.cache.swa_protected_size()


def swa_locked_pages_counted_free(layout: KVCacheLayout) -> SGLangEngine:
    """:class:`SWALockedPagesCountedFree` with the Python tree core."""
    return SWALockedPagesCountedFree(layout, tree_core="python")


swa_locked_pages_counted_free.layout_strategy = lambda: sglang_layouts(("swa",))  # type: ignore[attr-defined]
