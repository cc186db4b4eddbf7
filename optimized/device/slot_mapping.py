"""Slot mapping on the device: ``slot = table[row, pos // bs] * bs + pos % bs``.

The rule of :meth:`reference.block_table.BlockTable.slot` computed for a whole step at once
from the device block table. Example, bs 4, row ``[7, 2]``: positions 3 and 5 -> slots
``7 * 4 + 3 = 31`` and ``2 * 4 + 1 = 9``.

:func:`step_positions` expands ``(row, start, count)`` per request into per-token row and
position tensors (request order), the layout every kernel of the data plane takes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def step_positions(
    rows: Sequence[int], starts: Sequence[int], counts: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per scheduled token: its request's row and its position (int64, on ``device``)."""
    total = int(sum(counts))
    # one host -> device copy; output_size given, so no device -> host sync on CUDA
    rows_t, starts_t, counts_t = torch.tensor(
        [list(rows), list(starts), list(counts)], dtype=torch.int64
    ).to(device)
    token_rows = torch.repeat_interleave(rows_t, counts_t, output_size=total)
    first = torch.repeat_interleave(starts_t, counts_t, output_size=total)
    offsets = torch.arange(total, device=device) - torch.repeat_interleave(
        torch.cumsum(counts_t, 0) - counts_t, counts_t, output_size=total
    )
    return token_rows, first + offsets


def slot_mapping(
    table: torch.Tensor, token_rows: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Slots (int64) of the tokens ``(token_rows[i], positions[i])`` through ``table``."""
    blocks = table[token_rows, positions // block_size].to(torch.int64)
    return blocks * block_size + positions % block_size
