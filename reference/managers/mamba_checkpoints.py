"""Mamba prefill checkpoints ("align" mode): a state exported from inside a chunk.

A Mamba backend normally writes a request's state only at the end of a step's chunk.
A group whose spec has ``num_prefill_checkpoint_blocks > 0`` and a
``prefill_checkpoint_alignment`` ``a`` can also export the state at one position
*inside* the chunk, the **checkpoint**, into a block the manager reserves for it. The
manager decides per allocation:

1. the checkpoint position of a chunk ending at ``end`` (:func:`checkpoint_position`,
   over the cache hit alignment ``A``): the last multiple of ``A`` that leaves the
   logits token (``max(1, L)`` tokens with ``L`` lookahead hashes) to recompute;
   EAGLE's checkpoint drops one more unit;
2. whether the backend can export it (:func:`checkpoint_exportable`): the chunk starts
   on a hash boundary, the checkpoint lies strictly inside the chunk and at least one
   hash block past its start, on the backend's alignment from the start, and the
   chunk's reserved column ``cdiv(end, bs) - 2`` lies past the column of the state
   the chunk starts from;
3. whether the group wants it (:func:`needs_checkpoint`): the chunk reaches
   ``prefill_end`` (``max(P, N - 1)`` under sparse retention; 0, i.e. every chunk,
   otherwise) and the reserved column is not a live state: past the row, null, or
   one of the request's speculative columns.

The reserved column gets a real block (no null there), one more block than the step
would take otherwise. After the step the block is keyed by the chained hash at the
checkpoint (:func:`checkpoint_kept`: only when it is the prompt's own checkpoint, a
retained state under the retention interval, or the request's junction; otherwise its
keys are dropped, since the block holds no state any key promises).

Worked example (Mamba bs 4, one group so ``A = H = 4``, alignment 1, dense
retention): a prompt of 10 tokens in one chunk ``[0, 10)``: checkpoint position
``(10 - 1) // 4 * 4 = 8``; exportable (start 0, ``0 + 4 <= 8``, ``0 < 8 < 10``,
column ``cdiv(10, 4) - 2 = 1 > (0 - 1) // 4 = -1``); column 1 is past the empty row,
so it is reserved: the row becomes ``[0, c, s]`` (``c`` holds the state at 8, ``s``
the state at 10) and ``c`` is cached as the 8-token prefix. Without checkpoint blocks
the row is ``[0, 0, s]`` and nothing is cached.
"""

from __future__ import annotations

from reference.specs import MambaSpec, cdiv


def checkpoint_position(
    num_tokens: int, unit: int, drop_eagle: bool, num_hash_lookahead_tokens: int = 0
) -> int:
    """The reusable Mamba boundary of a prefix of ``num_tokens`` tokens on a grid of
    ``unit`` tokens: ``floor((n - max(1, L)) / unit) * unit`` (the logits token, or
    the ``L`` lookahead tokens, must be recomputed); with the EAGLE drop ``floor(n /
    unit) * unit - unit`` (the dropped block already leaves tokens to recompute); never
    below 0. Examples: ``(10, 4)`` -> 8; ``(12, 4)`` -> 8; ``(12, 4, L=2)`` -> 8;
    ``(12, 4, drop)`` -> 8; ``(3, 4)`` -> 0."""
    if drop_eagle:
        position = num_tokens // unit * unit - unit
    else:
        position = (num_tokens - max(1, num_hash_lookahead_tokens)) // unit * unit
    return max(position, 0)


def checkpoint_exportable(
    query_start: int,
    query_end: int,
    position: int,
    hash_block_size: int,
    block_size: int,
    alignment: int | None,
) -> bool:
    """Whether a backend of checkpoint ``alignment`` (None: it cannot export) can write
    the state at ``position`` during the chunk ``[query_start, query_end)`` (rule 2 of the
    module docstring): ``start % H == 0``, column ``cdiv(end, bs) - 2 > (start - 1) //
    bs``, ``start + H <= position``, ``start < position < end`` and ``(position - start)
    % alignment == 0``. Examples (H 4, bs 4, alignment 1): ``[0, 10)`` at 8 -> True;
    ``[8, 10)`` at 8 -> False (not inside); ``[2, 10)`` at 8 -> False (the chunk does
    not start on a hash boundary)."""
    if alignment is None:  # pragma: no cover - callers ask only with checkpoint blocks on
        return False  # (MambaSpec.has_prefill_checkpoints: an alignment is set)
    initial_state_column = (query_start - 1) // block_size
    column = cdiv(query_end, block_size) - 2
    return (
        query_start % hash_block_size == 0
        and column > initial_state_column
        and query_start + hash_block_size <= position
        and query_start < position < query_end
        and (position - query_start) % alignment == 0
    )


def reserved_column(query_end: int, block_size: int) -> int:
    """The column a chunk ending at ``query_end`` reserves for its checkpoint: the one
    before its final state's, ``cdiv(end, bs) - 2``. Example: end 10, bs 4 -> 1."""
    return cdiv(query_end, block_size) - 2


def needs_checkpoint(
    spec: MambaSpec,
    row: list,
    allocated: bool,
    query_start: int,
    query_end: int,
    position: int,
    prefill_end: int,
    hash_block_size: int,
) -> bool:
    """Whether the group reserves a block for the checkpoint at ``position`` in the chunk
    ``[query_start, query_end)`` of a request whose row is ``row`` (blocks with
    ``is_null``) and which was ``allocated`` before (rule 3 of the module docstring):
    checkpoint blocks on (:attr:`MambaSpec.has_prefill_checkpoints`), ``query_end >=
    prefill_end``, :func:`checkpoint_exportable`, and the reserved column ``c >= 0`` is
    past the row, null, or (``allocated``) one of the last ``k`` speculative columns.
    Example: the module docstring's prompt of 10, empty row -> True."""
    column = reserved_column(query_end, spec.block_size)
    return (
        spec.has_prefill_checkpoints
        and query_end >= prefill_end
        and checkpoint_exportable(
            query_start,
            query_end,
            position,
            hash_block_size,
            spec.block_size,
            spec.prefill_checkpoint_alignment,
        )
        and column >= 0
        and (
            column >= len(row)
            or row[column].is_null
            or (allocated and column >= len(row) - spec.num_speculative_blocks)
        )
    )


def checkpoint_kept(
    position: int,
    prompt_checkpoint: int,
    retained: bool,
    shared_prefix_boundary: int,
) -> bool:
    """Whether the block of a checkpoint at ``position`` is keyed after the step: it is
    the prompt's own checkpoint (``prompt_checkpoint``, :func:`checkpoint_position` of
    the prompt), a state the retention interval keeps (``retained``), or the request's
    junction. Otherwise the block's keys are dropped. Example: position 8 of a 10-token
    prompt (its own checkpoint 8) -> kept under any retention."""
    return retained or position in (prompt_checkpoint, shared_prefix_boundary)
