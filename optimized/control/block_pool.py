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
* several blocks may share a key; a lookup returns the earliest registered one (the key
  index, :mod:`optimized.control.key_index`: arrays and compiled loops, or dicts).

The free queue is a doubly linked list over ``prev_free`` / ``next_free`` intp arrays
with two sentinels (ids ``num_blocks`` = head, ``num_blocks + 1`` = tail); ``-1`` marks a
block that is not in the queue. Pop, remove, append and prepend are O(1) per block and
chains are linked with vectorised writes. Example: queue ``[1, 2, 3]``; ``free([5, 4])``
(unhashed) -> ``[5, 4, 1, 2, 3]``; ``popleft_n(2)`` -> ``[5, 4]``, queue ``[1, 2, 3]``.

Bulk forms for admission and prefill (each gives what the block-by-block rule gives):
``popleft_array`` / ``get_new_block_array`` pop a request's blocks for every group at
once (runs of consecutive ids by one array test, the rest walked in C) and evict the
popped blocks' keys in one call; ``cache_full_blocks`` registers fresh blocks in one call
of the key index; ``cached_prefix`` and ``cached_columns`` run a hit's lookups in one
call per group.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate, compress, repeat

import numpy as np

from optimized.control.compiled_pool import compiled_pop_front
from optimized.control.key_index import ArrayKeyIndex, DictKeyIndex, make_key_index
from reference.block_pool import PoolExhaustedError
from reference.errors import KVConformError

NULL_BLOCK_ID = 0
NOT_QUEUED = -1
#: ``free_blocks`` of at most this many blocks takes the scalar path (numpy's per-call
#: overhead is larger than the work).
SMALL_FREE = 8
#: :meth:`FreeBlockQueue.popleft_array` walks up to this many blocks link by link (in C,
#: about 50 ns a block) without testing for a run of consecutive ids first: the test
#: costs some numpy calls, about as much as walking this many blocks, and an admission
#: after churn rarely finds a long run (measured on the bench's prefix-heavy trace).
MIN_RUN_TEST = 48


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

    def last_first(self, positions: np.ndarray, blocks: np.ndarray) -> np.ndarray | list[int]:
        """:func:`later_runs_first` of ``blocks`` at ``positions`` (ascending): a few
        blocks in one walk in Python (a list back), more as one slice per run, cut where
        the runs end (one ``searchsorted``). Example: lengths ``[2, 3]``, positions ``[0,
        1, 3]``, blocks ``[7, 8, 9]`` -> ``[9, 7, 8]``. Every position of runs of one
        length (twin windows dropping the same span, all unhashed): the runs as rows of
        a matrix, read bottom up: lengths ``[2, 2]``, blocks ``[7, 8, 5, 6]`` -> ``[5, 6,
        7, 8]``."""
        if positions.size > SMALL_REORDER:
            lengths = self.lengths
            first = lengths[0]
            if blocks.size == first * len(lengths) and lengths.count(first) == len(lengths):
                return blocks.reshape(len(lengths), first)[::-1].reshape(-1)
            ends = list(accumulate(self.lengths[:-1]))
            cuts = [0, *np.searchsorted(positions, ends).tolist(), blocks.size]
            pieces = [blocks[cuts[j] : cuts[j + 1]] for j in range(len(cuts) - 2, -1, -1)]
            return np.concatenate(pieces)
        ends = accumulate(self.lengths)
        end = next(ends)
        pieces_: list[list[int]] = []
        piece: list[int] = []
        for p, b in zip(positions.tolist(), blocks.tolist()):
            if p >= end:
                if piece:
                    pieces_.append(piece)
                    piece = []
                end = next(e for e in ends if e > p)
            piece.append(b)
        pieces_.append(piece)
        if len(pieces_) == 1:
            return piece
        out: list[int] = []
        for piece in reversed(pieces_):
            out += piece
        return out


