"""Every group's row arrays stacked in one array per kind, each manager's own arrays views
of its group's slice.

A single-type manager keeps its rows in arrays of its own (the block table, lengths,
cached counts, leading nulls, dirty marks; a Mamba group its previous state and retired
columns). The compiled loops take them all; handed over as tuples of one array per group
they cost numba a type check per array at every call (about 0.1 us each, some 5 us for a
decode step's pass on six groups), stacked they cost one per kind. :class:`RowStore`
holds the stacks: ``tables[g, row, :width_g]`` is group ``g``'s table (the widest group's
width for all, the rest unused), ``row_len[g]`` its lengths, and so on; it binds each
manager's attributes to views of its slice, so every Python path reads and writes the
same memory as the loops. Growing (more rows) makes new stacks and binds the views again.

Example: gemma3 with 64 rows: ``tables`` is ``(6, 64, 256)``, ``managers[2].table`` is
``tables[2, :, :256]`` and ``managers[2].row_len`` is ``row_len[2]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: the stacked row arrays besides the tables: name, dtype, the value of a row no request
#: holds (``last_state_block_index`` and ``num_retired_blocks`` are a Mamba group's)
ROW_ARRAYS: tuple[tuple[str, type, int], ...] = (
    ("row_len", np.int32, 0),
    ("num_cached_block", np.int32, -1),
    ("num_leading_null", np.int32, 0),
    ("dirty_rows", np.bool_, 0),
    ("last_state_block_index", np.int32, -1),
    ("num_retired_blocks", np.int32, 0),
)
_STACKED = frozenset(name for name, _, _ in ROW_ARRAYS)


class RowStore:
    """The stacked row arrays of ``managers`` (module docstring), ``num_rows`` rows each;
    the managers' attributes are bound to views of them. ``managers``: the list it was
    bound to (a coordinator whose managers are replaced binds a new store)."""

    def __init__(self, managers: Sequence, num_rows: int) -> None:
        self.managers = managers
        self.members = tuple(managers)
        self.widths = [m.max_blocks_per_req for m in managers]
        self.tables = np.zeros((len(managers), num_rows, max(self.widths, default=1)), np.int32)
        for name, dtype, absent in ROW_ARRAYS:
            setattr(self, name, np.full((len(managers), num_rows), absent, dtype=dtype))
        self._adopt(num_rows)

    def bound_to(self, managers: Sequence) -> bool:
        """Is this store bound to exactly these manager objects?"""
        return (
            managers is self.managers
            and all(a is b for a, b in zip(self.members, managers))
            and len(self.members) == len(managers)
        )

    def _adopt(self, num_rows: int) -> None:
        """Copy each manager's current rows (up to ``num_rows``) into the stacks and bind
        its attributes to its views."""
        for g, m in enumerate(self.managers):
            width = self.widths[g]
            old = m.table
            n = min(old.shape[0], num_rows)
            self.tables[g, :n, :width] = old[:n]
            m.table = self.tables[g, :, :width]
            for name in _STACKED:
                arr = getattr(m, name, None)
                if arr is None:
                    continue
                stack = getattr(self, name)
                stack[g, :n] = arr[:n]
                setattr(m, name, stack[g])

    def grow(self, num_rows: int) -> None:
        """Room for ``num_rows`` rows (each row keeps its content; new rows are absent);
        the managers' views bound again, and any row array of a manager's own that is not
        stacked grown by the manager's rule."""
        old = self.tables.shape[1]
        if num_rows <= old:
            return
        tables = np.zeros((len(self.managers), num_rows, self.tables.shape[2]), np.int32)
        tables[:, :old] = self.tables
        self.tables = tables
        for name, dtype, absent in ROW_ARRAYS:
            stack = np.full((len(self.managers), num_rows), absent, dtype=dtype)
            stack[:, :old] = getattr(self, name)
            setattr(self, name, stack)
        for g, m in enumerate(self.managers):
            m.table = self.tables[g, :, : self.widths[g]]
            for name in _STACKED:
                if getattr(m, name, None) is not None:
                    setattr(m, name, getattr(self, name)[g])
            m.grow_own_rows(num_rows, _STACKED)
