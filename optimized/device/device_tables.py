"""Block tables on the device, updated per step by the entries that changed.

The device holds one 3-D ``int32 [slots, groups, max_blocks]`` tensor (``max_blocks`` the
widest group's row; group ``g`` uses columns ``[0, blocks_g)``), mirrored on the host by a
shadow of what was last uploaded. :meth:`DeviceBlockTables.sync` reads the control plane
through a :class:`optimized.device.table_source.BlockTableSource`: for each group only the
rows marked dirty are compared with the shadow, and only the entries that differ move, as
one packed ``(slot, group, column, block)`` upload followed by one scatter on the device
(the NVRTC ``table_update`` kernel on CUDA when loaded, ``index_put_`` otherwise). Slots
added when the control plane grows are compared too, whatever their marks (so the first
sync, from zero slots, compares every row).

Worked example: 256 requests decoding with bs 16, one full and one sliding group
(w = 128): per step about 16 requests cross a block boundary, so 16 tail entries appear in
the full group and 16 in the sliding group, while the sliding group nulls 16 leading entries:
48 entries move (4 int64 each), not 256 rows x 2 groups x 129 columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from optimized.device.table_source import BlockTableSource


@dataclass(frozen=True)
class Upload:
    """The changed entries of one sync: parallel int64 arrays (one entry per index)."""

    slots: np.ndarray
    groups: np.ndarray
    cols: np.ndarray
    blocks: np.ndarray

    @property
    def size(self) -> int:
        return int(self.slots.size)


class DeviceBlockTables:
    """The device copy of every group's block table (see the module docstring).

    ``kernels``: an object with ``table_update(table, packed)`` (the NVRTC kernels) or
    ``None`` for torch's ``index_put_``. ``entries_uploaded`` and ``rows_compared`` count
    over the object's life; ``last_upload`` is the last sync's :class:`Upload`.
    """

    def __init__(
        self, source: BlockTableSource, device: str | torch.device = "cpu", kernels=None
    ) -> None:
        self.source = source
        self.device = torch.device(device)
        self.kernels = kernels
        tables = source.group_tables()
        self.widths = [int(t.shape[1]) for t in tables]
        self.num_groups = len(tables)
        # no slots yet: the first sync grows to the source's and compares every row
        self.shadow = np.zeros((0, self.num_groups, max(self.widths, default=0)), np.int32)
        self.device_table = torch.from_numpy(self.shadow).to(self.device)
        self.entries_uploaded = 0
        self.rows_compared = 0
        self.last_upload = _empty_upload()
        self.sync()

    @property
    def num_slots(self) -> int:
        return self.shadow.shape[0]

    @property
    def tables(self) -> list[torch.Tensor]:
        """Per group, the ``[slots, blocks_g]`` view of the device table (no copy)."""
        return [self.device_table[:, g, :w] for g, w in enumerate(self.widths)]

    def dirty_rows(self, gid: int) -> np.ndarray:
        """The rows of group ``gid`` to compare with the shadow (int64 indices)."""
        return np.flatnonzero(self.source.dirty_masks()[gid])

    def _grow(self, num_slots: int) -> np.ndarray:
        old = self.num_slots
        shadow = np.zeros((num_slots, *self.shadow.shape[1:]), np.int32)
        shadow[:old] = self.shadow
        self.shadow = shadow
        pad = torch.zeros(
            (num_slots - old, *self.shadow.shape[1:]), dtype=torch.int32, device=self.device
        )
        self.device_table = torch.cat([self.device_table, pad])
        return np.arange(old, num_slots)

    def changed_entries(self) -> Upload:
        """Compare the dirty rows with the shadow, clear their marks, update the shadow, and
        return the entries that differ (nothing is sent to the device here)."""
        tables = self.source.group_tables()
        masks = self.source.dirty_masks()
        grown = np.zeros(0, np.int64)
        if tables and tables[0].shape[0] > self.num_slots:
            grown = self._grow(int(tables[0].shape[0]))
        parts = []
        for gid, (host, width) in enumerate(zip(tables, self.widths)):
            rows = self.dirty_rows(gid)
            if grown.size:
                rows = np.union1d(rows, grown)
            if rows.size == 0:
                continue
            self.rows_compared += int(rows.size)
            now = host[rows]
            before = self.shadow[rows, gid, :width]
            r, c = np.nonzero(now != before)
            self.shadow[rows, gid, :width] = now
            masks[gid][rows] = False
            if r.size:
                parts.append((rows[r], np.full(r.size, gid), c, now[r, c]))
        if not parts:
            return _empty_upload()
        slots, groups, cols, blocks = (np.concatenate(p).astype(np.int64) for p in zip(*parts))
        return Upload(slots, groups, cols, blocks)

    def sync(self) -> int:
        """Upload the changed entries of every group; returns how many moved."""
        upload = self.changed_entries()
        self.last_upload = upload
        if upload.size:
            packed = np.stack([upload.slots, upload.groups, upload.cols, upload.blocks])
            packed_t = torch.from_numpy(packed).to(self.device, non_blocking=True)
            if self.kernels is not None:
                self.kernels.table_update(self.device_table, packed_t)
            else:
                s, g, c, b = packed_t
                self.device_table.index_put_((s, g, c), b.to(torch.int32))
        self.entries_uploaded += upload.size
        return upload.size


def _empty_upload() -> Upload:
    empty = np.zeros(0, np.int64)
    return Upload(empty, empty, empty, empty)
