"""The blocks a KV connector is told cover a request's computed tokens (vLLM 0.33's
``get_block_ids_for_computed_tokens``, what its scheduler hands the connector at a
request's end and its offloading connectors read).

Rule (:func:`blocks_covering`): per group, an attention group's row up to the block
holding the last computed token (``cdiv(num_tokens, block_size)`` entries, nulls
included: a sliding window's skipped blocks stay as nulls); a Mamba group's whole row
(its blocks hold states, not tokens).

Under decode context parallelism (``dcp_world_size = d``) vLLM cuts an attention row at
its spec's block size, which is one rank's: ``cdiv(num_tokens, block_size / d)`` entries,
up to ``d`` times the blocks that hold the tokens (a manager block holds ``d`` ranks'
blocks); the rule follows vLLM there (the connector is told blocks past the computed
tokens, allocated ones only: a row is never lengthened).

Worked example: full bs 2 row ``(1, 2, 3)``, Mamba row ``(0, 4)``, 3 computed tokens:
``((1, 2), (0, 4))``; full bs 4 with ``d = 2``, row ``(1, 2, 3)``, 3 computed tokens:
``((1, 2),)`` (one block holds them: ``cdiv(3, 2)``).
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
    d = layout.dcp_world_size
    return tuple(
        tuple(row)
        if isinstance(g.spec, MambaSpec)
        else tuple(row[: cdiv(num_tokens, g.spec.block_size // d)])
        for row, g in zip(rows, layout.groups)
    )


__all__ = ["blocks_covering"]
