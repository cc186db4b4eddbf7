"""The block pool shared by every KV cache group.

Rules:

* Block 0 is the **null block**: a placeholder for tokens a group no longer needs.
  It is never in the free queue, never hashed, never handed out, and its ref count
  is not maintained.
* The free queue is ordered. Allocation pops from the **front**. When blocks are
  freed (in the order given), those reaching ref count 0 without a hash go to the
  **front** (``prepend``, keeping their order: they are reused first), hashed ones to
  the **back** (LRU). Callers free a request's blocks tail first, so the tail of a
  chain is evicted before its head. Example: queue ``[0]``, prepend ``[4, 5]`` ->
  ``[4, 5, 0]``; prepend ``[1, 2]`` -> ``[1, 2, 4, 5, 0]``.
* Eviction is lazy: a cached free block keeps its key until it is popped for a new
  allocation; then every key pointing to it is dropped.
* ``touch`` revives a cached free block (removes it from the queue) and counts a
  reference. Several blocks may share one key (no de-duplication); a lookup takes
  the earliest inserted.
* A block has at most one *primary* key (``cache_key``, with the prefix length it ends,
  ``num_cached_tokens``) and any number of *secondary* keys: partial entries registered
  on a block that already had a primary key (:meth:`BlockPool.cache_partial_block`).
  Every key of a block leaves the map with it (eviction, promotion, reset).
* ``reset_prefix_cache`` succeeds only when no request holds a block.

Worked example of the keys (H 4, one block ``b`` of 8 tokens): ``cache_partial_block(b,
h12, 0, 12)`` (a sub-block prefix of 12 tokens ends inside ``b``) makes ``h12`` its primary
key (12 tokens); ``cache_full_block(b, h16, 0, 16)`` promotes it (``h12`` leaves the map,
``h16`` becomes the primary key of 16 tokens); a later ``cache_partial_block(b, h12, 0,
12)`` adds ``h12`` back as a secondary key (``b`` keeps ``h16``): both keys find ``b``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from reference.errors import KVConformError
from reference.hashing import cache_key
from reference.validation import require_bool, require_int


class PoolExhaustedError(KVConformError):
    """More blocks were asked of the pool than it has free."""


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block. ``cache_key`` is set while it is registered in the cache."""

    block_id: int
    ref_cnt: int = 0
    cache_key: bytes | None = None
    num_cached_tokens: int = 0
    is_null: bool = False
    #: keys of partial entries registered after the primary key, in insertion order
    secondary_keys: list[bytes] = field(default_factory=list, repr=False)
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked free list with O(1) pop-front, remove, append and prepend."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def _link_before(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        prev = anchor.prev_free
        assert prev is not None
        block.prev_free, block.next_free = prev, anchor
        prev.next_free = block
        anchor.prev_free = block
        self.num_free_blocks += 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise PoolExhaustedError("no free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise PoolExhaustedError(f"cannot pop {n} blocks, {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:  # pragma: no cover - touch() removes free blocks only
            raise KVConformError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self._link_before(self._tail, block)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        first = self._head.next_free
        assert first is not None
        for block in blocks:
            self._link_before(first, block)

    def block_ids(self) -> list[int]:
        """Free block ids from the front (allocated / evicted next) to the back."""
        out = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            out.append(block.block_id)
            block = block.next_free
        return out


class BlockPool:
    """``num_blocks`` blocks (the null block included), the free queue and the cache map.

    ``hash_block_size`` is the token granularity of the request hash chains it is
    looked up with.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, hash_block_size: int) -> None:
        require_int(KVConformError, "BlockPool", "num_blocks", num_blocks, lowest=2)
        require_bool(KVConformError, "BlockPool", "enable_caching", enable_caching)
        require_int(KVConformError, "BlockPool", "hash_block_size", hash_block_size, lowest=1)
        self.num_blocks = num_blocks
        self.hash_block_size = hash_block_size
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # key -> {block_id: block}, insertion ordered (several blocks may share a key)
        self.cached: dict[bytes, dict[int, KVCacheBlock]] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:  # pragma: no cover - a metric, not an engine call
        """``1 - free / (num_blocks - 1)``: the null block does not count."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the front, evicting any cache key they still carry."""
        if n > self.get_num_free_blocks():
            raise PoolExhaustedError(
                f"cannot get {n} free blocks from the pool ({self.get_num_free_blocks()} free)"
            )
        blocks = self.free_block_queue.popleft_n(n)
        for block in blocks:
            if self.enable_caching:
                self._evict(block)
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> list[bytes]:
        """Remove every key of ``block`` (primary first, then the secondary ones in
        the order they were added) from the map; returns them."""
        keys = [] if block.cache_key is None else [block.cache_key]
        keys += block.secondary_keys
        for key in keys:
            entries = self.cached.get(key)
            if entries is not None:  # pragma: no branch - a block's key is always in the map
                entries.pop(block.block_id, None)
                if not entries:
                    del self.cached[key]
        block.cache_key = None
        block.num_cached_tokens = 0
        block.secondary_keys = []
        return keys

    def _insert(self, key: bytes, block: KVCacheBlock, num_tokens: int) -> None:
        """Index ``block`` under ``key``: its primary key when it has none (``num_tokens``
        recorded), else a secondary key; nothing when it already holds ``key``."""
        entries = self.cached.setdefault(key, {})
        if block.cache_key == key or block.block_id in entries:
            return
        if block.cache_key is None:
            block.cache_key = key
            block.num_cached_tokens = num_tokens
        else:
            block.secondary_keys.append(key)
        entries[block.block_id] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Count one more reference; a free (cached) block leaves the free queue."""
        for block in blocks:
            if block.is_null:  # pragma: no cover - hits adopt no null blocks past the skipped
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; at 0: unhashed to the front, hashed to the back."""
        front: list[KVCacheBlock] = []
        back: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt < 0:  # pragma: no cover - a bug of the reference itself
                raise KVConformError(f"block {block.block_id} freed more often than allocated")
            if block.ref_cnt == 0:
                (back if block.cache_key is not None else front).append(block)
        self.free_block_queue.prepend_n(front)
        self.free_block_queue.append_n(back)

    def cache_full_block(
        self, block: KVCacheBlock, block_hash: bytes, group_id: int, num_tokens: int
    ) -> None:
        """Register the full ``block`` (the prefix of ``num_tokens`` tokens ending at its
        end) under ``block_hash``. Null blocks are never cached. A block that carries
        the keys of a partial entry (a shorter prefix ending inside it) is promoted:
        those keys leave the map first. Example: ``b`` keyed ``h12`` (12 tokens) cached
        in full at 16 -> only ``h16`` finds it."""
        if block.is_null:
            return
        if block.cache_key is not None:
            if block.num_cached_tokens >= num_tokens:  # pragma: no cover - see below
                # a full block is registered once, after at most a partial entry
                raise KVConformError(
                    f"block {block.block_id} is cached in full again ({num_tokens} tokens; "
                    f"its key covers {block.num_cached_tokens})"
                )
            self._evict(block)
        self._insert(cache_key(block_hash, group_id), block, num_tokens)

    def cache_partial_block(
        self,
        block: KVCacheBlock,
        block_hash: bytes,
        group_id: int,
        num_tokens: int,
        replace_existing: bool = False,
    ) -> bytes | None:
        """A partial entry: the prefix of ``num_tokens`` tokens (a multiple of the hash
        block size) ends inside ``block``, which a lookup of that prefix may hit (a
        sub-block hit, or the partial tail of a prompt). Returns the key, or None for
        the null block.

        ``replace_existing``: the block's content was replaced, every key it had leaves
        the map first. Otherwise a block whose primary key is a shorter prefix loses its
        keys (the new one supersedes them); a block whose primary key is at least as
        long keeps it and gets ``block_hash`` as a secondary key. Example (H 4):
        ``b`` keyed ``h16`` (16 tokens), ``cache_partial_block(b, h12, 0, 12)`` -> ``b``
        found by both ``h16`` and ``h12``, its primary key still ``h16``.
        """
        if block.is_null:  # pragma: no cover - callers pass the table's real blocks
            return None
        key = cache_key(block_hash, group_id)
        already = block.cache_key == key or block.block_id in self.cached.get(key, {})
        shorter = block.cache_key is not None and block.num_cached_tokens < num_tokens
        if replace_existing or (shorter and not already):
            self._evict(block)
        self._insert(key, block, num_tokens)
        return key

    def move_keys(self, source: KVCacheBlock, target: KVCacheBlock) -> None:
        """Every key of ``source`` now finds ``target`` instead (``target`` has none):
        the first (``source``'s primary key) becomes ``target``'s primary key with
        ``source``'s prefix length, the others its secondary keys. The copy-on-write of a
        request that keeps writing ``source`` (:mod:`reference.managers.mamba`)."""
        num_tokens = source.num_cached_tokens
        for key in self._evict(source):
            self._insert(key, target, num_tokens)

    def get_cached_block(
        self, block_hash: bytes, group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """The earliest cached block of ``block_hash`` in each group, or None if any misses."""
        found = []
        for gid in group_ids:
            entries = self.cached.get(cache_key(block_hash, gid))
            if not entries:
                return None
            found.append(next(iter(entries.values())))
        return found

    def lookup(self, group_ids: Sequence[int]) -> Callable[[bytes], list[KVCacheBlock] | None]:
        """:meth:`get_cached_block` bound to ``group_ids`` (a hit scan's ``lookup``)."""
        return lambda block_hash: self.get_cached_block(block_hash, group_ids)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cache keys of these blocks; ref counts and the free queue stay (a
        Mamba checkpoint block whose state no key promises,
        :mod:`reference.managers.mamba_checkpoints`)."""
        for bid in block_ids:
            self._evict(self.blocks[bid])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached key; only allowed when no request holds a block."""
        if self.num_blocks - self.get_num_free_blocks() != 1:
            return False
        self.cached.clear()
        for block in self.blocks:
            block.cache_key = None
            block.num_cached_tokens = 0
            block.secondary_keys = []
        return True

    def ref_counts(self) -> dict[int, int]:
        return {b.block_id: b.ref_cnt for b in self.blocks[1:]}
