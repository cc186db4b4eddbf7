"""Block tables on the device, updated per step by delta.

The manager's host tables (:attr:`optimized.managers.base.SingleTypeKVCacheManager.table`,
``int32 [max_num_reqs, max_blocks_per_req]``) are mirrored by one device tensor per group.
:meth:`DeviceBlockTables.sync` uploads only the rows the manager marked dirty since the last
sync (one gather on the host, one copy, one scatter on the device) and clears the marks; a
grown host table is re-uploaded whole. Example: 4096 running requests in decode, bs 16:
about 256 rows change per step, so a step moves 256 rows, not 4096.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from optimized.managers.base import SingleTypeKVCacheManager


class DeviceBlockTables:
    """Device copies of every group's block table (see the module docstring)."""

    def __init__(
        self, managers: Sequence[SingleTypeKVCacheManager], device: str | torch.device = "cpu"
    ) -> None:
        self.managers = list(managers)
        self.device = torch.device(device)
        self.tables: list[torch.Tensor] = [self._full_copy(m) for m in self.managers]
        self.rows_uploaded = 0

    def _full_copy(self, manager: SingleTypeKVCacheManager) -> torch.Tensor:
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

    def dirty_rows(self, manager: SingleTypeKVCacheManager) -> np.ndarray:
        """The rows to upload (int64 indices)."""
        return np.flatnonzero(manager.dirty_rows)
