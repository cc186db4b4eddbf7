"""Chunked local attention ``C``: tokens before the current chunk are dead.

Hit rule (the group's block size must equal the hit alignment): with
``start = floor(max_length / C) * C``, blocks before ``start // bs`` count as computed
(null; never attended again); then blocks ``start // bs, ...`` up to
``max_length // bs`` are scanned and the hit extends to the first miss. A prompt
never cached still "hits" ``floor(max_length / C) * C`` null tokens; in a hybrid
model the full-attention group bounds the hit. Example: C 8, bs 4, max 13, nothing
cached -> hit 8 ([null, null]).
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.block_pool import BlockPool
from reference.managers.base import BlockList, SingleTypeKVCacheManager
from reference.specs import ChunkedLocalAttentionSpec, KVCacheSpec


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                               group_ids: Sequence[int], pool: BlockPool, spec: KVCacheSpec,
                               alignment: int) -> tuple[list[BlockList], int]:
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        bs = spec.block_size
        hashes = cls.coarse_hashes(block_hashes, pool.hash_block_size, spec)
        start_block = spec.num_skipped_tokens(max_length) // bs
        out: list[BlockList] = [[pool.null_block] * start_block for _ in group_ids]
        for i in range(start_block, max_length // bs):
            cached = pool.get_cached_block(hashes[i], group_ids)
            if cached is None:
                break
            for lst, block in zip(out, cached):
                lst.append(block)
        return out, len(out[0]) * bs
