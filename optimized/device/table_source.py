"""What the device data plane reads of the control plane: the block tables, by slot.

:class:`BlockTableSource` is the narrow interface between the two planes. The control
plane keeps one host block table per KV cache group (``int32 [slots, blocks_g]``, 0 = null;
a struct-of-arrays control plane hands out the ``[:, g, :]`` views of its 3-D
``slot x group x block`` array), one ``bool [slots]`` mask per group of the rows it wrote
since the last upload, and the slot each live request occupies. Slots are recycled: a
finished request's row is nulled and marked, and a later request reuses it.

:func:`table_source` gives the source of a manager: the manager itself when it implements
the protocol, else :class:`ManagerTables`, which adapts the per-group
``SingleTypeKVCacheManager`` tables (``manager.coordinator.managers[g].table`` /
``.dirty_rows``, ``manager.coordinator.row_of``). Example: a request on slot 3 whose full
group row grew from ``[5]`` to ``[5, 9]`` leaves ``group_tables()[0][3, :2] == [5, 9]`` and
``dirty_masks()[0][3]`` True until the next upload clears it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class BlockTableSource(Protocol):
    """The control plane's block tables as the data plane reads them (module docstring).

    Every call returns the current arrays (a table may have been reallocated when the slot
    count grew); all groups have the same number of slots.
    """

    def group_tables(self) -> Sequence[np.ndarray]:
        """Per group: ``int32 [slots, blocks_g]`` block ids (0 = null); views are fine."""
        ...

    def dirty_masks(self) -> Sequence[np.ndarray]:
        """Per group: a writable ``bool [slots]`` mask of the rows written since the last
        upload; the data plane clears the rows it uploads."""
        ...

    def slot_of(self, request_id: str) -> int | None:
        """The slot (table row) of a live request, ``None`` when it holds none."""
        ...


class ManagerTables:
    """:class:`BlockTableSource` over a control plane with one table object per group
    (``manager.coordinator.managers[g]`` has ``table`` and ``dirty_rows``) and a
    ``manager.coordinator.row_of`` dict."""

    def __init__(self, manager) -> None:
        self.coordinator = manager.coordinator

    def group_tables(self) -> list[np.ndarray]:
        return [m.table for m in self.coordinator.managers]

    def dirty_masks(self) -> list[np.ndarray]:
        return [m.dirty_rows for m in self.coordinator.managers]

    def slot_of(self, request_id: str) -> int | None:
        return self.coordinator.row_of.get(request_id)


def table_source(manager) -> BlockTableSource:
    """The manager itself when it implements :class:`BlockTableSource`, else its
    :class:`ManagerTables` adapter."""
    if isinstance(manager, BlockTableSource):
        return manager
    return ManagerTables(manager)
