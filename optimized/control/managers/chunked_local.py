"""Chunked local attention ``C`` (:mod:`reference.managers.chunked_local`): blocks before
the current chunk count as computed (null); the scan runs from the chunk start to the first
miss, and a hit inside the previous chunk is refused (the search restarts below it):
:func:`reference.managers.chunked_local.chunked_local_hit`.

Example: C 8, bs 4, max 13, nothing cached -> hit 8 (``[0, 0]``).
"""

from __future__ import annotations

import numpy as np

from optimized.control.managers.base import SingleTypeKVCacheManager
from reference.managers.chunked_local import chunked_local_hit
from reference.specs import ChunkedLocalAttentionSpec


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    drops_blocks = True
    scan = staticmethod(chunked_local_hit)

    def _skipped_tokens(self, total: np.ndarray) -> np.ndarray:
        assert isinstance(self.spec, ChunkedLocalAttentionSpec)
        chunk = self.spec.attention_chunk_size
        return total // chunk * chunk

    def _first_total_skipping(self, tokens: np.ndarray) -> np.ndarray:
        """``t // C * C >= tokens`` first holds at ``t = cdiv(tokens, C) * C``."""
        assert isinstance(self.spec, ChunkedLocalAttentionSpec)
        chunk = self.spec.attention_chunk_size
        return -(-tokens // chunk) * chunk
