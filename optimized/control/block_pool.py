"""The block pool in arrays: ref counts, an index-linked free queue, the cache map.

Implements the rules of :mod:`reference.block_pool` (vLLM 0.33 order) on block ids:

* block 0 is the null block, never free, never cached;
* ``get_new_blocks`` pops from the front and drops any key the block still carries;
* ``free_blocks`` decrements; blocks reaching 0 go, in the given order, unhashed to the
  **front** (one chain before the old front) and hashed to the **back**;
* ``free_runs`` is successive ``free_blocks`` calls over runs laid end to end (a request's
  groups, several requests' groups) in one pass, with the same counts and queue: a block
  shared by several runs moves at its last occurrence, later runs' unhashed blocks go
  before earlier runs';
* ``touch`` takes a cached free block out of the queue and counts a reference;
* several blocks may share a key; a lookup returns the earliest registered one.

The free queue is a doubly linked list over ``prev_free`` / ``next_free`` intp arrays
with two sentinels (ids ``num_blocks`` = head, ``num_blocks + 1`` = tail); ``-1`` marks a
block that is not in the queue. Pop, remove, append and prepend are O(1) per block and
chains are linked with vectorised writes. Example: queue ``[1, 2, 3]``; ``free([5, 4])``
(unhashed) -> ``[5, 4, 1, 2, 3]``; ``popleft_n(2)`` -> ``[5, 4]``, queue ``[1, 2, 3]``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate

import numpy as np

from reference.block_pool import PoolExhaustedError
from reference.errors import KVConformError

NULL_BLOCK_ID = 0
NOT_QUEUED = -1
#: ``free_blocks`` of at most this many blocks takes the scalar path (numpy's per-call
#: overhead is larger than the work).
SMALL_FREE = 8


class RunEnds:
    """Runs of the given ``lengths`` laid end to end (one request's groups, or a few
    requests' groups in order). Called with positions, gives the run of each (a list for
    up to :data:`SMALL_REORDER` positions: a bisection each, no numpy call); its
    :meth:`last_first` lays out a few blocks run by run, last run first. Example:
    lengths ``[2, 0, 3]`` -> positions ``[0, 1, 2, 4]`` are in runs ``[0, 0, 2, 2]``."""

    __slots__ = ("lengths",)

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = lengths

    def __call__(self, positions: np.ndarray) -> np.ndarray | list[int]:
        ends = list(accumulate(self.lengths))
        if positions.size <= SMALL_REORDER:
            return [bisect_right(ends, p) for p in positions.tolist()]
        return np.searchsorted(ends, positions, side="right")

    def last_first(self, positions: list[int], blocks: list[int]) -> list[int]:
        """:func:`later_runs_first` of ``blocks`` at ``positions`` (ascending) in one
        walk. Example: lengths ``[2, 3]``, positions ``[0, 1, 3]``, blocks ``[7, 8, 9]``
        -> ``[9, 7, 8]``."""
        ends = accumulate(self.lengths)
        end = next(ends)
        pieces: list[list[int]] = []
        piece: list[int] = []
        for p, b in zip(positions, blocks):
            if p >= end:
                if piece:
                    pieces.append(piece)
                    piece = []
                end = next(e for e in ends if e > p)
            piece.append(b)
        pieces.append(piece)
        if len(pieces) == 1:
            return piece
        out: list[int] = []
        for piece in reversed(pieces):
            out += piece
        return out


#: :func:`later_runs_first` reorders at most this many blocks in Python (fewer calls).
SMALL_REORDER = 32


def later_runs_first(blocks: np.ndarray, runs: np.ndarray | list[int]) -> np.ndarray | list[int]:
    """``blocks`` (their ``runs`` non-decreasing) reordered run by run, the last run first,
    each run keeping its order: the front chain of successive frees, each prepending its
    own. O(len), no sort; up to :data:`SMALL_REORDER` blocks in Python (a list back).
    Example: blocks ``[1, 2, 3, 4]``, runs ``[0, 0, 1, 3]`` -> ``[4, 3, 1, 2]``."""
    k = blocks.size
    if k < 2 or runs[0] == runs[-1]:
        return blocks
    if k <= SMALL_REORDER:
        ids, of = blocks.tolist(), runs if isinstance(runs, list) else runs.tolist()
        cuts = [0, *(j for j in range(1, k) if of[j] != of[j - 1]), k]
        out: list[int] = []
        for j in range(len(cuts) - 1, 0, -1):
            out += ids[cuts[j - 1] : cuts[j]]
        return out
    starts = np.flatnonzero(np.concatenate(([True], runs[1:] != runs[:-1])))
    lengths = np.diff(starts, append=k)
    starts, lengths = starts[::-1], lengths[::-1]
    placed = np.cumsum(lengths) - lengths  # where each run lands in the output
    return blocks[np.arange(k) + np.repeat(starts - placed, lengths)]


class FreeBlockQueue:
    """The free list of :class:`reference.block_pool.FreeBlockQueue`, in index arrays."""

    def __init__(self, num_blocks: int) -> None:
        self.head = num_blocks
        self.tail = num_blocks + 1
        # intp links: a chain of intp ids (every bulk path's) is written with no conversion
        self.prev_free = np.full(num_blocks + 2, NOT_QUEUED, dtype=np.intp)
        self.next_free = np.full(num_blocks + 2, NOT_QUEUED, dtype=np.intp)
        self.next_free[self.head] = self.tail
        self.prev_free[self.tail] = self.head
        self.num_free_blocks = 0
        self.append_n(np.arange(num_blocks, dtype=np.int64))

    def _link_chain(self, prev: int, nxt: int, chain: np.ndarray | list[int]) -> None:
        """Insert ``chain`` (in order) between the linked nodes ``prev`` and ``nxt``; a
        list (a few blocks) is linked block by block, an array with vectorised writes."""
        n = len(chain)
        if n == 0:
            return
        if n <= SMALL_FREE or isinstance(chain, list):
            prv, nxt_arr = self.prev_free, self.next_free
            for b in chain if isinstance(chain, list) else chain.tolist():
                prv[b] = prev
                nxt_arr[prev] = b
                prev = b
            nxt_arr[prev] = nxt
            prv[nxt] = prev
            self.num_free_blocks += n
            return
        prv, nxt_arr = self.prev_free, self.next_free
        first, last = chain.item(0), chain.item(n - 1)
        prv[first] = prev
        prv[chain[1:]] = chain[:-1]
        nxt_arr[chain[:-1]] = chain[1:]
        nxt_arr[last] = nxt
        nxt_arr[prev] = first
        prv[nxt] = last
        self.num_free_blocks += n

    def link_one(self, block_id: int, at_back: bool) -> None:
        """Link one block at the back (``append_n``) or at the front (``prepend_n``)."""
        prv, nxt = self.prev_free, self.next_free
        if at_back:
            before, after = prv.item(self.tail), self.tail
        else:
            before, after = self.head, nxt.item(self.head)
        prv[block_id] = before
        nxt[block_id] = after
        nxt[before] = block_id
        prv[after] = block_id
        self.num_free_blocks += 1

    def append_n(self, blocks: np.ndarray | list[int]) -> None:
        """Link ``blocks`` at the back, in order (hashed blocks: LRU)."""
        self._link_chain(int(self.prev_free[self.tail]), self.tail, blocks)

    def prepend_n(self, blocks: np.ndarray | list[int]) -> None:
        """Link ``blocks`` at the front, keeping their order (reused first)."""
        self._link_chain(self.head, int(self.next_free[self.head]), blocks)

    def remove(self, block_id: int) -> None:
        prev = int(self.prev_free[block_id])
        nxt = int(self.next_free[block_id])
        if prev == NOT_QUEUED or nxt == NOT_QUEUED:
            raise KVConformError(f"block {block_id} is not in the free queue")
        self.next_free[prev] = nxt
        self.prev_free[nxt] = prev
        self.prev_free[block_id] = self.next_free[block_id] = NOT_QUEUED
        self.num_free_blocks -= 1

    def popleft_n(self, n: int) -> list[int]:
        """Unlink the first ``n`` blocks (one relink of the head).

        The walk takes runs of consecutive ids (ascending, as the pool starts, or
        descending, as a request's blocks come back tail first) with one array test per
        run; once a run is short it walks block by block. Example: queue ``[4, 5, 6, 9]``,
        ``popleft_n(3)`` -> one run ``4..6``, queue ``[9]``.
        """
        if n > self.num_free_blocks:
            raise PoolExhaustedError(f"cannot pop {n} blocks, {self.num_free_blocks} are free")
        if n == 0:
            return []
        nxt = self.next_free
        item = nxt.item  # a Python int per read, faster than int(arr[i])
        block = item(self.head)
        if n <= SMALL_FREE:
            out = [0] * n
            for i in range(n):
                out[i] = block
                block = item(block)
        else:
            out, block = self._walk_runs(block, n)
        nxt[self.head] = block
        self.prev_free[block] = self.head
        if n <= SMALL_FREE:
            for b in out:
                self.prev_free[b] = nxt[b] = NOT_QUEUED
        else:
            popped = np.asarray(out, dtype=np.int64)
            self.prev_free[popped] = NOT_QUEUED
            nxt[popped] = NOT_QUEUED
        self.num_free_blocks -= n
        return out

    def _walk_runs(self, block: int, n: int) -> tuple[list[int], int]:
        """The ``n`` queued blocks from ``block`` on, and the block after them."""
        nxt = self.next_free
        item = nxt.item
        out: list[int] = []
        left = n
        while left > SMALL_FREE:
            step = item(block) - block
            if step not in (1, -1):
                break
            # the longest run of ids block, block + step, ... (at most ``left``) linked in order
            end = block + step * left
            end = max(min(end, self.head), -1)
            run = np.arange(block, end, step, dtype=np.int64)
            broken = np.flatnonzero(nxt[run[:-1]] != run[1:])
            length = int(broken[0]) + 1 if broken.size else run.size
            out.extend(run[:length].tolist())
            left -= length
            block = item(int(run[length - 1]))
            if length <= SMALL_FREE:
                break
        for _ in range(left):
            out.append(block)
            block = item(block)
        return out, block

    def popleft(self) -> int:
        if self.num_free_blocks == 0:
            raise PoolExhaustedError("no free blocks available")
        return self.popleft_n(1)[0]

    def block_ids(self) -> list[int]:
        """Free block ids from the front (allocated / evicted next) to the back."""
        out = []
        nxt = self.next_free.tolist()
        block = nxt[self.head]
        limit = self.head  # num_blocks: no walk may be longer
        while block != self.tail:
            if block == NOT_QUEUED or len(out) >= limit:
                raise KVConformError(
                    f"free queue is corrupt: the walk from the head reached {block} after "
                    f"{len(out)} blocks without meeting the tail"
                )
            out.append(block)
            block = nxt[block]
        return out


class BlockPool:
    """Ref counts, free queue and prefix-cache map of ``num_blocks`` blocks (null included).

    Cache map: per group, ``cached[g][hash]`` is the earliest registered block of that key,
    and ``duplicates[g][hash]`` the later ones in registration order. A block's own key is
    ``block_hash[b]`` in group ``block_group[b]`` over ``num_cached_tokens[b]`` tokens.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool, hash_block_size: int, num_groups: int = 1
    ) -> None:
        self.num_blocks = num_blocks
        self.hash_block_size = hash_block_size
        self.enable_caching = enable_caching
        self.ref_cnt = np.zeros(num_blocks, dtype=np.int32)
        self.num_cached_tokens = np.zeros(num_blocks, dtype=np.int64)
        self.block_group = np.full(num_blocks, -1, dtype=np.int32)
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_block_queue = FreeBlockQueue(num_blocks)
        self.null_block = self.free_block_queue.popleft()
        self.cached: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        self.duplicates: list[dict[bytes, list[int]]] = [{} for _ in range(num_groups)]
        #: scratch of :meth:`has_repeats` (one slot per block, allocated on first use)
        self._mark: np.ndarray | None = None

    def has_repeats(self, ids: np.ndarray) -> bool:
        """Does some block id occur twice in ``ids``? A mark array over the pool instead of a
        sort: position ``k`` is written into ``mark[ids[k]]``; an id occurring twice keeps
        only one of its positions, so some occurrence reads another position back (whichever
        write numpy keeps). O(len(ids)). Example: ``[4, 7, 4]`` -> True; ``[4, 7]`` -> False.
        """
        if ids.size < 2:
            return False
        if self._mark is None:
            self._mark = np.zeros(self.num_blocks, dtype=np.int32)
        position = np.arange(ids.size, dtype=np.int32)
        self._mark[ids] = position
        return bool((self._mark[ids] != position).any())

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the front, evicting keys (:meth:`reference...get_new_blocks`)."""
        if n > self.get_num_free_blocks():
            raise PoolExhaustedError(
                f"cannot get {n} free blocks from the pool ({self.get_num_free_blocks()} free)"
            )
        blocks = self.free_block_queue.popleft_n(n)
        if n == 1:
            b = blocks[0]
            if self.enable_caching and self.block_group[b] >= 0:
                self._evict(b)
            self.ref_cnt[b] = 1
            return blocks
        ids = np.asarray(blocks, dtype=np.int64)
        if self.enable_caching:
            hashed = ids[self.block_group[ids] >= 0]
            if hashed.size:
                self._evict_many(hashed)
        self.ref_cnt[ids] = 1
        return blocks

    def _evict_many(self, hashed: np.ndarray) -> None:
        """:meth:`_evict` of several hashed blocks: map updates per block, arrays at once.

        In a group with no duplicate keys every registered block is its key's head
        (``cached[g][key] == b``), so its eviction is one ``del``; other groups take
        :meth:`_evict`'s general rule (promote the next duplicate).
        """
        block_hash = self.block_hash
        cached_by_group = self.cached
        duplicates = self.duplicates
        for b, g in zip(hashed.tolist(), self.block_group[hashed].tolist()):
            if duplicates[g]:
                self._evict_key(b, g)
            else:
                del cached_by_group[g][block_hash[b]]
            block_hash[b] = None
        self.block_group[hashed] = -1
        self.num_cached_tokens[hashed] = 0

    def _evict_key(self, block_id: int, g: int) -> None:
        """Take ``block_id`` off its key in group ``g``: the head is replaced by the next
        duplicate in registration order (:meth:`reference.block_pool.BlockPool._evict`)."""
        key = self.block_hash[block_id]
        cached, dupes = self.cached[g], self.duplicates[g]
        if cached.get(key) == block_id:
            later = dupes.get(key)
            if later:
                cached[key] = later.pop(0)
                if not later:
                    del dupes[key]
            else:
                del cached[key]
        else:
            later = dupes.get(key)
            if later is not None and block_id in later:
                later.remove(block_id)
                if not later:
                    del dupes[key]

    def _evict(self, block_id: int) -> bool:
        if self.block_hash[block_id] is None:
            return False
        self._evict_key(block_id, int(self.block_group[block_id]))
        self.block_hash[block_id] = None
        self.block_group[block_id] = -1
        self.num_cached_tokens[block_id] = 0
        return True

    def touch(self, blocks: Iterable[int]) -> None:
        """One more reference each; a free cached block leaves the queue (null skipped)."""
        ref = self.ref_cnt
        for b in blocks:
            if b == NULL_BLOCK_ID:
                continue
            if ref[b] == 0:
                self.free_block_queue.remove(b)
            ref[b] += 1

    def free_blocks(self, ordered_blocks: Sequence[int]) -> None:
        """Drop one reference each (distinct ids); at 0: unhashed to the front, hashed back.

        Vectorised form of :meth:`reference.block_pool.BlockPool.free_blocks`.
        """
        if len(ordered_blocks) <= SMALL_FREE:
            self._free_few(ordered_blocks)
            return
        ids = np.asarray(ordered_blocks, dtype=np.int64)
        ids = ids[ids != NULL_BLOCK_ID]
        if ids.size == 0:
            return
        after = self._drop_references(ids)
        zero = ids[after == 0]
        if zero.size == 0:
            return
        hashed = self.block_group[zero] >= 0
        self.free_block_queue.prepend_n(zero[~hashed])
        self.free_block_queue.append_n(zero[hashed])

    def _drop_references(self, ids: np.ndarray) -> np.ndarray:
        """One reference less for each of ``ids`` (distinct, non-null); their counts after.
        A count below 0 raises (a block freed more often than allocated)."""
        self.ref_cnt[ids] -= 1
        after = self.ref_cnt[ids]
        if (after < 0).any():
            bad = int(ids[after < 0][0])
            raise KVConformError(f"block {bad} freed more often than allocated")
        return after

    def free_block(self, block_id: int) -> None:
        """:meth:`free_blocks` of one block (a window dropping one block in a decode step):
        at ref count 0 it goes to the back when hashed, to the front otherwise."""
        if block_id == NULL_BLOCK_ID:
            return
        count = self.ref_cnt.item(block_id) - 1
        if count < 0:
            raise KVConformError(f"block {block_id} freed more often than allocated")
        self.ref_cnt[block_id] = count
        if count == 0:
            self.free_block_queue.link_one(block_id, at_back=self.block_group[block_id] >= 0)

    def free_block_lists(self, lists: Sequence[np.ndarray]) -> None:
        """``free_blocks(lists[0])``, ``free_blocks(lists[1])``, ... in one pass (a request's
        groups on ``free``: :meth:`reference.coordinator.KVCacheCoordinator.free`). Ids are
        distinct across lists (a block belongs to one group); nulls are skipped. Same queue
        as the successive calls: hashed blocks reaching 0 go to the back in list order;
        unhashed ones go to the front list by list, so a later list's blocks end up before
        an earlier list's. Example: lists ``[a1, a2]``, ``[b1]``, all unhashed -> queue
        ``[b1, a1, a2, ...]``."""
        lengths = [len(ids) for ids in lists]
        if sum(lengths) <= SMALL_FREE or len(lists) == 1:
            for ids in lists:
                self.free_blocks(ids)
            return
        self.free_runs(np.concatenate(lists, dtype=np.intp), RunEnds(lengths), repeats=False)

    def free_runs(
        self,
        ids: np.ndarray,
        runs_of: Callable[[np.ndarray], np.ndarray | list[int]],
        repeats: bool = True,
    ) -> None:
        """Successive :meth:`free_blocks` calls over consecutive runs laid end to end in
        ``ids`` (intp; nulls skipped), in one pass. ``runs_of(positions)`` gives the run of
        each position of ``ids`` asked for (non-decreasing; asked only for the blocks going
        to the front). With ``repeats`` a block may appear in several runs (a prefix block
        shared by requests freed together, :meth:`KVCacheCoordinator.free_many`), never
        twice in one; without, ids are distinct (one request's groups).

        Same counts and queue as the successive calls: each occurrence drops one
        reference; a block moves at its last occurrence when its count reaches 0 there
        (an earlier occurrence cannot reach 0: the later one would go below 0), hashed to
        the back in order, unhashed to the front with a later run's blocks before an
        earlier run's (:func:`later_runs_first`). Each occurrence in a table holds one
        reference, so only blocks held more than once before the call can repeat: their
        occurrences are counted with one ``unique`` over them alone (usually none: the
        common case is one gather, one subtraction, one scatter). Example: runs
        ``[a, s]``, ``[s, b]`` with ``s`` held twice, all unhashed -> ``s`` moves with the
        second run: queue ``[s, b, a, ...]``.
        """
        pos = None
        if np.count_nonzero(ids) != ids.size:  # nulls (window gaps, padding) are skipped
            pos = np.flatnonzero(ids)
            ids = ids.take(pos)
        if ids.size == 0:
            return
        ref = self.ref_cnt
        after = ref.take(ids)
        after -= 1  # (in place: the gather is a copy)
        moving = None  # None: every block reaches 0 (the common case: one test)
        if np.count_nonzero(after):  # some block stays held (or went below 0)
            moving = self._count_repeats(ids, after) if repeats else after == 0
        ref[ids] = after  # (a repeated id writes the same count each time)
        if moving is not None and np.minimum.reduce(after) < 0:
            raise KVConformError(f"block {int(ids[after < 0][0])} freed more often than allocated")
        num_moving = ids.size if moving is None else np.count_nonzero(moving)
        if num_moving == 0:
            return
        to_front = self.block_group.take(ids) < 0
        if moving is not None:
            to_front &= moving
        front = np.flatnonzero(to_front)
        queue = self.free_block_queue
        if front.size:
            at = front if pos is None else pos.take(front)
            if front.size <= SMALL_REORDER and isinstance(runs_of, RunEnds):
                queue.prepend_n(runs_of.last_first(at.tolist(), ids.take(front).tolist()))
            else:
                queue.prepend_n(later_runs_first(ids.take(front), runs_of(at)))
        if front.size == num_moving:
            return
        if moving is None:
            queue.append_n(ids if front.size == 0 else ids[~to_front])
        else:
            moving ^= to_front  # the moving blocks that are hashed
            queue.append_n(ids[moving])

    def _count_repeats(self, ids: np.ndarray, after: np.ndarray) -> np.ndarray:
        """For :meth:`free_runs`: ``after`` holds each count less one; fix the counts of
        the ids that repeat (all held more than once before: ``after > 0``) to their count
        less their number of occurrences, and return which positions move (reach 0 at
        their last occurrence). Example: ids ``[5, 7, 5]`` with counts ``5: 2, 7: 1`` ->
        ``after [0, 0, 0]``, moving ``[False, True, True]``."""
        moving = after == 0  # (False at every held position: only a last occurrence may move)
        at = np.flatnonzero(after > 0)
        if at.size < 2:
            return moving
        _, last_from_end, inverse, counts = np.unique(
            ids[at][::-1], return_index=True, return_inverse=True, return_counts=True
        )
        if counts.max() == 1:
            return moving
        per_position = counts[inverse[::-1]]
        after[at] += 1 - per_position
        # a repeated block reaching 0 moves at its last occurrence only
        last = at[at.size - 1 - last_from_end]
        moving[last[after[last] == 0]] = True
        return moving

    def _free_few(self, ordered_blocks: Sequence[int]) -> None:
        """:meth:`free_blocks` for a few blocks (a decode step's): scalar steps, same order."""
        ref = self.ref_cnt
        group = self.block_group
        front: list[int] = []
        back: list[int] = []
        for b in ordered_blocks:
            b = int(b)
            if b == NULL_BLOCK_ID:
                continue
            count = int(ref[b]) - 1
            if count < 0:
                raise KVConformError(f"block {b} freed more often than allocated")
            ref[b] = count
            if count == 0:
                (back if group[b] >= 0 else front).append(b)
        queue = self.free_block_queue
        if front:
            queue.prepend_n(np.asarray(front, dtype=np.int64))
        if back:
            queue.append_n(np.asarray(back, dtype=np.int64))

    def cache_block(self, block_id: int, block_hash: bytes, group_id: int, num_tokens: int) -> None:
        """Register a block under ``block_hash`` (:meth:`reference...cache_block`: a shorter
        key is promoted, a key covering ``num_tokens`` or more is kept)."""
        if block_id == NULL_BLOCK_ID:
            return
        if self.block_hash[block_id] is not None:
            if self.num_cached_tokens[block_id] >= num_tokens:
                return
            self._evict(block_id)
        self.block_hash[block_id] = block_hash
        self.block_group[block_id] = group_id
        self.num_cached_tokens[block_id] = num_tokens
        cached = self.cached[group_id]
        if block_hash in cached:
            self.duplicates[group_id].setdefault(block_hash, []).append(block_id)
        else:
            cached[block_hash] = block_id

    def cache_full_blocks(
        self,
        blocks: Sequence[int],
        hashes: Sequence[bytes],
        group_id: int,
        first_index: int,
        block_size: int,
        mask: Sequence[bool] | None = None,
    ) -> None:
        """:meth:`cache_block` of ``blocks[k]`` under ``hashes[k]`` for the prefix of
        ``(first_index + k + 1) * block_size`` tokens, for every ``k`` (nulls and masked
        blocks skipped), with the array writes done at once. ``blocks`` may be a list or an
        int array (a table slice: no conversion on the bulk path)."""
        if len(blocks) == 1:  # a decode step completing one block: the scalar rule
            if mask is None or mask[0]:
                self.cache_block(
                    int(blocks[0]), hashes[0], group_id, (first_index + 1) * block_size
                )
            return
        block_hash = self.block_hash
        nct = self.num_cached_tokens
        cached = self.cached[group_id]
        ids = np.asarray(blocks, dtype=np.int64)
        blocks = ids.tolist()
        if mask is None and ids.size and ids.all() and (self.block_group[ids] < 0).all():
            keys = hashes if isinstance(hashes, list) else list(hashes)
            new = dict(zip(keys, blocks))
            if len(new) == len(keys) and cached.keys().isdisjoint(new):
                # fresh blocks, new distinct keys: one dict update, array writes at once
                cached.update(new)
                for b, h in zip(blocks, keys):
                    block_hash[b] = h
                self.block_group[ids] = group_id
                nct[ids] = np.arange(
                    (first_index + 1) * block_size,
                    (first_index + len(blocks) + 1) * block_size,
                    block_size,
                )
                return
        fresh: list[int] = []
        fresh_tokens: list[int] = []
        for k, b in enumerate(blocks):
            if b == NULL_BLOCK_ID or (mask is not None and not mask[k]):
                continue
            tokens = (first_index + k + 1) * block_size
            if block_hash[b] is not None:
                if nct[b] >= tokens:
                    continue
                self._evict(b)
            h = hashes[k]
            block_hash[b] = h
            fresh.append(b)
            fresh_tokens.append(tokens)
            if h in cached:
                self.duplicates[group_id].setdefault(h, []).append(b)
            else:
                cached[h] = b
        if fresh:
            ids = np.asarray(fresh, dtype=np.int64)
            self.block_group[ids] = group_id
            nct[ids] = fresh_tokens

    def get_cached_block(self, block_hash: bytes, group_ids: Sequence[int]) -> list[int] | None:
        """The earliest cached block of ``block_hash`` in each group, or None if any misses."""
        found = []
        for g in group_ids:
            b = self.cached[g].get(block_hash)
            if b is None:
                return None
            found.append(b)
        return found

    def lookup(self, group_ids: Sequence[int]) -> Callable[[bytes], list[int] | None]:
        """:meth:`get_cached_block` bound to ``group_ids`` (a scan's ``lookup``); one
        group reads its index directly. Example: ``pool.lookup([1])(h)`` is ``[b]`` when
        ``b`` is the earliest block cached under ``h`` in group 1, else None."""
        if len(group_ids) != 1:
            return lambda block_hash: self.get_cached_block(block_hash, group_ids)
        get = self.cached[group_ids[0]].get

        def one(block_hash: bytes) -> list[int] | None:
            block = get(block_hash)
            return None if block is None else [block]

        return one

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            self._evict(b)

    def reset_prefix_cache(self) -> bool:
        """Forget every key; only when no request holds a block."""
        if self.num_blocks - self.get_num_free_blocks() != 1:
            return False
        for g in range(len(self.cached)):
            self.cached[g].clear()
            self.duplicates[g].clear()
        self.block_hash = [None] * self.num_blocks
        self.block_group[:] = -1
        self.num_cached_tokens[:] = 0
        return True

    def ref_counts(self) -> dict[int, int]:
        """Ref count of every non-null block."""
        return dict(enumerate(self.ref_cnt.tolist()[1:], start=1))

    def cached_block_entries(self) -> list[tuple[int, int, int]]:
        """``(block_id, group_id, num_tokens)`` of every registered block."""
        out = []
        for b, key in enumerate(self.block_hash):
            if key is not None:
                out.append((b, int(self.block_group[b]), int(self.num_cached_tokens[b])))
        return out
