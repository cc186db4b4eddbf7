"""The loud items of a decode step in one compiled pass (numba), when numba is installed.

:meth:`optimized.control.kv_cache_manager.KVCacheManager.schedule_step` settles a step's
quiet items in one pass; each *loud* item (one new token on a running request with no
hit, whose row reached its decode threshold; or any item of a running request holding a
row, a prefill chunk too, in a step that mixes them) is ``allocate_slots``: in group
order, free what left the window or chunk (``remove_skipped_blocks``: one
``free_blocks`` call per group, the span tail first; a Mamba group: the columns before
its newest state, then its previous state once stale), then ``need > free`` -> None and
stop, else pop ``need`` blocks from the front (a hashed block loses its key) and append
them group by group (a Mamba group: one state block at column ``cdiv(main, bs) - 1``,
the previous one remembered), then cache the completed blocks. :func:`loud_pass` runs that on index
arrays (the row store's stacks, :mod:`optimized.control.row_store`), item after
item, exactly as :func:`optimized.control.batched_decode.apply_decode_item` does: the
same frees in the same order (a call's unhashed blocks prepended as one chain, hashed
ones appended), the same pops, the same table writes, and, when the pool keeps its keys
in arrays (:class:`~optimized.control.key_index.ArrayKeyIndex`), the same evictions and
registrations (:func:`~optimized.control.compiled_caching.cache_row`, each item's hashes
read from a slab of its chain's last rows). What it cannot do in compiled code it hands
back:

* keys live in Python dicts: the pass evicts a popped block's arrays (group -1, no
  tokens) and lists ``(block, group)``; the caller drops the key (registering and
  evicting commute: each key's blocks form a list, and appending one block and removing
  another give the same list in either order); and it only flags the items with a block
  to register (their count of cached blocks is predicted for the threshold, ``min(cache
  limit, hashed tokens) // bs``, which is what registering sets): the caller caches them;
* a Mamba group's keys registered in a step join its keys cached this step (a Python
  set): the pass gives each item's span of such blocks;
* an item whose registrations reach below its slab (not met in a decode step: a row
  caches at most the blocks of the last scheduler block), and a row that is not running
  (``num_cached_block < 0``: no prefix cache, or nothing cached yet) whose need by a new
  request's rule, ``cdiv(slots, bs) - max(skipped blocks, held)``, differs from what it
  pops (``cdiv(slots, bs) - held``): the pass stops before the item (status
  :data:`FALLBACK`) and the caller applies it in Python, then starts the pass again
  after it.

Each applied item's row gets its new decode threshold
(:func:`optimized.control.compiled_rows.row_threshold`).
:meth:`LoudPass.admit` and :meth:`LoudPass.cache` give ``allocate_slots`` a new request's
admission (:mod:`optimized.control.compiled_admission`) and a row's caching in one
compiled call each.
Example: gemma3 (full + 5 windows w 1024, bs 16), an item at 2063 computed tokens: each
window frees its oldest block (unhashed: to the front), the full group none, nothing is
popped, the completed block 128 is flagged for caching and the threshold becomes 2064
(the full group's next block).

With numba missing, or ``KVCONFORM_JIT=0``, :data:`compiled_pass` is None and the Python
paths run; ``NUMBA_DISABLE_JIT=1`` runs this same pass as plain Python
(:mod:`optimized.control.jit`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain

import numpy as np

from optimized.control.batched_decode import cache_decode_item
from optimized.control.block_pool import BlockPool, FreeBlockQueue
from optimized.control.compiled_admission import compiled_admit
from optimized.control.compiled_caching import (
    EVERY_BLOCK,
    MAMBA_MASK,
    WINDOW_MASK,
    row_caching,
)
from optimized.control.compiled_pool import group_row_arrays, span_free
from optimized.control.compiled_rows import CHUNK, MAMBA, NO_SKIP, WINDOW, threshold_of
from optimized.control.hashing import KEY_BYTES, KEY_WORDS
from optimized.control.jit import compiled
from optimized.control.key_index import ArrayKeyIndex, remove_key
from optimized.control.managers.chunked_local import ChunkedLocalAttentionManager
from optimized.control.managers.full import FullAttentionManager
from optimized.control.managers.mamba import MambaManager
from optimized.control.managers.sliding_window import SlidingWindowManager
from reference.errors import KVConformError
from reference.specs import ChunkedLocalAttentionSpec, MambaSpec, SlidingWindowSpec

#: :func:`loud_pass` statuses: every item applied; the item at the returned index met a
#: full pool (its result is None: its frees are done, nothing else); the pass leaves the
#: item at the index to the caller (nothing done); a block reached a ref
#: count below 0 (its id is returned)
APPLIED, EXHAUSTED, FALLBACK, FREED_TOO_OFTEN = 0, 1, 2, 3
#: ``report`` columns: the item's new decode threshold, its caching (-1: nothing
#: registered, else the least ``num_cached * ratio`` of the groups that register), then
#: its pops in each group
THRESHOLD, CACHED_FROM, POPS = 0, 1, 2
#: ``items`` columns: row, computed tokens, slots (``min(computed + 1, max_model_len)``),
#: cache limit (``min(cacheable tokens, hashed tokens)``)
#: ... and, for the caching in the pass: prompt tokens, junction (0: none), the row of
#: ``words`` holding the request's chain row 0 (may be below 0), the first chain row held
#: ... and the tokens the item computes to (``computed + new``: a Mamba group's state)
ROW, TOTAL, SLOTS, LIMIT, PROMPT, JUNCTION, BASE, SLAB_LO, MAIN = 0, 1, 2, 3, 4, 5, 6, 7, 8
ITEM_COLUMNS = (ROW, TOTAL, SLOTS, LIMIT, PROMPT, JUNCTION, BASE, SLAB_LO, MAIN)


def loud_pass(
    first: int,
    items: np.ndarray,
    twin_of: np.ndarray,
    block_size: np.ndarray,
    skip_kind: np.ndarray,
    skip_param: np.ndarray,
    ratio: np.ndarray,
    mask_kind: np.ndarray,
    alignment: np.ndarray,
    need_blocks: np.ndarray,
    interval: np.ndarray,
    caching: bool,
    words: np.ndarray,
    tables: np.ndarray,
    row_lens: np.ndarray,
    leading: np.ndarray,
    cached: np.ndarray,
    dirty: np.ndarray,
    retired: np.ndarray,
    last_state: np.ndarray,
    ref_cnt: np.ndarray,
    block_group: np.ndarray,
    cached_tokens: np.ndarray,
    prev_free: np.ndarray,
    next_free: np.ndarray,
    key_index: tuple,
    head: int,
    tail: int,
    num_free: int,
    popped: np.ndarray,
    evicted: np.ndarray,
    spans: np.ndarray,
    report: np.ndarray,
) -> tuple[int, int, int, int, int, int]:
    """Apply ``items[first:]`` in order (see the module docstring); return ``(status,
    index, free blocks, popped, evicted, bad block)``: :data:`APPLIED` and
    ``len(items)``, or the status and the item it stopped at; the free count after; how
    many blocks it popped (``popped[:n]``) and left keys to drop (``evicted[:n]``); the
    block freed too often, or -1. Per group ``g``: its class ``twin_of[g]`` (the rows of
    twins hold the same counts: the first group of the class decides), ``block_size``,
    ``skip_kind`` and
    ``skip_param`` (the window or the chunk), ``ratio`` (its block size in hash blocks)
    and the caching's ``mask_kind``, ``alignment``, ``need_blocks``, ``interval``
    (:func:`~optimized.control.compiled_caching.keeps`); ``words``: the items' hash
    slabs (``items[:, BASE]``, ``items[:, SLAB_LO]``); ``tables[g]``, ``row_lens[g]``,
    ``leading[g]``, ``cached[g]``, ``dirty[g]`` its row arrays, ``retired[g]`` and
    ``last_state[g]`` a Mamba group's (the stacks of a
    :class:`~optimized.control.row_store.RowStore`). ``key_index``: the
    pool's :class:`~optimized.control.key_index.ArrayKeyIndex` arrays ``(heads, words,
    links)``, which the pass updates itself when a popped block loses its key, or three
    empty arrays (the keys live in dicts: the caller drops them). ``head``, ``tail``,
    ``num_free``: the free queue's sentinels and free count. Out: ``popped`` (the blocks
    popped, item by item, in group order), ``evicted[k] = (block, group)`` (keys left to
    the caller), ``spans[i]`` (a Mamba group's registered span,
    :func:`~optimized.control.compiled_caching.cache_row`), ``report[i]`` (columns
    :data:`THRESHOLD`, :data:`CACHED_FROM`, :data:`POPS`: registered in the pass when the
    keys live in arrays, else flagged for the caller). ``report`` comes last (a mutant
    reads it there)."""
    m = items.shape[0]
    num_groups = twin_of.shape[0]
    n_popped = 0
    n_evicted = 0
    key_heads, key_words, key_links = key_index
    inline_keys = key_heads.shape[0] > 0
    start = np.zeros(num_groups, dtype=np.int64)
    end = np.zeros(num_groups, dtype=np.int64)
    pops = np.zeros(num_groups, dtype=np.int64)
    required = np.zeros(num_groups, dtype=np.int64)
    status = APPLIED
    i = first
    while i < m:
        row = items[i, ROW]
        total = items[i, TOTAL]
        slots = items[i, SLOTS]
        for g in range(num_groups):
            report[i, POPS + g] = 0
        # -- each class decides its drop span and pops (its first group's row) --------
        need = 0
        odd = False
        for g in range(num_groups):
            t = twin_of[g]
            if t == g and inline_keys and caching:
                done = max(cached[g, row], 0)
                if items[i, LIMIT] // block_size[g] > done and done * ratio[g] < items[i, SLAB_LO]:
                    odd = True  # registrations below the item's slab
            if t == g:
                bs = block_size[g]
                held = row_lens[g, row]
                start[g] = 0
                end[g] = 0
                kind = skip_kind[g]
                if kind == MAMBA:
                    # the columns before (total - 1) // bs not retired yet; one state
                    # block at column cdiv(main, bs) - 1 when the row is shorter
                    if total > 1:
                        last = min((total - 1) // bs, held)
                        if last > retired[g, row]:
                            start[g] = retired[g, row]
                            end[g] = last
                    required[g] = (items[i, MAIN] + bs - 1) // bs
                    pops[g] = 0
                    if required[g] > held:
                        pops[g] = 1
                    elif required[g] < held:
                        odd = True  # a row longer than its tokens: the reference counts < 0
                    need += pops[g]
                    continue
                skipped = 0
                if kind == WINDOW:
                    skipped = max(total - skip_param[g] + 1, 0)
                elif kind == CHUNK:
                    skipped = total // skip_param[g] * skip_param[g]
                if skipped > 0:
                    last = min(skipped // bs, held)
                    lead = leading[g, row]
                    if last > lead:
                        start[g] = lead
                        end[g] = last
                req = (slots + bs - 1) // bs
                pops[g] = max(req - held, 0)
                if cached[g, row] < 0 and max(req - max(skipped // bs, held), 0) != pops[g]:
                    odd = True  # a new request's rule that counts fewer blocks than it pops
            need += pops[t]
        if odd or n_popped + need > popped.shape[0]:
            status = FALLBACK
            break
        # -- remove_skipped_blocks: one free call per group, in group order -------------
        for g in range(num_groups):
            t = twin_of[g]
            if end[t] > 0:
                freed, bad = span_free(
                    tables[g],
                    row,
                    start[t],
                    end[t],
                    ref_cnt,
                    block_group,
                    prev_free,
                    next_free,
                    head,
                    tail,
                )
                num_free += freed
                if bad >= 0:
                    return FREED_TOO_OFTEN, i, num_free, n_popped, n_evicted, bad
                if skip_kind[t] == MAMBA:
                    retired[g, row] = end[t]
                else:
                    leading[g, row] = end[t]
                dirty[g, row] = True
            if skip_kind[t] == MAMBA:
                # the previous state once older than column cdiv(total, bs) - 1 (the
                # reference's rule; the retirement above has always freed it already)
                state = last_state[g, row]
                stale = state >= 0 and state < (total + block_size[t] - 1) // block_size[t] - 1
                if stale and tables[g, row, state] != 0:
                    freed, bad = span_free(
                        tables[g],
                        row,
                        state,
                        state + 1,
                        ref_cnt,
                        block_group,
                        prev_free,
                        next_free,
                        head,
                        tail,
                    )
                    num_free += freed
                    if bad >= 0:
                        return FREED_TOO_OFTEN, i, num_free, n_popped, n_evicted, bad
                    dirty[g, row] = True
        # -- the pool check, then the pops in group order -----------------------------
        exhausted = need > num_free
        if not exhausted and need:
            k = n_popped
            for _ in range(need):
                block = next_free[head]
                after = next_free[block]
                next_free[head] = after
                prev_free[after] = head
                prev_free[block] = -1
                next_free[block] = -1
                if caching and block_group[block] >= 0:  # its key is dropped
                    if inline_keys:
                        remove_key(
                            key_heads, key_words, key_links, block_group, block, block_group[block]
                        )
                    else:  # by the caller
                        evicted[n_evicted, 0] = block
                        evicted[n_evicted, 1] = block_group[block]
                        n_evicted += 1
                    block_group[block] = -1
                    cached_tokens[block] = 0
                ref_cnt[block] = 1
                popped[n_popped] = block
                n_popped += 1
            num_free -= need
            for g in range(num_groups):
                t = twin_of[g]
                p = pops[t]
                if p == 0:
                    continue
                n = row_lens[g, row]
                if skip_kind[t] == MAMBA:
                    # the state block at column required - 1, nulls before it; the last
                    # column held is the previous state
                    if n > 0:
                        last_state[g, row] = n - 1
                    column = required[t] - 1
                    for j in range(n, column):
                        tables[g, row, j] = 0
                    tables[g, row, column] = popped[k]
                    row_lens[g, row] = column + 1
                else:
                    for j in range(p):
                        tables[g, row, n + j] = popped[k + j]
                    row_lens[g, row] = n + p
                dirty[g, row] = True
                report[i, POPS + g] = p
                k += p
        # -- what the item registers, and the row's new threshold (caching predicted) --
        limit = -1 if exhausted or not caching else items[i, LIMIT]
        cache_from = -1
        for g in range(num_groups):
            done = max(cached[g, row], 0)
            registers = twin_of[g] == g and limit // block_size[g] > done
            if registers and (cache_from < 0 or done * ratio[g] < cache_from):
                cache_from = done * ratio[g]
        report[i, THRESHOLD] = threshold_of(
            row,
            limit,
            caching,
            twin_of,
            block_size,
            skip_kind,
            skip_param,
            row_lens,
            leading,
            cached,
            retired,
        )
        report[i, CACHED_FROM] = cache_from
        if cache_from >= 0 and inline_keys:
            row_caching(
                row,
                items[i, LIMIT],
                items[i, PROMPT],
                items[i, JUNCTION],
                words,
                items[i, BASE],
                block_size,
                ratio,
                mask_kind,
                alignment,
                need_blocks,
                interval,
                tables,
                cached,
                block_group,
                cached_tokens,
                key_heads,
                key_words,
                key_links,
                spans[i],
            )
        if exhausted:
            status = EXHAUSTED
            break
        i += 1
    return status, i, num_free, n_popped, n_evicted, -1


#: the compiled :func:`loud_pass` (None: numba missing or turned off)
compiled_pass = compiled(loud_pass)


@dataclass(frozen=True, eq=False)
class CompiledLayout:
    """The per-group constants :func:`loud_pass` reads (see its docstring), and those of
    the caching (:func:`~optimized.control.compiled_caching.cache_items`): each group's
    block size in hash blocks, retention mask kind, alignment, blocks a window's hit
    needs (0 elsewhere) and retention interval (-1: dense)."""

    twin_of: np.ndarray
    block_size: np.ndarray
    skip_kind: np.ndarray
    skip_param: np.ndarray
    ratio: np.ndarray
    mask_kind: np.ndarray
    alignment: np.ndarray
    need: np.ndarray
    interval: np.ndarray

    @property
    def has_mamba(self) -> bool:
        return bool((self.skip_kind == MAMBA).any())

    @property
    def admits(self) -> bool:
        """Does :func:`~optimized.control.compiled_admission.admit` know this layout (no
        Mamba group)?"""
        return not self.has_mamba


def compiled_layout(managers: Sequence, twin_of: Sequence[int], pool) -> CompiledLayout | None:
    """The constants of groups the pass knows, or None when some group, the pool or the
    queue is of another type (a full group with a partial tail key, a subclass with rules
    of its own: the Python paths apply them).
    Example: gemma3 -> classes ``[0, 1, 1, 1, 1, 1]``, kinds ``[NO_SKIP, WINDOW, ...]``;
    full + window + two Mamba groups of one spec -> ``[0, 1, 2, 2]``, ``[NO_SKIP, WINDOW,
    MAMBA, MAMBA]``."""
    if type(pool) is not BlockPool or type(pool.free_block_queue) is not FreeBlockQueue:
        return None
    kinds, params = [], []
    for m in managers:
        if m.always_tested():
            return None
        if type(m) is FullAttentionManager:
            kinds.append(NO_SKIP)
            params.append(0)
        elif type(m) is SlidingWindowManager and type(m.spec) is SlidingWindowSpec:
            kinds.append(WINDOW)
            params.append(m.spec.sliding_window)
        elif type(m) is ChunkedLocalAttentionManager and type(m.spec) is ChunkedLocalAttentionSpec:
            kinds.append(CHUNK)
            params.append(m.spec.attention_chunk_size)
        elif type(m) is MambaManager and type(m.spec) is MambaSpec:
            kinds.append(MAMBA)
            params.append(0)
        else:
            return None
        if m.use_eagle or m.eagle_replay:  # (no EAGLE group in this engine)
            return None
    masks = {NO_SKIP: EVERY_BLOCK, WINDOW: WINDOW_MASK, CHUNK: EVERY_BLOCK, MAMBA: MAMBA_MASK}

    def ints(values) -> np.ndarray:
        return np.asarray(list(values), dtype=np.int64)

    return CompiledLayout(
        ints(twin_of),
        ints(m.block_size for m in managers),
        ints(kinds),
        ints(params),
        ints(m.block_size // pool.hash_block_size for m in managers),
        ints(masks[k] for k in kinds),
        ints(m.cache_hit_alignment for m in managers),
        ints(m._need if k == WINDOW else 0 for m, k in zip(managers, kinds)),
        ints(-1 if m.retention_interval is None else m.retention_interval for m in managers),
    )


#: the hash slabs of no item; the hit blocks of no group
_NO_WORDS = np.zeros((0, 4), dtype=np.int64)
_NO_HITS = np.zeros(0, dtype=np.int64)
#: the key index of a pool whose keys live in dicts, as the pass takes it: no arrays
_NO_KEY_ARRAYS = (
    np.zeros(0, dtype=np.int32),
    np.zeros((0, 4), dtype=np.int64),
    np.zeros((0, 2), dtype=np.int32),
)


def _key_arrays(index) -> tuple:
    """The arrays of an :class:`ArrayKeyIndex` (the pass drops popped blocks' keys
    there), or :data:`_NO_KEY_ARRAYS` (dicts: the caller drops them)."""
    if isinstance(index, ArrayKeyIndex):
        return (index.heads, index.words, index.links)
    return _NO_KEY_ARRAYS


class LoudPass:
    """One manager's compiled pass: its :class:`CompiledLayout` (made again whenever the
    manager's groups or pool are replaced, and None when they are not all of kinds the
    pass knows), the state arrays it hands the pass (fetched again once the manager has
    grown) and output buffers reused from step to step (grown to the most items seen).
    ``run``: the pass (:data:`compiled_pass`; a test gives the Python :func:`loud_pass`,
    a mutant a broken one). With the pool's keys in arrays the pass caches the items
    itself; else each flagged item is cached in Python
    (:func:`~optimized.control.batched_decode.cache_decode_item`)."""

    def __init__(self, manager, run: Callable | None = None, admit: Callable | None = None) -> None:
        self.manager = manager
        self.run_pass = compiled_pass if run is None else run
        #: a new request's admission (:func:`~optimized.control.compiled_admission.
        #: admit`; a test gives the Python form)
        self.run_admit = compiled_admit if admit is None else admit
        self.layout: CompiledLayout | None = None
        self._seen: tuple = ()
        self._arrays: tuple = ()
        self._arrays_rows = -1  # the manager's row count when ``_arrays`` was taken
        self._capacity = -1
        #: the chain rows an item's slab holds (:meth:`_slab_rows`)
        self._slab = 0
        self.usable()

    def usable(self) -> bool:
        """Can the pass apply this manager's loud items (its layout checked again if the
        manager's groups, pool or queue were replaced)?"""
        manager = self.manager
        coord = manager.coordinator
        pool = manager.block_pool
        seen = (coord.managers, pool, pool.free_block_queue, pool.index)
        if len(seen) == len(self._seen) and all(a is b for a, b in zip(seen, self._seen)):
            return self.layout is not None
        self._seen = seen
        self._arrays_rows = -1
        self.layout = (
            None
            if self.run_pass is None
            else compiled_layout(coord.managers, manager._twin_of, pool)
        )
        if self.layout is None:
            return False
        self._slab = self._slab_rows()
        self._capacity = -1
        self._grow_buffers(8)
        self._admit_pops = np.zeros(len(self.layout.twin_of), dtype=np.int64)
        self._no_hit_ends = np.zeros(len(self.layout.twin_of), dtype=np.int64)
        self.run(np.zeros((0, len(ITEM_COLUMNS)), dtype=np.int64), 0, _NO_WORDS)  # compile
        return True

    def _slab_rows(self) -> int:
        """How many of a loud item's last chain rows (hashes at the hash block size) the
        pass is given: what a decode step registers (a row's registrations since its last
        caching: at most one scheduler block, plus the widest group's block), twice."""
        pool = self.manager.block_pool
        layout = self.layout
        assert layout is not None
        scheduler = self.manager.layout.scheduler_block_size // pool.hash_block_size
        return 2 * (scheduler + int(layout.ratio.max()))

    def _state_arrays(self) -> tuple:
        """The arrays the pass reads and writes, in its argument order."""
        manager = self.manager
        coord = manager.coordinator
        if coord.max_num_reqs != self._arrays_rows:
            pool = manager.block_pool
            queue = pool.free_block_queue
            self._arrays = (
                *group_row_arrays(coord),
                pool.ref_cnt,
                pool.block_group,
                pool.num_cached_tokens,
                queue.prev_free,
                queue.next_free,
                _key_arrays(pool.index),
            )
            self._arrays_rows = coord.max_num_reqs
        return self._arrays

    def _grow_buffers(self, m: int) -> None:
        if m <= self._capacity:
            return
        num_groups = len(self.layout.twin_of)
        self._capacity = m
        self.popped = np.empty(2 * m * num_groups, dtype=np.int64)
        self.evicted = np.empty((self.popped.size, 2), dtype=np.int64)
        self.spans = np.zeros((m, num_groups, 2), dtype=np.int64)
        self.report = np.empty((m, POPS + num_groups), dtype=np.int64)

    def run(self, items: np.ndarray, first: int, words: np.ndarray) -> tuple[int, int, int]:
        """:func:`loud_pass` of ``items[first:]`` (their hash slabs in ``words``) on the
        manager's state; the queue's free count is written back. Returns ``(status,
        stop, popped)``; a block freed too often raises (:class:`KVConformError`)."""
        layout = self.layout
        assert layout is not None
        queue = self.manager.block_pool.free_block_queue
        status, stop, num_free, n_popped, n_evicted, bad = self.run_pass(
            first,
            items,
            layout.twin_of,
            layout.block_size,
            layout.skip_kind,
            layout.skip_param,
            layout.ratio,
            layout.mask_kind,
            layout.alignment,
            layout.need,
            layout.interval,
            self.manager.enable_caching,
            words,
            *self._state_arrays(),
            queue.head,
            queue.tail,
            queue.num_free_blocks,
            self.popped,
            self.evicted,
            self.spans,
            self.report,
        )
        queue.num_free_blocks = num_free
        if n_evicted:
            evict_key = self.manager.block_pool._evict_key
            for block, group in self.evicted[:n_evicted].tolist():
                evict_key(block, group)
        if status == FREED_TOO_OFTEN:
            raise KVConformError(f"block {bad} freed more often than allocated")
        return status, stop, n_popped

    def apply(
        self,
        requests: Sequence,
        picked: Sequence[int],
        rows: Sequence[int],
        tokens: Sequence[int] | None = None,
        lookahead: Sequence[int] | None = None,
    ) -> list:
        """The results of the loud items ``requests[i]`` for ``i`` in ``picked`` (on
        ``rows``), as :meth:`~optimized.control.kv_cache_manager.KVCacheManager._apply_loud`
        gives them: per item its new blocks per group (``manager.no_new_blocks`` when
        none), stopping after the first None; each row's decode threshold refreshed. The
        items went through ``_loud_items`` (one new token, no hit, running, a row each),
        or ``_mixed_items`` (``tokens[i]`` new tokens and ``lookahead[i]`` for item
        ``requests[i]``: a running request's prefill chunk too); the caller checked
        :meth:`usable`. With the keys in arrays each item's chain rows go to the pass as
        its slab, laid end to end (one join of the chains' raw bytes): a decode item's
        last ones (:meth:`_slab_rows`), a chunk's all."""
        manager = self.manager
        coord = manager.coordinator
        mml = manager.max_model_len
        h = coord.block_pool.hash_block_size
        unit = coord.cache_unit
        in_arrays = coord.block_pool.keys_as_words
        width = self._slab
        m = len(picked)
        self._grow_buffers(m)
        flat: list[int] = []
        cache_tokens: list[int] = []
        slabs: list[bytearray] = []
        at = 0
        for i, row in zip(picked, rows):
            request = requests[i]
            total = request.num_computed_tokens
            if tokens is None or (tokens[i] == 1 and lookahead[i] == 0):  # a decode item
                main = total + 1
                slots = main if main < mml else mml
                last = width
            else:  # a chunk (its caching may reach back to the chain's start)
                main = total + tokens[i]
                slots = min(main + lookahead[i], mml)
                last = 0
            cacheable = min(main, request.num_tokens) // unit * unit  # num_cacheable_tokens
            chain = request.block_hashes
            limit = min(cacheable, len(chain) * h)
            if in_arrays:
                hi = limit // h
                lo = hi - last if 0 < last < hi else 0
                slabs.append(chain.raw[KEY_BYTES * lo : KEY_BYTES * hi])
                flat += (
                    row,
                    total,
                    slots,
                    limit,
                    request.num_prompt_tokens,
                    request.shared_prefix_boundary,
                    at - lo,
                    lo,
                    main,
                )
                at += hi - lo
            else:
                flat += (row, total, slots, limit, 0, 0, 0, 0, main)
                cache_tokens.append(cacheable)
        if tokens is not None:  # room for a chunk's pops: at most cdiv(tokens, bs) a group
            smallest = int(self.layout.block_size.min())
            room = sum(tokens[i] + lookahead[i] for i in picked) // smallest + 2 * m
            if self.popped.size < room * len(self.layout.twin_of):
                self.popped = np.empty(room * len(self.layout.twin_of), dtype=np.int64)
                self.evicted = np.empty((self.popped.size, 2), dtype=np.int64)
        items = np.array(flat, dtype=np.int64).reshape(m, len(ITEM_COLUMNS))
        if in_arrays:
            words = np.frombuffer(bytearray().join(slabs), dtype=np.int64).reshape(-1, KEY_WORDS)
        else:
            words = _NO_WORDS
        next_work = manager._next_work
        empty = manager.no_new_blocks
        out: list = []
        first = 0
        while first < m:
            status, stop, n_popped = self.run(items, first, words)
            last = stop + 1 if status == EXHAUSTED else stop
            report = self.report[first:last].tolist()
            ids = self.popped[:n_popped].tolist() if n_popped else ()
            if in_arrays and self.layout.has_mamba:
                for j, done in enumerate(report, first):
                    if done[CACHED_FROM] >= 0:
                        self._mamba_keys(rows[j], self.spans[j])
            k = 0
            for j, done in enumerate(report, first):
                row = rows[j]
                next_work[row] = done[THRESHOLD]
                if j == stop:  # the exhausted item
                    out.append(None)
                    return out
                if done[CACHED_FROM] >= 0 and not in_arrays:
                    cache_decode_item(
                        coord.managers,
                        manager._twin_of,
                        manager._class_reps,
                        requests[picked[j]],
                        row,
                        cache_tokens[j],
                        manager._all_groups,
                    )
                if k == len(ids):
                    out.append(empty)
                    continue
                blocks = []
                for c in done[POPS:]:
                    blocks.append(ids[k : k + c])
                    k += c
                out.append(blocks)
            if status == APPLIED:
                return out
            # FALLBACK: the item at ``stop`` goes through the Python path
            i = picked[stop]
            if tokens is None or (tokens[i] == 1 and lookahead[i] == 0):
                new_blocks = manager._apply_loud(requests, [i], [rows[stop]])[0]
            else:  # a chunk: allocate_slots itself
                new_blocks = manager.allocate_slots(requests[i], tokens[i], 0, None, lookahead[i])
                manager._next_work[rows[stop]] = manager._row_threshold(rows[stop])
            out.append(new_blocks)
            if new_blocks is None:
                return out
            first = stop + 1
        return out

    def admits(self) -> bool:
        """Can :meth:`admit` take a new request (the pass usable, no Mamba group, the keys
        in arrays)?"""
        if not self.usable() or self.run_admit is None:
            return False
        layout = self.layout
        return layout.admits and self.manager.block_pool.keys_as_words

    def admit(
        self,
        request,
        row: int,
        hits: Sequence[Sequence[int]],
        total: int,
        slots: int,
        limit: int,
        adopt: bool,
    ) -> tuple[int, list[list[int]] | None]:
        """``allocate_slots`` of a new request on the fresh ``row`` in one compiled call
        (:func:`~optimized.control.compiled_admission.admit`): ``(need, new blocks per
        group)``, or ``(need, None)`` when the pool cannot hold it (nothing changed).
        ``hits`` per group (adopted when ``adopt``), ``total`` computed tokens, ``slots``
        to cover, cache limit ``limit`` (-1: none). The row's decode threshold is set."""
        layout = self.layout
        manager = self.manager
        queue = manager.block_pool.free_block_queue
        num_groups = len(layout.twin_of)
        if adopt:
            ends = np.fromiter(accumulate(map(len, hits)), dtype=np.int64, count=num_groups)
            flat = np.fromiter(chain.from_iterable(hits), dtype=np.int64, count=int(ends[-1]))
        else:
            ends, flat = self._no_hit_ends, _NO_HITS
        arrays = self._state_arrays()
        pops = self._admit_pops
        if self.popped.size < (slots // int(layout.block_size.min()) + 1) * num_groups:
            self.popped = np.empty(2 * (slots + 1) * num_groups, dtype=np.int64)
            self.evicted = np.empty((self.popped.size, 2), dtype=np.int64)
        need, num_free, threshold = self.run_admit(
            row,
            total,
            slots,
            limit,
            request.num_prompt_tokens,
            request.shared_prefix_boundary,
            adopt,
            flat,
            ends,
            request.block_hashes.words(),
            layout.twin_of,
            layout.block_size,
            layout.skip_kind,
            layout.skip_param,
            layout.ratio,
            layout.mask_kind,
            layout.alignment,
            layout.need,
            layout.interval,
            manager.enable_caching,
            arrays[0],  # tables
            arrays[1],  # row lengths
            arrays[2],  # leading nulls
            arrays[3],  # cached counts
            arrays[4],  # dirty rows
            arrays[5],  # retired columns
            *arrays[7:12],  # ref counts, groups, cached tokens, the queue's links
            *arrays[12],  # the key index
            queue.head,
            queue.num_free_blocks,
            self.popped,
            pops,
            self.spans[0],
        )
        if need > queue.num_free_blocks:
            return need, None
        queue.num_free_blocks = num_free
        manager._next_work[row] = threshold
        ids = self.popped[: int(pops.sum())].tolist()
        out: list[list[int]] = []
        k = 0
        for n in pops.tolist():
            out.append(ids[k : k + n])
            k += n
        return need, out

    def caches(self) -> bool:
        """Can :meth:`cache` register a row's blocks (the pass usable, the keys in arrays,
        a prefix cache)?"""
        return (
            self.usable() and self.manager.enable_caching and self.manager.block_pool.keys_as_words
        )

    def cache(self, request, row: int, num_tokens: int) -> None:
        """The coordinator's ``cache_blocks(request, row, num_tokens)`` in one compiled
        call (:func:`~optimized.control.compiled_caching.cache_row` over the request's
        chain, every group's masks in the loop); a Mamba group's registered keys join its
        keys cached this step. The caller checked :meth:`caches`."""
        layout = self.layout
        manager = self.manager
        coord = manager.coordinator
        chain = request.block_hashes
        limit = min(coord.num_cacheable_tokens(num_tokens), len(chain) * request.hash_block_size)
        arrays = self._state_arrays()
        spans = self.spans[0]
        row_caching(
            row,
            limit,
            request.num_prompt_tokens,
            request.shared_prefix_boundary,
            chain.words(),
            0,
            layout.block_size,
            layout.ratio,
            layout.mask_kind,
            layout.alignment,
            layout.need,
            layout.interval,
            arrays[0],  # tables
            arrays[3],  # cached counts
            arrays[8],  # block groups
            arrays[9],  # cached tokens
            *arrays[12],  # the key index
            spans,
        )
        self._mamba_keys(row, spans)

    def _mamba_keys(self, row: int, spans: np.ndarray) -> None:
        """The keys a Mamba group registered in ``row`` join its keys cached this step:
        each hashed block of the span the caching gave it (``spans[g]``,
        :func:`~optimized.control.compiled_caching.cache_row`)."""
        layout = self.layout
        if not layout.has_mamba:
            return
        manager = self.manager
        managers = manager.coordinator.managers
        key_of = manager.block_pool.index.key_of
        block_group = manager.block_pool.block_group
        for g, kind in enumerate(layout.mask_kind.tolist()):
            if kind != MAMBA_MASK:
                continue
            done, full = spans[g].tolist()
            table = managers[g].table
            for column in range(done, full):
                block = table.item(row, column)
                if block and block_group.item(block) >= 0:
                    managers[g].cached_keys_this_step.add(key_of(block))
