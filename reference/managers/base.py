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

Partial (sub-block) hits (:attr:`reference.layout.KVCacheLayout.partial_hits_enabled`:
hit lengths are multiples of the hash block size ``H``, which may end inside a block of
a full-attention or Mamba group). A *fine-grained* manager (full attention, Mamba: the
class attribute ``fine_grained_lookup``) looks a hit up in the hash chain itself when
the hit alignment is below its block size and divides it; every other manager sees the
chain at its block size (:meth:`ManagerBase.find_longest_cache_hit`). A new request's
local hit that ends inside a block (``hit % bs != 0``) shares that block with its owner,
who may still be writing past the boundary: the request gets a private copy instead
(*copy-on-write*). Counting reserves one more block for it; adopting the hit remembers
``(index, shared block)`` and counts the blocks before it as cached (the copy is cached
again once full); the next ``allocate_new_blocks`` takes one fresh block first, puts it
at that index in place of the shared block and queues the copy ``shared -> fresh``.
Until the copy is handed over (:meth:`SingleTypeKVCacheManager.take_block_copies`, when
the scheduler's step is planned), the shared block keeps the reference the hit gave it
and the fresh block holds one reference more than its row: neither can be reused by an
allocation of the same step. Example: full bs 8, H 4, a hit of 12 tokens on blocks ``[a,
b]``: 2 new tokens need ``cdiv(14, 8) - 2 = 0`` blocks plus the copy: 1; the table
becomes ``[a, c]``, the copy ``b -> c`` is queued, ``b`` keeps its hit reference and
``c`` has 2 until the copy is handed over.
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
    partial_hit: bool = False,
) -> int:
    """The blocks one group needs for ``num_tokens`` slots (module docstring): ``required
    = cdiv(num_tokens, bs)`` (at most ``cap``); a ``running`` request (already allocated)
    needs ``required - held``; a new one needs ``required - max(skipped, hit + held)``
    plus its hit blocks past the skipped ones that sit evictable in the free queue
    (``evictable(block)``: ref count 0 and not null), plus one when its local hit ends
    inside a block (``partial_hit``: the copy-on-write block). Shared by both engines.

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
    copy = 1 if partial_hit else 0
    return num_new + copy + sum(1 for b in hit_blocks[skip_in_hits:] if evictable(b))


def num_skipped_hit_blocks(
    spec: KVCacheSpec, num_local_computed_tokens: int, num_external_computed_tokens: int
) -> int:
    """Leading blocks a first allocation pads with nulls: the group's skip boundary at
    ``local + external`` computed tokens, in blocks. The hit blocks before it are never
    adopted (not touched, no access of theirs counted); the rest are. Example: SWA w 4,
    bs 2, a 6-token local hit ``[n, 3, 4]`` (``n`` null) and 4 external tokens: 10
    computed, ``10 - 4 + 1 = 7`` tokens skipped, ``7 // 2 = 3`` blocks (blocks 3 and 4
    stay free and cached; the table starts with 3 nulls); without the external tokens
    ``3 // 2 = 1``: ``[3, 4]`` adopted."""
    total = num_local_computed_tokens + num_external_computed_tokens
    return spec.num_skipped_tokens(total) // spec.block_size


def has_partial_local_hit(
    hit_blocks: Sequence[Block], num_local_computed_tokens: int, block_size: int
) -> bool:
    """A local hit that ends inside a block: some hit blocks, and ``num_local_computed_tokens
    % bs != 0`` (its last block is shared only up to the boundary: copy-on-write). Example:
    bs 8, hit ``[a, b]`` of 12 tokens -> True; of 16 tokens -> False; no block -> False."""
    return len(hit_blocks) > 0 and num_local_computed_tokens % block_size != 0


