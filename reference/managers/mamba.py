"""Mamba state in "align" mode: one state per block boundary, only the newest needed.

Block ``i`` of a request's row holds the recurrent state at boundary ``(i+1)*bs``
once the tokens up to there are computed. The row is position indexed: before an
allocation that needs column ``c = cdiv(main_tokens, bs) - 1``, columns ``[len, c)``
are filled with nulls and one new block is appended at ``c``; at most one physical
block is taken per step. The previous state stays until a later step has read it:
``remove_skipped_blocks(n)`` frees every real block before column
``(n - 1) // bs`` (skipping null gaps, never revisiting retired columns) and also
the previous step's state once it is older than column ``cdiv(n, bs) - 1``.

Example, bs 4: prefill 10 tokens -> row [0, 0, s]; at 12 computed tokens ``s``
holds the state at 12 and is cached under the 12-token prefix; the step that
computes token 13 appends a new block at column 3, and the step after frees ``s``.

Hit rule: the rightmost cached state at an aligned boundary ``(i+1)*bs <= max``:
``[null] * i + [state]``, hit ``(i + 1) * bs``. A hit on a state cached during the
current step is refused (``allocate_slots`` returns None) until ``new_step_starts``:
the state is only written when the step runs.

Which states are registered: :func:`reference.retention.mamba_block_mask` (every one
under dense retention; under sparse retention only the state on the prompt's replay
boundary and on a shared-prefix junction).
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.block_pool import KVCacheBlock
from reference.managers.base import Block, BlockList, Lookup, SingleTypeKVCacheManager
from reference.request import Request
from reference.retention import mamba_block_mask
from reference.specs import KVCacheSpec, MambaSpec, cdiv


def mamba_hit(
    hashes: Sequence[bytes],
    max_length: int,
    num_groups: int,
    spec: KVCacheSpec,
    alignment: int,
    lookup: Lookup,
    null_block: Block,
    drop_eagle: bool = False,
) -> tuple[list[list[Block]], int]:
    """The Mamba hit rule of the module docstring over ``hashes`` (the chain at ``bs``;
    only hashed states: ``i < min(max_length // bs, len(hashes))``). ``drop_eagle`` is
    unused (a Mamba group never drops).

    Example: bs 4, A 8, states 1 and 2 cached, max 15 -> state 2 ends at 12, not
    aligned -> state 1: ``[null, s1]`` per group, hit 8.
    """
    assert isinstance(spec, MambaSpec)
    bs = spec.block_size
    for i in range(min(max_length // bs, len(hashes)) - 1, -1, -1):
        cached = lookup(hashes[i])
        if cached is None:
            continue
        if bs != alignment and ((i + 1) * bs) % alignment != 0:
            continue
        return [[null_block] * i + [block] for block in cached], (i + 1) * bs
    return [[] for _ in range(num_groups)], 0


def mamba_cache_mask(manager, request, start: int, end: int) -> list[bool] | None:
    """Which states ``[start, end)`` of ``request`` a Mamba ``manager`` registers:
    :func:`reference.retention.mamba_block_mask` with the manager's alignment, block
    size, retention interval and the request's reachable boundaries (the
    ``cacheable_block_mask`` of both engines' Mamba managers). Example: bs 2, A 2,
    sparse, P 11 -> only the state ending at 10 (block 4)."""
    return mamba_block_mask(
        start,
        end,
        manager.cache_hit_alignment,
        manager.block_size,
        manager.retention_interval,
        manager.reachable_boundaries(request),
    )


class MambaManager(SingleTypeKVCacheManager):
    scan = staticmethod(mamba_hit)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cached_keys_this_step: set[bytes] = set()
        self.last_state_block_index: dict[str, int] = {}
        self.num_retired_blocks: dict[str, int] = {}
        self.allocated_requests: set[str] = set()

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main: int,
        apply_admission_cap: bool = False,
    ) -> int:
        if new_computed_blocks and new_computed_blocks[-1].cache_key in self.cached_keys_this_step:
            return self.block_pool.num_blocks + 1
        required = cdiv(num_tokens_main, self.block_size)
        num_new = required - len(new_computed_blocks) - len(self.req_to_blocks.get(request_id, ()))
        if num_new > 0:
            num_new = min(num_new, 1)
        evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + evictable

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main: int
    ) -> BlockList:
        blocks = self.blocks_of(request_id)
        required = cdiv(num_tokens_main, self.block_size)
        if required <= len(blocks):
            self.allocated_requests.add(request_id)
            return []
        if blocks:
            self.last_state_block_index[request_id] = len(blocks) - 1
        blocks.extend([self.null_block] * max(0, required - 1 - len(blocks)))
        new_blocks = self.block_pool.get_new_blocks(required - len(blocks))
        blocks.extend(new_blocks)
        self.allocated_requests.add(request_id)
        return new_blocks

    cacheable_block_mask = mamba_cache_mask

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        before = self.num_cached_block.get(request.request_id, 0)
        super().cache_blocks(request, num_tokens)
        after = self.num_cached_block.get(request.request_id, 0)
        blocks = self.blocks_of(request.request_id)
        for block in blocks[before:after]:
            if not block.is_null and block.cache_key is not None:
                self.cached_keys_this_step.add(block.cache_key)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        super().remove_skipped_blocks(request_id, num_computed_tokens)
        last = self.last_state_block_index.get(request_id)
        # unreachable while num_skipped_tokens(n) is n - 1: super() already freed every
        # column before (n - 1) // bs == cdiv(n, bs) - 1 (kept as vLLM states the rule)
        stale = last is not None and last < cdiv(num_computed_tokens, self.block_size) - 1
        if stale:  # pragma: no cover
            blocks = self.blocks_of(request_id)
            if not blocks[last].is_null:
                self.block_pool.free_blocks([blocks[last]])
                blocks[last] = self.null_block

    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        blocks = self.req_to_blocks.get(request_id, [])
        first = max(first, self.num_retired_blocks.get(request_id, 0))
        last = min(last, len(blocks))
        if first >= last:
            return
        freed: BlockList = []
        for i in range(last - 1, first - 1, -1):
            if blocks[i].is_null:
                continue
            freed.append(blocks[i])
            blocks[i] = self.null_block
        if freed:
            self.block_pool.free_blocks(freed)
        self.num_retired_blocks[request_id] = last

    def pop_blocks_for_free(self, request_id: str) -> BlockList:
        self.allocated_requests.discard(request_id)
        self.last_state_block_index.pop(request_id, None)
        self.num_retired_blocks.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def new_step_starts(self) -> None:
        self.cached_keys_this_step.clear()
