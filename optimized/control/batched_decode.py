"""The working items of a decode step, applied together (exactly as one by one).

:meth:`optimized.control.kv_cache_manager.KVCacheManager.schedule_step` settles idle items
without touching anything; the items left (a request that crosses a block boundary, whose
window or chunk drops a block, or that completes a block to cache) are applied here in one
pass when the step is a plain decode step, else one by one through ``allocate_slots``.

Per item the reference does, in order: free the blocks that left the window
(``remove_skipped_blocks``: tail first, hashed ones to the back of the queue), check
``need <= free``, pop the new blocks from the front, cache the full blocks. Done for all
items at once this gives the same state when

* no block is freed twice in the step; then each free call's unhashed blocks (ref count
  0) are prepended in call order (the last call's end up first) and the hashed ones
  appended;
* with no unhashed block freed, the pops take the front in item order: the blocks free
  before the step, then the hashed blocks this step appended, in item order (each item's
  pops fit what is free at its turn, so it never takes a block a later item frees);
* with unhashed blocks freed and pops, every item pops at most the unhashed blocks it
  freed itself (its free calls put them at the front just before its pops):
  :func:`_pops_from_own_front` (a window dropping many blocks on the first decode step
  after a long prefill, while the full group pops one);
* every item's ``need`` fits what would be free at its turn;
* no group is Mamba (its state retirement is per step and per request).

Caching still goes item by item, after every pop: registering a held block and evicting
a popped block's key commute (each key's blocks form a list; appending one block and
removing another give the same list in either order). When a condition fails nothing has
changed and the caller falls back. Example: 3 decode items on full + SWA (w 32, bs 16), the
first crossing into a new block and dropping its oldest SWA block: SWA frees that block
(to the back), two pops (one per group) come from the front, then its completed block is
cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from optimized.control.block_pool import NULL_BLOCK_ID
from optimized.control.managers.mamba import MambaManager
from optimized.control.uniform_decode import apply_uniform, uniform_caches_nothing, uniform_plan
from optimized.control.uniformity import same_everywhere
from reference.request import RequestStatus

_REQUEST_ID = attrgetter("request_id")
_REQUEST_HASHES = attrgetter("block_hashes")

#: the fewest items for which the uniform step (:mod:`optimized.control.uniform_decode`)
#: is tried (below, its checks cost more than the general pass saves)
MIN_UNIFORM_ITEMS = 8


def apply_decode_items(
    manager,
    requests: Sequence,
    rows: np.ndarray,
    total: np.ndarray,
    slots: np.ndarray,
    cache_tokens: np.ndarray,
) -> list[list[list[int]]] | None:
    """New block ids per item and group, or None (nothing changed) when a condition of the
    module docstring fails. ``requests`` have no hit and hold ``rows``; arrays per item."""
    coord = manager.coordinator
    pool = manager.block_pool
    managers = coord.managers
    if any(isinstance(m, MambaManager) for m in managers):
        return None
    m = len(requests)
    if m >= MIN_UNIFORM_ITEMS and same_everywhere(total):
        plan = uniform_plan(managers, rows, total.item(0), slots.item(0))
        results = None if plan is None else apply_uniform(managers, pool, rows, plan)
        if results is not None:
            caching = manager.enable_caching and not uniform_caches_nothing(
                managers, plan, cache_tokens
            )
            _cache_and_settle(manager, requests, rows, cache_tokens, caching)
            return results
    num_groups = len(managers)
    pops = np.zeros((m, num_groups), dtype=np.int64)
    first_free = np.zeros((m, num_groups), dtype=np.int64)
    last_free = np.zeros((m, num_groups), dtype=np.int64)
    for g, mg in enumerate(managers):
        bs = mg.block_size
        held = mg.row_len[rows].astype(np.int64)
        alloc = np.maximum(-(-slots // bs) - held, 0)
        skipped = mg._skipped_tokens(total)
        skipped_blocks = 0 if skipped is None else skipped // bs
        running = mg.num_cached_block[rows] >= 0
        if not running.all():
            need = np.maximum(-(-slots // bs) - np.maximum(skipped_blocks, held), 0)
            if (need != alloc)[~running].any():
                return None
        pops[:, g] = alloc
        if skipped is not None:
            lead = mg.num_leading_null[rows].astype(np.int64)
            first_free[:, g] = lead
            last_free[:, g] = np.maximum(np.minimum(skipped_blocks, held), lead)
    # the freed blocks in the reference's order: item, group, tail first
    freed, freed_item, freed_call = _freed_blocks(managers, rows, first_free, last_free)
    freed_per_item = np.zeros(m, dtype=np.int64)
    zero = front = np.zeros(0, dtype=bool)
    all_zero = True
    num_front = 0
    if freed.size:
        # a block held once sits in one table cell: only when some block stays held can
        # one be freed twice in the step (a block shared by two requests: its last free
        # decides its place)
        all_zero = pool.all_held_once(freed)  # (the common case: no block shared)
        if not all_zero:
            after = pool.ref_cnt[freed] - 1
            zero = after == 0
            if (after < 0).any() or pool.has_repeats(freed):
                return None
        unhashed = pool.block_group[freed] < 0
        front = unhashed if all_zero else zero & unhashed
        num_front = np.count_nonzero(front)
        freed_per_item = np.bincount(freed_item if all_zero else freed_item[zero], minlength=m)
    own = None  # per item, its own front-freed blocks it pops (None: pops from the queue)
    if num_front and pops.any():
        if num_front == freed.size:  # (every freed block goes to the front: no selection)
            front_blocks, front_items, front_calls = freed, freed_item, freed_call
        else:
            front_blocks = freed[front]
            front_items, front_calls = freed_item[front], freed_call[front]
        one_group = np.count_nonzero((last_free > first_free).any(axis=0)) == 1
        own = _pops_from_own_front(
            front_blocks, front_items, front_calls, pops.sum(axis=1), num_groups, one_group
        )
        if own is None:
            return None  # a pop would reach past the item's own front-freed blocks
    pops_per_item = pops.sum(axis=1)
    free_before = pool.get_num_free_blocks()
    free_at_turn = (
        free_before + np.cumsum(freed_per_item) - (np.cumsum(pops_per_item) - pops_per_item)
    )
    if (pops_per_item > free_at_turn).any():
        return None
    # -- apply: frees, pops, tables, caching -------------------------------------------
    if freed.size:
        if all_zero:
            pool.ref_cnt[freed] = 0
        else:
            pool.ref_cnt[freed] -= 1
        for g, mg in enumerate(managers):
            idx = np.flatnonzero(last_free[:, g] > first_free[:, g])
            if not idx.size:
                continue
            grow = rows[idx]
            a, b = first_free[idx, g], last_free[idx, g]
            if ((b - a) == 1).all():
                mg.table[grow, a] = NULL_BLOCK_ID
            elif (a == a[0]).all() and (b == b[0]).all():  # the same columns of every row
                mg.table[grow, a.item(0) : b.item(0)] = NULL_BLOCK_ID
            else:
                for row, lo, hi in zip(grow.tolist(), a.tolist(), b.tolist()):
                    mg.table[row, lo:hi] = NULL_BLOCK_ID
            mg.num_leading_null[grow] = b
            mg.dirty_rows[grow] = True
        queue = pool.free_block_queue
        # each free call prepends its unhashed blocks: later calls end up nearer the front
        if own is not None:
            popped_arr, left = own
            if left.size:
                queue.prepend_n(left)
            pool.ref_cnt[popped_arr] = 1
            popped = popped_arr.tolist()
        elif num_front:
            queue.prepend_n(freed[front][np.argsort(-freed_call[front], kind="stable")])
        if num_front < freed.size:
            queue.append_n(freed[~front] if all_zero else freed[zero & ~front])
    total_pops = int(pops_per_item.sum())
    if own is None:
        popped = pool.get_new_blocks(total_pops) if total_pops else []
    results = _append_popped(managers, rows, pops, popped)
    _cache_and_settle(manager, requests, rows, cache_tokens, manager.enable_caching)
    return results


def _cache_and_settle(
    manager, requests: Sequence, rows: np.ndarray, cache_tokens: np.ndarray, caching: bool
) -> None:
    """The end of every applied item, after all frees and pops: its full blocks cached
    when ``caching`` (:func:`_caching_items`; only items that register a block are
    visited), its id known, its request running unless it finished."""
    if caching:
        coord = manager.coordinator
        for i in _caching_items(coord.managers, rows, cache_tokens, requests):
            coord.cache_blocks(requests[i], rows.item(i), cache_tokens.item(i))
    manager._known.update(map(_REQUEST_ID, requests))
    running = RequestStatus.RUNNING
    if [request.status for request in requests].count(running) == len(requests):
        return  # (a step's running requests: nothing to set)
    finished = RequestStatus.FINISHED
    for request in requests:
        if request.status is not finished:
            request.status = running


def _append_popped(
    managers, rows: np.ndarray, pops: np.ndarray, popped: Sequence[int]
) -> list[list[list[int]]]:
    """Append each item's popped blocks to its rows (``popped`` in item order, then group
    order: ``pops[i, g]`` blocks for item ``i`` in group ``g``) and return them per item and
    group. One table write per group when every item pops at most one block there (a
    decode step), else a write per item. Example: pops ``[[1, 0], [1, 1]]``, popped
    ``[7, 8, 9]`` -> ``[[[7], []], [[8], [9]]]``."""
    m, num_groups = pops.shape
    flat = pops.ravel()
    start = np.cumsum(flat) - flat  # where each (item, group) cell's blocks start
    popped_arr = np.asarray(popped, dtype=np.int64)
    columns: list[list] = []
    for g, mg in enumerate(managers):
        col = pops[:, g]
        if not col.any():
            columns.append([[] for _ in range(m)])
            continue
        if col.max() == 1:
            idx = np.flatnonzero(col)
            grow = rows[idx]
            ids = popped_arr[start[idx * num_groups + g]]
            held = mg.row_len[grow]
            mg.table[grow, held] = ids
            mg.row_len[grow] = held + 1
            mg.dirty_rows[grow] = True
            if idx.size == m:  # every item pops one block here
                columns.append([[b] for b in ids.tolist()])
                continue
            cells: list = [[] for _ in range(m)]
            for i, b in zip(idx.tolist(), ids.tolist()):
                cells[i] = [b]
            columns.append(cells)
            continue
        cells = []
        for i in range(m):
            n = col.item(i)
            k = start.item(i * num_groups + g)
            ids = list(popped[k : k + n])
            if n:
                mg._append(rows.item(i), ids)
            cells.append(ids)
        columns.append(cells)
    return list(map(list, zip(*columns)))


def _caching_items(managers, rows: np.ndarray, cache_tokens: np.ndarray, requests) -> list[int]:
    """The items for which some group's ``cache_blocks`` would register a block: ``min(
    cache_tokens, hashed tokens) // bs > num_cached`` (``cacheable_full_blocks``), or, for a
    full group whose block size differs from the hash block size, any item (its partial
    tail key is checked by ``cache_blocks`` itself). Others would change nothing.
    Example: bs 16, 40 tokens to cache, 32 hashed, 2 blocks cached -> not caching."""
    m = len(rows)
    h = managers[0].block_pool.hash_block_size
    if any(mg.block_size != h for mg in managers):
        return list(range(m))
    hashed = np.fromiter(map(len, map(_REQUEST_HASHES, requests)), dtype=np.int64, count=m) * h
    full = np.minimum(cache_tokens, hashed)
    work = np.zeros(m, dtype=bool)
    for mg in managers:
        work |= full // mg.block_size > np.maximum(mg.num_cached_block[rows], 0)
    return np.flatnonzero(work).tolist()


def apply_decode_item(
    manager,
    request,
    row: int,
    total: int,
    main: int,
    slots: int,
    cache_tokens: int,
    groups: Sequence[int],
) -> list[list[int]] | None:
    """``allocate_slots`` of one working item with no hit on a request that has a row
    (:meth:`reference.kv_cache_manager.KVCacheManager.allocate_slots`: free what left the
    window, ``need > free`` -> None, allocate, cache), calling only the managers of
    ``groups``: those whose ``pending_work`` flagged the item. Exact because an
    unflagged group frees, allocates and caches nothing and needs 0 blocks (with no hit,
    ``need <= max(cdiv(slots, bs) - held, 0)``, which the flag tests). ``cache_tokens`` is
    already rounded by the coordinator's ``num_cacheable_tokens``. No Mamba group (its
    per-step state goes through ``allocate_slots``).

    Example: full + 5 SWA groups, an item whose windows each drop a block but which
    needs no new block: only the 5 SWA managers run ``remove_skipped_blocks``.
    """
    managers = manager.coordinator.managers
    pool = manager.block_pool
    twin_of = manager._twin_of  # twin groups hold the same counts: decided once per class
    # remove_skipped_blocks, in group order (the queue order depends on it): each class of
    # twins decides once where its rows' drop starts and ends, and how many blocks each of
    # its groups pops when the row runs (``num_cached_block >= 0``): ``max(cdiv(slots, bs)
    # - held, 0)``, ``blocks_to_allocate``'s running rule (a drop nulls entries, it keeps
    # the row's length). Per class, by its first group: ``start``, ``end`` (0: no drop)
    # and ``pops``; ``seen`` marks the classes decided.
    num_groups = len(managers)
    seen = [False] * num_groups
    start = [0] * num_groups
    end = [0] * num_groups
    pops = [0] * num_groups
    reps: list[int] = []  # the first group of each class
    dropping: list[int] = []
    wide = False  # some class drops more than one block
    running = True
    need = 0
    for g in groups:
        t = twin_of[g]
        if not seen[t]:  # the first of its class: its row's counts decide for the class
            seen[t] = True
            reps.append(g)
            mg = managers[g]
            if mg.drops_blocks:
                last = mg.skipped_end(row, total)
                if last:
                    lead = mg.num_leading_null.item(row)
                    if last > lead:
                        start[t], end[t] = lead, last
                        wide = wide or last - lead > 1
            running = running and mg.num_cached_block.item(row) >= 0
            pops[t] = max(-(-slots // mg.block_size) - mg.row_len.item(row), 0)
        if end[t]:
            dropping.append(g)
        need += pops[t]
    if dropping:
        _free_dropped(managers, pool, twin_of, row, dropping, start, end, wide)
    new_blocks: list[list[int]] = [[] for _ in managers]
    if running:
        if need > pool.get_num_free_blocks():
            return None
        if need:  # one pop for every group, split in group order (no free comes between;
            # evicting a popped block's key leaves the queue alone)
            popped = pool.get_new_blocks(need)
            k = 0
            for g in groups:
                n = pops[twin_of[g]]
                if n:
                    new_blocks[g] = ids = popped[k : k + n]
                    managers[g]._append(row, ids)
                    k += n
    else:
        need = 0
        for g in groups:
            need += managers[g].get_num_blocks_to_allocate(row, slots, (), total, main)
        if need > pool.get_num_free_blocks():
            return None
        for g in groups:
            new_blocks[g] = managers[g].allocate_new_blocks(row, slots, main)
    if manager.enable_caching:
        cache_decode_item(managers, twin_of, reps, request, row, cache_tokens, groups)
    manager._known.add(request.request_id)
    if request.status is not RequestStatus.FINISHED:
        request.status = RequestStatus.RUNNING
    return new_blocks


def _free_dropped(
    managers,
    pool,
    twin_of: Sequence[int],
    row: int,
    dropping: Sequence[int],
    start: Sequence[int],
    end: Sequence[int],
    wide: bool,
) -> None:
    """``remove_skipped_blocks`` of the ``dropping`` groups of one row, in group order:
    group ``g`` frees ``row[start[c]:end[c]]`` tail first, ``c = twin_of[g]`` its class.
    One block each (a decode step's window move): the scalar path, group by group
    (:meth:`BlockPool.free_block_each`); some group dropping many blocks (``wide``: the
    first decode step after a long prefill): one run per group in one pass
    (:meth:`BlockPool.free_block_lists`). Example: 5 twin windows, w 1024, bs 16, 2048
    computed: each drops columns ``0:64``, 5 runs of 64 blocks."""
    if not wide:
        pool.free_block_each([managers[g].take_block_at(row, start[twin_of[g]]) for g in dropping])
        return
    pool.free_block_lists(
        [
            managers[g]._take_blocks_in_range(row, start[twin_of[g]], end[twin_of[g]])
            for g in dropping
        ]
    )


def cache_decode_item(
    managers,
    twin_of: Sequence[int],
    reps: Sequence[int],
    request,
    row: int,
    cache_tokens: int,
    groups: Sequence[int],
) -> None:
    """``cache_blocks`` of ``groups`` (in order) for one item, each class of twins planned
    once by its first group ``reps`` (:meth:`~optimized.control.managers.base.
    SingleTypeKVCacheManager.cache_plan`): a class registers something only past its
    cached count (``cacheable_full_blocks``), or when its block size differs from the hash
    block size, or when it adds its own rule (then each of its groups runs
    ``cache_blocks``); when no class does, no group is called. Registrations of different
    groups touch different keys and blocks, so planning every class first changes
    nothing. Example: full + 5 identical windows completing a block: one plan for the full
    group, one for the 5 windows, 6 registrations; the step after, no plan, no call."""
    h = request.hash_block_size
    limit = min(cache_tokens, len(request.block_hashes) * h)
    plans: list | None = None  # per class: its plan, _OWN_RULE or None (nothing to register)
    for g in reps:
        mg = managers[g]  # its row's counts decide for the class
        bs = mg.block_size
        if bs == h and limit // bs <= mg.num_cached_block.item(row):
            continue
        if plans is None:
            plans = [None] * len(managers)
        if mg.shares_cache_plans():
            plans[twin_of[g]] = mg.cache_plan(request, row, cache_tokens)
        else:
            plans[twin_of[g]] = _OWN_RULE
    if plans is None:
        return
    for g in groups:
        plan = plans[twin_of[g]]
        if plan is _OWN_RULE:
            managers[g].cache_blocks(request, row, cache_tokens)
        elif plan is not None:
            managers[g].apply_cache_plan(row, plan)


#: :func:`cache_decode_item`'s mark of a class whose ``cache_blocks`` adds its own rule
_OWN_RULE = object()


def _pops_from_own_front(
    blocks: np.ndarray,
    items: np.ndarray,
    calls: np.ndarray,
    pops: np.ndarray,
    num_groups: int,
    one_group: bool = False,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The pops of a step whose items free unhashed blocks (to the front) and pop, when
    every item pops no more than the unhashed blocks it freed itself: ``(popped blocks in
    item order, what is left at the front in queue order)``, else None.

    ``blocks`` are the unhashed blocks reaching ref count 0, in the reference's free order
    (item, group, tail first), with their item and call (``item * num_groups + group``);
    ``one_group``: a single group frees in the step, so they are already in run order.
    Per item the reference frees every group (each call prepends, so the last group's
    blocks come first), then pops from the front: its own blocks, while it pops no more
    than it freed. What it leaves stays at the front, and the next item's frees go before
    it. So item ``i`` pops the first ``pops[i]`` of its front run ``S_i`` and the queue
    starts ``S_m[p_m:] + ... + S_1[p_1:]``. Example: 2 items, 1 group, item 0 frees
    ``[5, 4]`` and pops 1, item 1 frees ``[9, 8]`` and pops 1: pops ``[5, 9]``, front
    ``[8, 4]``.
    """
    run, run_item = blocks, items  # in run order when one group frees (``one_group``)
    if not one_group:
        group = calls - items * num_groups
        key = items * num_groups + (num_groups - 1 - group)
        if key.size > 1 and (key[1:] < key[:-1]).any():
            order = np.argsort(key, kind="stable")
            run, run_item = blocks[order], items[order]
    sizes = np.bincount(run_item, minlength=pops.size)
    if (pops > sizes).any():
        return None
    k, p = sizes.item(0), pops.item(0)
    if k and (sizes == k).all() and (pops == p).all():
        # every item frees k and pops p (a batch prefilled together): rows of a matrix
        runs = run.reshape(-1, k)
        return runs[:, :p].ravel(), runs[::-1, p:].ravel()
    starts = np.cumsum(sizes) - sizes
    position = np.arange(run.size) - starts[run_item]
    take = position < pops[run_item]
    left, left_item = run[~take], run_item[~take]
    # last item's leftovers first, each item's kept in order: a stable sort on -item, as
    # positions (run order is item order)
    left_sizes = sizes - np.minimum(pops, sizes)
    ends = np.cumsum(left_sizes)
    rank = np.arange(left.size) - (ends - left_sizes)[left_item]
    front = np.empty_like(left)
    front[(left.size - ends)[left_item] + rank] = left
    return run[take], front


def _freed_blocks(
    managers, rows: np.ndarray, first_free: np.ndarray, last_free: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The blocks ``remove_skipped_blocks`` frees for every item, in the reference's call
    order (item, then group, each group's span tail first, nulls skipped), with each
    block's item and call index (``item * num_groups + group``). Item ``i`` frees
    ``table[rows[i], first_free[i, g]:last_free[i, g]]`` in group ``g``. One array gather
    per group when no span exceeds one block (a decode step's window move), else
    :func:`_freed_spans`.
    Example: 2 items, 2 groups, spans ``[[0, 1], [1, 1]]`` of blocks ``[[-, 7], [5, 9]]``
    -> blocks ``[7, 5, 9]``, items ``[0, 1, 1]``, calls ``[1, 2, 3]``."""
    num_groups = len(managers)
    span = last_free - first_free
    if (span > 1).any():
        widest = span.max(axis=0)
        if rows.size * int(widest.sum()) <= 2 * int(span.sum()) + 64:
            return _freed_padded(managers, rows, last_free, span, widest)
        return _freed_spans(managers, rows, last_free, span)
    ii, gg = np.nonzero(span > 0)  # row-major: item order, then group order
    blocks = np.zeros(ii.size, dtype=np.int64)
    for g, mg in enumerate(managers):
        sel = gg == g
        if sel.any():
            blocks[sel] = mg.table[rows[ii[sel]], first_free[ii[sel], g]]
    real = blocks != NULL_BLOCK_ID
    return blocks[real], ii[real], (ii * num_groups + gg)[real]


def _freed_padded(
    managers, rows: np.ndarray, last_free: np.ndarray, span: np.ndarray, widest: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_freed_spans` when the spans are about equal (the first decode step of a
    batch prefilled together): per group one 2-D gather of ``widest[g]`` cells per item
    (``(rows[i], last_free[i, g] - 1 - k)``, tail first), the cells past an item's span
    masked off; the groups' blocks side by side, read row by row, give the order item,
    group, tail first. When one group frees the same columns of every row, one slice per
    row does. Example: one item, one group, span 2 ending at 3 of row ``[-, 4, 6, ...]``
    -> blocks ``[6, 4]``."""
    num_groups = len(managers)
    m = rows.size
    freeing = np.flatnonzero(widest)
    if freeing.size == 1:
        g = freeing.item(0)
        width = int(widest[g])
        hi = last_free.item(0, g)
        if (span[:, g] == width).all() and (last_free[:, g] == hi).all():
            # one group frees the same columns of every row: one slice per row, tail first
            blocks = np.empty((m, width), dtype=np.int64)  # (one copy, reversed in place)
            blocks[:] = managers[g].table[rows, hi - width : hi][:, ::-1]
            blocks = blocks.reshape(-1)
            ii = np.arange(m).repeat(width)
            if np.count_nonzero(blocks) == blocks.size:
                return blocks, ii, ii * num_groups + g
            real = blocks != NULL_BLOCK_ID
            return blocks[real], ii[real], (ii * num_groups + g)[real]
    parts, valid, calls = [], [], []
    for g, mg in enumerate(managers):
        width = int(widest[g])
        if width == 0:
            continue
        k = np.arange(width)
        col = last_free[:, g, None] - 1 - k
        ok = k < span[:, g, None]
        parts.append(mg.table[rows[:, None], np.where(ok, col, 0)])
        valid.append(ok)
        calls.append(np.full(width, g))
    blocks = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    ok = np.concatenate(valid, axis=1) if len(valid) > 1 else valid[0]
    group = np.concatenate(calls) if len(calls) > 1 else calls[0]
    ii, cc = np.nonzero(ok)
    blocks = blocks[ii, cc].astype(np.int64)
    real = blocks != NULL_BLOCK_ID
    return blocks[real], ii[real], (ii * num_groups + group[cc])[real]


def _freed_spans(
    managers, rows: np.ndarray, last_free: np.ndarray, span: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_freed_blocks` when spans exceed one block (the first decode step after a
    long prefill drops most of a window), with one gather per group: every freed table
    cell ``(rows[i], last_free[i, g] - 1 - k)`` for ``k < span[i, g]``, laid out pair by
    pair (item, then group, as ``np.nonzero`` walks), each pair tail first. Example: one
    item, one group, span 2 ending at 3 of row ``[-, 4, 6, ...]`` -> blocks ``[6, 4]``."""
    num_groups = len(managers)
    ii, gg = np.nonzero(span > 0)
    lengths = span[ii, gg]
    seg = np.repeat(np.arange(ii.size), lengths)  # the pair of each freed cell
    offset = np.arange(seg.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    col = last_free[ii, gg][seg] - 1 - offset
    row = rows[ii][seg]
    group = gg[seg]
    blocks = np.zeros(seg.size, dtype=np.int64)
    for g, mg in enumerate(managers):
        sel = group == g
        if sel.any():
            blocks[sel] = mg.table[row[sel], col[sel]]
    real = blocks != NULL_BLOCK_ID
    return blocks[real], ii[seg][real], (ii * num_groups + gg)[seg][real]
