"""Full attention (:mod:`reference.managers.full`): scan from block 0 to the first miss,
round down to the alignment (:func:`reference.managers.full.full_attention_hit`); partial
tail entry when ``bs != hash_block_size``.

Example: bs 8, H 4, prompt 13: the 12-token boundary lies inside block 1, which gets the
key of the 12-token prefix until it is promoted to its full key.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

import numpy as np

from optimized.control.block_pool import NULL_BLOCK_ID, BlockPool
from optimized.control.managers.base import SingleTypeKVCacheManager, lookup_words
from optimized.control.request import Request
from reference.managers.full import full_attention_hit
from reference.specs import KVCacheSpec


def partial_tail_boundary(num_prompt_tokens: int, num_hashes: int, hash_block_size: int) -> int:
    """``floor(min(P - 1, hashed) / H) * H``: the prompt boundary a partial key marks."""
    return min((num_prompt_tokens - 1) // hash_block_size, num_hashes) * hash_block_size


class FullAttentionManager(SingleTypeKVCacheManager):
    scan = staticmethod(full_attention_hit)

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
        """:func:`reference.managers.full.full_attention_hit` with its lookups in bulk: the
        blocks from block 0 to the first miss (:meth:`BlockPool.cached_prefix` over the
        chain at ``bs``, at most ``max_length // bs`` blocks), rounded down to
        ``alignment``. Example: bs 4, A 8, blocks 0..2 cached, max 15 -> 3 blocks match,
        hit 8, ``[b0, b1]`` per group. (No EAGLE group in this engine: a drop goes to the
        reference scan.)"""
        if drop_eagle:
            return super().find_longest_cache_hit(
                block_hashes, max_length, group_ids, pool, spec, alignment, drop_eagle
            )
        bs = spec.block_size
        k = bs // pool.hash_block_size
        if k == 1:  # the chain itself: a slice
            hashes = block_hashes[: max_length // bs]
        else:
            hashes = list(islice(block_hashes, k - 1, k * (max_length // bs), k))
        words = lookup_words(block_hashes, pool, bs)
        found = pool.cached_prefix(
            hashes, group_ids, None if words is None else words[: len(hashes)]
        )
        hit = len(found[0]) * bs
        hit -= hit % alignment
        keep = -(-hit // bs)
        return [blocks[:keep] for blocks in found], hit

    def cache_blocks(self, request: Request, row: int, num_tokens: int) -> None:
        super().cache_blocks(request, row, num_tokens)
        h = request.hash_block_size
        if self.block_size == h:
            return
        boundary = partial_tail_boundary(request.num_prompt_tokens, len(request.block_hashes), h)
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        index = boundary // self.block_size
        if index >= self.row_len[row]:
            return
        self.block_pool.cache_block(
            int(self.table[row, index]),
            request.block_hashes[boundary // h - 1],
            self.group_id,
            boundary,
        )

    def shares_cache_plans(self) -> bool:
        """With the hash block size as block size there is no partial tail key: the base
        rule alone."""
        return self.block_size == self.block_pool.hash_block_size

    def pending_work(self, rows, total, main, slots, cache_tokens, num_hashed, boundary):
        """Base test plus the partial tail: a block at the boundary whose key is shorter."""
        work = super().pending_work(rows, total, main, slots, cache_tokens, num_hashed, boundary)
        h = self.block_pool.hash_block_size
        if not self.enable_caching or self.block_size == h:
            return work
        bs = self.block_size
        index = boundary // bs
        live = (boundary > 0) & (boundary <= cache_tokens) & (boundary % bs != 0)
        live &= index < self.row_len[rows]
        if live.any():
            blocks = self.table[rows[live], index[live]]
            short = (blocks != NULL_BLOCK_ID) & (
                self.block_pool.num_cached_tokens[blocks] < boundary[live]
            )
            work[np.flatnonzero(live)[short]] = True
        return work

    def always_tested(self) -> bool:
        """When a partial tail key may be promoted (block size differs from the hash block
        size: :meth:`pending_work`'s extra rule)."""
        return self.enable_caching and self.block_size != self.block_pool.hash_block_size
