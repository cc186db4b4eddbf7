"""Block tables on the device, updated per step by delta.

The manager's host tables (``int32 [max_num_reqs, max_blocks_per_req]``, one per group: a
:class:`HostTable`, which the control plane's managers satisfy) are mirrored by one device
tensor per group.
:meth:`DeviceBlockTables.sync` uploads only the rows the manager marked dirty since the last
sync (one gather on the host, one copy, one scatter on the device) and clears the marks; a
grown host table is re-uploaded whole. Example: 4096 running requests in decode, bs 16:
about 256 rows change per step, so a step moves 256 rows, not 4096.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch


class HostTable(Protocol):
    """What the device tables read of one group's host table (the control plane's
    :class:`optimized.control.managers.base.SingleTypeKVCacheManager` has both): ``table``,
    the ``int32 [rows, max_blocks_per_req]`` block ids (0 = null), and ``dirty_rows``, a
    ``bool [rows]`` mask of the rows written since the last upload, which
    :meth:`DeviceBlockTables.sync` clears. Example: rows 2 and 5 written -> ``dirty_rows``
    is True at 2 and 5, and a sync moves those two rows."""

    table: np.ndarray
    dirty_rows: np.ndarray


class DeviceBlockTables:
    """Device copies of every group's block table (see the module docstring)."""

    def __init__(self, managers: Sequence[HostTable], device: str | torch.device = "cpu") -> None:
        self.managers = list(managers)
        self.device = torch.device(device)
        self.tables: list[torch.Tensor] = [self._full_copy(m) for m in self.managers]
        self.rows_uploaded = 0

    def _full_copy(self, manager: HostTable) -> torch.Tensor:
        manager.dirty_rows[:] = False
        return torch.from_numpy(manager.table.copy()).to(self.device)

    def sync(self) -> int:
        """Upload the dirty rows of every group; returns how many rows moved."""
        moved = 0
        for gid, manager in enumerate(self.managers):
            if self.tables[gid].shape != manager.table.shape:
                self.tables[gid] = self._full_copy(manager)
                moved += manager.table.shape[0]
                continue
            rows = self.dirty_rows(manager)
            if rows.size == 0:
                continue
            host = torch.from_numpy(manager.table[rows])
            index = torch.from_numpy(rows).to(self.device)
            self.tables[gid].index_copy_(0, index, host.to(self.device))
            manager.dirty_rows[rows] = False
            moved += rows.size
        self.rows_uploaded += moved
        return moved

    def dirty_rows(self, manager: HostTable) -> np.ndarray:
        """The rows to upload (int64 indices)."""
        return np.flatnonzero(manager.dirty_rows)
