"""Compiled loops of the block pool (numba, :mod:`optimized.control.jit`): popping the
front of the free queue and freeing whole rows, each the same rule as its Python form.

* :func:`pop_front` unlinks the first ``n`` blocks of the free queue, walking its links
  one block at a time (about 2 ns a block compiled; the numpy walk of
  :meth:`~optimized.control.block_pool.FreeBlockQueue.popleft_array` costs about 50 ns a
  block once the queue is fragmented, as it is after some churn).
* :func:`free_rows` is :meth:`~optimized.control.coordinator.KVCacheCoordinator.free` of
  each row in order: per group one ``free_blocks`` call on the row's blocks tail first
  (nulls skipped; at ref count 0 a hashed block goes to the back, the call's unhashed
  ones to the front as one chain, in order), then the row released in every group
  (entries nulled, length 0, no cached count, no leading nulls).

Example: one group, a row ``[4, 5]`` held once, 5 unhashed and 4 hashed: ``free_rows``
puts 5 at the front, 4 at the back and empties the row.
"""

from __future__ import annotations

import numpy as np

from optimized.control.jit import compiled


def pop_front(
    next_free: np.ndarray, prev_free: np.ndarray, head: int, n: int, out: np.ndarray
) -> None:
    """Unlink the first ``n`` blocks after ``head`` (there are at least ``n``) into
    ``out[:n]``, in queue order; their links become -1."""
    block = next_free[head]
    for k in range(n):
        out[k] = block
        after = next_free[block]
        prev_free[block] = -1
        next_free[block] = -1
        block = after
    next_free[head] = block
    prev_free[block] = head


def free_span(
    table: np.ndarray,
    row: int,
    start: int,
    end: int,
    ref_cnt: np.ndarray,
    block_group: np.ndarray,
    prev_free: np.ndarray,
    next_free: np.ndarray,
    head: int,
    tail: int,
) -> tuple[int, int]:
    """One ``free_blocks`` call on ``table[row, start:end]`` tail first, each cell nulled
    (nulls skipped): one reference less each; at 0 a hashed block goes to the back, the
    call's unhashed ones to the front as one chain, in order. Returns ``(blocks that
    reached 0, -1)``, or ``(..., block)`` for the first block whose count would go below
    0 (the call stops there). Example: cells ``[4, 5]``, both held once, 4 hashed ->
    queue ``[5, ..., 4]``, ``(2, -1)``."""
    freed = 0
    chain_first = -1
    chain_last = -1
    for col in range(end - 1, start - 1, -1):
        block = table[row, col]
        table[row, col] = 0
        if block == 0:
            continue
        count = ref_cnt[block] - 1
        if count < 0:
            return freed, block
        ref_cnt[block] = count
        if count > 0:
            continue
        if block_group[block] >= 0:  # hashed: to the back
            before = prev_free[tail]
            prev_free[block] = before
            next_free[block] = tail
            next_free[before] = block
            prev_free[tail] = block
        else:  # unhashed: the call's chain, linked at the front below
            if chain_first < 0:
                chain_first = block
            else:
                next_free[chain_last] = block
                prev_free[block] = chain_last
            chain_last = block
        freed += 1
    if chain_first >= 0:
        old = next_free[head]
        next_free[head] = chain_first
        prev_free[chain_first] = head
        next_free[chain_last] = old
        prev_free[old] = chain_last
    return freed, -1


#: :func:`free_span` and :func:`pop_front` as the other loops call them: compiled where
#: numba is on
span_free = compiled(free_span) or free_span
front_pop = compiled(pop_front) or pop_front


def free_rows(
    rows: np.ndarray,
    tables: np.ndarray,
    row_lens: np.ndarray,
    leading: np.ndarray,
    cached: np.ndarray,
    dirty: np.ndarray,
    retired: np.ndarray,
    last_state: np.ndarray,
    ref_cnt: np.ndarray,
    block_group: np.ndarray,
    prev_free: np.ndarray,
    next_free: np.ndarray,
    queue: np.ndarray,
) -> int:
    """Free and release ``rows`` in order (module docstring): per group one
    :func:`free_span` of the whole row. The row arrays are a
    :class:`~optimized.control.row_store.RowStore`'s stacks (``tables[g]``, ``row_lens[g]``
    group ``g``'s; ``retired`` and ``last_state`` read by Mamba groups only, reset in
    every group). ``queue``: head, tail and number of free blocks (updated). Returns -1,
    or the first block whose ref count would go below 0 (the rows before it are freed,
    its row partly)."""
    head = queue[0]
    tail = queue[1]
    num_groups = tables.shape[0]
    for r in range(rows.shape[0]):
        row = rows[r]
        for g in range(num_groups):
            freed, bad = span_free(
                tables[g],
                row,
                0,
                row_lens[g, row],
                ref_cnt,
                block_group,
                prev_free,
                next_free,
                head,
                tail,
            )
            queue[2] += freed
            if bad >= 0:
                return bad
        for g in range(num_groups):  # (the entries were nulled as they were freed)
            row_lens[g, row] = 0
            cached[g, row] = -1
            leading[g, row] = 0
            dirty[g, row] = True
            retired[g, row] = 0
            last_state[g, row] = -1
    return -1


def group_row_arrays(coordinator) -> tuple[np.ndarray, ...]:
    """The groups' row arrays as the loops take them, stacked
    (:meth:`~optimized.control.coordinator.KVCacheCoordinator.row_store`): tables, row
    lengths, leading nulls, cached counts, dirty rows, retired columns, previous
    states."""
    rows = coordinator.row_store()
    return (
        rows.tables,
        rows.row_len,
        rows.num_leading_null,
        rows.num_cached_block,
        rows.dirty_rows,
        rows.num_retired_blocks,
        rows.last_state_block_index,
    )


#: the compiled forms (None: numba missing or turned off)
compiled_pop_front = compiled(pop_front)
compiled_free_rows = compiled(free_rows)
