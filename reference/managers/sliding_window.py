"""Sliding window ``w``: a hit at ``L`` needs the ``w - 1`` tokens before ``L``.

Since hits are block aligned, those tokens fill the ``need = cdiv(w - 1, bs)``
blocks that end at ``L``. Hit rule (scan from the right, at the group's block size):

    for i = M-1 down to 0 (M = max_length // bs):
        block i cached in every group?
          no  -> run = 0
          yes -> if run == 0 and bs != A and (i+1)*bs % A != 0: skip it (a run must END
                 on an aligned boundary); else take it, run += 1;
                 run >= need -> hit = (i + run) * bs, done
    no run long enough: a run that reaches block 0 is still a hit (nothing before it
    is needed); pop blocks until the length is aligned.

Blocks before the run are null in the result. Example (bs 4, w 8, blocks 2 and 3
cached, M = 4): need 2 -> result [null, null, b2, b3], hit 16. With ``w = 1``,
``need = 0`` but the scan still takes one cached block, so a hit ends on a cached
block (vLLM 0.33 behaviour; see ``cacheable_block_mask``: such a group caches none).

Not downward closed: a hit at ``L`` says nothing about shorter lengths.

Which blocks are cached (dense retention, alignment ``A`` a multiple of ``bs``):
only the ``need`` tail blocks of every ``A``-token segment, since a hit can only end
on an aligned boundary: block ``i`` iff ``i % (A/bs) >= A/bs - need``; every block
when ``need >= A/bs``. Example: bs 2, A 8, w 3 -> need 1 -> blocks 3, 7, 11, ...
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.block_pool import BlockPool
from reference.managers.base import BlockList, SingleTypeKVCacheManager
from reference.specs import KVCacheSpec, SlidingWindowSpec, cdiv


def blocks_needed_for_hit(spec: SlidingWindowSpec) -> int:
    """``cdiv(w - 1, bs)``: the blocks holding the ``w - 1`` tokens before a hit."""
    return cdiv(spec.sliding_window - 1, spec.block_size)


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
        out: list[BlockList] = [[pool.null_block] * num_blocks for _ in group_ids]
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
            out = [lst[:run] for lst in out]
            # a run starts only on an aligned block end (above), so [0, run) is aligned
            while bs != alignment and (len(out[0]) * bs) % alignment != 0:
                out = [lst[:-1] for lst in out]  # pragma: no cover - see above
        return out, len(out[0]) * bs

    def cacheable_block_mask(self, start: int, end: int) -> list[bool] | None:
        assert isinstance(self.spec, SlidingWindowSpec)
        if self.cache_hit_alignment % self.block_size != 0:  # pragma: no cover - lcm of sizes
            return None
        per_segment = self.cache_hit_alignment // self.block_size
        need = blocks_needed_for_hit(self.spec)
        if need >= per_segment:
            return None
        return [i % per_segment >= per_segment - need for i in range(start, end)]