def is_fine_grained(block_size: int, alignment: int) -> bool:
    """Whether a fine-grained manager's scan reads the hash chain itself (at the hit
    alignment, the hash block size) rather than the chain at its block size: ``alignment <
    bs`` and ``bs % alignment == 0`` (hits may end inside a block). Example: bs 8, A 4 ->
    True (fine hashes ``A B C D`` are read as they are, not as ``B D``); bs 8, A 8 or 16
    -> False."""
    return alignment < block_size and block_size % alignment == 0


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
    #: Whether the hit rule can end inside a block (partial hits: full attention, Mamba).
    fine_grained_lookup: bool = False

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
        ``drop_eagle``: the last matched block is dropped (EAGLE recomputes it). A
        fine-grained manager reads the chain itself when hits may end inside its blocks
        (:func:`is_fine_grained`); every other one the chain at its block size."""
        if cls.fine_grained_lookup and is_fine_grained(spec.block_size, alignment):
            hashes = block_hashes
        else:
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
        #: request id -> (index, shared block) of a hit ending inside that block, whose
        #: copy-on-write the next ``allocate_new_blocks`` makes (module docstring)
        self.partial_hits: dict[str, tuple[int, KVCacheBlock]] = {}
        #: (source, copy) block pairs queued since the last ``take_block_copies``
        self.pending_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []

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
        num_local_computed_tokens: int = 0,
    ) -> int:
        """:func:`blocks_to_allocate` for this group (``prefill_end``: only Mamba's
        prefill checkpoints read it; ``num_local_computed_tokens``: the request's computed
        tokens plus its local hit, for the copy-on-write of a hit ending inside a
        block)."""
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
            has_partial_local_hit(new_computed_blocks, num_local_computed_tokens, self.block_size),
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
        appended. A hit ending inside its last block is remembered for copy-on-write
        (module docstring): that block's index counts as the cached ones' end."""
        blocks = self.blocks_of(request_id)
        assert not blocks, f"request {request_id} already has blocks in group {self.group_id}"
        skipped = num_skipped_hit_blocks(
            self.spec, num_local_computed_tokens, num_external_computed_tokens
        )
        kept = list(new_computed_blocks[skipped:])
        if self.enable_caching:  # pragma: no branch - no hits to adopt without caching
            self.block_pool.touch(kept)
        blocks.extend([self.null_block] * skipped)
        blocks.extend(kept)
        self.num_cached_block[request_id] = len(blocks)
        if has_partial_local_hit(kept, num_local_computed_tokens, self.block_size):
            index = num_local_computed_tokens // self.block_size
            self.partial_hits[request_id] = (index, kept[-1])
            self.num_cached_block[request_id] = index

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
        """Append fresh blocks until the table covers ``num_tokens`` slots; a pending
        copy-on-write (module docstring) takes its block first, returned first."""
        copies: BlockList = []
        partial = self.partial_hits.pop(request_id, None)
        if partial is not None:
            index, source = partial
            (copy,) = self.block_pool.get_new_blocks(1)
            self.copy_on_write(request_id, index, source, copy)
            copies.append(copy)
        blocks = self.blocks_of(request_id)
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return copies
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return copies + new_blocks

    def copy_on_write(
        self, request_id: str, index: int, source: KVCacheBlock, copy: KVCacheBlock
    ) -> None:
        """The request's entry ``index`` becomes ``copy`` in place of the shared ``source``,
        and the copy ``source -> copy`` is queued; ``source`` keeps the reference the hit
        gave it and ``copy`` takes one more than its row's, both released when the copy
        is handed over (:meth:`take_block_copies`)."""
        self.blocks_of(request_id)[index] = copy
        self.pending_copies.append((source, copy))
        copy.ref_cnt += 1

    def take_block_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """The ``(source, copy)`` pairs queued since the last call, in order; the queue is
        emptied (the caller releases the references they hold)."""
        pairs, self.pending_copies = self.pending_copies, []
        return pairs

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
            self.block_pool.cache_full_block(
                blocks[i], hashes[i], self.group_id, (i + 1) * self.block_size
            )
        self.num_cached_block[request.request_id] = num_full

    # -- freeing -----------------------------------------------------------------
    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free the blocks before ``num_skipped_tokens`` (module docstring);
        ``num_prompt_tokens`` is for the managers whose rule needs it (R-SWA)."""
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
        self.partial_hits.pop(request_id, None)
        start = 0
        while start < len(blocks) and blocks[start].is_null:
            start += 1
        return blocks[start:]

    def free(self, request_id: str) -> None:
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))

    def new_step_starts(self) -> None:
        """A scheduler step begins (only Mamba keeps per-step state)."""
