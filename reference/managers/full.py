"""Full attention: every token stays needed until the request is freed.

Hit rule: scan blocks ``0, 1, ...`` up to ``max_length // bs`` and stop at the first
block missing in any group; round the hit down to the alignment. Full attention is
downward closed: if block ``i`` hits, every block before it hits too (the chain).
EAGLE drop: the hit loses ``min(A, bs)`` tokens before the rounding (bs 4, A 4, 3
blocks cached, max 15 -> 12 -> 8).

Fine-grained (partial hits, alignment ``A = H`` below ``bs``, ``hashes`` the chain at
``H``): the scan above runs over the chain at ``bs`` (every ``bs / H``-th hash); then the
first block that missed is probed at its inner boundaries, from the highest below
``min(max_length, hashed)`` down: the first prefix found cached there (a partial entry, or
a block cached in full under a secondary key) adds that block, and the hit ends at that
boundary. The EAGLE drop then takes one hash block (``min(A, bs) = H``). Example: bs 8, H
4, block 0 cached, block 1 missing but its 12-token prefix cached on ``b``, max 13 ->
``[b0, b]``, hit 12 (EAGLE: 8, ``[b0]``).

Partial tail entry (only when ``bs != hash_block_size``): after caching, the prompt
boundary ``floor(min(P - 1, hashed) / H) * H`` (``P`` instead of ``P - 1`` under
EAGLE) that falls inside a block (not on a block boundary) is registered on that
block, keyed by the chained hash at the boundary
(:meth:`reference.block_pool.BlockPool.cache_partial_block`). It makes the block
"hashed" (freed to the back of the queue) until the block is promoted to its full key;
on a block already cached in full (a hit shared it) it is a secondary key. With partial
hits, it is what a resend of the prompt hits inside the block. Example: bs 8, H 4, P 13:
boundary 12 lies inside block 1 ([8, 16)), which gets the key of the 12-token prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.hashing import hashes_at_block_size
from reference.managers.base import Block, Lookup, SingleTypeKVCacheManager, is_fine_grained
from reference.request import Request
from reference.specs import KVCacheSpec


def full_attention_hit(
    hashes: Sequence[bytes],
    max_length: int,
    num_groups: int,
    spec: KVCacheSpec,
    alignment: int,
    lookup: Lookup,
    null_block: Block,
    drop_eagle: bool = False,
) -> tuple[list[list[Block]], int]:
    """The full-attention hit rule (module docstring) over ``hashes`` at ``bs``: blocks
    ``0, 1, ...`` up to ``min(max_length // bs, len(hashes))`` until the first miss, the
    EAGLE drop, then rounded down to ``alignment``. ``null_block`` is unused (no nulls).
    Fine-grained (:func:`reference.managers.base.is_fine_grained`): ``hashes`` is the
    chain at ``alignment`` and the first missing block is probed inside.

    Example: bs 4, A 8, blocks 0..2 cached, max 15 -> 3 blocks match (12) -> hit 8,
    ``[b0, b1]`` per group.
    """
    bs = spec.block_size
    fine = is_fine_grained(bs, alignment)
    coarse = hashes_at_block_size(hashes, alignment, bs) if fine else hashes
    out: list[list[Block]] = [[] for _ in range(num_groups)]
    for block_hash in coarse[: max_length // bs]:
        found = lookup(block_hash)
        if found is None:
            break
        for lst, block in zip(out, found):
            lst.append(block)
    hit = len(out[0]) * bs
    if fine:
        k = bs // alignment
        first = len(out[0]) * k
        last = min(first + k - 1, max_length // alignment, len(hashes))
        for j in range(last - 1, first - 1, -1):
            found = lookup(hashes[j])
            if found is None:
                continue
            for lst, block in zip(out, found):
                lst.append(block)
            hit = (j + 1) * alignment
            break
    if drop_eagle and hit > 0:
        hit -= min(alignment, bs)
    hit -= hit % alignment
    keep = -(-hit // bs)
    return [lst[:keep] for lst in out], hit


class FullAttentionManager(SingleTypeKVCacheManager):
    scan = staticmethod(full_attention_hit)
    fine_grained_lookup = True

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        super().cache_blocks(request, num_tokens)
        h = request.hash_block_size
        if self.block_size == h:
            return
        limit = request.num_prompt_tokens if self.use_eagle else request.num_prompt_tokens - 1
        boundary = min(limit // h, len(request.block_hashes)) * h
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.blocks_of(request.request_id)
        index = boundary // self.block_size
        if index >= len(blocks):  # pragma: no cover - boundary <= num_tokens <= the table's slots
            return
        self.block_pool.cache_partial_block(
            blocks[index], request.block_hashes[boundary // h - 1], self.group_id, boundary
        )
