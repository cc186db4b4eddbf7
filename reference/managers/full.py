"""Full attention: every token stays needed until the request is freed.

Hit rule: scan blocks ``0, 1, ...`` up to ``max_length // bs`` and stop at the first
block missing in any group; round the hit down to the alignment. Full attention is
downward closed: if block ``i`` hits, every block before it hits too (the chain).
EAGLE drop: the hit loses ``min(A, bs)`` tokens before the rounding (bs 4, A 4, 3
blocks cached, max 15 -> 12 -> 8).

Partial tail entry (only when ``bs != hash_block_size``): after caching, the prompt
boundary ``floor(min(P - 1, hashed) / H) * H`` (``P`` instead of ``P - 1`` under
EAGLE) that falls inside a block (not on a block boundary) is registered on that
block, keyed by the chained hash at the boundary. It makes the block "hashed" (freed
to the back of the queue) until the block is promoted to its full key. Example: bs 8,
H 4, P 13: boundary 12 lies inside block 1 ([8, 16)), which gets the key of the
12-token prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.managers.base import Block, Lookup, SingleTypeKVCacheManager
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

    Example: bs 4, A 8, blocks 0..2 cached, max 15 -> 3 blocks match (12) -> hit 8,
    ``[b0, b1]`` per group.
    """
    bs = spec.block_size
    out: list[list[Block]] = [[] for _ in range(num_groups)]
    for block_hash in hashes[: max_length // bs]:
        found = lookup(block_hash)
        if found is None:
            break
        for lst, block in zip(out, found):
            lst.append(block)
    hit = len(out[0]) * bs
    if drop_eagle and hit > 0:
        hit -= min(alignment, bs)
    hit -= hit % alignment
    keep = -(-hit // bs)
    return [lst[:keep] for lst in out], hit


class FullAttentionManager(SingleTypeKVCacheManager):
    scan = staticmethod(full_attention_hit)

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
        self.block_pool.cache_block(
            blocks[index], request.block_hashes[boundary // h - 1], self.group_id, boundary
        )
