"""The blocks a KV connector is told cover a request's computed tokens (vLLM 0.33's
``get_block_ids_for_computed_tokens``, what its scheduler hands the connector at a
request's end and its offloading connectors read).

Rule (:func:`blocks_covering`): per group, an attention group's row up to the block
holding the last computed token (``cdiv(num_tokens, block_size)`` entries, nulls
included: a sliding window's skipped blocks stay as nulls); a Mamba group's whole row
(its blocks hold states, not tokens).

Worked example: full bs 2 row ``(1, 2, 3)``, Mamba row ``(0, 4)``, 3 computed tokens:
``((1, 2), (0, 4))``.
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.layout import KVCacheLayout
from reference.specs import MambaSpec, cdiv


def blocks_covering(
    layout: KVCacheLayout, rows: Sequence[Sequence[int]], num_tokens: int
) -> tuple[tuple[int, ...], ...]:
    """The rows of a request cut to its ``num_tokens`` computed tokens (module
    docstring)."""
    return tuple(
        tuple(row)
        if isinstance(g.spec, MambaSpec)
        else tuple(row[: cdiv(num_tokens, g.spec.block_size)])
        for row, g in zip(rows, layout.groups)
    )


__all__ = ["blocks_covering"]
