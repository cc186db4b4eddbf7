"""Which Mamba states a step writes into which blocks: vLLM 0.33's worker, as the checks'
shadow learns it.

A step computes positions ``[start, end)`` of a request, ``d`` of them draft tokens
(the last ``d``; ``end`` includes them). In a Mamba group of block size ``bs`` whose row
is ``row`` after the step's allocation (``c = cdiv(end, bs) - 1``, the running column):

1. the running state, at ``end - d`` tokens, goes to column ``c``;
2. the state after draft ``j`` (at ``end - d + j`` tokens) goes to column ``c + j``
   (``j = 1..d``, the speculative columns); it is the request's state only if the
   draft is accepted;
3. a prefill checkpoint (``"align"``, :attr:`reference.specs.MambaSpec.has_prefill_checkpoints`):
   when the worker's rule finds one for the chunk
   (:func:`reference.managers.mamba_checkpoints.checkpoint_exportable` at
   :func:`reference.managers.mamba_checkpoints.checkpoint_position` of ``end``), the
   state at that position goes to column ``c - 1``;
4. after the step, with ``a`` drafts accepted (``computed = end - d + a``), the state
   at ``B = floor(computed / bs) * bs`` is copied to column ``B / bs - 1`` when ``B``
   is at least the running state's ``end - d`` (``"align"``, drafts only): so every
   block boundary the request passes holds its state.

Writes to a null column (block 0) are lost; a column past the row is not written.

Worked example (bs 4, k 2): a decode at 6 with 2 drafts: ``end = 9``, ``c = 2``; the
state at 7 goes to column 2, the states at 8 and 9 to columns 3 and 4. One draft is
accepted (computed 8): the state at 8 (column 3) is the request's running state, and
``B = 8 >= 7`` copies it to column 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from reference.layout import KVCacheLayout
from reference.managers.mamba_checkpoints import checkpoint_exportable, checkpoint_position
from reference.specs import MambaSpec, cdiv


@dataclass(frozen=True)
class StateWrite:
    """The state at ``position`` tokens written into ``block`` (a real block)."""

    block: int
    position: int


def step_state_writes(
    layout: KVCacheLayout,
    spec: MambaSpec,
    row: Sequence[int],
    start: int,
    end: int,
    num_drafts: int,
) -> list[StateWrite]:
    """Rules 1 to 3 of the module docstring for the chunk ``[start, end)`` with
    ``num_drafts`` drafts, over ``row`` (the group's row after the allocation)."""
    if end <= 0:
        return []
    bs = spec.block_size
    column = cdiv(end, bs) - 1
    running = end - num_drafts
    writes = [(column + j, running + j) for j in range(num_drafts + 1)]
    if spec.has_prefill_checkpoints:
        position = checkpoint_position(
            end,
            layout.cache_hit_alignment,
            bool(layout.drop_eagle_group_ids),
            layout.num_hash_lookahead_tokens,
        )
        if checkpoint_exportable(
            start,
            end,
            position,
            layout.hash_block_size,
            bs,
            spec.prefill_checkpoint_alignment,
        ):
            writes.append((column - 1, position))
    return [StateWrite(row[c], p) for c, p in writes if 0 <= c < len(row) and row[c] != 0 and p > 0]


def settle_copy(
    spec: MambaSpec, row: Sequence[int], running_end: int, num_computed_tokens: int
) -> StateWrite | None:
    """Rule 4 of the module docstring: the boundary copy after a draft step whose running
    state is at ``running_end`` and which ends with ``num_computed_tokens`` computed;
    None when nothing is copied. Example: bs 4, running 7, computed 8 -> the state at 8
    into column 1."""
    if not spec.is_align:
        return None
    bs = spec.block_size
    boundary = num_computed_tokens // bs * bs
    if boundary <= 0 or boundary < running_end:
        return None
    column = boundary // bs - 1
    if column >= len(row) or row[column] == 0:
        return None
    return StateWrite(row[column], boundary)
