"""Full attention: every token stays needed until the request is freed.

Hit rule: scan blocks ``0, 1, ...`` up to ``max_length // bs`` and stop at the first
block missing in any group; round the hit down to the alignment. Full attention is
downward closed: if block ``i`` hits, every block before it hits too (the chain).

Partial tail entry (only when ``bs != hash_block_size``): after caching, the prompt
boundary ``floor(min(P - 1, hashed) / H) * H`` that falls inside a block (not on a
block boundary) is registered on that block, keyed by the chained hash at the
boundary. It makes the block "hashed" (freed to the back of the queue) until the
block is promoted to its full key. Example: bs 8, H 4, P 13: boundary 12 lies
inside block 1 ([8, 16)), which gets the key of the 12-token prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.block_pool import BlockPool
from reference.managers.base import BlockList, SingleTypeKVCacheManager
from reference.request import Request
from reference.specs import KVCacheSpec


class FullAttentionManager(SingleTypeKVCacheManager):
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
        bs = spec.block_size
        hashes = cls.coarse_hashes(block_hashes, pool.hash_block_size, spec)
        out: list[BlockList] = [[] for _ in group_ids]
        for block_hash in hashes[: max_length // bs]:
            found = pool.get_cached_block(block_hash, group_ids)
            if found is None:
                break
            for lst, block in zip(out, found):
                lst.append(block)
        hit = len(out[0]) * bs
        hit -= hit % alignment
        keep = -(-hit // bs)
        return [lst[:keep] for lst in out], hit

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        super().cache_blocks(request, num_tokens)
        h = request.hash_block_size
        if self.block_size == h:
            return
        boundary = min((request.num_prompt_tokens - 1) // h, len(request.block_hashes)) * h
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.blocks_of(request.request_id)
        index = boundary // self.block_size
        if index >= len(blocks):  # pragma: no cover - boundary <= num_tokens <= the table's slots
            return
        self.block_pool.cache_block(
            blocks[index], request.block_hashes[boundary // h - 1], self.group_id, boundary
        )
