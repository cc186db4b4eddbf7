"""Sliding window ``w`` (:mod:`reference.managers.sliding_window`): the hit scans from the
right for a run of ``cdiv(w - 1, bs)`` cached blocks ending on an aligned boundary
(:func:`reference.managers.sliding_window.sliding_window_hit`); which blocks are cached
follows the retention interval (:func:`reference.managers.sliding_window.window_cache_mask`).

Example (bs 4, w 8, blocks 2 and 3 cached, 4 blocks asked): ``[0, 0, b2, b3]``, hit 16.
"""

from __future__ import annotations

import numpy as np

from optimized.control.managers.base import SingleTypeKVCacheManager
from reference.managers.sliding_window import sliding_window_hit, window_cache_mask
from reference.specs import SlidingWindowSpec


class SlidingWindowManager(SingleTypeKVCacheManager):
    drops_blocks = True
    scan = staticmethod(sliding_window_hit)

    cacheable_block_mask = window_cache_mask

    def _skipped_tokens(self, total: np.ndarray) -> np.ndarray:
        assert isinstance(self.spec, SlidingWindowSpec)
        return np.maximum(total - self.spec.sliding_window + 1, 0)

    def _first_total_skipping(self, tokens: np.ndarray) -> np.ndarray:
        """``t - w + 1 >= tokens`` first holds at ``t = tokens + w - 1``."""
        assert isinstance(self.spec, SlidingWindowSpec)
        return tokens + (self.spec.sliding_window - 1)