#: :func:`later_runs_first` reorders at most this many blocks in Python (fewer calls).
SMALL_REORDER = 32
#: ... and at most this many with one stable sort (measured: 3.7 us against 8.1 for 192
#: blocks in 128 runs; the linear layout wins from about 2000 blocks)
STABLE_SORT_REORDER = 1024


def later_runs_first(blocks: np.ndarray, runs: np.ndarray | list[int]) -> np.ndarray | list[int]:
    """``blocks`` (their ``runs`` non-decreasing) reordered run by run, the last run first,
    each run keeping its order: the front chain of successive frees, each prepending its
    own. Up to :data:`SMALL_REORDER` blocks in Python (a list back); up to
    :data:`STABLE_SORT_REORDER`, one stable sort of the runs descending (fewer numpy
    calls); more, an O(len) layout with no sort.
    Example: blocks ``[1, 2, 3, 4]``, runs ``[0, 0, 1, 3]`` -> ``[4, 3, 1, 2]``."""
    k = blocks.size
    if k < 2 or runs[0] == runs[-1]:
        return blocks
    if SMALL_REORDER < k <= STABLE_SORT_REORDER:
        return blocks[np.argsort(-np.asarray(runs), kind="stable")]
    if k <= SMALL_REORDER:
        ids, of = blocks.tolist(), runs if isinstance(runs, list) else runs.tolist()
        cuts = [0, *(j for j in range(1, k) if of[j] != of[j - 1]), k]
        out: list[int] = []
        for j in range(len(cuts) - 1, 0, -1):
            out += ids[cuts[j - 1] : cuts[j]]
        return out
    starts = np.flatnonzero(np.concatenate(([True], runs[1:] != runs[:-1])))
    lengths = np.empty_like(starts)
    lengths[:-1] = starts[1:] - starts[:-1]
    lengths[-1] = k - starts[-1]
    starts, lengths = starts[::-1], lengths[::-1]
    placed = np.cumsum(lengths) - lengths  # where each run lands in the output
    return blocks[np.arange(k) + np.repeat(starts - placed, lengths)]


