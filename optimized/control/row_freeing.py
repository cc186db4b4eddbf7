"""Freeing whole rows through the compiled :func:`optimized.control.compiled_pool.free_rows`
for a coordinator whose groups keep their rows by the base rules, or are Mamba groups
(whose rows also hold a previous state and a retired count, reset by the loop as
:meth:`~optimized.control.managers.mamba.MambaManager.release_row` resets them).

Example: a decode-heavy request finishing on gemma3 frees 456 blocks (the full group's
131, each window's 65) in one compiled call instead of some dozens of numpy calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from optimized.control.block_pool import BlockPool, FreeBlockQueue
from optimized.control.compiled_pool import compiled_free_rows, group_row_arrays
from optimized.control.managers.base import SingleTypeKVCacheManager
from optimized.control.managers.mamba import MambaManager
from reference.errors import KVConformError


class RowFreeing:
    """A coordinator's compiled :func:`free_rows`, used while every group keeps its rows
    by the base rules or is a plain Mamba group (no subclass releasing rows its own way)
    and the pool and queue are the plain ones; checked again whenever the coordinator's
    managers, pool or queue are replaced. ``run``: the loop (the compiled one; a test
    gives the Python :func:`~optimized.control.compiled_pool.free_rows`)."""

    def __init__(self, coordinator, run: Callable | None = None) -> None:
        self.coordinator = coordinator
        self.run = compiled_free_rows if run is None else run
        self._seen: tuple = ()
        self._plain = False
        self._arrays: tuple = ()
        self._rows = -1  # the row count when ``_arrays`` was taken
        self.state = np.zeros(3, dtype=np.int64)
        self.free(())  # numba compiles (or loads) the loop now, not in a timed free

    def _usable(self) -> bool:
        coord = self.coordinator
        pool = coord.block_pool
        seen = (coord.managers, pool, pool.free_block_queue)
        if len(seen) != len(self._seen) or any(a is not b for a, b in zip(seen, self._seen)):
            self._seen = seen
            self._plain = self.run is not None and _plain_rows(coord.managers, pool)
            self._rows = -1
        if not self._plain:
            return False
        if self._rows != coord.max_num_reqs:
            queue = pool.free_block_queue
            self._arrays = (
                *group_row_arrays(coord),
                pool.ref_cnt,
                pool.block_group,
                queue.prev_free,
                queue.next_free,
            )
            self._rows = coord.max_num_reqs
        return True

    def free(self, rows: Sequence[int]) -> bool:
        """Free and release ``rows`` (False: not usable here, nothing done). A block freed
        more often than allocated raises :class:`KVConformError` naming it."""
        if not self._usable():
            return False
        queue = self.coordinator.block_pool.free_block_queue
        state = self.state
        state[0], state[1], state[2] = queue.head, queue.tail, queue.num_free_blocks
        bad = self.run(np.asarray(rows, dtype=np.int64), *self._arrays, state)
        queue.num_free_blocks = int(state[2])
        if bad >= 0:
            raise KVConformError(f"block {bad} freed more often than allocated")
        return True


def _plain_rows(managers: Sequence, pool) -> bool:
    """Do the groups, pool and queue keep rows and links by the base rules (a plain Mamba
    group's rows by the base rules and its two arrays of its own)?"""
    if type(pool) is not BlockPool or type(pool.free_block_queue) is not FreeBlockQueue:
        return False
    base = SingleTypeKVCacheManager
    return all(
        type(m) is MambaManager
        or (
            type(m).release_row is base.release_row
            and type(m).release_rows is base.release_rows
            and type(m)._row_arrays is base._row_arrays
        )
        for m in managers
    )
