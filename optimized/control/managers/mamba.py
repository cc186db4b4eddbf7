"""Mamba state in "align" mode (:mod:`reference.managers.mamba`), on arrays.

The row is position indexed: allocation fills ``[len, c)`` with nulls and appends one
block at ``c = cdiv(main, bs) - 1``; ``num_retired_blocks[row]`` columns were retired
(never revisited), ``last_state_block_index[row]`` (``-1``: none) is the previous state,
freed once a later step is past it. Hit: the rightmost cached state at an aligned
boundary (:func:`reference.managers.mamba.mamba_hit`); a state cached during the current
step is refused until ``new_step_starts``. Which states are cached follows the retention
interval (:func:`reference.managers.mamba.mamba_cache_mask`).

Example, bs 4: prefill 10 tokens -> row ``[0, 0, s]``; the step computing token 13 appends
a block at column 3 and remembers column 2; the step after frees ``s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

import numpy as np

from optimized.control.block_pool import NULL_BLOCK_ID, BlockPool
from optimized.control.managers.base import SingleTypeKVCacheManager, lookup_words
from optimized.control.request import Request
from reference.managers.mamba import mamba_cache_mask, mamba_hit
from reference.specs import KVCacheSpec, cdiv


class MambaManager(SingleTypeKVCacheManager):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        n = self.row_len.shape[0]
        self.cached_keys_this_step: set[bytes] = set()
        self.last_state_block_index = np.full(n, -1, dtype=np.int32)
        self.num_retired_blocks = np.zeros(n, dtype=np.int32)

    def _row_arrays(self) -> tuple[str, ...]:
        return (*super()._row_arrays(), "last_state_block_index", "num_retired_blocks")

    def _absent_minus_one(self) -> tuple[str, ...]:
        return (*super()._absent_minus_one(), "last_state_block_index")

    def release_row(self, row: int) -> None:
        super().release_row(row)
        self.last_state_block_index[row] = -1
        self.num_retired_blocks[row] = 0

    scan = staticmethod(mamba_hit)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        group_ids: Sequence[int],
        pool: BlockPool,
        spec: KVCacheSpec,
        alignment: int,
        drop_eagle: bool = False,
    ) -> tuple[list[list[int]], int]:
        """:func:`reference.managers.mamba.mamba_hit` with its lookups in bulk: the
        rightmost state ``i < min(max_length // bs, hashed)`` cached in every group whose
        end ``(i + 1) * bs`` is aligned -> ``[0] * i + [state]`` per group. The first
        group's lookups are one call (compiled from the right when the pool keeps keys as
        words, :meth:`~optimized.control.key_index.ArrayKeyIndex.rightmost`; else one
        C-level ``map``); the other groups are asked only for a state the first caches.
        Example: bs 4, A 8, states 1 and 2 cached, max 15 -> state 2 ends at 12, not
        aligned -> state 1: ``[0, s1]``, hit 8."""
        bs = spec.block_size
        k = bs // pool.hash_block_size
        hashes = list(islice(block_hashes, k - 1, k * (max_length // bs), k))
        index = pool.index
        free_end = bs == alignment
        if pool.keys_as_words:
            words = lookup_words(block_hashes, pool, bs)
            i = len(hashes)
            while True:
                i = index.rightmost(words, group_ids[0], i, bs, alignment)
                if i < 0:
                    return [[] for _ in group_ids], 0
                states = [index.get(hashes[i], g) for g in group_ids]
                if None not in states:
                    return [[NULL_BLOCK_ID] * i + [state] for state in states], (i + 1) * bs
        first = index.get_many(hashes, group_ids[0])  # one C-level pass
        for i in range(len(hashes) - 1, -1, -1):
            state = first[i]
            if state is None or (not free_end and (i + 1) * bs % alignment):
                continue
            states = [state, *(index.get(hashes[i], g) for g in group_ids[1:])]
            if None in states:
                continue
            return [[NULL_BLOCK_ID] * i + [state] for state in states], (i + 1) * bs
        return [[] for _ in group_ids], 0

    cacheable_block_mask = mamba_cache_mask

    def get_num_blocks_to_allocate(
        self,
        row: int,
        num_tokens: int,
        new_computed_blocks: Sequence[int],
        total_computed_tokens: int,
        num_tokens_main: int,
    ) -> int:
        if new_computed_blocks:
            key = self.block_pool.index.key_of(new_computed_blocks[-1])
            if key is not None and key in self.cached_keys_this_step:
                return self.block_pool.num_blocks + 1
        required = cdiv(num_tokens_main, self.block_size)
        num_new = required - len(new_computed_blocks) - int(self.row_len[row])
        if num_new > 0:
            num_new = min(num_new, 1)
        ref = self.block_pool.ref_cnt
        evictable = sum(1 for b in new_computed_blocks if b != NULL_BLOCK_ID and ref[b] == 0)
        return num_new + evictable

    def num_new_blocks(self, row: int, num_tokens: int, num_tokens_main: int) -> int:
        """One state block when ``cdiv(main, bs)`` passes the row's columns, else none."""
        return 1 if cdiv(num_tokens_main, self.block_size) > self.row_len.item(row) else 0

    def place_new_blocks(self, row: int, new_blocks: Sequence[int], num_tokens_main: int) -> None:
        """The state block goes to column ``cdiv(main, bs) - 1``, nulls before it; the
        previous last column is remembered as the state to free later."""
        held = self.row_len.item(row)
        if held:
            self.last_state_block_index[row] = held - 1
        gap = max(0, cdiv(num_tokens_main, self.block_size) - 1 - held)
        self._append(row, [NULL_BLOCK_ID] * gap + list(new_blocks))

    def cache_blocks(self, request: Request, row: int, num_tokens: int) -> None:
        before = max(int(self.num_cached_block[row]), 0)
        super().cache_blocks(request, row, num_tokens)
        after = max(int(self.num_cached_block[row]), 0)
        key_of = self.block_pool.index.key_of
        for block in self.table[row, before:after].tolist():
            if block != NULL_BLOCK_ID:
                key = key_of(block)
                if key is not None:
                    self.cached_keys_this_step.add(key)

    def remove_skipped_blocks(self, row: int, num_computed_tokens: int) -> None:
        super().remove_skipped_blocks(row, num_computed_tokens)
        last = int(self.last_state_block_index[row])
        if last >= 0 and last < cdiv(num_computed_tokens, self.block_size) - 1:
            block = int(self.table[row, last])
            if block != NULL_BLOCK_ID:
                self.block_pool.free_blocks([block])
                self.table[row, last] = NULL_BLOCK_ID
                self.dirty_rows[row] = True

    def _remove_blocks_in_range(self, row: int, first: int, last: int) -> None:
        first = max(first, int(self.num_retired_blocks[row]))
        last = min(last, int(self.row_len[row]))
        if first >= last:
            return
        freed = self.table[row, first:last][::-1].copy()
        self.table[row, first:last] = NULL_BLOCK_ID
        self.dirty_rows[row] = True
        self.block_pool.free_blocks(freed)
        self.num_retired_blocks[row] = last

    def new_step_starts(self) -> None:
        self.cached_keys_this_step.clear()

    #: the decode threshold reads the retired columns (:meth:`_threshold`)
    dropped_columns = "num_retired_blocks"

    def always_tested(self) -> bool:
        """Never: :meth:`_threshold` restates :meth:`pending_work`'s rule for a decode
        item (its stale-state test never fires there, see :meth:`_threshold`)."""
        return False

    def _threshold(self, held, retired, cached, minimum, select):
        """:meth:`SingleTypeKVCacheManager._threshold` of a Mamba row, ``retired`` its
        retired columns: with ``c`` computed a one-token decode item (``main = c + 1``)
        takes a new state block once ``cdiv(c + 1, bs) > held``, i.e. ``c >= held * bs``;
        retires columns once ``min((c - 1) // bs, held) > retired``, at the earliest
        ``c = (retired + 1) * bs + 1`` (later while ``held <= retired``: the figure stays a
        lower bound); caches once ``c + 1 >= (cached + 1) * bs``. The previous state
        (``last_state_block_index``) sits at a column before ``held``: below ``retired``
        it is null already, else the retirement that passes it frees it just before the
        stale-state test of :meth:`remove_skipped_blocks` reads it, so that test adds no
        work. Every term grows with the counts.
        Example: bs 16, held 3, retired 1, cached 2: allocation at 48, retirement at 33,
        caching at 47 -> 33."""
        bs = self.block_size
        least = minimum(held * bs, (retired + 1) * bs + 1)
        if self.enable_caching:
            least = minimum(least, cached * bs + (bs - 1))
        return least

    def pending_work(self, rows, total, main, slots, cache_tokens, num_hashed, boundary):
        """Mamba: a new state column, a retirement, or the previous state to free."""
        bs = self.block_size
        held = self.row_len[rows]
        work = -(-main // bs) > held
        skipped = np.maximum(total - 1, 0)
        work |= (skipped > 0) & (np.minimum(skipped // bs, held) > self.num_retired_blocks[rows])
        last = self.last_state_block_index[rows]
        stale = (last >= 0) & (last < -(-total // bs) - 1)
        if stale.any():
            idx = np.flatnonzero(stale)
            work[idx[self.table[rows[idx], last[idx]] != NULL_BLOCK_ID]] = True
        if self.enable_caching:
            num_full = np.minimum(cache_tokens, num_hashed) // bs
            work |= num_full > np.maximum(self.num_cached_block[rows], 0)
        return work