class FreeBlockQueue:
    """The free list of :class:`reference.block_pool.FreeBlockQueue`, in index arrays."""

    def __init__(self, num_blocks: int, compiled: bool = True) -> None:
        #: the compiled walk of :meth:`popleft_array` (None: numba missing, or ``compiled``
        #: False: the numpy walk)
        self._pop_front = compiled_pop_front if compiled else None
        self.head = num_blocks
        self.tail = num_blocks + 1
        # intp links: a chain of intp ids (every bulk path's) is written with no conversion
        self.prev_free = np.full(num_blocks + 2, NOT_QUEUED, dtype=np.intp)
        self.next_free = np.full(num_blocks + 2, NOT_QUEUED, dtype=np.intp)
        self.next_free[self.head] = self.tail
        self.prev_free[self.tail] = self.head
        self.num_free_blocks = 0
        self.append_n(np.arange(num_blocks, dtype=np.int64))
        if self._pop_front is not None:  # numba compiles (or loads) the walk now
            self._pop_front(self.next_free, self.prev_free, self.head, 0, np.zeros(0, np.int64))

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

    def append_n(self, blocks: np.ndarray | list[int]) -> None:
        """Link ``blocks`` at the back, in order (hashed blocks: LRU)."""
        self._link_chain(int(self.prev_free[self.tail]), self.tail, blocks)

    def prepend_n(self, blocks: np.ndarray | list[int]) -> None:
        """Link ``blocks`` at the front, keeping their order (reused first)."""
        self._link_chain(self.head, int(self.next_free[self.head]), blocks)

    def prepend_append(self, front: list[int] | np.ndarray, back: np.ndarray) -> None:
        """:meth:`prepend_n` of ``front`` then :meth:`append_n` of ``back`` (both
        non-empty, distinct blocks not in the queue), every link written at once: the
        sequence ``head, *front, first, last, *back, tail`` (``first`` and ``last``: the
        old queue's ends) is linked pair by pair with one vectorised write per link array,
        then the one false pair ``(first, last)`` gets its old links back. A queue of
        fewer than two blocks (the sequence would repeat a node) takes the two calls.
        Example: queue ``[1, 2, 3]``, front ``[5, 4]``, back ``[8, 9]`` -> ``[5, 4, 1, 2,
        3, 8, 9]``."""
        prv, nxt = self.prev_free, self.next_free
        first, last = nxt.item(self.head), prv.item(self.tail)
        if first == last or first == self.tail:
            self.prepend_n(front)
            self.append_n(back)
            return
        after_first, before_last = nxt.item(first), prv.item(last)
        seq = np.concatenate(([self.head], front, [first, last], back, [self.tail]))
        before, after = seq[:-1], seq[1:]
        nxt[before] = after
        prv[after] = before
        nxt[first] = after_first
        prv[last] = before_last
        self.num_free_blocks += len(front) + back.size

    def remove(self, block_id: int) -> None:
        prev = int(self.prev_free[block_id])
        nxt = int(self.next_free[block_id])
        if prev == NOT_QUEUED or nxt == NOT_QUEUED:
            raise KVConformError(f"block {block_id} is not in the free queue")
        self.next_free[prev] = nxt
        self.prev_free[nxt] = prev
        self.prev_free[block_id] = self.next_free[block_id] = NOT_QUEUED
        self.num_free_blocks -= 1

    def remove_each(self, blocks: Iterable[int]) -> None:
        """:meth:`remove` of each block (distinct ids), with scalar reads: unlinking
        several nodes of a doubly linked list leaves the same list in any order. Example:
        queue ``[4, 5, 6, 7]``, ``remove_each([6, 4])`` -> ``[5, 7]``."""
        prv, nxt = self.prev_free, self.next_free
        before, after = prv.item, nxt.item
        n = 0
        for b in blocks:
            p, q = before(b), after(b)
            if p == NOT_QUEUED or q == NOT_QUEUED:
                self.num_free_blocks -= n
                raise KVConformError(f"block {b} is not in the free queue")
            nxt[p] = q
            prv[q] = p
            prv[b] = nxt[b] = NOT_QUEUED
            n += 1
        self.num_free_blocks -= n

    def popleft_n(self, n: int) -> list[int]:
        """Unlink the first ``n`` blocks (one relink of the head); a few blocks are walked
        one by one, more through :meth:`popleft_array`. Example: queue ``[4, 5, 6, 9]``,
        ``popleft_n(3)`` -> ``[4, 5, 6]``, queue ``[9]``.
        """
        if n > SMALL_FREE:
            return self.popleft_array(n).tolist()
        if n > self.num_free_blocks:
            raise PoolExhaustedError(f"cannot pop {n} blocks, {self.num_free_blocks} are free")
        if n == 0:
            return []
        nxt = self.next_free
        prv = self.prev_free
        item = nxt.item  # a Python int per read, faster than int(arr[i])
        block = item(self.head)
        out = [0] * n
        for i in range(n):
            out[i] = block
            block = item(block)
        nxt[self.head] = block
        prv[block] = self.head
        for b in out:
            prv[b] = nxt[b] = NOT_QUEUED
        self.num_free_blocks -= n
        return out

    def popleft_array(self, n: int) -> np.ndarray:
        """:meth:`popleft_n` as an int64 array (the bulk form: a prefill's blocks).

        With numba the walk is compiled (:func:`optimized.control.compiled_pool.
        pop_front`). Else it takes runs of consecutive ids (ascending, as the pool
        starts, or descending, as a request's blocks come back tail first) with one array
        test per run; once a run is short it walks block by block. Example: queue
        ``[4, 5, 6, 7, ..., 20, 2]``, ``popleft_array(18)`` -> one run ``4..20`` and the
        block ``2`` walked alone, queue ``[]`` after.
        """
        if n > self.num_free_blocks:
            raise PoolExhaustedError(f"cannot pop {n} blocks, {self.num_free_blocks} are free")
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        if self._pop_front is not None:  # the walk compiled (numba)
            popped = np.empty(n, dtype=np.int64)
            self._pop_front(self.next_free, self.prev_free, self.head, n, popped)
            self.num_free_blocks -= n
            return popped
        nxt = self.next_free
        popped, block = self._walk_runs(nxt.item(self.head), n)
        nxt[self.head] = block
        self.prev_free[block] = self.head
        self.prev_free[popped] = NOT_QUEUED
        nxt[popped] = NOT_QUEUED
        self.num_free_blocks -= n
        return popped

    def _walk_runs(self, block: int, n: int) -> tuple[np.ndarray, int]:
        """The ``n`` queued blocks from ``block`` on (int64), and the block after them.
        Runs of consecutive ids are looked for only while more than :data:`MIN_RUN_TEST`
        blocks are left; the rest is walked in C. Example: ``n = 20`` (an admission's
        new blocks after a hit) -> walked, whatever the ids."""
        nxt = self.next_free
        item = nxt.item
        pieces: list[np.ndarray] = []
        left = n
        while left > MIN_RUN_TEST:
            step = item(block) - block
            if step != 1 and step != -1:
                break
            # the longest run of ids block, block + step, ... (at most ``left``) linked in order
            end = max(min(block + step * left, self.head), -1)
            run = np.arange(block, end, step, dtype=np.int64)
            broken = nxt[block : end - step : step] != run[1:]  # the links of run[:-1]
            first = int(broken.argmax())  # the first break (0 when none)
            length = first + 1 if broken.size and broken[first] else run.size
            pieces.append(run[:length] if length < run.size else run)
            left -= length
            block = item(block + step * (length - 1))
            if length <= SMALL_FREE:
                break
        if left:
            # block, next(block), next(next(block)), ...: ``left`` pops and the block after
            # them, walked in C (``accumulate`` over the links read as a column)
            step = nxt.reshape(-1, 1).item
            walk = accumulate(repeat(0, left), step, initial=block)
            walked = np.fromiter(walk, dtype=np.int64, count=left + 1)
            pieces.append(walked[:-1])
            block = int(walked[-1])
        popped = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return popped, block

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

    Cache map (``index``, :mod:`optimized.control.key_index`): per group, the earliest
    registered block of each key, and the later ones in registration order. A block
    carries a key (``index.key_of(b)``) exactly when ``block_group[b] >= 0``: in that
    group, over ``num_cached_tokens[b]`` tokens. ``compiled``: the index in arrays with
    compiled loops where numba is on, else in dicts (as the queue's walk).
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        num_groups: int = 1,
        compiled: bool = True,
    ) -> None:
        self.num_blocks = num_blocks
        self.hash_block_size = hash_block_size
        self.enable_caching = enable_caching
        self.ref_cnt = np.zeros(num_blocks, dtype=np.int32)
        self.num_cached_tokens = np.zeros(num_blocks, dtype=np.int64)
        self.block_group = np.full(num_blocks, -1, dtype=np.int32)
        self.num_groups = num_groups
        self.free_block_queue = FreeBlockQueue(num_blocks, compiled)
        self.null_block = self.free_block_queue.popleft()
        self.index: ArrayKeyIndex | DictKeyIndex = make_key_index(
            num_blocks, num_groups, self.block_group, compiled
        )
        #: are keys kept as int64 words (:class:`ArrayKeyIndex`)? Then callers holding
        #: them (a request's :class:`~optimized.control.hashing.HashChain`) pass them
        self.keys_as_words = isinstance(self.index, ArrayKeyIndex)
        #: scratch of :meth:`has_repeats` (one slot per block, allocated on first use)
        self._mark: np.ndarray | None = None
        #: a ref count of 1 for every block, as bytes (:meth:`all_held_once`)
        self._ones = np.ones(num_blocks, dtype=self.ref_cnt.dtype).tobytes()

    def all_held_once(self, ids: np.ndarray) -> bool:
        """Is every block of ``ids`` held exactly once (ref count 1)? One gather, its bytes
        compared with a prefix of :attr:`_ones` (no arithmetic pass). Then freeing them all
        takes each to 0, and no id can occur twice among them (a block held once sits in
        one table cell). Example: counts ``[0, 1, 1, 2]``, ids ``[1, 2]`` -> True; ``[1,
        3]`` -> False."""
        return self.ref_cnt.take(ids).tobytes() == self._ones[: ids.size * self.ref_cnt.itemsize]

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
        if n > SMALL_FREE:
            return self.get_new_block_array(n).tolist()
        if n > self.get_num_free_blocks():
            raise PoolExhaustedError(
                f"cannot get {n} free blocks from the pool ({self.get_num_free_blocks()} free)"
            )
        blocks = self.free_block_queue.popleft_n(n)
        # a few blocks (a decode step's): scalar steps; a hashed block's key is evicted
        ref = self.ref_cnt
        group = self.block_group if self.enable_caching else None
        for b in blocks:
            if group is not None and group.item(b) >= 0:
                self._evict(b)
            ref[b] = 1
        return blocks

    def get_new_block_array(self, n: int) -> np.ndarray:
        """:meth:`get_new_blocks` as an int64 array (the bulk form: the new blocks of every
        group of a prefill, popped at once). Example: queue ``[5, 6, 7]``, ``7`` cached ->
        ``get_new_block_array(3)`` is ``[5, 6, 7]`` and ``7``'s key is gone."""
        if n > self.get_num_free_blocks():
            raise PoolExhaustedError(
                f"cannot get {n} free blocks from the pool ({self.get_num_free_blocks()} free)"
            )
        ids = self.free_block_queue.popleft_array(n)
        if self.enable_caching:
            hashed = ids[self.block_group[ids] >= 0]
            if hashed.size:
                self._evict_many(hashed)
        self.ref_cnt[ids] = 1
        return ids

    @property
    def cached(self) -> list[dict[bytes, int]]:
        """Per group, ``{key: earliest registered block}`` (the index's view)."""
        return [self.index.head_map(g) for g in range(self.num_groups)]

    @property
    def duplicates(self) -> list[dict[bytes, list[int]]]:
        """Per group, ``{key: later blocks in registration order}`` for keys registered on
        several blocks (the index's view)."""
        return [self.index.duplicate_map(g) for g in range(self.num_groups)]

    def _evict_many(self, hashed: np.ndarray) -> None:
        """:meth:`_evict` of several hashed blocks (int64) in one call of the index. The
        result does not depend on the order of the blocks (each key's blocks stay in
        registration order, the earliest left is its head)."""
        self.index.remove_many(hashed, self.num_cached_tokens)

    def _evict_key(self, block_id: int, g: int) -> None:
        """Take ``block_id`` off its key in group ``g``: the head is replaced by the next
        duplicate in registration order (:meth:`reference.block_pool.BlockPool._evict`)."""
        self.index.remove(block_id, g)

    def _evict(self, block_id: int) -> bool:
        g = self.block_group.item(block_id)
        if g < 0:
            return False
        self.index.remove(block_id, g)
        self.block_group[block_id] = -1
        self.num_cached_tokens[block_id] = 0
        return True

    def touch(self, blocks: Iterable[int]) -> None:
        """One more reference each; a free cached block leaves the queue (null skipped).
        Many blocks (a prefix hit) take array steps: the free ones are looked up at once
        and removed from the queue one by one, then every count goes up at once (a block
        given twice counts twice, leaves the queue once). Example: ``touch([0, 5, 6])``
        with 5 free -> 5 leaves the queue, counts of 5 and 6 up by one."""
        if not isinstance(blocks, np.ndarray):
            blocks = list(blocks)
        if len(blocks) <= SMALL_FREE:
            ref = self.ref_cnt
            for b in blocks:
                if b == NULL_BLOCK_ID:
                    continue
                if ref[b] == 0:
                    self.free_block_queue.remove(b)
                ref[b] += 1
            return
        ids = np.asarray(blocks, dtype=np.intp)
        if np.count_nonzero(ids) != ids.size:
            ids = ids[ids != NULL_BLOCK_ID]
        ref = self.ref_cnt
        free = ids[ref[ids] == 0]
        if free.size:
            deque(map(self.free_block_queue.remove, dict.fromkeys(free.tolist())), maxlen=0)
        np.add.at(ref, ids, ref.dtype.type(1))

    def touch_array(
        self, ids: np.ndarray, distinct: bool, counts: np.ndarray | None = None
    ) -> None:
        """:meth:`touch` of the non-null intp array ``ids`` (an adopted hit's blocks),
        with one gather: the free ones leave the queue (once each), then each count goes
        up by one per occurrence; ``distinct`` (no id twice) writes the counts back with
        one scatter instead of ``np.add.at``. Example: ``touch_array([5, 6], True)`` with
        counts ``5: 0, 6: 2`` -> 5 leaves the queue, counts ``5: 1, 6: 3``. ``counts``: the
        ids' counts as the caller has just read them (None: read here)."""
        ref = self.ref_cnt
        if counts is None:
            counts = ref[ids]
        if np.count_nonzero(counts) != counts.size:
            free = ids[counts == 0].tolist()
            self.free_block_queue.remove_each(free if distinct else dict.fromkeys(free))
        if distinct:
            ref[ids] = counts + 1
        else:
            np.add.at(ref, ids, ref.dtype.type(1))

    def cached_prefix(
        self,
        hashes: Sequence[bytes],
        group_ids: Sequence[int],
        words: np.ndarray | None = None,
    ) -> list[list[int]]:
        """The blocks of the longest prefix of ``hashes`` cached in every group of
        ``group_ids`` (each group's earliest block of each key), one list per group: what
        a scan calling :meth:`get_cached_block` from the first hash until a miss collects.
        Each group is one call of the index over the prefix the groups before it matched.
        Example: group 0 caches ``a, b``, group 1 ``a`` only: ``cached_prefix([a, b], [0,
        1])`` -> ``[[b0a], [b1a]]``. ``words``: the hashes as words, or None."""
        return self.index.prefix(hashes, group_ids, words)

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
        """:meth:`free_blocks` of one block: :meth:`free_block_each` of ``[block_id]``."""
        self.free_block_each((block_id,))

    def free_block_each(self, blocks: Sequence[int]) -> None:
        """:meth:`free_blocks` of each block alone, in order (windows each dropping one
        block in a decode step): at ref count 0 a block goes to the back when hashed, to
        the front otherwise, so the unhashed ones end up in reverse order. Scalar steps,
        nulls skipped. Example: unhashed ``[4, 6]``, hashed ``[9]`` -> queue ``[6, 4, ...,
        9]``."""
        ref = self.ref_cnt
        group = self.block_group
        queue = self.free_block_queue
        prv, nxt = queue.prev_free, queue.next_free
        head, tail = queue.head, queue.tail
        for b in blocks:
            if b == NULL_BLOCK_ID:
                continue
            count = ref.item(b) - 1
            if count < 0:
                raise KVConformError(f"block {b} freed more often than allocated")
            ref[b] = count
            if count:
                continue
            if group.item(b) >= 0:
                before, after = prv.item(tail), tail
            else:
                before, after = head, nxt.item(head)
            prv[b] = before
            nxt[b] = after
            nxt[before] = b
            prv[after] = b
            queue.num_free_blocks += 1

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
            if isinstance(runs_of, RunEnds):
                queue.prepend_n(runs_of.last_first(at, ids.take(front)))
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
        if self.block_group.item(block_id) >= 0:
            if self.num_cached_tokens[block_id] >= num_tokens:
                return
            self._evict(block_id)
        self.block_group[block_id] = group_id
        self.num_cached_tokens[block_id] = num_tokens
        self.index.add(block_id, block_hash, group_id)

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
        int array (a table slice: no conversion on the bulk path).

        Bulk path: when the kept blocks are all unhashed, each becomes its key's head (a
        key new to the group) or its latest duplicate, in one call of the index, and the
        arrays are written at once: what the block-by-block rule gives then. A mask
        keeping a few blocks (a window's tail) takes :meth:`cache_block` per block; other
        calls take that rule block by block. Example:
        blocks ``[7, 0, 9]``, mask ``[1, 1, 0]``, first index 2, bs 4 -> only ``7`` is
        registered, over 12 tokens.
        """
        index = None  # positions kept (None: all)
        if mask is not None:
            kept = list(compress(range(len(mask)), mask))
            if len(kept) <= SMALL_FREE:  # a window's few tail blocks: the scalar rule
                self._cache_few(blocks, hashes, group_id, first_index, block_size, kept)
                return
            index = np.array(kept, dtype=np.int64)
            ids = np.asarray(blocks, dtype=np.int64)[index]
            keys = list(compress(hashes, mask))
        else:
            ids = np.asarray(blocks, dtype=np.int64)
            keys = hashes if isinstance(hashes, list) else list(hashes)
        if np.count_nonzero(ids) != ids.size:  # nulls are skipped
            real = np.flatnonzero(ids)
            index = real if index is None else index[real]
            ids = ids[real]
            keys = [keys[k] for k in real.tolist()]
        if ids.size == 0:
            return
        block_list = ids.tolist()
        if not np.count_nonzero(self.block_group[ids] >= 0):
            self.block_group[ids] = group_id  # (set before indexing: the index reads it)
            self.index.add_fresh(block_list, keys, group_id, ids)
            if index is None:
                self.num_cached_tokens[ids] = np.arange(
                    (first_index + 1) * block_size,
                    (first_index + ids.size + 1) * block_size,
                    block_size,
                )
            else:
                self.num_cached_tokens[ids] = (first_index + 1 + index) * block_size
            return
        positions = range(ids.size) if index is None else index.tolist()
        block_group = self.block_group
        nct = self.num_cached_tokens
        add = self.index.add
        for b, h, k in zip(block_list, keys, positions):
            tokens = (first_index + k + 1) * block_size
            if block_group.item(b) >= 0:
                if nct[b] >= tokens:
                    continue
                self._evict(b)
            block_group[b] = group_id
            nct[b] = tokens
            add(b, h, group_id)

    def cache_fresh_blocks(
        self,
        blocks: list[int],
        hashes: Sequence[bytes],
        group_id: int,
        first_index: int,
        block_size: int,
        positions: Sequence[int] | None = None,
        block_array: np.ndarray | None = None,
        words: np.ndarray | None = None,
    ) -> None:
        """:meth:`cache_full_blocks` of blocks just popped (unhashed, not null): ``blocks[j]``
        under ``hashes[j]`` over ``(first_index + positions[j] + 1) * block_size`` tokens
        (``positions`` None: ``j``), for every ``j``; ``block_array``: the blocks as an intp
        array, or None. Their keys are entered by :meth:`_register_fresh` (no null or key
        test); a few blocks' arrays are written one block at a time, more with one write
        per array. Example: fresh ``[7, 9]`` under ``[a, b]`` at positions ``[0, 3]``,
        first index 2, bs 4 -> ``7`` over 12 tokens, ``9`` over 24. ``words``: the hashes
        as int64 words (:class:`ArrayKeyIndex`; None: converted when needed)."""
        if len(blocks) <= SMALL_FREE:
            block_group, nct = self.block_group, self.num_cached_tokens
            at = range(len(blocks)) if positions is None else positions
            for b, k in zip(blocks, at):
                block_group[b] = group_id
                nct[b] = (first_index + k + 1) * block_size
            self.index.add_fresh(blocks, hashes, group_id, block_array, words)
            return
        ids = np.array(blocks, dtype=np.intp) if block_array is None else block_array
        self.block_group[ids] = group_id
        self.index.add_fresh(blocks, hashes, group_id, ids, words)
        if positions is None:
            self.num_cached_tokens[ids] = np.arange(
                (first_index + 1) * block_size,
                (first_index + 1 + len(blocks)) * block_size,
                block_size,
            )
        else:
            self.num_cached_tokens[ids] = (first_index + 1 + np.array(positions)) * block_size

    def _cache_few(
        self,
        blocks: Sequence[int],
        hashes: Sequence[bytes],
        group_id: int,
        first_index: int,
        block_size: int,
        kept: Sequence[int],
    ) -> None:
        """:meth:`cache_block` of ``blocks[k]`` under ``hashes[k]`` over ``(first_index + k
        + 1) * block_size`` tokens for each ``k`` of ``kept`` (a few positions, in order),
        inlined for an unhashed block (a fresh one: its key and arrays written, the key
        new to the group or its latest duplicate); a null or hashed block takes
        :meth:`cache_block` itself. Example: blocks ``[7, 8]``, kept ``[1]``, first index
        2, bs 4 -> 8 registered over 16 tokens."""
        block_group = self.block_group
        nct = self.num_cached_tokens
        add = self.index.add
        for k in kept:
            b = int(blocks[k])
            h = hashes[k]
            tokens = (first_index + k + 1) * block_size
            if b == NULL_BLOCK_ID or block_group.item(b) >= 0:
                self.cache_block(b, h, group_id, tokens)
                continue
            block_group[b] = group_id
            nct[b] = tokens
            add(b, h, group_id)

    def cached_columns(
        self,
        hashes: Sequence[bytes],
        group_ids: Sequence[int],
        words: np.ndarray | None = None,
    ) -> tuple[list[list[int | None]], list[int | None]]:
        """Every lookup of ``hashes`` at once: per group of ``group_ids``, the earliest
        block of each key or None (one call of the index per group), and per hash a
        marker that is None when some group misses it. Example: group 0 caches ``a`` on
        3, group 1 caches ``a`` on 4 and ``b`` on 5: ``cached_columns([a, b], [0, 1])`` ->
        ``([[3, None], [4, 5]], [3, None])``. ``words``: the hashes as words, or None."""
        columns = [self.index.get_many(hashes, g, words) for g in group_ids]
        if len(columns) == 1:
            return columns, columns[0]
        present = [None if None in found else found[0] for found in zip(*columns)]
        return columns, present

    def get_cached_block(self, block_hash: bytes, group_ids: Sequence[int]) -> list[int] | None:
        """The earliest cached block of ``block_hash`` in each group, or None if any misses."""
        found = []
        get = self.index.get
        for g in group_ids:
            b = get(block_hash, g)
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
        get = self.index.get
        group = group_ids[0]

        def one(block_hash: bytes) -> list[int] | None:
            block = get(block_hash, group)
            return None if block is None else [block]

        return one

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            self._evict(b)

    def reset_prefix_cache(self) -> bool:
        """Forget every key; only when no request holds a block."""
        if self.num_blocks - self.get_num_free_blocks() != 1:
            return False
        self.index.clear()
        self.block_group[:] = -1
        self.num_cached_tokens[:] = 0
        return True

    def ref_counts(self) -> dict[int, int]:
        """Ref count of every non-null block."""
        return dict(enumerate(self.ref_cnt.tolist()[1:], start=1))

    def cached_block_entries(self) -> list[tuple[int, int, int]]:
        """``(block_id, group_id, num_tokens)`` of every registered block."""
        cached = np.flatnonzero(self.block_group >= 0)
        return list(
            zip(
                cached.tolist(),
                self.block_group[cached].tolist(),
                self.num_cached_tokens[cached].tolist(),
            )
        )
