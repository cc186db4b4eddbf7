"""Which newly allocated blocks the workers zero before use (vLLM 0.33's KV cache zeroing).

A layout *needs zeroing* (:func:`needs_zeroing`) when it has a Mamba group (a Mamba
state is read before it is fully written) or when its attention groups do not all use
one precision (a block freed by one group and reused by another would be read under
the other precision, stale bytes decoding to NaN or infinity). Then the manager records
every block it adds to a request's table in an attention group (full, sliding window,
chunked local: never a Mamba group), whether for new tokens or for tokens a connector
loads synchronously (an asynchronous load writes its blocks itself: not recorded), and
the scheduler hands the blocks recorded since the last step to the workers, every step.

Order (:func:`blocks_to_zero`): group by group in layout order; within a group, the
blocks of each allocation in allocation order, each allocation's blocks in table
order. Blocks a hit adopts were written already: they are not added.

Worked example: groups full (bs 2) and Mamba; a step allocates ``r0``: full (1, 2),
Mamba (3), then ``r1``: full (4), Mamba (5): the blocks to zero are ``[1, 2, 4]``; a
layout of one full group of 2-byte elements and a sliding window of 1-byte elements
needs zeroing too, one of two full groups with the same element size does not.
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.layout import KVCacheLayout
from reference.specs import MambaSpec


def needs_zeroing(layout: KVCacheLayout) -> bool:
    """Whether the layout's new blocks are zeroed (module docstring)."""
    if any(isinstance(g.spec, MambaSpec) for g in layout.groups):
        return True
    return len({g.spec.dtype_bytes for g in layout.groups}) > 1


def blocks_to_zero(
    layout: KVCacheLayout, allocations: Sequence[Sequence[Sequence[int]]]
) -> list[int]:
    """The blocks to zero after ``allocations`` (each the blocks one allocation added to a
    request's table, per group; null entries 0 skipped), in the order of the module
    docstring; empty when the layout does not need zeroing."""
    if not needs_zeroing(layout):
        return []
    out: list[int] = []
    for gid, group in enumerate(layout.groups):
        if isinstance(group.spec, MambaSpec):
            continue
        for added in allocations:
            out.extend(b for b in added[gid] if b != 0)
    return out


__all__ = ["blocks_to_zero", "needs_zeroing"]
