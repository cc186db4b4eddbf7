"""Rules shared by every single-type manager (:mod:`reference.managers.base`), on arrays.

Each manager keeps its group's block table as a preallocated int32 array
``table[max_num_reqs, max_blocks_per_req]`` (0 = null) with ``row_len[row]`` valid entries;
the coordinator gives each request one row index for all groups and reuses rows of finished
requests. ``num_cached_block[row]`` is ``-1`` while the reference would have no entry for
the request (its presence marks the "running" path of ``get_num_blocks_to_allocate``).

Attention rows always read ``[null] * num_leading_null[row] + [real blocks]``: hits are
``[nulls, reals]`` and only the leading entries are ever nulled, so the reference's
backwards walk of ``remove_skipped_blocks`` (stop at the first null) frees exactly
``row[num_leading_null : last]``, tail first. Example, bs 2, w 4, row ``[a b c d]``,
``n = 7``: skipped 4 tokens -> 2 blocks -> free ``b, a``, row ``[0 0 c d]``, leading 2.

``pending_work`` is the vectorised test of the batched step: for running rows, is any of
remove_skipped / allocate / cache_blocks going to change anything? Rows where it is False
are skipped by :meth:`optimized.control.kv_cache_manager.KVCacheManager.schedule_step`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from typing import NamedTuple

import numpy as np

from optimized.control.block_pool import NULL_BLOCK_ID, BlockPool
from optimized.control.hashing import HashChain, chain_words, hashes_at_block_size
from optimized.control.request import Request
from optimized.control.uniformity import same_everywhere
from reference.managers.base import ManagerBase, blocks_to_allocate, cacheable_full_blocks
from reference.specs import KVCacheSpec, cdiv

BlockList = list[int]


class HitAdoption(NamedTuple):
    """One group's share of a new request's hit, counted by
    :meth:`optimized.control.coordinator.KVCacheCoordinator.count_hit_admission` and
    written to the row by :meth:`SingleTypeKVCacheManager.adopt_hit`: ``skipped``
    leading hit columns become nulls, ``kept`` (intp, nulls included) fills the columns
    after them, ``real`` is ``kept`` without its nulls. Example: w 4, bs 2, hit ``[3,
    5, 7]`` over 6 tokens -> skipped 1, kept ``[5, 7]``, real ``[5, 7]``."""

    skipped: int
    kept: np.ndarray
    real: np.ndarray


class HitAdmission(NamedTuple):
    """A new request's whole hit as :meth:`optimized.control.coordinator.
    KVCacheCoordinator.count_hit_admission` counted it: each group's
    :class:`HitAdoption`, and every group's real blocks one group after the other
    (``real``, intp) with their ref counts when counted (``counts``) and whether no block
    occurs twice among them (``distinct``), for one touch of the pool
    (:meth:`BlockPool.touch_array`) right after the count. Example: groups with real
    blocks ``[5]`` and ``[8, 9]``, 8 free -> real ``[5, 8, 9]``, counts ``[1, 0, 2]``,
    distinct."""

    groups: list[HitAdoption]
    real: np.ndarray
    counts: np.ndarray
    distinct: bool


#: ``(num_cached, num_full, mask, hashes)``: see :meth:`SingleTypeKVCacheManager.cache_plan`
CachePlan = tuple[int, int, Sequence[bool] | None, Sequence[bytes]]


def lookup_words(block_hashes: Sequence[bytes], pool: BlockPool, block_size: int):
    """The chain at ``block_size`` as int64 words when the pool keeps its keys so
    (:attr:`BlockPool.keys_as_words`: a request's
    :class:`~optimized.control.hashing.HashChain` gives them at no cost once converted),
    else None (the dict index reads the hashes themselves)."""
    if not pool.keys_as_words:
        return None
    if type(block_hashes) is HashChain and block_size == pool.hash_block_size:
        return block_hashes.words()  # (the common case, without a call more)
    return chain_words(block_hashes, block_size, pool.hash_block_size)


def _select(condition: bool, if_true: int, if_false: int) -> int:
    """``np.where`` of one value."""
    return if_true if condition else if_false


def _none_evictable(block: int) -> bool:
    """``blocks_to_allocate``'s ``evictable`` when no hit block sits free."""
    return False


class SingleTypeKVCacheManager(ManagerBase):
    """Block tables of one KV cache group."""

    #: Do blocks leave the group's rows as tokens are computed (a window or a chunk)?
    drops_blocks: bool = False
    #: the row array counting the leading columns already dropped, which the decode
    #: threshold reads (:meth:`_threshold`): the leading nulls here, retired columns in Mamba
    dropped_columns: str = "num_leading_null"

    def __init__(
        self,
        spec: KVCacheSpec,
        block_pool: BlockPool,
        group_id: int,
        enable_caching: bool,
        cache_hit_alignment: int,
        max_model_len: int,
        max_num_reqs: int,
        retention_interval: int | None = None,
        scheduler_block_size: int | None = None,
    ) -> None:
        # no EAGLE groups in the optimized engine: the base's flags stay off
        super().__init__(
            spec,
            block_pool,
            group_id,
            enable_caching,
            cache_hit_alignment,
            retention_interval,
            scheduler_block_size,
        )
        self.max_blocks_per_req = cdiv(max_model_len, spec.block_size)
        self.table = np.zeros((max_num_reqs, self.max_blocks_per_req), dtype=np.int32)
        self.row_len = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_cached_block = np.full(max_num_reqs, -1, dtype=np.int32)
        self.num_leading_null = np.zeros(max_num_reqs, dtype=np.int32)
        #: Rows written since the data plane last uploaded them (delta uploads).
        self.dirty_rows = np.zeros(max_num_reqs, dtype=bool)

    # -- rows --------------------------------------------------------------------
    def grow(self, max_num_reqs: int) -> None:
        """Make room for ``max_num_reqs`` rows (existing rows keep their content), for a
        manager whose arrays are its own (a coordinator's managers have theirs grown by
        its :class:`~optimized.control.row_store.RowStore`)."""
        old = self.row_len.shape[0]
        if max_num_reqs <= old:
            return
        table = np.zeros((max_num_reqs, self.max_blocks_per_req), dtype=np.int32)
        table[:old] = self.table
        self.table = table
        self.grow_own_rows(max_num_reqs, frozenset())

    def grow_own_rows(self, max_num_reqs: int, skip: frozenset[str]) -> None:
        """Grow each row array of :meth:`_row_arrays` not named in ``skip`` (those a
        :class:`~optimized.control.row_store.RowStore` holds) to ``max_num_reqs`` rows,
        new rows absent."""
        for name in self._row_arrays():
            arr = getattr(self, name)
            old = arr.shape[0]
            if name in skip or max_num_reqs <= old:
                continue
            fill = -1 if name in self._absent_minus_one() else 0
            grown = np.full(max_num_reqs, fill, dtype=arr.dtype)
            grown[:old] = arr
            setattr(self, name, grown)

    def _row_arrays(self) -> tuple[str, ...]:
        return ("row_len", "num_cached_block", "num_leading_null", "dirty_rows")

    def _absent_minus_one(self) -> tuple[str, ...]:
        return ("num_cached_block",)

    def release_row(self, row: int) -> None:
        """Forget a row (its blocks were freed); the table row is reused later."""
        self.table[row, : self.row_len.item(row)] = NULL_BLOCK_ID
        self.dirty_rows[row] = True
        self.row_len[row] = 0
        self.num_cached_block[row] = -1
        self.num_leading_null[row] = 0

    def rows_held(self, rows: np.ndarray | slice) -> np.ndarray:
        """The table entries of ``rows`` (an index array, or a slice of consecutive rows:
        then a view) as ``(num_rows, w)``, ``w`` the longest row's length, without the
        leading columns that are null in every row (window blocks already freed); entries
        past a row's length are null (a row is only ever written up to its length).
        Example: rows with tables ``[0, 3, 4]`` and ``[0, 5]`` -> ``[[3, 4], [5, 0]]``."""
        lengths = self.row_len[rows]
        if lengths.size == 0:
            return self.table[rows, :0]
        width = int(lengths.max())
        lead = int(self.num_leading_null[rows].min())
        if lead and not np.count_nonzero(self.table[rows, :lead]):
            return self.table[rows, lead:width]
        return self.table[rows, :width]

    def release_rows(self, rows: np.ndarray | slice) -> None:
        """:meth:`release_row` of each of ``rows`` (distinct indices, or a slice) in one
        pass: their entries are nulled up to the longest row's length."""
        lengths = self.row_len[rows]
        if lengths.size:
            self.table[rows, : int(lengths.max())] = NULL_BLOCK_ID
        absent = self._absent_minus_one()
        for name in self._row_arrays():
            arr = getattr(self, name)
            arr[rows] = True if name == "dirty_rows" else (-1 if name in absent else 0)

    def blocks(self, row: int) -> BlockList:
        return self.table[row, : self.row_len[row]].tolist()

    def _append(self, row: int, ids: Sequence[int]) -> None:
        n = self.row_len.item(row)
        k = len(ids)
        if k == 1:  # a decode step's new block: a scalar write
            self.table[row, n] = ids[0]
        else:
            self.table[row, n : n + k] = ids
        self.row_len[row] = n + k
        self.dirty_rows[row] = True

    @property
    def null_block(self) -> int:
        return NULL_BLOCK_ID

    @staticmethod
    def coarse_hashes(
        block_hashes: Sequence[bytes], pool_hash_block_size: int, spec: KVCacheSpec
    ) -> Sequence[bytes]:
        """The chain at the group's block size as a slice (no copy when equal)."""
        return hashes_at_block_size(block_hashes, pool_hash_block_size, spec.block_size)

    # -- allocation --------------------------------------------------------------
    def get_num_blocks_to_allocate(
        self,
        row: int,
        num_tokens: int,
        new_computed_blocks: Sequence[int],
        total_computed_tokens: int,
        num_tokens_main: int,
    ) -> int:
        """:meth:`reference.managers.base.SingleTypeKVCacheManager.get_num_blocks_to_allocate`."""
        running = self.num_cached_block.item(row) >= 0
        held = self.row_len.item(row)
        evictable = _none_evictable
        if new_computed_blocks and not running:
            # the hit's blocks that sit free in the queue, found at once (a set test each)
            ids = np.asarray(new_computed_blocks, dtype=np.intp)
            free = ids[(self.block_pool.ref_cnt[ids] == 0) & (ids != NULL_BLOCK_ID)]
            if free.size:
                evictable = frozenset(free.tolist()).__contains__
            else:
                # none to count: a new request's hit blocks only add to what it holds
                held += len(new_computed_blocks)
                new_computed_blocks = ()
        return blocks_to_allocate(
            self.spec,
            num_tokens,
            held,
            running,
            new_computed_blocks,
            total_computed_tokens,
            evictable,
        )

    def add_local_computed_blocks(
        self, row: int, new_computed_blocks: Sequence[int], num_local_computed_tokens: int
    ) -> None:
        """Adopt a hit: skipped hit blocks become nulls, the others are touched."""
        assert self.row_len[row] == 0, f"row {row} already has blocks in group {self.group_id}"
        skipped = self.spec.num_skipped_tokens(num_local_computed_tokens) // self.block_size
        kept = np.asarray(new_computed_blocks[skipped:], dtype=np.intp)
        if self.enable_caching:
            self.block_pool.touch(kept)
        length = skipped + kept.size
        self.table[row, :skipped] = NULL_BLOCK_ID
        self.table[row, skipped:length] = kept
        self.row_len[row] = length
        self.dirty_rows[row] = True
        self.num_cached_block[row] = length
        real = np.flatnonzero(kept)
        self.num_leading_null[row] = skipped + (int(real[0]) if real.size else kept.size)

    def adopt_hit(self, row: int, adoption: HitAdoption) -> None:
        """:meth:`add_local_computed_blocks` of a hit counted by the coordinator (a fresh
        row), the pool's touch of its real blocks aside (the coordinator touches every
        group's at once): the row becomes ``[null] * skipped + kept``, counted as cached.
        Example: fresh row, skipped 1, kept ``[5, 7]`` -> row ``[0, 5, 7]``, leading 1, 3
        blocks cached."""
        skipped, kept, real = adoption
        length = skipped + kept.size
        table = self.table
        if skipped:
            table[row, :skipped] = NULL_BLOCK_ID
        if kept.size:
            table[row, skipped:length] = kept
        self.row_len[row] = length
        self.dirty_rows[row] = True
        self.num_cached_block[row] = length
        if real.size == kept.size:  # no null kept: the leading nulls are the skipped ones
            self.num_leading_null[row] = skipped
        elif real.size == 0:  # every kept entry null
            self.num_leading_null[row] = length
        else:
            self.num_leading_null[row] = skipped + int(np.argmax(kept != NULL_BLOCK_ID))

    def allocate_new_blocks(self, row: int, num_tokens: int, num_tokens_main: int) -> BlockList:
        """Pop :meth:`num_new_blocks` fresh blocks and :meth:`place_new_blocks` them."""
        num_new = self.num_new_blocks(row, num_tokens, num_tokens_main)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        self.place_new_blocks(row, new_blocks, num_tokens_main)
        return new_blocks

    def num_new_blocks(self, row: int, num_tokens: int, num_tokens_main: int) -> int:
        """The fresh blocks ``allocate_new_blocks`` pops: until the row covers
        ``num_tokens`` slots. Example: bs 4, row of 2 blocks, 13 slots -> 2."""
        return max(cdiv(num_tokens, self.block_size) - self.row_len.item(row), 0)

    def place_new_blocks(self, row: int, new_blocks: Sequence[int], num_tokens_main: int) -> None:
        """Put the popped ``new_blocks`` in the row (appended)."""
        self._append(row, new_blocks)

    # -- caching -----------------------------------------------------------------
    def cacheable_block_mask(self, request: Request, start: int, end: int) -> list[bool] | None:
        """Which blocks of ``[start, end)`` ``cache_blocks`` registers (None: all; sliding
        window and Mamba apply :mod:`reference.retention`)."""
        return None

    def cacheable_block_positions(
        self, request: Request, start: int, end: int
    ) -> list[int] | range | None:
        """The blocks of ``[start, end)`` that ``cache_blocks`` registers, as positions from
        ``start`` (None: all; a ``range`` when they are one run): :meth:`cacheable_block_mask`'s
        kept entries. Example: mask ``[False, True, True]`` -> ``[1, 2]``."""
        mask = self.cacheable_block_mask(request, start, end)
        return None if mask is None else list(compress(range(end - start), mask))

    def cache_blocks(self, request: Request, row: int, num_tokens: int) -> None:
        """Register the full blocks of ``[0, num_tokens)`` not registered yet."""
        plan = self.cache_plan(request, row, num_tokens)
        if plan is not None:
            self.apply_cache_plan(row, plan)

    def cache_plan(self, request: Request, row: int, num_tokens: int) -> CachePlan | None:
        """What :meth:`cache_blocks` registers: ``(num_cached, num_full, mask, hashes)``
        (blocks ``[num_cached, num_full)`` of the row under ``hashes``, ``mask`` as
        :meth:`cacheable_block_mask`), or None when nothing is left to register. A plan
        depends on the spec and the row's counts only, so groups of the same class and
        spec (twins, whose rows hold the same counts) share one. Example: bs 16, 40 tokens
        hashed, 2 blocks cached, 48 tokens -> None; 3 hashes, 1 cached -> ``(1, 2, ...)``."""
        num_cached = max(self.num_cached_block.item(row), 0)
        num_full = cacheable_full_blocks(request, num_tokens, self.block_size)
        if num_cached >= num_full:
            return None
        mask = self.cacheable_block_mask(request, num_cached, num_full)
        hashes = hashes_at_block_size(
            request.block_hashes, request.hash_block_size, self.block_size
        )
        return num_cached, num_full, mask, hashes[num_cached:num_full]

    def cache_new_blocks(
        self,
        request: Request,
        row: int,
        num_tokens: int,
        new_blocks: Sequence[int],
        new_array: np.ndarray | None = None,
    ) -> None:
        """:meth:`cache_blocks` right after an allocation that appended ``new_blocks`` (just
        popped: unhashed, not null) to a row holding only cached blocks before them
        (``num_cached_block[row]`` columns, none on a fresh row: -1 reads 0 there, as in
        :meth:`cache_plan`): blocks ``[num_cached, num_full)`` are the first ``num_full -
        num_cached`` new ones, registered from the list
        (:meth:`BlockPool.cache_fresh_blocks`), no table read. Only for a class that
        :meth:`shares_cache_plans`; any other row shape takes :meth:`cache_blocks`.
        Example: bs 4, 3 cached columns, new ``[8, 9]``, 18 tokens hashed and cached ->
        ``8`` registered over 16 tokens, ``num_cached_block`` 4; a fresh row given ``[8,
        9]`` with 8 tokens: both, ``num_cached_block`` 2. ``new_array``: the new blocks
        as an array too (None: made from the list when needed)."""
        num_cached = max(self.num_cached_block.item(row), 0)
        if self.row_len.item(row) - len(new_blocks) != num_cached:
            self.cache_blocks(request, row, num_tokens)
            return
        num_full = cacheable_full_blocks(request, num_tokens, self.block_size)
        if num_cached >= num_full:
            return
        pool = self.block_pool
        hashes = hashes_at_block_size(
            request.block_hashes, request.hash_block_size, self.block_size
        )
        words = lookup_words(request.block_hashes, pool, self.block_size)
        kept = self.cacheable_block_positions(request, num_cached, num_full)
        if kept is None:
            n = num_full - num_cached
            pool.cache_fresh_blocks(
                new_blocks[:n],
                hashes[num_cached:num_full],
                self.group_id,
                num_cached,
                self.block_size,
                None,
                None if new_array is None else new_array[:n],
                None if words is None else words[num_cached:num_full],
            )
        elif isinstance(kept, range) and kept:  # one run of new blocks: slices, no lists
            a, b = kept.start, kept.stop
            pool.cache_fresh_blocks(
                new_blocks[a:b],
                hashes[num_cached + a : num_cached + b],
                self.group_id,
                num_cached + a,
                self.block_size,
                None,
                None if new_array is None else new_array[a:b],
                None if words is None else words[num_cached + a : num_cached + b],
            )
        elif kept:
            pool.cache_fresh_blocks(
                [new_blocks[k] for k in kept],
                [hashes[num_cached + k] for k in kept],
                self.group_id,
                num_cached,
                self.block_size,
                kept,
                None,
                None if words is None else words[[num_cached + k for k in kept]],
            )
        self.num_cached_block[row] = num_full

    def apply_cache_plan(self, row: int, plan: CachePlan) -> None:
        """Register the blocks of ``plan`` (:meth:`cache_plan`) in this group's row."""
        num_cached, num_full, mask, hashes = plan
        if num_full == num_cached + 1:  # a decode step completing one block: the scalar rule
            if mask is None or mask[0]:
                self.block_pool.cache_block(
                    self.table.item(row, num_cached),
                    hashes[0],
                    self.group_id,
                    num_full * self.block_size,
                )
        else:
            self.block_pool.cache_full_blocks(
                self.table[row, num_cached:num_full],
                hashes,
                self.group_id,
                num_cached,
                self.block_size,
                mask,
            )
        self.num_cached_block[row] = num_full

    def shares_cache_plans(self) -> bool:
        """Does :meth:`cache_blocks` register exactly its :meth:`cache_plan` (no extra
        rule, such as full attention's partial tail key or Mamba's state blocks)?"""
        return type(self).cache_blocks is SingleTypeKVCacheManager.cache_blocks

    # -- freeing -----------------------------------------------------------------
    def skipped_end(self, row: int, num_computed_tokens: int) -> int:
        """How many leading columns of the row left the window (or chunk) once
        ``num_computed_tokens`` are computed: ``min(skipped // bs, len)``, 0 when none.
        Example: w 4, bs 2, 7 computed, 4 columns -> 4 skipped tokens -> 2."""
        skipped = self.spec.num_skipped_tokens(num_computed_tokens)
        if skipped <= 0:
            return 0
        return min(skipped // self.block_size, self.row_len.item(row))

    def remove_skipped_blocks(self, row: int, num_computed_tokens: int) -> None:
        end = self.skipped_end(row, num_computed_tokens)
        if end > 0:
            self._remove_blocks_in_range(row, 0, end)

    def _remove_blocks_in_range(self, row: int, first: int, last: int) -> None:
        """Free ``row[max(first, leading) : last]`` tail first and null it."""
        start = max(first, self.num_leading_null.item(row))
        if start >= last:
            return
        if last == start + 1:  # one block (a decode step's window move): scalar path
            self.block_pool.free_block(self.take_block_at(row, start))
            return
        self.block_pool.free_blocks(self._take_blocks_in_range(row, start, last))

    def take_block_at(self, row: int, column: int) -> int:
        """:meth:`_take_blocks_in_range` of the one column ``column`` (the leading nulls
        end there): null it and return its block. Example: row ``[0, 4, 6]``, leading 1,
        column 1 -> 4, row ``[0, 0, 6]``, leading 2."""
        table = self.table
        block = table.item(row, column)
        table[row, column] = NULL_BLOCK_ID
        self.dirty_rows[row] = True
        self.num_leading_null[row] = column + 1
        return block

    def _take_blocks_in_range(self, row: int, start: int, last: int) -> np.ndarray:
        """Null ``row[start:last]`` (``start`` at or past the leading nulls) and return its
        blocks tail first, for the caller to free. Example: row ``[0, 4, 6, 8]``, leading 1,
        ``(1, 3)`` -> ``[6, 4]``, row ``[0, 0, 0, 8]``, leading 3."""
        freed = self.table[row, start:last][::-1].copy()
        self.table[row, start:last] = NULL_BLOCK_ID
        self.dirty_rows[row] = True
        self.num_leading_null[row] = last
        return freed

    def new_step_starts(self) -> None:
        """A scheduler step begins (only Mamba keeps per-step state)."""

    # -- batched step ------------------------------------------------------------
    def pending_work(
        self,
        rows: np.ndarray,
        total: np.ndarray,
        main: np.ndarray,
        slots: np.ndarray,
        cache_tokens: np.ndarray,
        num_hashed: np.ndarray,
        boundary: np.ndarray,
    ) -> np.ndarray:
        """Rows for which this step's allocate_slots changes something in this group.

        remove_skipped: ``min(skipped // bs, len) > leading``; allocation: ``cdiv(slots, bs)
        > len`` (a row with no hit needs a block only then, running or not); caching:
        ``min(cache_tokens, hashed) // bs > num_cached``.
        """
        bs = self.block_size
        held = self.row_len[rows]
        work = -(-slots // bs) > held
        skipped = self._skipped_tokens(total)
        if skipped is not None:
            work |= np.minimum(skipped // bs, held) > self.num_leading_null[rows]
        if self.enable_caching:
            num_full = np.minimum(cache_tokens, num_hashed) // bs
            work |= num_full > np.maximum(self.num_cached_block[rows], 0)
        return work

    def _skipped_tokens(self, total: np.ndarray) -> np.ndarray | None:
        """Vectorised ``spec.num_skipped_tokens`` (None: never skips)."""
        return None

    def _first_total_skipping(self, tokens: np.ndarray) -> np.ndarray:
        """The smallest computed count whose ``num_skipped_tokens`` reaches ``tokens`` (the
        inverse of :meth:`_skipped_tokens`), for a class that :attr:`drops_blocks`."""
        raise NotImplementedError(f"{type(self).__name__} drops no blocks")

    def always_tested(self) -> bool:
        """Must every decode item be tested in this group (no threshold applies)? Yes for a
        class that adds its own rule to :meth:`pending_work` unless it says otherwise (the
        threshold restates the base rule only)."""
        return type(self).pending_work is not SingleTypeKVCacheManager.pending_work

    def decode_work_threshold(self, rows: np.ndarray) -> np.ndarray:
        """Per row, a computed-token count below which a decode item of one new token (no
        hit, no lookahead) changes nothing in this group: the least ``c`` at which
        :meth:`pending_work` may flag it, from the row's counts alone (:meth:`_threshold`;
        0 for every row when :meth:`always_tested`)."""
        if self.always_tested():
            return np.zeros(len(rows), dtype=np.int64)
        held, leading = self.row_len[rows], getattr(self, self.dropped_columns)[rows]
        cached = self.num_cached_block[rows]
        if same_everywhere(held) and same_everywhere(leading) and same_everywhere(cached):
            # rows alike (a batch prefilled together): one row's figure for all
            one = self._threshold(
                held.item(0), leading.item(0), max(cached.item(0), 0), min, _select
            )
            return np.full(len(held), one, dtype=np.int64)
        return self._threshold(held, leading, np.maximum(cached, 0), np.minimum, np.where)

    def decode_work_threshold_of(self, row: int) -> int:
        """:meth:`decode_work_threshold` of one row, on Python ints (a few loud rows)."""
        if self.always_tested():
            return 0
        cached = max(self.num_cached_block.item(row), 0)
        dropped = getattr(self, self.dropped_columns).item(row)
        return self._threshold(self.row_len.item(row), dropped, cached, min, _select)

    def _threshold(self, held, leading, cached, minimum, select):
        """The rule of :meth:`decode_work_threshold` over the counts (ints or arrays, with
        the matching ``minimum`` and ``select``): with ``c`` computed a one-token decode
        item has ``slots = c + 1`` and caches at most ``c + 1`` tokens, so it allocates
        once ``c >= held * bs``, drops a block once ``c`` skips ``(leading + 1) * bs``
        tokens (only while ``held > leading``) and caches once ``c + 1 >= (cached + 1) *
        bs``. Counts only grow while a request holds its row, so the figure stays a lower
        bound until the row is released.
        Example: bs 16, w 32, held 3, leading 1, cached 2: allocation at 48, window at
        ``32 + 31 = 63``, caching at 47 -> 47."""
        bs = self.block_size
        least = held * bs  # (int32 arrays: counts stay far below 2**31)
        if self.drops_blocks:
            first = self._first_total_skipping((leading + 1) * bs)
            least = select(held > leading, minimum(least, first), least)
        if self.enable_caching:
            least = minimum(least, cached * bs + (bs - 1))
        return least
