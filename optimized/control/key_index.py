"""The prefix cache's key index: which block is cached under a block hash, per group.

The rule (:class:`reference.block_pool.BlockPool`'s cache map): in each group, a key
maps to the blocks registered under it in registration order; a lookup returns the
earliest (the *head*); evicting a block takes it off its key's list (the head's
successor becomes the head); a key whose last block is evicted is gone. Example: ``a``
registered on 3 then on 5 in group 0: ``get(a, 0)`` is 3; evict 3 -> 5; evict 5 -> none.

Two forms of one interface, chosen by :func:`make_key_index`:

* :class:`ArrayKeyIndex` (numba, the ``jit`` extra): an open-addressing table of heads
  keyed by ``(group, hash)``, each block's hash as four int64 words and its place in its
  key's list as two links, every operation a compiled loop over the arrays (about 20 ns
  a key, against about 80 ns for a dict operation called from Python), in bulk: a
  prefill's lookups, its registrations and the evictions of the blocks it pops are one
  call each, and the compiled decode pass evicts the blocks it pops itself;
* :class:`DictKeyIndex` (numba missing, ``KVCONFORM_JIT=0``, or a pool built with
  ``compiled=False``): Python dicts of heads and lists of later duplicates.

The table (:func:`find_slot`): linear probing over a power-of-two number of slots (at
least 1.5 per block, so at most two in three are taken), a slot holding a head block
(``-1``: empty); the home slot of ``(group, words)`` is ``(words[0] ^ group) & mask``
(the words are SHA-256 output: uniform); a deleted slot is refilled by shifting later
entries of its probe run back (no tombstones, so probe runs stay short under churn).
The key of a slot is its head's: ``words[head]`` and the pool's ``block_group[head]``,
which the pool sets before a block is indexed and clears after it leaves. The lists:
``links[b] = (next, prev)``, a head's ``prev`` being its list's tail (``next`` of the
tail: -1). Hashes are SHA-256 digests (:mod:`optimized.control.hashing`): 32 bytes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import islice, takewhile

import numpy as np

from optimized.control.hashing import KEY_WORDS, key_words
from optimized.control.jit import compiled

#: a slot with no head; a block with no list neighbour
EMPTY = -1
#: ``links`` columns
NEXT, PREV = 0, 1


# ---------------------------------------------------------------------------
# The compiled loops (plain Python for numba's subset: NUMBA_DISABLE_JIT=1 runs them as
# Python; a test may call them either way)


def find_slot(
    heads: np.ndarray,
    words: np.ndarray,
    block_group: np.ndarray,
    query: np.ndarray,
    q: int,
    group: int,
) -> int:
    """The slot holding the head of ``(group, query[q])``, or ``-1 - s`` for the empty
    slot ``s`` where the probe ended (the key is not indexed). Example: an empty table
    -> ``-1 - home``."""
    mask = heads.shape[0] - 1
    w0 = query[q, 0]
    s = (w0 ^ group) & mask
    while True:
        head = heads[s]
        if head < 0:
            return -1 - s
        if (
            words[head, 0] == w0
            and block_group[head] == group
            and words[head, 1] == query[q, 1]
            and words[head, 2] == query[q, 2]
            and words[head, 3] == query[q, 3]
        ):
            return s
        s = (s + 1) & mask


def delete_slot(heads: np.ndarray, words: np.ndarray, block_group: np.ndarray, s: int) -> None:
    """Empty slot ``s``, shifting back each later entry of its probe run whose home slot
    does not lie after the hole (so every entry stays reachable from its home, with no
    tombstone). Example: entries at 5 (home 5) and 6 (home 5): deleting 5 moves 6 to 5."""
    mask = heads.shape[0] - 1
    j = s
    while True:
        j = (j + 1) & mask
        head = heads[j]
        if head < 0:
            break
        home = (words[head, 0] ^ block_group[head]) & mask
        if ((j - home) & mask) >= ((j - s) & mask):  # the hole lies on its probe path
            heads[s] = head
            s = j
    heads[s] = EMPTY


def insert_block(
    heads: np.ndarray,
    words: np.ndarray,
    links: np.ndarray,
    block_group: np.ndarray,
    query: np.ndarray,
    q: int,
    group: int,
    block: int,
) -> bool:
    """Index the unindexed ``block`` under ``(group, query[q])``: its key's head when the
    key is new (True), else its latest duplicate (False). ``block_group[block]`` need not
    be set yet. Example: ``a`` on 3, then ``insert(a, 5)`` -> False, list ``[3, 5]``."""
    s = _find(heads, words, block_group, query, q, group)
    for k in range(KEY_WORDS):
        words[block, k] = query[q, k]
    links[block, NEXT] = EMPTY
    if s >= 0:  # the key's latest duplicate: after the tail
        head = heads[s]
        tail = links[head, PREV]
        links[tail, NEXT] = block
        links[block, PREV] = tail
        links[head, PREV] = block
        return False
    heads[-1 - s] = block
    links[block, PREV] = block  # (a head's prev is its list's tail)
    return True


def remove_block(
    heads: np.ndarray,
    words: np.ndarray,
    links: np.ndarray,
    block_group: np.ndarray,
    block: int,
    group: int,
) -> None:
    """Take ``block``, indexed in ``group``, off its key: a head is replaced by its next
    duplicate, the last block empties the slot, a duplicate leaves its list. Example:
    list ``[3, 5, 7]``: remove 5 -> ``[3, 7]``; remove 3 -> ``[7]``; remove 7 -> the key
    is gone. A block whose key is not indexed changes nothing."""
    s = _find(heads, words, block_group, words, block, group)
    if s < 0:
        return
    head = heads[s]
    after = links[block, NEXT]
    if head == block:
        if after < 0:
            _delete(heads, words, block_group, s)
        else:
            heads[s] = after
            links[after, PREV] = links[block, PREV]
        return
    before = links[block, PREV]
    links[before, NEXT] = after
    if after < 0:  # the tail: its predecessor is the new tail
        links[head, PREV] = before
    else:
        links[after, PREV] = before


#: the single-key loops as the other loops (and the decode pass) call them: compiled
#: where numba is on (a compiled loop calls compiled functions only)
_find = compiled(find_slot) or find_slot
_delete = compiled(delete_slot) or delete_slot
_insert = compiled(insert_block) or insert_block
_remove = compiled(remove_block) or remove_block
#: :func:`insert_block` and :func:`remove_block` as other modules' loops call them
insert_key = _insert
remove_key = _remove


def lookup_heads(
    heads: np.ndarray,
    words: np.ndarray,
    block_group: np.ndarray,
    query: np.ndarray,
    group: int,
    stop_at_miss: bool,
    out: np.ndarray,
) -> int:
    """``out[k]``: the head of ``(group, query[k])``, or -1; with ``stop_at_miss`` the
    lookups stop at the first miss. Returns how many leading keys hit. Example: ``a, b``
    cached on 3, 4, ``c`` not: ``[a, c, b]`` -> ``out [3, -1, 4]``, returns 1."""
    hits = -1
    for k in range(query.shape[0]):
        s = _find(heads, words, block_group, query, k, group)
        if s < 0:
            out[k] = EMPTY
            if hits < 0:
                hits = k
                if stop_at_miss:
                    return hits
        else:
            out[k] = heads[s]
    return query.shape[0] if hits < 0 else hits


def insert_blocks(
    heads: np.ndarray,
    words: np.ndarray,
    links: np.ndarray,
    block_group: np.ndarray,
    query: np.ndarray,
    group: int,
    blocks: np.ndarray,
) -> int:
    """:func:`insert_block` of ``blocks[k]`` under ``query[k]``, in order (a later block
    of a key repeated in the call becomes that key's latest duplicate). Returns how many
    became duplicates. Example: ``[a, b, b]`` on ``[5, 6, 7]`` -> 1 (7 after 6)."""
    duplicates = 0
    for k in range(blocks.shape[0]):
        if not _insert(heads, words, links, block_group, query, k, group, blocks[k]):
            duplicates += 1
    return duplicates


def evict_blocks(
    heads: np.ndarray,
    words: np.ndarray,
    links: np.ndarray,
    block_group: np.ndarray,
    num_cached_tokens: np.ndarray,
    blocks: np.ndarray,
) -> None:
    """Evict each of the hashed ``blocks`` (the pool's ``_evict``): off its key
    (:func:`remove_block`), then its group -1 and no cached tokens. The result does not
    depend on their order (each key's blocks keep their order)."""
    for k in range(blocks.shape[0]):
        block = blocks[k]
        _remove(heads, words, links, block_group, block, block_group[block])
        block_group[block] = -1
        num_cached_tokens[block] = 0


def lookup_right(
    heads: np.ndarray,
    words: np.ndarray,
    block_group: np.ndarray,
    query: np.ndarray,
    group: int,
    below: int,
    block_size: int,
    alignment: int,
) -> int:
    """The rightmost row ``i < below`` of ``query`` whose key is cached in ``group`` and
    whose block ends aligned (``(i + 1) * block_size % alignment == 0``; any end when
    the block size is the alignment), or -1 (a Mamba group's scan). Example: bs 4, A 8,
    rows 1 and 2 cached, below 3 -> row 2 ends at 12, not aligned -> 1."""
    free_end = block_size == alignment
    for i in range(below - 1, -1, -1):
        if not free_end and (i + 1) * block_size % alignment:
            continue
        if _find(heads, words, block_group, query, i, group) >= 0:
            return i
    return -1


def window_run(
    heads: np.ndarray,
    words: np.ndarray,
    block_group: np.ndarray,
    query: np.ndarray,
    group: int,
    need: int,
    block_size: int,
    alignment: int,
    out: np.ndarray,
) -> tuple[int, int]:
    """A sliding window's scan of one group (:func:`reference.managers.sliding_window.
    sliding_window_hit`, no EAGLE), its lookups made from the right: the rightmost run of
    ``need`` cached rows whose last row ends aligned, as ``(first row, length)`` with the
    run's heads in ``out[first:first + length]``; else the run reaching row 0 (not cut
    to the alignment: the caller cuts it). Example: bs 4, A 4, need 2, rows 14 and 15 of
    16 cached -> ``(14, 2)`` after two lookups."""
    free_end = block_size == alignment
    run = 0
    for i in range(query.shape[0] - 1, -1, -1):
        s = _find(heads, words, block_group, query, i, group)
        if s < 0:
            run = 0
        elif run or free_end or (i + 1) * block_size % alignment == 0:
            out[i] = heads[s]
            run += 1
            if run >= need:
                return i, run
    return 0, run


#: are the loops compiled (numba on)? Else :func:`make_key_index` keeps the keys in
#: dicts; an :class:`ArrayKeyIndex` built anyway runs its loops as Python (tests)
COMPILED = _find is not find_slot
#: the bulk loops as :class:`ArrayKeyIndex` calls them: compiled where numba is on
compiled_lookup = compiled(lookup_heads) or lookup_heads
compiled_lookup_right = compiled(lookup_right) or lookup_right
compiled_window_run = compiled(window_run) or window_run
compiled_insert = compiled(insert_blocks) or insert_blocks
compiled_evict = compiled(evict_blocks) or evict_blocks


# ---------------------------------------------------------------------------
# The two forms


class ArrayKeyIndex:
    """The key index in arrays (module docstring), over the pool's ``block_group``
    (``num_blocks`` blocks). ``heads``: the table; ``words[b]``: block ``b``'s hash (its
    last one once evicted: read only while indexed); ``links[b]``: next / prev in its
    key's list. Every operation is one compiled call."""

    def __init__(self, num_blocks: int, block_group: np.ndarray) -> None:
        capacity = 1 << max(4, (num_blocks + num_blocks // 2).bit_length())
        self.heads = np.full(capacity, EMPTY, dtype=np.int32)
        self.words = np.zeros((num_blocks, KEY_WORDS), dtype=np.int64)
        self.links = np.full((num_blocks, 2), EMPTY, dtype=np.int32)
        self.block_group = block_group
        self._out = np.empty(64, dtype=np.int64)  # lookup results, grown as asked
        self._warm_up()

    def _warm_up(self) -> None:
        """numba compiles (or loads) every loop now, for the query kinds the calls pass
        (read-only words of joined hashes, an int64 block array), not in a timed call."""
        none = key_words([])
        self.lookup_words(none, 0, False)
        self.rightmost(none, 0, 0, 1, 1)
        self.window(none, 0, 1, 1, 1)
        self.add_words(np.zeros(0, dtype=np.int64), none, 0)
        self.remove_many(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))

    # -- one key ---------------------------------------------------------------------
    def key_of(self, block: int) -> bytes | None:
        """The hash ``block`` is registered under, or None."""
        if self.block_group.item(block) < 0:
            return None
        return self.words[block].tobytes()

    def add(self, block: int, key: bytes, group: int) -> None:
        """Index the unhashed ``block`` under ``key`` in ``group`` (head or latest
        duplicate)."""
        _insert(
            self.heads, self.words, self.links, self.block_group, key_words([key]), 0, group, block
        )

    def remove(self, block: int, group: int) -> None:
        """Take ``block``, indexed in ``group``, off its key."""
        _remove(self.heads, self.words, self.links, self.block_group, block, group)

    def get(self, key: bytes, group: int) -> int | None:
        """The head of ``key`` in ``group``, or None."""
        return self.get_row(key_words([key]), 0, group)

    def get_row(self, query: np.ndarray, row: int, group: int) -> int | None:
        """:meth:`get` of the key at ``query[row]`` (words): no conversion."""
        s = _find(self.heads, self.words, self.block_group, query, row, group)
        return None if s < 0 else int(self.heads[s])

    # -- many keys -------------------------------------------------------------------
    def lookup_words(
        self, query: np.ndarray, group: int, stop_at_miss: bool
    ) -> tuple[np.ndarray, int]:
        """``(heads, hits)``: per row of ``query`` its head in ``group`` or -1 (a view of
        a reused buffer: read it before the next call), and how many leading rows hit
        (with ``stop_at_miss`` the rows after the first miss are not looked up)."""
        n = query.shape[0]
        if self._out.size < n:
            self._out = np.empty(max(n, 2 * self._out.size), dtype=np.int64)
        out = self._out[:n]
        hits = compiled_lookup(
            self.heads, self.words, self.block_group, query, group, stop_at_miss, out
        )
        return out, hits

    def rightmost(
        self, query: np.ndarray, group: int, below: int, block_size: int, alignment: int
    ) -> int:
        """:func:`lookup_right` (a Mamba group's scan)."""
        return compiled_lookup_right(
            self.heads, self.words, self.block_group, query, group, below, block_size, alignment
        )

    def window(
        self, query: np.ndarray, group: int, need: int, block_size: int, alignment: int
    ) -> tuple[list[int], int]:
        """:func:`window_run`: ``(the run's heads, first row)``."""
        n = query.shape[0]
        if self._out.size < n:
            self._out = np.empty(max(n, 2 * self._out.size), dtype=np.int64)
        out = self._out
        first, run = compiled_window_run(
            self.heads, self.words, self.block_group, query, group, need, block_size, alignment, out
        )
        return out[first : first + run].tolist(), first

    def get_many(
        self, keys: Sequence[bytes], group: int, words: np.ndarray | None = None
    ) -> list[int | None]:
        """The head of each key in ``group`` (None: not cached). ``words``: the keys as
        words (:func:`~optimized.control.hashing.key_words`), or None."""
        out, _ = self.lookup_words(key_words(keys) if words is None else words, group, False)
        return [None if b < 0 else b for b in out.tolist()]

    def prefix(
        self, keys: Sequence[bytes], group_ids: Sequence[int], words: np.ndarray | None = None
    ) -> list[list[int]]:
        """The heads of the longest prefix of ``keys`` cached in every group of
        ``group_ids``, one list per group (:meth:`BlockPool.cached_prefix`)."""
        query = key_words(keys) if words is None else words
        found: list[list[int]] = []
        n = query.shape[0]
        for g in group_ids:
            out, n = self.lookup_words(query[:n], g, True)
            found.append(out[:n].tolist())
        return [blocks[:n] for blocks in found] if len(found) > 1 else found

    def add_words(self, blocks: np.ndarray, query: np.ndarray, group: int) -> int:
        """Index the unhashed ``blocks`` (int64) under the rows of ``query`` in order;
        returns how many became duplicates."""
        return compiled_insert(
            self.heads, self.words, self.links, self.block_group, query, group, blocks
        )

    def add_fresh(
        self,
        blocks: Sequence[int],
        keys: Sequence[bytes],
        group: int,
        block_array: np.ndarray | None = None,
        words: np.ndarray | None = None,
    ) -> None:
        """Index the unhashed ``blocks`` (``block_array``: as an array, or None) under
        ``keys`` (``words``: as words, or None) in ``group``, in order."""
        ids = np.asarray(blocks if block_array is None else block_array, dtype=np.int64)
        self.add_words(ids, key_words(keys) if words is None else words, group)

    def remove_many(self, blocks: np.ndarray, num_cached_tokens: np.ndarray) -> None:
        """Evict the hashed ``blocks`` (int64): off their keys, their group -1 and no
        cached tokens (the pool's arrays)."""
        compiled_evict(
            self.heads, self.words, self.links, self.block_group, num_cached_tokens, blocks
        )

    def clear(self) -> None:
        """Forget every key (the pool clears its groups)."""
        self.heads.fill(EMPTY)
        self.links.fill(EMPTY)

    # -- views (tests, diagnostics) --------------------------------------------------
    def head_map(self, group: int) -> dict[bytes, int]:
        """``{key: head}`` of ``group`` (a copy, built from the table)."""
        taken = self.heads[self.heads >= 0]
        return {
            self.words[b].tobytes(): int(b)
            for b in taken.tolist()
            if self.block_group.item(b) == group
        }

    def duplicate_map(self, group: int) -> dict[bytes, list[int]]:
        """``{key: later blocks in registration order}`` of ``group``'s keys that have
        duplicates (a copy)."""
        out: dict[bytes, list[int]] = {}
        for key, head in self.head_map(group).items():
            later = []
            b = self.links.item(head, NEXT)
            while b >= 0:
                later.append(b)
                b = self.links.item(b, NEXT)
            if later:
                out[key] = later
        return out


class DictKeyIndex:
    """The key index in Python dicts (the form used without numba): per group,
    ``cached[g][key]`` is the head and ``duplicates[g][key]`` the later blocks in
    registration order; ``block_hash[b]`` is block ``b``'s key (None: not cached), an
    object array (keys read and cleared for many blocks at once)."""

    def __init__(self, num_blocks: int, num_groups: int, block_group: np.ndarray) -> None:
        self.block_group = block_group
        self.block_hash: np.ndarray = np.full(num_blocks, None, dtype=object)
        self.cached: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        self.duplicates: list[dict[bytes, list[int]]] = [{} for _ in range(num_groups)]

    def key_of(self, block: int) -> bytes | None:
        return self.block_hash[block]

    def add(self, block: int, key: bytes, group: int) -> None:
        """Enter ``block`` under ``key``: the key's head when new to the group, else its
        latest duplicate (the head stays the earliest block, the one lookups return).
        Example: ``a`` cached on 3, then ``add(5, a, ..)`` -> ``a: 3``, duplicates
        ``a: [5]``."""
        self.block_hash[block] = key
        cached = self.cached[group]
        if key in cached:
            self.duplicates[group].setdefault(key, []).append(block)
        else:
            cached[key] = block

    def remove(self, block: int, group: int) -> None:
        """Take ``block`` off its key in ``group``: the head is replaced by the next
        duplicate in registration order (:meth:`reference.block_pool.BlockPool._evict`)."""
        key = self.block_hash[block]
        cached, dupes = self.cached[group], self.duplicates[group]
        if cached.get(key) == block:
            later = dupes.get(key)
            if later:
                cached[key] = later.pop(0)
                if not later:
                    del dupes[key]
            else:
                del cached[key]
        else:
            later = dupes.get(key)
            if later is not None and block in later:
                later.remove(block)
                if not later:
                    del dupes[key]
        self.block_hash[block] = None

    def get(self, key: bytes, group: int) -> int | None:
        return self.cached[group].get(key)

    def get_many(
        self, keys: Sequence[bytes], group: int, words: np.ndarray | None = None
    ) -> list[int | None]:
        """One C-level ``map`` of the group's dict ``get`` (``words`` unused)."""
        return list(map(self.cached[group].get, keys))

    def prefix(
        self, keys: Sequence[bytes], group_ids: Sequence[int], words: np.ndarray | None = None
    ) -> list[list[int]]:
        """Each group one C-level pass (``map`` of the dict's ``get``, cut at the first
        ``None``) over the prefix the groups before it matched."""
        found: list[list[int]] = []
        n = len(keys)
        for g in group_ids:
            blocks = list(takewhile(_is_block, map(self.cached[g].get, islice(keys, n))))
            n = len(blocks)
            found.append(blocks)
        return [blocks[:n] for blocks in found] if len(found) > 1 else found

    def add_fresh(
        self,
        blocks: Sequence[int],
        keys: Sequence[bytes],
        group: int,
        block_array: np.ndarray | None = None,
        words: np.ndarray | None = None,
    ) -> None:
        """Register unhashed ``blocks`` under ``keys`` in order (``words`` unused), as
        :meth:`add` block by block does: one ``setdefault`` per key (a C-level ``map``)
        enters the new heads
        and reads back each key's head; a head other than the block itself marks a
        duplicate (an unhashed block heads no key). Example: ``a`` cached on 3, keys
        ``[a, b, b]`` on ``[5, 6, 7]`` -> ``b: 6``, 5 a duplicate of ``a``, 7 one of
        ``b``."""
        blocks = blocks if isinstance(blocks, list) else list(blocks)
        cached = self.cached[group]
        heads = list(map(cached.setdefault, keys, blocks))
        if heads != blocks:
            dupes = self.duplicates[group]
            for key, block, head in zip(keys, blocks, heads):
                if head != block:
                    dupes.setdefault(key, []).append(block)
        if len(blocks) <= 8:
            block_hash = self.block_hash
            for b, key in zip(blocks, keys):
                block_hash[b] = key
        else:
            self.block_hash[np.asarray(blocks if block_array is None else block_array)] = keys

    def remove_many(self, blocks: np.ndarray, num_cached_tokens: np.ndarray) -> None:
        """:meth:`remove` of several hashed blocks, their group -1 and no cached tokens:
        map updates per block, arrays at once. The result does not depend on the order of
        the blocks (each key's blocks stay in registration order, the earliest left is
        its head). When no group holds duplicate keys every registered block is its key's
        head: its eviction is one ``del``, run as one ``map`` over the blocks."""
        keys = self.block_hash[blocks].tolist()
        groups = self.block_group[blocks].tolist()
        if any(self.duplicates):
            cached = self.cached
            duplicates = self.duplicates
            for b, g, key in zip(blocks.tolist(), groups, keys):
                dupes = duplicates[g]
                later = dupes.get(key) if dupes else None
                if later is None:  # the key's only block: its head
                    if cached[g].get(key) == b:
                        del cached[g][key]
                elif cached[g].get(key) == b:  # the head: the next duplicate takes over
                    cached[g][key] = later.pop(0)
                    if not later:
                        del dupes[key]
                elif b in later:
                    later.remove(b)
                    if not later:
                        del dupes[key]
        else:
            cached = self.cached
            deque(map(dict.__delitem__, map(cached.__getitem__, groups), keys), maxlen=0)
        self.block_hash[blocks] = None
        self.block_group[blocks] = -1
        num_cached_tokens[blocks] = 0

    def clear(self) -> None:
        for g in range(len(self.cached)):
            self.cached[g].clear()
            self.duplicates[g].clear()
        self.block_hash[:] = None

    def head_map(self, group: int) -> dict[bytes, int]:
        return self.cached[group]

    def duplicate_map(self, group: int) -> dict[bytes, list[int]]:
        return self.duplicates[group]


def _is_block(found: int | None) -> bool:
    """``takewhile`` test of :meth:`DictKeyIndex.prefix`: a lookup found a block."""
    return found is not None


def make_key_index(
    num_blocks: int, num_groups: int, block_group: np.ndarray, compiled_loops: bool
) -> ArrayKeyIndex | DictKeyIndex:
    """:class:`ArrayKeyIndex` when ``compiled_loops`` and numba is on, else
    :class:`DictKeyIndex`."""
    if compiled_loops and COMPILED:
        return ArrayKeyIndex(num_blocks, block_group)
    return DictKeyIndex(num_blocks, num_groups, block_group)
