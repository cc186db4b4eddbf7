"""Coordinators (:mod:`reference.coordinator`): one pool, one manager per group, rows.

* No prefix cache: lookups return nothing.
* Unitary (one group): the group's own hit, aligned to its block size.
* Hybrid: the reference's fixed-point search (:func:`reference.coordinator.hybrid_cache_hit`)
  over spec groups (:func:`reference.coordinator.spec_groups_of`) with the optimized
  managers' lookups (bulk scans), after a one-lookup miss test (the full-attention group's
  first block). Hybrids cache only up to a multiple of the LCM.

Allocation pops a request's new blocks for every group at once (group order), and counts
a request with no row and no hit without taking a row (a refused admission takes none).

Rows: each request gets one row index, shared by every group's table, from the first
allocation until ``free``; released rows are reused (lowest first) and the tables grow by
doubling when every row is taken.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Sequence
from itertools import repeat

import numpy as np

from optimized.control.block_pool import (
    NULL_BLOCK_ID,
    SMALL_FREE,
    SMALL_REORDER,
    BlockPool,
    RunEnds,
)
from optimized.control.hashing import chain_words
from optimized.control.managers import SingleTypeKVCacheManager, manager_class_for
from optimized.control.managers.base import BlockList, HitAdmission, HitAdoption
from optimized.control.request import Request
from optimized.control.row_freeing import RowFreeing
from optimized.control.row_store import RowStore
from optimized.control.uniformity import row_index
from reference.coordinator import hybrid_coordinator_hit, make_managers, spec_groups_of
from reference.layout import KVCacheLayout
from reference.managers.base import blocks_to_allocate
from reference.specs import FullAttentionSpec, MambaSpec

#: Rows preallocated per group table before the first doubling.
DEFAULT_MAX_NUM_REQS = 64


def front_chain(positions: list[int], blocks: list[int], lengths: Sequence[int]) -> list[int]:
    """The front chain of successive frees of runs laid end to end (``lengths``): the
    ``blocks`` at ascending ``positions`` taken run by run, the last run first, each run
    keeping its order (one bisection per run, no step per block). Example: lengths ``[2,
    0, 3]``, positions ``[1, 2, 4]``, blocks ``[7, 8, 9]`` -> ``[8, 9, 7]``."""
    out: list[int] = []
    hi = len(positions)
    start = sum(lengths)
    for length in reversed(lengths):
        if not hi:
            break
        start -= length
        lo = bisect_left(positions, start, 0, hi)
        out += blocks[lo:hi]
        hi = lo
    return out


def _never(block: int) -> bool:
    """No hit block to test (``blocks_to_allocate``'s ``evictable`` of a request with no
    hit is never called)."""
    return False


class KVCacheCoordinator:
    """Shared pool, per-group managers and the request -> row map.

    ``min_batched_free``: :meth:`free_many` of fewer requests than this reads their rows one
    by one (:meth:`_free_few_rows`; the sheet form costs some dozens of numpy calls:
    measured on the bench's decode-heavy trace, 2 or 3 requests cost more that way).
    """

    #: Fewer requests than this are freed by :meth:`_free_few_rows` in :meth:`free_many`.
    min_batched_free: int = 8

    def __init__(
        self,
        layout: KVCacheLayout,
        max_num_reqs: int = DEFAULT_MAX_NUM_REQS,
        compiled: bool = True,
    ) -> None:
        self.layout = layout
        self.enable_caching = layout.enable_caching
        self.block_pool = BlockPool(
            layout.num_blocks,
            layout.enable_caching,
            layout.hash_block_size,
            len(layout.groups),
            compiled,
        )
        alignment = self.cache_hit_alignment()
        self.managers: list[SingleTypeKVCacheManager] = make_managers(
            layout,
            self.block_pool,
            alignment,
            manager_class_for,
            max_model_len=layout.max_model_len,
            max_num_reqs=max_num_reqs,
        )
        self.max_num_reqs = max_num_reqs
        #: every group's row arrays stacked (the managers' arrays are views of them)
        self._rows = RowStore(self.managers, max_num_reqs)
        self.row_of: dict[str, int] = {}
        self._free_rows: list[int] = list(range(max_num_reqs))
        #: no Mamba group: a new request's block count follows
        #: :func:`reference.managers.base.blocks_to_allocate` in every group
        self.plain_counts = not any(isinstance(g.spec, MambaSpec) for g in layout.groups)
        #: every group counts and adopts a hit by the base rules (no Mamba group) and
        #: caching is on: a new request's hit takes :meth:`count_hit_admission`
        self.plain_hits = layout.enable_caching and all(
            type(m).get_num_blocks_to_allocate
            is SingleTypeKVCacheManager.get_num_blocks_to_allocate
            and type(m).add_local_computed_blocks
            is SingleTypeKVCacheManager.add_local_computed_blocks
            for m in self.managers
        )
        #: per group, whether it caches new blocks from their list (:meth:`cache_new_blocks`)
        self._caches_fresh = [m.shares_cache_plans() for m in self.managers]
        #: per group, the first group with an equal spec (counts computed once per spec)
        specs = [g.spec for g in layout.groups]
        self._first_of_spec: tuple[int, ...] = tuple(specs.index(spec) for spec in specs)
        #: per group, ``(bs, blocks its spec skips with nothing computed)``
        #: (:meth:`num_blocks_for_new_request`)
        self._skipped_at_zero: tuple[tuple[int, int], ...] = tuple(
            (spec.block_size, spec.num_skipped_tokens(0) // spec.block_size) for spec in specs
        )
        #: frees whole rows in compiled code where the groups allow it (None: the numpy
        #: paths, ``compiled`` False)
        self._row_freeing = RowFreeing(self) if compiled else None

    # -- rows --------------------------------------------------------------------
    def row(self, request_id: str) -> int:
        """The request's row, taking a free one (lowest index) on first use."""
        row = self.row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                self._grow(2 * self.max_num_reqs)
            row = heapq.heappop(self._free_rows)
            self.row_of[request_id] = row
        return row

    def row_store(self) -> RowStore:
        """The stacked row arrays of the current managers (bound again when the managers
        were replaced after the coordinator was built, as a mutant does)."""
        if not self._rows.bound_to(self.managers):
            self._rows = RowStore(self.managers, self.max_num_reqs)
        return self._rows

    def _grow(self, max_num_reqs: int) -> None:
        self.row_store().grow(max_num_reqs)
        for r in range(self.max_num_reqs, max_num_reqs):
            heapq.heappush(self._free_rows, r)
        self.max_num_reqs = max_num_reqs

    # -- hits --------------------------------------------------------------------
    def cache_hit_alignment(self) -> int:
        return self.layout.scheduler_block_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int, int]:
        """``(blocks per group, hit, uncached)`` (:meth:`reference.coordinator.
        KVCacheCoordinator.find_longest_cache_hit`)."""
        raise NotImplementedError

    #: the tokens caching registers are rounded down to a multiple of this (a hybrid
    #: coordinator's scheduler block size, the LCM of its groups' block sizes)
    cache_unit: int = 1

    def num_cacheable_tokens(self, num_tokens: int) -> int:
        """``num_tokens`` rounded down to :attr:`cache_unit`. Example: unit 32, 70 -> 64."""
        return num_tokens // self.cache_unit * self.cache_unit

    # -- allocation --------------------------------------------------------------
    def get_num_blocks_to_allocate(
        self,
        row: int,
        num_tokens: int,
        hit_blocks: Sequence[Sequence[int]],
        total_computed: int,
        num_tokens_main: int,
    ) -> int:
        return sum(
            m.get_num_blocks_to_allocate(
                row, num_tokens, hit_blocks[i], total_computed, num_tokens_main
            )
            for i, m in enumerate(self.managers)
        )

    def count_hit_admission(
        self, hit_blocks: Sequence[Sequence[int]], num_tokens: int, total_computed: int
    ) -> tuple[int, HitAdmission]:
        """:meth:`get_num_blocks_to_allocate` of a request on a fresh row (nothing held,
        not running) adopting ``hit_blocks``, for :attr:`plain_hits` layouts, with the hit
        prepared for :meth:`adopt_hit` on the way (one array per group; every group's
        real blocks' counts read with one gather). Per group
        (:func:`reference.managers.base.blocks_to_allocate` with ``held = 0``):
        ``max(cdiv(num_tokens, bs) - max(skipped, len(hit)), 0)`` plus the hit blocks
        past the ``skipped`` ones that sit free (count 0, not null), all counted before
        any adoption. Nothing changes, so a refusal leaves no trace. Example: SWA w 4,
        bs 2, hit ``[3, 5, 7]`` over 6 computed tokens, 10 slots, 7 free: ``5 - max(1, 3)
        = 2``, plus 1 -> 3."""
        need = 0
        groups: list[HitAdoption] = []
        seen: set[int] = set()
        num_kept = 0
        for m, hit in zip(self.managers, hit_blocks):
            bs = m.block_size
            skipped = m.spec.num_skipped_tokens(total_computed) // bs
            need += max(-(-num_tokens // bs) - max(skipped, len(hit)), 0)
            kept_ids = hit[skipped:]
            kept = np.array(kept_ids, dtype=np.intp)
            real = kept if np.count_nonzero(kept) == kept.size else kept[kept != NULL_BLOCK_ID]
            groups.append(HitAdoption(skipped, kept, real))
            seen.update(kept_ids)
            num_kept += len(kept_ids)
        real = groups[0].real if len(groups) == 1 else np.concatenate([a.real for a in groups])
        counts = self.block_pool.ref_cnt[real]
        need += real.size - np.count_nonzero(counts)
        # (nulls count as repeats: ``distinct`` may be False with none repeated, never True
        # with one repeated)
        return need, HitAdmission(groups, real, counts, len(seen) == num_kept)

    def adopt_hit(self, row: int, admission: HitAdmission) -> None:
        """Adopt the hit :meth:`count_hit_admission` has just counted on the fresh ``row``
        (what :meth:`allocate_new_computed_blocks` does there): every group's real blocks
        touched at once (:meth:`BlockPool.touch_array` with the counts read then: nothing
        changed the pool since; the same counts and queue as a touch per group), then
        each group's row written."""
        if admission.real.size and self.enable_caching:
            self.block_pool.touch_array(admission.real, admission.distinct, admission.counts)
        for m, adoption in zip(self.managers, admission.groups):
            m.adopt_hit(row, adoption)

    def allocate_new_computed_blocks(
        self, row: int, hit_blocks: Sequence[Sequence[int]], num_local_computed_tokens: int
    ) -> None:
        """Adopt a hit in every group; nothing for a request already on the running path."""
        if any(m.num_cached_block[row] >= 0 for m in self.managers):
            return
        for i, m in enumerate(self.managers):
            m.add_local_computed_blocks(row, hit_blocks[i], num_local_computed_tokens)

    def num_blocks_for_new_request(self, num_tokens: int, total_computed: int) -> int:
        """:meth:`get_num_blocks_to_allocate` of a request with no row (no blocks in any
        group, not running) and no hit, without taking a row: each group's
        :func:`reference.managers.base.blocks_to_allocate` with nothing held, computed
        once per distinct spec. Only for :attr:`plain_counts` layouts (a Mamba group
        counts its own way). Example: full bs 16 + 5 windows of bs 16, 2048 slots, nothing
        computed -> ``6 * 128 = 768``. With nothing computed (a new request with no hit)
        each group needs ``cdiv(num_tokens, bs)`` less the blocks its spec skips at 0
        (none for any attention type), read from ``_skipped_at_zero``."""
        if total_computed == 0:
            return sum([max(-(-num_tokens // bs) - s, 0) for bs, s in self._skipped_at_zero])
        counts = [0] * len(self._first_of_spec)
        for g, first in enumerate(self._first_of_spec):
            if first == g:
                spec = self.layout.groups[g].spec
                counts[g] = blocks_to_allocate(
                    spec, num_tokens, 0, False, (), total_computed, _never
                )
            else:
                counts[g] = counts[first]
        return sum(counts)

    def allocate_new_blocks(
        self, row: int, num_tokens: int, num_tokens_main: int
    ) -> list[BlockList]:
        """Each group's :meth:`SingleTypeKVCacheManager.allocate_new_blocks`, in group
        order (:meth:`allocate_new_block_arrays`, its lists)."""
        return self.allocate_new_block_arrays(row, num_tokens, num_tokens_main)[0]

    def allocate_new_block_arrays(
        self, row: int, num_tokens: int, num_tokens_main: int
    ) -> tuple[list[BlockList], list[np.ndarray] | None]:
        """Each group's :meth:`SingleTypeKVCacheManager.allocate_new_blocks`, in group
        order, with the groups' blocks popped at once (group 0's first: the blocks each
        group's own pop would take, since nothing else touches the queue in between) and
        placed per group; also each group's blocks as a slice of the popped array (None
        when a few blocks were popped group by group). Example: 2 groups needing 2 and 1
        blocks, queue ``[4, 5, 6, 7]`` -> ``[[4, 5], [6]]`` (and arrays of the same)."""
        managers = self.managers
        counts = [m.num_new_blocks(row, num_tokens, num_tokens_main) for m in managers]
        total = sum(counts)
        if total <= SMALL_FREE:
            lists = [m.allocate_new_blocks(row, num_tokens, num_tokens_main) for m in managers]
            return lists, None
        ids = self.block_pool.get_new_block_array(total)
        as_list = ids.tolist()
        out: list[BlockList] = []
        arrays: list[np.ndarray] = []
        at = 0
        for m, n in zip(managers, counts):
            part = ids[at : at + n]
            if n:
                m.place_new_blocks(row, part, num_tokens_main)
            out.append(as_list[at : at + n])
            arrays.append(part)
            at += n
        return out, arrays

    def cache_blocks(self, request: Request, row: int, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        cacheable = self.num_cacheable_tokens(num_tokens)
        for m in self.managers:
            m.cache_blocks(request, row, cacheable)

    def cache_new_blocks(
        self,
        request: Request,
        row: int,
        num_tokens: int,
        new_blocks: Sequence[Sequence[int]],
        new_arrays: Sequence[np.ndarray] | None = None,
    ) -> None:
        """:meth:`cache_blocks` right after the allocation that appended ``new_blocks`` (per
        group; ``new_arrays``: the same as arrays, or None) to the row: a group that
        :meth:`SingleTypeKVCacheManager.shares_cache_plans` registers from its new blocks
        (:meth:`SingleTypeKVCacheManager.cache_new_blocks`), any other its own way."""
        if not self.enable_caching:
            return
        cacheable = self.num_cacheable_tokens(num_tokens)
        arrays = repeat(None) if new_arrays is None else new_arrays
        for m, new, array, fresh in zip(self.managers, new_blocks, arrays, self._caches_fresh):
            if fresh:
                m.cache_new_blocks(request, row, cacheable, new, array)
            else:
                m.cache_blocks(request, row, cacheable)

    def remove_skipped_blocks(self, row: int, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(row, num_computed_tokens)

    def free_many(self, request_ids: Sequence[str]) -> None:
        """:meth:`free` of each id in order, in one pass: the blocks of request 1 group 0
        (reversed), request 1 group 1, ..., request 2 group 0, ... go to
        :meth:`BlockPool.free_runs` as one run per (request, group), which gives the counts
        and free queue of the successive calls (shared blocks move at their last
        reference). Fewer than :attr:`min_batched_free` requests take
        :meth:`_free_few_rows` (rows read one by one: measured cheaper for a few rows than
        the sheets), more one sheet per group
        (:meth:`SingleTypeKVCacheManager.rows_held`). Example: ids ``a, b`` one group,
        tables ``[1, 2]``, ``[3]``, all unhashed -> queue ``[3, 2, 1, ...]`` as
        ``free(a); free(b)`` gives."""
        rows = [r for r in map(self.row_of.pop, request_ids, repeat(None)) if r is not None]
        if rows and self._row_freeing is not None and self._row_freeing.free(rows):
            self._free_rows.extend(rows)
            heapq.heapify(self._free_rows)
            return
        if len(rows) < max(self.min_batched_free, 1):
            if rows:
                self._free_few_rows(rows)
            return
        at = row_index(np.asarray(rows, dtype=np.intp))  # consecutive rows: views, no gathers
        num_groups = len(self.managers)
        # one (rows x columns) sheet: each group's columns reversed, groups side by side
        sheets = [m.rows_held(at)[:, ::-1] for m in self.managers]
        flat = np.concatenate(sheets, axis=1, dtype=np.intp).ravel()
        for m in self.managers:
            m.release_rows(at)
        width = flat.size // len(rows)
        widths = [s.shape[1] for s in sheets]

        def runs_of(where: np.ndarray) -> np.ndarray:
            """The (request, group) run of positions of ``flat``: row * groups + group."""
            group_of_column = np.repeat(np.arange(num_groups), widths)
            return where // width * num_groups + group_of_column[where % width]

        self.block_pool.free_runs(flat, runs_of)
        self._free_rows.extend(rows)
        heapq.heapify(self._free_rows)  # (linear: cheaper than a push per row)

    def free(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        if self._row_freeing is not None and self._row_freeing.free((row,)):
            heapq.heappush(self._free_rows, row)
            return
        self._free_few_rows((row,))

    def _free_few_rows(self, rows: Sequence[int]) -> None:
        """Free each of a few ``rows`` in order (each group's blocks tail first, groups in
        order, then the row released in every group), in one pass. Each row is read up
        to its length, nulls skipped by value (a stale leading-null count cannot hide a
        block). When every block is held once (ref count 1: the common case, no prefix
        shared with another request) no block occurs twice and each reaches 0: the queue
        gets the unhashed blocks at the front run by run, the last run first, and the
        hashed ones at the back in run order (a run: one row's group, tail first;
        :func:`front_chain`). Any other count (a prefix shared by some of the rows or
        held by another request, a block not held) goes to :meth:`BlockPool.free_runs`
        with its repeats counted. Either way: the counts and queue of the successive
        frees. Example: one row, groups ``[0, 0, 7, 9]`` (9 unhashed) and ``[4, 5]`` (5
        unhashed), each held once -> the back gets ``[7, 4]``, the front ``[5, 9]``."""
        managers = self.managers
        pool = self.block_pool
        lengths: list[int] = []
        parts: list[np.ndarray] = []
        for row in rows:
            for m in managers:
                n = m.row_len.item(row)
                lengths.append(n)
                parts.append(m.table[row, n - 1 :: -1] if n else m.table[row, :0])
        table_ids = np.concatenate(parts, dtype=np.intp)
        at = table_ids.nonzero()[0]
        ids = table_ids.take(at) if at.size < table_ids.size else table_ids
        if ids.size:
            if not pool.all_held_once(ids):
                # a block held more than once (a shared prefix) or not held: one pass that
                # counts the repeats (:meth:`BlockPool.free_runs`, one run per row and group;
                # one row's blocks are distinct)
                pool.free_runs(table_ids, RunEnds(lengths), repeats=len(rows) > 1)
                self._release_rows(rows)
                return
            pool.ref_cnt[ids] = 0
            to_front = pool.block_group.take(ids) < 0
            front = to_front.nonzero()[0]
            queue = pool.free_block_queue
            if not front.size:
                queue.append_n(ids)
            else:
                if front.size <= SMALL_REORDER:  # a few (the decode case): lists
                    chain = front_chain(at.take(front).tolist(), ids.take(front).tolist(), lengths)
                else:  # many (no prefix cache): one slice per run
                    chain = RunEnds(lengths).last_first(at.take(front), ids.take(front))
                if front.size == ids.size:
                    queue.prepend_n(chain)
                else:
                    queue.prepend_append(chain, ids.compress(~to_front))
        self._release_rows(rows)

    def _release_rows(self, rows: Sequence[int]) -> None:
        """Release each of ``rows`` in every group and return it to the free rows."""
        managers = self.managers
        for row in rows:
            for m in managers:
                m.release_row(row)
            heapq.heappush(self._free_rows, row)

    def new_step_starts(self) -> None:
        for m in self.managers:
            m.new_step_starts()

    def get_blocks(self, request_id: str) -> list[BlockList]:
        row = self.row_of.get(request_id)
        if row is None:
            return [[] for _ in self.managers]
        return [m.blocks(row) for m in self.managers]


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int, int]:
        return [[] for _ in self.managers], 0, 0


class UnitaryCoordinator(KVCacheCoordinator):
    def cache_hit_alignment(self) -> int:
        return self.layout.groups[0].spec.block_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int, int]:
        m = self.managers[0]
        blocks, hit = m.find_longest_cache_hit(
            block_hashes, max_length, [0], self.block_pool, m.spec, self.cache_hit_alignment()
        )
        return blocks, hit, 0


class HybridCoordinator(KVCacheCoordinator):
    def __init__(
        self,
        layout: KVCacheLayout,
        max_num_reqs: int = DEFAULT_MAX_NUM_REQS,
        compiled: bool = True,
    ) -> None:
        super().__init__(layout, max_num_reqs, compiled)
        self.spec_groups = spec_groups_of(self.managers)
        self.scheduler_block_size = layout.scheduler_block_size
        self.cache_unit = layout.scheduler_block_size
        #: the first full-attention spec group's ids and its block size in hash blocks
        #: (None: no full-attention group), for the miss test of ``find_longest_cache_hit``
        self._first_full: tuple[list[int], int] | None = next(
            (
                (sg.group_ids, sg.spec.block_size // layout.hash_block_size)
                for sg in self.spec_groups
                if isinstance(sg.spec, FullAttentionSpec)
            ),
            None,
        )
        #: one full-attention spec group and one other, no EAGLE drop: the search is
        #: one pass (:meth:`_two_spec_hit`)
        self._two_specs = (
            len(self.spec_groups) == 2
            and isinstance(self.spec_groups[0].spec, FullAttentionSpec)
            and not any(sg.use_eagle for sg in self.spec_groups)
        )

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int, int]:
        """:func:`reference.coordinator.hybrid_coordinator_hit` over the optimized managers,
        after one test that settles a miss: the full-attention spec group is searched
        first from block 0, so when its first block misses in one of its groups (or
        ``max_length`` or the hashes do not reach one block) its hit is 0, every later
        group is asked for at most 0 tokens, and the answer is no block, hit 0, uncached
        0. Example: full bs 16 + windows, a 2048-token prompt whose first 16 tokens are
        not cached -> ``([[], ...], 0, 0)`` after one lookup."""
        first = self._first_full
        if first is not None:
            group_ids, ratio = first
            if max_length < ratio * self.block_pool.hash_block_size or len(block_hashes) < ratio:
                return [[] for _ in self.managers], 0, 0
            pool = self.block_pool
            if pool.keys_as_words:  # the key's row of the chain's words: no conversion
                words = chain_words(block_hashes)
                get_row = pool.index.get_row
                if any(get_row(words, ratio - 1, g) is None for g in group_ids):
                    return [[] for _ in self.managers], 0, 0
            else:
                key = block_hashes[ratio - 1]
                get = pool.index.get
                for g in group_ids:
                    if get(key, g) is None:
                        return [[] for _ in self.managers], 0, 0
        if self._two_specs:
            return self._two_spec_hit(block_hashes, max_length)
        return hybrid_coordinator_hit(self, block_hashes, max_length)

    def _two_spec_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int, int]:
        """:func:`reference.coordinator.hybrid_cache_hit` of one full-attention spec group
        and one other (no EAGLE: its one pass): the full groups' hit ``F <= max_length``,
        then the other spec group's hit ``h <= F``; the full lists are cut to ``cdiv(h,
        bs)`` blocks and ``uncached = F - h``. Example (full bs 4 + SWA, max 15): full 12
        (3 blocks), SWA asked for ``<= 12`` answers 8 -> full lists cut to 2 blocks, hit
        8, uncached 4."""
        full, other = self.spec_groups
        pool = self.block_pool
        alignment = self.scheduler_block_size
        found, full_hit = full.manager_cls.find_longest_cache_hit(
            block_hashes, max_length, full.group_ids, pool, full.spec, alignment
        )
        other_found, hit = other.manager_cls.find_longest_cache_hit(
            block_hashes, full_hit, other.group_ids, pool, other.spec, alignment
        )
        blocks: list[BlockList] = [[] for _ in self.managers]
        keep = -(-hit // full.spec.block_size)
        for g, lst in zip(full.group_ids, found):
            blocks[g] = lst[:keep] if len(lst) > keep else lst
        for g, lst in zip(other.group_ids, other_found):
            blocks[g] = lst
        return blocks, hit, full_hit - hit


def make_coordinator(
    layout: KVCacheLayout, max_num_reqs: int = DEFAULT_MAX_NUM_REQS, compiled: bool = True
) -> KVCacheCoordinator:
    """No prefix cache, unitary (one group) or hybrid (several groups); ``compiled``: the
    compiled loops of :mod:`optimized.control.compiled_pool` where numba is there."""
    if not layout.enable_caching:
        return NoPrefixCacheCoordinator(layout, max_num_reqs, compiled)
    if len(layout.groups) == 1:
        return UnitaryCoordinator(layout, max_num_reqs, compiled)
    return HybridCoordinator(layout, max_num_reqs, compiled)
