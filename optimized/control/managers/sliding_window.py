"""Sliding window ``w`` (:mod:`reference.managers.sliding_window`): the hit scans from the
right for a run of ``cdiv(w - 1, bs)`` cached blocks ending on an aligned boundary
(:func:`reference.managers.sliding_window.sliding_window_hit`); which blocks are cached
follows the retention interval (:func:`reference.retention.sliding_window_block_mask`).

Example (bs 4, w 8, blocks 2 and 3 cached, 4 blocks asked): ``[0, 0, b2, b3]``, hit 16.
"""

from __future__ import annotations

import numpy as np

from optimized.control.managers.base import SingleTypeKVCacheManager
from optimized.control.request import Request
from reference.managers.sliding_window import blocks_needed_for_hit, sliding_window_hit
from reference.retention import sliding_window_block_mask
from reference.specs import SlidingWindowSpec


class SlidingWindowManager(SingleTypeKVCacheManager):
    scan = staticmethod(sliding_window_hit)

    def cacheable_block_mask(self, request: Request, start: int, end: int) -> list[bool] | None:
        """:func:`reference.retention.sliding_window_block_mask` (no EAGLE shift)."""
        assert isinstance(self.spec, SlidingWindowSpec)
        return sliding_window_block_mask(
            start,
            end,
            self.cache_hit_alignment,
            self.block_size,
            blocks_needed_for_hit(self.spec),
            self.retention_interval,
            self.reachable_boundaries(request),
        )

    def _skipped_tokens(self, total: np.ndarray) -> np.ndarray:
        assert isinstance(self.spec, SlidingWindowSpec)
        return np.maximum(total - self.spec.sliding_window + 1, 0)
