"""Worker-side block tables: one per KV cache group, rows per request (docs/spec.md §7).

Rules:

* **Rows are append-only.** ``add_row(req, ids)`` (re)starts a row, ``append_row(req, ids)``
  writes the new ids after the ones already there. The worker never learns that the manager
  replaced an entry with the null block.
* **Slot mapping.** For the token at position ``pos`` of row ``req``:
  ``slot = table[req, pos // bs] * bs + pos % bs``. Padding entries (beyond the real tokens,
  up to a requested length) get ``PAD_SLOT_ID = -1``. Worked example, ``bs = 4`` and the row
  ``[7, 2]``: position 5 lies in column 1 at offset 1, so its slot is ``2 * 4 + 1 = 9``;
  position 0 gets ``7 * 4 + 0 = 28``.
* **No slot mapping for Mamba.** A Mamba row is a list of state indices, one per block.
* **Sliding-window nulling view** (the V2 runner's input table). Entries wholly before the
  first key any scheduled token can see read as 0. With ``first_pos`` the request's first
  scheduled position, the number of such entries is ``spec.num_skipped_tokens(first_pos) //
  bs``: for a sliding window ``w`` this is ``max(first_pos - (w - 1), 0) // bs`` (reach
  ``w - 1``), for chunked local ``C`` it is ``(first_pos // C * C) // bs`` (the blocks before
  the current chunk's first block), for full attention 0. Example, SWA ``w = 5``, ``bs = 4``,
  row ``[3, 8, 9]``, ``first_pos = 10``: ``(10 - 4) // 4 = 1`` entry is nulled ->
  ``[0, 8, 9]``.

Everything here is standard-library Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from reference.errors import KVConformError, require_positive
from reference.layout import KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

PAD_SLOT_ID = -1
NULL_BLOCK_ID = 0


class BlockTableError(KVConformError):
    """A block-table call is impossible (unknown row, bad id, position past the row)."""


def num_nulled_entries(spec: KVCacheSpec, first_pos: int) -> int:
    """How many leading entries the nulling view replaces with 0 (see the module docstring).

    SWA ``w = 5``, ``bs = 4``: ``first_pos = 10`` -> 1, ``first_pos = 7`` -> 0.
    Chunked ``C = 8``, ``bs = 4``: ``first_pos = 17`` -> 4 (chunk [16, 24) starts at block 4).
    Full attention, Mamba, and a window ``w = 1`` (reach 0): always 0.
    """
    if first_pos < 0:
        raise BlockTableError(f"first_pos must be >= 0, got {first_pos}")
    if isinstance(spec, SlidingWindowSpec) and spec.sliding_window == 1:
        return 0  # reach w - 1 == 0: the V2 runner nulls nothing
    if isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
        return spec.num_skipped_tokens(first_pos) // spec.block_size
    return 0


@dataclass
class BlockTable:
    """The block table of one KV cache group: one append-only row of block ids per request."""

    block_size: int
    uses_slot_mapping: bool = True
    _rows: dict[str, list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        require_positive("BlockTable", "block_size", self.block_size)

    @classmethod
    def for_spec(cls, spec: KVCacheSpec) -> BlockTable:
        """A table for one group; Mamba groups get no slot mapping."""
        return cls(spec.block_size, uses_slot_mapping=not isinstance(spec, MambaSpec))

    # -- rows ---------------------------------------------------------------------------
    def add_row(self, req: str, ids: Sequence[int]) -> None:
        """Start (or restart) the row of ``req`` with ``ids``."""
        self._rows[req] = _checked_ids(req, ids)

    def append_row(self, req: str, ids: Sequence[int]) -> None:
        """Append ``ids`` after the entries already in the row of ``req``."""
        self._row(req).extend(_checked_ids(req, ids))

    def remove_row(self, req: str) -> None:
        """Forget the row of ``req`` (the request finished or was preempted)."""
        self._row(req)
        del self._rows[req]

    def row(self, req: str) -> tuple[int, ...]:
        """The entries of the row of ``req``, as written."""
        return tuple(self._row(req))

    def has_row(self, req: str) -> bool:
        return req in self._rows

    def _row(self, req: str) -> list[int]:
        try:
            return self._rows[req]
        except KeyError:
            raise BlockTableError(f"block table has no row for request {req!r}") from None

    # -- slot mapping -------------------------------------------------------------------
    def slot(self, req: str, pos: int) -> int:
        """``table[req, pos // bs] * bs + pos % bs``; row ``[7, 2]``, bs 4, pos 5 -> 9."""
        if not self.uses_slot_mapping:
            raise BlockTableError("a group without slot mapping (Mamba) has no slots")
        if pos < 0:
            raise BlockTableError(f"position must be >= 0, got {pos} (request {req!r})")
        row = self._row(req)
        col = pos // self.block_size
        if col >= len(row):
            raise BlockTableError(
                f"position {pos} of request {req!r} needs column {col}, but the row has "
                f"{len(row)} entries"
            )
        return row[col] * self.block_size + pos % self.block_size

    def slot_mapping(
        self, rows: Sequence[str], positions: Sequence[int], pad_to: int | None = None
    ) -> list[int]:
        """Slots of the tokens ``(rows[i], positions[i])``, padded with -1 to ``pad_to``.

        bs 4, rows ``a -> [7, 2]``: ``slot_mapping(["a", "a"], [3, 4], pad_to=4)`` ->
        ``[31, 8, -1, -1]``.
        """
        if len(rows) != len(positions):
            raise BlockTableError(
                f"slot_mapping needs one row per position, got {len(rows)} rows and "
                f"{len(positions)} positions"
            )
        slots = [self.slot(r, p) for r, p in zip(rows, positions)]
        if pad_to is not None:
            if pad_to < len(slots):
                raise BlockTableError(
                    f"pad_to must be >= the number of tokens {len(slots)}, got {pad_to}"
                )
            slots.extend([PAD_SLOT_ID] * (pad_to - len(slots)))
        return slots

    # -- the V2 runner's view -----------------------------------------------------------
    def nulled_row(self, req: str, spec: KVCacheSpec, first_pos: int) -> tuple[int, ...]:
        """The row of ``req`` with entries wholly outside every scheduled window read as 0."""
        row = self._row(req)
        n = min(num_nulled_entries(spec, first_pos), len(row))
        return (NULL_BLOCK_ID,) * n + tuple(row[n:])


@dataclass
class MultiGroupBlockTable:
    """One :class:`BlockTable` per KV cache group, in the layout's group order."""

    tables: tuple[BlockTable, ...]

    @classmethod
    def for_layout(cls, layout: KVCacheLayout) -> MultiGroupBlockTable:
        return cls(tuple(BlockTable.for_spec(g.spec) for g in layout.groups))

    def add_row(self, req: str, ids_per_group: Sequence[Sequence[int]]) -> None:
        self._check_groups(ids_per_group)
        for table, ids in zip(self.tables, ids_per_group):
            table.add_row(req, ids)

    def append_row(self, req: str, ids_per_group: Sequence[Sequence[int]]) -> None:
        self._check_groups(ids_per_group)
        for table, ids in zip(self.tables, ids_per_group):
            table.append_row(req, ids)

    def remove_row(self, req: str) -> None:
        for table in self.tables:
            table.remove_row(req)

    def _check_groups(self, ids_per_group: Sequence[Sequence[int]]) -> None:
        if len(ids_per_group) != len(self.tables):
            raise BlockTableError(
                f"expected block ids for {len(self.tables)} groups, got {len(ids_per_group)}"
            )


def _checked_ids(req: str, ids: Sequence[int]) -> list[int]:
    out = list(ids)
    for i in out:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise BlockTableError(f"block ids of request {req!r} must be ints >= 0, got {i!r}")
    return out
