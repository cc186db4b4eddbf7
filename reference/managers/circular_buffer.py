"""Circular buffer groups: one block per request for its whole life, outside prefix
caching (vLLM 0.33 ``CircularBufferManager``).

A request's first allocation (for its new tokens, or for tokens a KV connector loads)
claims one block, which it keeps until it is freed; a hit gives it nothing, caching and
window removal do nothing. Example: ``allocate_slots(r, 100)`` -> one new block in the
group; every later allocation of ``r`` -> none.
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.block_pool import KVCacheBlock
from reference.managers.base import Block, BlockList, Lookup, SingleTypeKVCacheManager
from reference.request import Request
from reference.specs import KVCacheSpec


def no_hit(
    hashes: Sequence[bytes],
    max_length: int,
    num_groups: int,
    spec: KVCacheSpec,
    alignment: int,
    lookup: Lookup,
    null_block: Block,
    drop_eagle: bool = False,
) -> tuple[list[list[Block]], int]:
    """A group outside prefix caching never hits: empty lists, 0 tokens."""
    return [[] for _ in range(num_groups)], 0


class CircularBufferManager(SingleTypeKVCacheManager):
    scan = staticmethod(no_hit)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
        num_local_computed_tokens: int = 0,
    ) -> int:
        """One block until the request holds its ring, then none."""
        return 0 if self.req_to_blocks.get(request_id) else 1

    def claim_ring_block(self, request_id: str) -> BlockList:
        """The request's ring block, taken when it has none yet."""
        blocks = self.blocks_of(request_id)
        if blocks:
            return []
        new_blocks = self.block_pool.get_new_blocks(1)
        blocks.extend(new_blocks)
        return new_blocks

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main: int
    ) -> BlockList:
        return self.claim_ring_block(request_id)

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int
    ) -> BlockList:
        return self.claim_ring_block(request_id)

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int = 0,
    ) -> None:
        """Nothing to adopt (it never hits)."""

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Nothing is cached."""

    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """The ring stays."""
