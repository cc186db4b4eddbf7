"""Chunked local attention ``C``: tokens before the current chunk are dead.

Hit rule (the group's block size must equal the hit alignment). With
``start = floor(max_length / C) * C``, blocks wholly before ``start // bs`` count as
computed (null; never attended again); blocks ``start // bs, ...`` up to
``max_length // bs`` are scanned and the hit extends to the first miss. A prompt
never cached still "hits" ``floor(max_length / C) * C`` null tokens; in a hybrid
model the full-attention group bounds the hit. Example: C 8, bs 4, max 13, nothing
cached -> hit 8 ([null, null]).

When ``C`` is not a multiple of ``bs`` the block holding ``start`` also holds tokens
of the previous chunk. If that block misses, the scan stops at ``(start // bs) * bs
< start``: a length inside the previous chunk, whose tokens
``[floor(L/C)*C, L)`` are needed but were replaced by nulls. Such a hit is unsound,
so the search continues in the previous chunk (``max_length = (start // bs) * bs``).
Example: C 6, bs 4, nothing cached, max 8: start 6, block 1 misses -> 4 would need
tokens 0..3 (chunk [0, 6)) -> search again with max 4: start 0, block 0 misses -> 0.
vLLM 0.33 returns 4 here (findings/vllm/chunked-hit-in-previous-chunk.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.managers.base import Block, Lookup, SingleTypeKVCacheManager
from reference.specs import ChunkedLocalAttentionSpec, KVCacheSpec


def chunked_local_hit(
    hashes: Sequence[bytes],
    max_length: int,
    num_groups: int,
    spec: KVCacheSpec,
    alignment: int,
    lookup: Lookup,
    null_block: Block,
    drop_eagle: bool = False,
) -> tuple[list[list[Block]], int]:
    """The chunked-local hit rule of the module docstring over ``hashes`` (the chain at
    ``bs``; the scan stops at ``min(max_length // bs, len(hashes))``). ``alignment`` and
    ``drop_eagle`` are unused (the block size is the alignment; no EAGLE drop).

    Example: C 8, bs 4, max 13, nothing cached -> ``[null, null]`` per group, hit 8.
    """
    assert isinstance(spec, ChunkedLocalAttentionSpec)
    bs = spec.block_size
    while True:
        start = spec.num_skipped_tokens(max_length)
        start_block = start // bs
        out: list[list[Block]] = [[null_block] * start_block for _ in range(num_groups)]
        for i in range(start_block, min(max_length // bs, len(hashes))):
            cached = lookup(hashes[i])
            if cached is None:
                break
            for lst, block in zip(out, cached):
                lst.append(block)
        hit = len(out[0]) * bs
        if hit >= start or hit == 0:
            return out, hit
        max_length = hit


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    scan = staticmethod(chunked_local_hit)
