"""Chunked local attention ``C`` (:mod:`reference.managers.chunked_local`): blocks before
the current chunk count as computed (null); the scan runs from the chunk start to the first
miss, and a hit inside the previous chunk is refused (the search restarts below it).

Example: C 8, bs 4, max 13, nothing cached -> hit 8 (``[0, 0]``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from optimized.block_pool import BlockPool
from optimized.managers.base import BlockList, SingleTypeKVCacheManager
from reference.specs import ChunkedLocalAttentionSpec, KVCacheSpec


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        group_ids: Sequence[int],
        pool: BlockPool,
        spec: KVCacheSpec,
        alignment: int,
    ) -> tuple[list[BlockList], int]:
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        bs = spec.block_size
        hashes = cls.coarse_hashes(block_hashes, pool.hash_block_size, spec)
        while True:
            start = spec.num_skipped_tokens(max_length)
            start_block = start // bs
            out: list[BlockList] = [[0] * start_block for _ in group_ids]
            for i in range(start_block, max_length // bs):
                cached = pool.get_cached_block(hashes[i], group_ids)
                if cached is None:
                    break
                for lst, block in zip(out, cached):
                    lst.append(block)
            hit = len(out[0]) * bs
            if hit >= start or hit == 0:
                return out, hit
            max_length = hit

    def _skipped_tokens(self, total: np.ndarray) -> np.ndarray:
        assert isinstance(self.spec, ChunkedLocalAttentionSpec)
        chunk = self.spec.attention_chunk_size
        return total // chunk * chunk
