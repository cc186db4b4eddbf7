"""Sliding window ``w`` (:mod:`reference.managers.sliding_window`): the hit scans from the
right for a run of ``cdiv(w - 1, bs)`` cached blocks ending on an aligned boundary; only
the tail blocks of every aligned segment are cached.

Example (bs 4, w 8, blocks 2 and 3 cached, 4 blocks asked): ``[0, 0, b2, b3]``, hit 16.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from optimized.block_pool import BlockPool
from optimized.managers.base import BlockList, SingleTypeKVCacheManager
from reference.managers.sliding_window import blocks_needed_for_hit
from reference.specs import KVCacheSpec, SlidingWindowSpec


class SlidingWindowManager(SingleTypeKVCacheManager):
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
        assert isinstance(spec, SlidingWindowSpec)
        bs = spec.block_size
        hashes = cls.coarse_hashes(block_hashes, pool.hash_block_size, spec)
        need = blocks_needed_for_hit(spec)
        num_blocks = max_length // bs
        out: list[BlockList] = [[0] * num_blocks for _ in group_ids]
        run = 0
        found_run = False
        for i in range(num_blocks - 1, -1, -1):
            cached = pool.get_cached_block(hashes[i], group_ids)
            if cached is None:
                run = 0
                continue
            if run == 0 and bs != alignment and ((i + 1) * bs) % alignment != 0:
                continue
            for lst, block in zip(out, cached):
                lst[i] = block
            run += 1
            if run >= need:
                out = [lst[: i + run] for lst in out]
                found_run = True
                break
        if not found_run:
            keep = run
            while bs != alignment and (keep * bs) % alignment != 0:
                keep -= 1
            out = [lst[:keep] for lst in out]
        return out, len(out[0]) * bs

    def cacheable_block_mask(self, start: int, end: int) -> list[bool] | None:
        assert isinstance(self.spec, SlidingWindowSpec)
        if self.cache_hit_alignment % self.block_size != 0:
            return None
        per_segment = self.cache_hit_alignment // self.block_size
        need = blocks_needed_for_hit(self.spec)
        if need >= per_segment:
            return None
        return [i % per_segment >= per_segment - need for i in range(start, end)]

    def _skipped_tokens(self, total: np.ndarray) -> np.ndarray:
        assert isinstance(self.spec, SlidingWindowSpec)
        return np.maximum(total - self.spec.sliding_window + 1, 0)
