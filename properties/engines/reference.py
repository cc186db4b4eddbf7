"""The reference engine: :class:`reference.kv_cache_manager.KVCacheManager` behind the
engine protocol. It exposes every optional capability (ref counts, free queue,
cached blocks), so every invariant applies to it. Mutant engines in
``properties/mutants/`` subclass it.
"""

from __future__ import annotations

from properties.core.allocation import Allocation
from properties.core.engine import BlockIds, CachedBlock, CacheHit, EngineError
from properties.core.modes import PRODUCTION_SETTINGS
from properties.engines.manager_engine import ManagerEngine
from reference.errors import KVConformError
from reference.kv_cache_manager import ComputedBlocks, KVCacheManager
from reference.layout import KVCacheLayout
from reference.request import Request


class ReferenceEngine(ManagerEngine):
    """Drives the reference manager; keeps the ComputedBlocks of each lookup."""

    name = "reference"

    def __init__(self, layout: KVCacheLayout) -> None:
        self.layout = layout
        self.manager = KVCacheManager(layout)
        self.requests: dict[str, Request] = {}
        self._hits: dict[str, tuple[CacheHit, ComputedBlocks]] = {}

    def get_computed_blocks(self, request_id: str) -> CacheHit:
        computed, num_tokens = self.manager.get_computed_blocks(self._request(request_id))
        hit = CacheHit(computed.block_ids(), num_tokens)
        self._hits[request_id] = (hit, computed)
        return hit

    def allocate(self, allocation: Allocation) -> BlockIds | None:
        request_id = allocation.request_id
        computed = self._computed_blocks(request_id, allocation.hit)
        try:
            new = self.manager.allocate_slots(
                self._request(request_id),
                allocation.num_new_tokens,
                allocation.num_new_computed_tokens,
                computed,
                allocation.num_lookahead_tokens,
                **allocation.keywords(),
            )
        except KVConformError as exc:
            raise EngineError(f"reference: allocate_slots({request_id!r}): {exc}") from exc
        if new is None:
            return None
        return tuple(tuple(b.block_id for b in group) for group in new)

    # serving modes (properties.core.engine.SupportsServingModes)
    def set_in_flight(
        self, request_id: str, num_in_flight_tokens: int, num_pending_tokens: int
    ) -> None:
        req = self._request(request_id)
        req.num_in_flight_tokens = num_in_flight_tokens
        req.num_output_placeholders = num_pending_tokens

    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        self.manager.cache_blocks(self._request(request_id), num_tokens)

    # copy-on-write of partial hits (properties.core.engine.CopiesBlocks)
    def pending_block_copies(self) -> list[tuple[int, int]]:
        return [(s.block_id, c.block_id) for s, c in self.manager.pending_block_copies()]

    def take_block_copies(self) -> list[tuple[int, int]]:
        return [(s.block_id, c.block_id) for s, c in self.manager.take_block_copies()]

    # optional capabilities
    def cached_blocks(self) -> list[CachedBlock]:
        """Every block under its primary key (a secondary key, a partial entry on a block
        cached in full, is not reported: it has no prefix length of its own)."""
        out = []
        for key, entries in self.manager.block_pool.cached.items():
            gid = int.from_bytes(key[-4:], "big")
            for block in entries.values():
                if block.cache_key == key:
                    out.append(CachedBlock(block.block_id, gid, block.num_cached_tokens))
        return out


def make_engine(layout: KVCacheLayout) -> ReferenceEngine:
    return ReferenceEngine(layout)


#: Every production layout setting (``properties.core.modes.PRODUCTION_SETTINGS``).
make_engine.production_settings = PRODUCTION_SETTINGS  # type: ignore[attr-defined]
