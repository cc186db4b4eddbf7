"""Rules shared by every single-type manager.

State per request: ``req_to_blocks[r]`` (the group's block table, with null
placeholders) and ``num_cached_block[r]`` (leading blocks already registered in the
cache; its presence marks a request that has been allocated, the "running" path).

* ``remove_skipped_blocks(r, n)``: blocks ``[0, num_skipped_tokens(n) // bs)`` become
  null and are freed. The walk goes backwards from the last skipped block and stops
  at the first null (earlier ones were removed before), so blocks are freed tail
  first. Example, bs 2, w 4, blocks [a b c d], n = 7: skipped 4 -> blocks 0, 1 ->
  table [0 0 c d], free order b, a.
* ``get_num_blocks_to_allocate``: ``cdiv(num_tokens, bs)`` (capped at
  ``max_admission_blocks`` for the admission gate) minus what the request holds; a
  new request's prefix-hit blocks count as held, its skipped blocks need nothing,
  and hit blocks that sit evictable in the free queue count as taken (touching them
  removes them from the queue).
* ``free(r)``: leading nulls dropped, the rest freed in reverse order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from reference.block_pool import KVCacheBlock
from reference.hashing import hashes_at_block_size
from reference.request import Request
from reference.retention import reachable_boundaries
from reference.specs import KVCacheSpec, cdiv

BlockList = list[KVCacheBlock]

#: A block of either engine: the reference's :class:`KVCacheBlock` or an optimized block id.
Block = TypeVar("Block")
#: ``lookup(block_hash)``: the earliest cached block of that hash in each group of a spec
#: group, or None when any group misses (:meth:`BlockPool.get_cached_block`).
Lookup = Callable[[bytes], "Sequence[Block] | None"]
#: A per-type hit scan: ``scan(hashes, max_length, num_groups, spec, alignment, lookup,
#: null_block, drop_eagle) -> (one block list per group, hit length)``; ``hashes`` is the
#: chain at the group's block size. One rule per attention type, shared by the reference
#: and the optimized managers (which differ in ``lookup`` and in what a block is).
HitScan = Callable[..., "tuple[list[list[Block]], int]"]


def blocks_to_allocate(
    spec: KVCacheSpec,
    num_tokens: int,
    held: int,
    running: bool,
    hit_blocks: Sequence[Block],
    total_computed_tokens: int,
    evictable: Callable[[Block], bool],
    cap: int | None = None,
) -> int:
    """The blocks one group needs for ``num_tokens`` slots (module docstring): ``required
    = cdiv(num_tokens, bs)`` (at most ``cap``); a ``running`` request (already allocated)
    needs ``required - held``; a new one needs ``required - max(skipped, hit + held)``
    plus its hit blocks past the skipped ones that sit evictable in the free queue
    (``evictable(block)``: ref count 0 and not null). Shared by both engines.

    Example: SWA w 4, bs 2, a new request with 3 hit blocks (the first free and cached),
    computed 6, 10 slots: required 5, skipped ``3 // 2 = 1`` block, so 2 new blocks; the
    hits past the first skipped one are both held -> 2. Were the second hit free: 3.
    """
    required = cdiv(num_tokens, spec.block_size)
    if cap is not None:
        required = min(required, cap)
    if running:
        return max(required - held, 0)
    skipped_blocks = spec.num_skipped_tokens(total_computed_tokens) // spec.block_size
    local_blocks = len(hit_blocks) + held
    num_new = max(required - max(skipped_blocks, local_blocks), 0)
    skip_in_hits = max(0, skipped_blocks - held)
    return num_new + sum(1 for b in hit_blocks[skip_in_hits:] if evictable(b))


def cacheable_full_blocks(request, num_tokens: int, block_size: int) -> int:
    """The full blocks of ``[0, num_tokens)`` that have a hash, for a request of either
    engine: ``min(num_tokens, hashed tokens) // bs``. Example: 3 hashes of H 4 (12
    tokens), 14 tokens, bs 8 -> 1."""
    num_hashed = len(request.block_hashes) * request.hash_block_size
    return min(num_tokens, num_hashed) // block_size


def _evictable(block: KVCacheBlock) -> bool:
    return block.ref_cnt == 0 and not block.is_null


class ManagerBase:
    """What a single-type manager of either engine holds and how it looks a hit up: the
    group's spec and settings, the lookup through its class's :data:`HitScan` over the
    pool's ``lookup(group_ids)`` and ``null_block``, and the reachable boundaries of a
    request (:func:`reference.retention.reachable_boundaries`). Both engines' managers
    derive from it; they differ in their block tables."""

    #: The attention type's hit rule (a :data:`HitScan`), set by each subclass.
    scan: HitScan

    def __init__(
        self,
        spec: KVCacheSpec,
        block_pool,
        group_id: int,
        enable_caching: bool,
        cache_hit_alignment: int,
        retention_interval: int | None = None,
        scheduler_block_size: int | None = None,
    ) -> None:
        self.spec = spec
        self.retention_interval = retention_interval
        self.scheduler_block_size = scheduler_block_size or cache_hit_alignment
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.enable_caching = enable_caching
        self.cache_hit_alignment = cache_hit_alignment
        self.max_admission_blocks: int | None = None
        self.use_eagle = False
        self.eagle_replay = False

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        group_ids: Sequence[int],
        pool,
        spec: KVCacheSpec,
        alignment: int,
        drop_eagle: bool = False,
    ) -> tuple[list[list], int]:
        """Longest hit ``<= max_length`` (a multiple of ``alignment``) in every group of
        ``group_ids``; returns one block list per group (nulls where not needed).
        ``drop_eagle``: the last matched block is dropped (EAGLE recomputes it)."""
        hashes = cls.coarse_hashes(block_hashes, pool.hash_block_size, spec)
        return cls.scan(
            hashes,
            max_length,
            len(group_ids),
            spec,
            alignment,
            pool.lookup(group_ids),
            pool.null_block,
            drop_eagle,
        )

    @staticmethod
    def coarse_hashes(
        block_hashes: Sequence[bytes], pool_hash_block_size: int, spec: KVCacheSpec
    ) -> Sequence[bytes]:
        return hashes_at_block_size(block_hashes, pool_hash_block_size, spec.block_size)

    def reachable_boundaries(self, request) -> list[int]:
        """The replay boundaries of ``request``'s prompt and its junction, if any.
        Example: P 11, S 4, junction 8, no EAGLE -> ``[10, 8]``."""
        return reachable_boundaries(
            request.num_prompt_tokens,
            request.shared_prefix_boundary,
            self.scheduler_block_size,
            self.block_size,
            self.use_eagle,
            self.eagle_replay,
        )


class SingleTypeKVCacheManager(ManagerBase):
    """Block tables of one KV cache group (built with :class:`ManagerBase`'s arguments)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.req_to_blocks: dict[str, BlockList] = {}
        self.num_cached_block: dict[str, int] = {}

    @property
    def null_block(self) -> KVCacheBlock:
        return self.block_pool.null_block

    def blocks_of(self, request_id: str) -> BlockList:
        return self.req_to_blocks.setdefault(request_id, [])

    # -- allocation --------------------------------------------------------------
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """:func:`blocks_to_allocate` for this group (``prefill_end``: only Mamba's
        prefill checkpoints read it)."""
        cap = self.max_admission_blocks if apply_admission_cap else None
        return blocks_to_allocate(
            self.spec,
            num_tokens,
            len(self.req_to_blocks.get(request_id, ())),
            request_id in self.num_cached_block,
            new_computed_blocks,
            total_computed_tokens,
            _evictable,
            cap,
        )

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int = 0,
    ) -> None:
        """Adopt a prefix hit (first allocation only): the blocks skipped at
        ``local + external`` tokens become nulls, the other hit blocks are touched and
        appended."""
        blocks = self.blocks_of(request_id)
        assert not blocks, f"request {request_id} already has blocks in group {self.group_id}"
        total = num_local_computed_tokens + num_external_computed_tokens
        skipped = self.spec.num_skipped_tokens(total) // self.block_size
        kept = list(new_computed_blocks[skipped:])
        if self.enable_caching:  # pragma: no branch - no hits to adopt without caching
            self.block_pool.touch(kept)
        blocks.extend([self.null_block] * skipped)
        blocks.extend(kept)
        self.num_cached_block[request_id] = len(blocks)

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int
    ) -> BlockList:
        """Fresh blocks for tokens a KV connector loads (after every group adopted its
        local hit, so these pops cannot evict another group's hit blocks).

        External tokens below the window start need nothing: ``external = min(external,
        total - skipped)``; then the table grows to ``cdiv(local + external, bs)``
        blocks (never shrinks). Example: SWA w 3, bs 2, local 0, external 8 -> skipped
        6 -> external 2 -> table [0, 0, 0] grows to 4 blocks: one new block.
        Tested in tests/reference/test_production_modes.py; the machine drives it in the
        ``external_hits`` serving mode (a host tier, :mod:`reference.host_tier`).
        """
        total = num_local_computed_tokens + num_external_computed_tokens
        skipped = self.spec.num_skipped_tokens(total)
        external = num_external_computed_tokens
        if skipped > 0:
            external = min(total - skipped, external)
        if external <= 0:  # pragma: no cover - chunked group, load ending on a chunk end
            return []
        blocks = self.blocks_of(request_id)
        num_new = max(0, cdiv(total, self.block_size) - len(blocks))
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main: int
    ) -> BlockList:
        """Append fresh blocks until the table covers ``num_tokens`` slots."""
        blocks = self.blocks_of(request_id)
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    # -- caching -----------------------------------------------------------------
    def cacheable_block_mask(self, request: Request, start: int, end: int) -> list[bool] | None:
        """Which blocks of ``[start, end)`` ``cache_blocks`` registers (None: all;
        sliding window and Mamba apply :mod:`reference.retention`)."""
        return None

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the full blocks of ``[0, num_tokens)`` not registered yet."""
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = cacheable_full_blocks(request, num_tokens, self.block_size)
        if num_cached >= num_full:
            return
        mask = self.cacheable_block_mask(request, num_cached, num_full)
        hashes = hashes_at_block_size(
            request.block_hashes, request.hash_block_size, self.block_size
        )
        blocks = self.blocks_of(request.request_id)
        for i in range(num_cached, num_full):
            if mask is not None and not mask[i - num_cached]:
                continue
            self.block_pool.cache_block(
                blocks[i], hashes[i], self.group_id, (i + 1) * self.block_size
            )
        self.num_cached_block[request.request_id] = num_full

    # -- freeing -----------------------------------------------------------------
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        skipped = self.spec.num_skipped_tokens(num_computed_tokens)
        if skipped <= 0:
            return
        blocks = self.blocks_of(request_id)
        self._remove_blocks_in_range(request_id, 0, min(skipped // self.block_size, len(blocks)))

    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or first >= last:
            return
        freed: BlockList = []
        for i in range(min(last, len(blocks)) - 1, first - 1, -1):
            if blocks[i].is_null:
                break
            freed.append(blocks[i])
            blocks[i] = self.null_block
        if freed:
            self.block_pool.free_blocks(freed)

    def pop_blocks_for_free(self, request_id: str) -> BlockList:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        start = 0
        while start < len(blocks) and blocks[start].is_null:
            start += 1
        return blocks[start:]

    def free(self, request_id: str) -> None:
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    def new_step_starts(self) -> None:
        """A scheduler step begins (only Mamba keeps per-step state)."""
