"""Sliding window ``w`` (:mod:`reference.managers.sliding_window`): the hit scans from the
right for a run of ``cdiv(w - 1, bs)`` cached blocks ending on an aligned boundary
(:func:`reference.managers.sliding_window.sliding_window_hit`); which blocks are cached
follows the retention interval (:func:`reference.managers.sliding_window.window_cache_mask`).

Example (bs 4, w 8, blocks 2 and 3 cached, 4 blocks asked): ``[0, 0, b2, b3]``, hit 16.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

import numpy as np

from optimized.control.block_pool import NULL_BLOCK_ID, BlockPool
from optimized.control.managers.base import SingleTypeKVCacheManager, lookup_words
from optimized.control.request import Request
from reference.managers.sliding_window import (
    blocks_needed_for_hit,
    sliding_window_hit,
    window_cache_mask,
)
from reference.retention import boundary_blocks
from reference.specs import KVCacheSpec, SlidingWindowSpec


class SlidingWindowManager(SingleTypeKVCacheManager):
    drops_blocks = True
    scan = staticmethod(sliding_window_hit)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        assert isinstance(self.spec, SlidingWindowSpec)
        #: the blocks a hit ends with (``blocks_needed_for_hit``)
        self._need = blocks_needed_for_hit(self.spec)
        #: :meth:`cacheable_block_positions` computes its sparse case itself
        self._sparse_mask = (
            self.retention_interval == 0
            and not self.use_eagle
            and not self.eagle_replay
            and self.cache_hit_alignment % self.block_size == 0
        )

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
        """:func:`reference.managers.sliding_window.sliding_window_hit` over lookups done
        in bulk (:meth:`BlockPool.cached_columns`: one C-level pass per group over the
        ``M = min(max_length // bs, hashed)`` blocks), the scan from the right reading
        them: the rightmost run of ``need`` cached blocks (at least one) whose last block
        ends aligned, the blocks before it null; else the run reaching block 0, cut to an
        aligned length. Example: bs 4, w 8, A 4, blocks 2 and 3 cached, max 16 ->
        ``[0, 0, b2, b3]`` per group, hit 16. (No EAGLE group in this engine: a drop goes
        to the reference scan.)"""
        if drop_eagle:
            return super().find_longest_cache_hit(
                block_hashes, max_length, group_ids, pool, spec, alignment, drop_eagle
            )
        assert isinstance(spec, SlidingWindowSpec)
        bs = spec.block_size
        k = bs // pool.hash_block_size
        if len(group_ids) == 1:
            return cls._scan_one_group(
                block_hashes, max_length, group_ids[0], pool, spec, alignment
            )
        hashes = list(islice(block_hashes, k - 1, k * (max_length // bs), k))
        words = lookup_words(block_hashes, pool, bs)
        columns, present = pool.cached_columns(
            hashes, group_ids, None if words is None else words[: len(hashes)]
        )
        need = max(blocks_needed_for_hit(spec), 1)  # w = 1: the scan still takes one block
        free_end = bs == alignment
        run = top = 0
        for i in range(len(present) - 1, -1, -1):
            if present[i] is None:
                run = 0
            elif run or free_end or (i + 1) * bs % alignment == 0:
                if not run:
                    top = i
                run += 1
                if run >= need:  # blocks i..top, nulls before
                    nulls = [NULL_BLOCK_ID] * i
                    return [nulls + col[i : top + 1] for col in columns], (top + 1) * bs
        # no run long enough: the one reaching block 0 (it ends aligned, as every run)
        while run and not free_end and run * bs % alignment:
            run -= 1
        return [col[:run] for col in columns], run * bs

    @staticmethod
    def _scan_one_group(
        block_hashes: Sequence[bytes],
        max_length: int,
        group_id: int,
        pool: BlockPool,
        spec: SlidingWindowSpec,
        alignment: int,
    ) -> tuple[list[list[int]], int]:
        """:meth:`find_longest_cache_hit` of a spec group of one group, its lookups made
        from the right as the scan reads them (the scan usually stops after ``need``
        blocks, long before block 0): the run's blocks are collected as it grows and
        dropped when a miss ends it. Example: bs 4, w 8 (need 2), A 4, 16 blocks of which
        14 and 15 are cached, max 64 -> two lookups, ``[0] * 14 + [b14, b15]``, hit 64."""
        bs = spec.block_size
        k = bs // pool.hash_block_size
        need = max(blocks_needed_for_hit(spec), 1)  # w = 1: the scan still takes one block
        free_end = bs == alignment
        num_blocks = min(max_length // bs, len(block_hashes) // k)
        if (
            pool.keys_as_words
        ):  # the scan compiled (:func:`~optimized.control.key_index.window_run`)
            words = lookup_words(block_hashes, pool, bs)[:num_blocks]
            run, first = pool.index.window(words, group_id, need, bs, alignment)
            if len(run) >= need:
                return [[NULL_BLOCK_ID] * first + run], (first + len(run)) * bs
        else:
            get = pool.index.cached[group_id].get
            run = []  # the current run's blocks, rightmost first
            for i in range(num_blocks - 1, -1, -1):
                block = get(block_hashes[(i + 1) * k - 1])
                if block is None:
                    run = []
                elif run or free_end or (i + 1) * bs % alignment == 0:
                    run.append(block)
                    if len(run) >= need:  # blocks i..top, nulls before
                        run.reverse()
                        return [[NULL_BLOCK_ID] * i + run], (i + len(run)) * bs
            run.reverse()
        # no run long enough: the one reaching block 0 (it ends aligned, as every run)
        length = len(run)
        while length and not free_end and length * bs % alignment:
            length -= 1
        return [run[:length]], length * bs

    cacheable_block_mask = window_cache_mask

    def cacheable_block_positions(
        self, request: Request, start: int, end: int
    ) -> list[int] | range | None:
        """The kept positions of :func:`reference.managers.sliding_window.
        window_cache_mask` over ``[start, end)``, the sparse case (retention interval 0,
        no EAGLE, alignment a multiple of ``bs``) computed with no mask: the blocks the
        reference keeps for each reachable boundary (:func:`reference.retention.
        boundary_blocks` of the replay boundary and of the junction, if any), clipped, in
        order. Any other setting reads the reference's mask. Example: bs 16, A 16, w 128
        (need 8), P 2048, no junction, blocks ``[0, 128)`` -> positions ``range(119, 127)``."""
        if not self._sparse_mask:
            return super().cacheable_block_positions(request, start, end)
        a, bs, need = self.cache_hit_alignment, self.block_size, self._need
        runs = [
            range(max(start, run.start) - start, min(end, run.stop) - start)
            for run in (boundary_blocks(b, a, bs, need) for b in self.reachable_boundaries(request))
        ]
        if len(runs) == 1:
            return runs[0]  # (one run: the caller slices)
        return sorted({k for run in runs for k in run})

    def _skipped_tokens(self, total: np.ndarray) -> np.ndarray:
        assert isinstance(self.spec, SlidingWindowSpec)
        return np.maximum(total - self.spec.sliding_window + 1, 0)

    def _first_total_skipping(self, tokens: np.ndarray) -> np.ndarray:
        """``t - w + 1 >= tokens`` first holds at ``t = tokens + w - 1``."""
        assert isinstance(self.spec, SlidingWindowSpec)
        return tokens + (self.spec.sliding_window - 1)
