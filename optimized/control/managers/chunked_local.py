"""Chunked local attention ``C`` (:mod:`reference.managers.chunked_local`): blocks before
the current chunk count as computed (null); the scan runs from the chunk start to the first
miss, and a hit inside the previous chunk is refused (the search restarts below it):
:func:`reference.managers.chunked_local.chunked_local_hit`.

Example: C 8, bs 4, max 13, nothing cached -> hit 8 (``[0, 0]``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from optimized.control.block_pool import NULL_BLOCK_ID, BlockPool
from optimized.control.hashing import hashes_at_block_size
from optimized.control.managers.base import SingleTypeKVCacheManager, lookup_words
from reference.managers.chunked_local import chunked_local_hit
from reference.specs import ChunkedLocalAttentionSpec, KVCacheSpec


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    drops_blocks = True
    scan = staticmethod(chunked_local_hit)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        group_ids: Sequence[int],
        pool: BlockPool,
        spec: KVCacheSpec,
        alignment: int,
        drop_eagle: bool = False,
    ) -> tuple[list[list[int]], int]:
        """:func:`reference.managers.chunked_local.chunked_local_hit` with its lookups in
        bulk: from the chunk start ``floor(max_length / C) * C`` the blocks to the first
        miss in any group (:meth:`BlockPool.cached_prefix` over the chain at ``bs``, at
        most ``max_length // bs`` blocks), nulls before; a hit that ends inside the
        previous chunk searches again below it. ``alignment`` and ``drop_eagle`` are
        unused, as in the reference. Example: C 8, bs 4, max 13, blocks 2 and 3 cached ->
        ``[0, 0, b2]`` (block 3 lies past ``13 // 4 = 3`` blocks), hit 12."""
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        bs = spec.block_size
        hashes = hashes_at_block_size(block_hashes, pool.hash_block_size, bs)
        words = lookup_words(block_hashes, pool, bs)
        while True:
            start = spec.num_skipped_tokens(max_length)
            first = start // bs
            stop = min(max_length // bs, len(hashes))
            if stop > first:
                found = pool.cached_prefix(
                    hashes[first:stop], group_ids, None if words is None else words[first:stop]
                )
            else:
                found = [[] for _ in group_ids]
            hit = (first + len(found[0])) * bs
            if hit >= start or hit == 0:
                nulls = [NULL_BLOCK_ID] * first
                return [nulls + blocks for blocks in found], hit
            max_length = hit

    def _skipped_tokens(self, total: np.ndarray) -> np.ndarray:
        assert isinstance(self.spec, ChunkedLocalAttentionSpec)
        chunk = self.spec.attention_chunk_size
        return total // chunk * chunk

    def _first_total_skipping(self, tokens: np.ndarray) -> np.ndarray:
        """``t // C * C >= tokens`` first holds at ``t = cdiv(tokens, C) * C``."""
        assert isinstance(self.spec, ChunkedLocalAttentionSpec)
        chunk = self.spec.attention_chunk_size
        return -(-tokens // chunk) * chunk
