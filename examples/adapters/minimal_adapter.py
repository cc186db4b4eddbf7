"""A minimal engine adapter that imports only kvconform's public API (``kvconform``).

The engine is the smallest correct KV cache manager: full-attention groups over one
shared block pool, no prefix caching (every lookup is an empty hit, which the universal
level allows: a hit is bounded, not required). It declares the spec types it supports
(``make_engine.spec_types``), so kvconform draws only full-attention layouts, and it
exposes ``ref_counts`` and ``free_queue`` so that the pool checks apply.

Rule of the allocation, worked: a group with ``block_size = 4`` and a request with 6
computed tokens asked for 3 new tokens and 1 lookahead slot needs ``ceil((6 + 3 + 1) /
4) = 3`` blocks; holding 2, it takes 1 from the free queue (its head), or returns
``None`` without changing anything when the pool has fewer blocks free than all groups
need together.

    kvconform check --engine minimal_adapter:make_engine --level universal
    pytest --pyargs kvconform.conformance --kv-engine minimal_adapter:make_engine
"""

from __future__ import annotations

from collections.abc import Sequence

from kvconform import (
    BlockIds,
    CacheHit,
    FullAttentionSpec,
    KVCacheLayout,
    RequestInput,
    UnsupportedLayoutError,
)


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class MinimalEngine:
    """Full-attention groups, one pool, no prefix cache (see the module docstring)."""

    name = "minimal"

    def __init__(self, layout: KVCacheLayout) -> None:
        if not all(type(g.spec) is FullAttentionSpec for g in layout.groups):
            raise UnsupportedLayoutError("minimal engine: full attention only")
        self.block_sizes = [g.spec.block_size for g in layout.groups]
        self.free_ids = list(range(1, layout.num_blocks))  # block 0 is the null block
        self.tables: dict[str, list[list[int]]] = {}
        self.computed: dict[str, int] = {}

    def add_request(self, request: RequestInput) -> None:
        self.tables[request.request_id] = [[] for _ in self.block_sizes]
        self.computed[request.request_id] = 0

    def append_output_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        pass  # no block is keyed by its tokens: nothing to update

    def set_num_computed_tokens(self, request_id: str, num_computed_tokens: int) -> None:
        self.computed[request_id] = num_computed_tokens

    def new_step(self) -> None:
        pass

    def get_computed_blocks(self, request_id: str) -> CacheHit:
        return CacheHit(tuple(() for _ in self.block_sizes), 0)

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        hit: CacheHit | None = None,
        num_lookahead_tokens: int = 0,
    ) -> BlockIds | None:
        tables = self.tables[request_id]
        total = (
            self.computed[request_id]
            + num_new_computed_tokens
            + num_new_tokens
            + num_lookahead_tokens
        )
        wanted = [
            max(0, _blocks_for(total, size) - len(table))
            for size, table in zip(self.block_sizes, tables)
        ]
        if sum(wanted) > len(self.free_ids):
            return None
        new: list[tuple[int, ...]] = []
        for table, count in zip(tables, wanted):
            taken, self.free_ids = self.free_ids[:count], self.free_ids[count:]
            table.extend(taken)
            new.append(tuple(taken))
        return tuple(new)

    def free(self, request_id: str) -> None:
        for table in self.tables.get(request_id, []):
            self.free_ids.extend(reversed(table))  # tail first
            table.clear()

    def remove_request(self, request_id: str) -> None:
        self.tables.pop(request_id, None)
        self.computed.pop(request_id, None)

    def reset_prefix_cache(self) -> bool:
        return not any(any(table) for table in self.tables.values())

    def get_block_ids(self, request_id: str) -> BlockIds:
        return tuple(tuple(table) for table in self.tables[request_id])

    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    # optional capabilities: the pool checks (ref counts equal owners, free queue)
    def ref_counts(self) -> dict[int, int]:
        counts = {block: 0 for block in self.free_ids}
        for tables in self.tables.values():
            for table in tables:
                for block in table:
                    counts[block] = counts.get(block, 0) + 1
        return counts

    def free_queue(self) -> list[int]:
        return list(self.free_ids)


def make_engine(layout: KVCacheLayout) -> MinimalEngine:
    return MinimalEngine(layout)


make_engine.spec_types = ("full",)
