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
* ``reset_prefix_cache`` succeeds only when no request holds a block.
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

    def _evict(self, block: KVCacheBlock) -> bool:
        key = block.cache_key
        if key is None:
            return False
        entries = self.cached.get(key)
        if entries is not None:  # pragma: no branch - a block's key is always in the map
            entries.pop(block.block_id, None)
            if not entries:
                del self.cached[key]
        block.cache_key = None
        block.num_cached_tokens = 0
        return True

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

    def cache_block(
        self, block: KVCacheBlock, block_hash: bytes, group_id: int, num_tokens: int
    ) -> None:
        """Register ``block`` (prefix of ``num_tokens`` tokens) under ``block_hash``.

        Null blocks are never cached. A block that already carries a key for a
        shorter prefix (a partial-tail entry) is promoted: the old key is dropped.
        A block whose key covers at least ``num_tokens`` keeps it.
        """
        if block.is_null:
            return
        if block.cache_key is not None:
            # a partial-tail key only lands on a block already registered in full (the
            # request's hashes cover every cacheable token), so no promotion happens
            if block.num_cached_tokens >= num_tokens:  # pragma: no branch - see above
                return
            self._evict(block)  # pragma: no cover - see above
        key = cache_key(block_hash, group_id)
        block.cache_key = key
        block.num_cached_tokens = num_tokens
        self.cached.setdefault(key, {})[block.block_id] = block

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
        return True

    def ref_counts(self) -> dict[int, int]:
        return {b.block_id: b.ref_cnt for b in self.blocks[1:]}
