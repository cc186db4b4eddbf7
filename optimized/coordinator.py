"""Coordinators (:mod:`reference.coordinator`): one pool, one manager per group, rows.

* No prefix cache: lookups return nothing.
* Unitary (one group): the group's own hit, aligned to its block size.
* Hybrid: spec groups (equal specs) looked up together, full attention first; the
  candidate length shrinks until a pass leaves it unchanged (one pass for exactly one
  full and one other spec group); a full-attention answer is reused, never re-queried,
  and cut to the final length. Hybrids cache only up to a multiple of the LCM.

Rows: each request gets one row index, shared by every group's table, from the first
allocation until ``free``; released rows are reused (lowest first) and the tables grow by
doubling when every row is taken.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from optimized.block_pool import BlockPool
from optimized.managers import SingleTypeKVCacheManager, manager_class_for
from optimized.managers.base import BlockList
from optimized.request import Request
from reference.layout import KVCacheLayout
from reference.specs import FullAttentionSpec, KVCacheSpec, cdiv

#: Rows preallocated per group table before the first doubling.
DEFAULT_MAX_NUM_REQS = 64


@dataclass
class SpecGroup:
    """Groups with one spec, looked up together."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]


class KVCacheCoordinator:
    """Shared pool, per-group managers and the request -> row map."""

    def __init__(self, layout: KVCacheLayout, max_num_reqs: int = DEFAULT_MAX_NUM_REQS) -> None:
        self.layout = layout
        self.enable_caching = layout.enable_caching
        self.block_pool = BlockPool(
            layout.num_blocks, layout.enable_caching, layout.hash_block_size, len(layout.groups)
        )
        alignment = self.cache_hit_alignment()
        self.managers: list[SingleTypeKVCacheManager] = [
            manager_class_for(g.spec)(
                g.spec,
                self.block_pool,
                gid,
                layout.enable_caching,
                alignment,
                layout.max_model_len,
                max_num_reqs,
            )
            for gid, g in enumerate(layout.groups)
        ]
        self.max_num_reqs = max_num_reqs
        self.row_of: dict[str, int] = {}
        self._free_rows: list[int] = list(range(max_num_reqs))

    # -- rows --------------------------------------------------------------------
    def row(self, request_id: str) -> int:
        """The request's row, taking a free one (lowest index) on first use."""
        row = self.row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                self._grow(2 * self.max_num_reqs)
            row = heapq.heappop(self._free_rows)
            self.row_of[request_id] = row
        return row

    def _grow(self, max_num_reqs: int) -> None:
        for m in self.managers:
            m.grow(max_num_reqs)
        for r in range(self.max_num_reqs, max_num_reqs):
            heapq.heappush(self._free_rows, r)
        self.max_num_reqs = max_num_reqs

    # -- hits --------------------------------------------------------------------
    def cache_hit_alignment(self) -> int:
        return self.layout.scheduler_block_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int]:
        raise NotImplementedError

    def num_cacheable_tokens(self, num_tokens: int) -> int:
        return num_tokens

    # -- allocation --------------------------------------------------------------
    def get_num_blocks_to_allocate(
        self,
        row: int,
        num_tokens: int,
        hit_blocks: Sequence[Sequence[int]],
        total_computed: int,
        num_tokens_main: int,
    ) -> int:
        return sum(
            m.get_num_blocks_to_allocate(
                row, num_tokens, hit_blocks[i], total_computed, num_tokens_main
            )
            for i, m in enumerate(self.managers)
        )

    def allocate_new_computed_blocks(
        self, row: int, hit_blocks: Sequence[Sequence[int]], num_local_computed_tokens: int
    ) -> None:
        """Adopt a hit in every group; nothing for a request already on the running path."""
        if any(m.num_cached_block[row] >= 0 for m in self.managers):
            return
        for i, m in enumerate(self.managers):
            m.add_local_computed_blocks(row, hit_blocks[i], num_local_computed_tokens)

    def allocate_new_blocks(
        self, row: int, num_tokens: int, num_tokens_main: int
    ) -> list[BlockList]:
        return [m.allocate_new_blocks(row, num_tokens, num_tokens_main) for m in self.managers]

    def cache_blocks(self, request: Request, row: int, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        cacheable = self.num_cacheable_tokens(num_tokens)
        for m in self.managers:
            m.cache_blocks(request, row, cacheable)

    def remove_skipped_blocks(self, row: int, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(row, num_computed_tokens)

    def free(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        # each group's blocks in reverse order (``SingleTypeKVCacheManager.free``), in one pass
        self.block_pool.free_block_lists(
            [m.table[row, : m.row_len[row]][::-1] for m in self.managers]
        )
        for m in self.managers:
            m.release_row(row)
        heapq.heappush(self._free_rows, row)

    def new_step_starts(self) -> None:
        for m in self.managers:
            m.new_step_starts()

    def get_blocks(self, request_id: str) -> list[BlockList]:
        row = self.row_of.get(request_id)
        if row is None:
            return [[] for _ in self.managers]
        return [m.blocks(row) for m in self.managers]


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int]:
        return [[] for _ in self.managers], 0


class UnitaryCoordinator(KVCacheCoordinator):
    def cache_hit_alignment(self) -> int:
        return self.layout.groups[0].spec.block_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int]:
        m = self.managers[0]
        return m.find_longest_cache_hit(
            block_hashes, max_length, [0], self.block_pool, m.spec, self.cache_hit_alignment()
        )


class HybridCoordinator(KVCacheCoordinator):
    def __init__(self, layout: KVCacheLayout, max_num_reqs: int = DEFAULT_MAX_NUM_REQS) -> None:
        super().__init__(layout, max_num_reqs)
        self.spec_groups: list[SpecGroup] = []
        for gid, m in enumerate(self.managers):
            for sg in self.spec_groups:
                if sg.spec == m.spec and sg.manager_cls is type(m):
                    sg.group_ids.append(gid)
                    break
            else:
                self.spec_groups.append(SpecGroup(m.spec, [gid], type(m)))
        self.spec_groups.sort(key=lambda sg: not isinstance(sg.spec, FullAttentionSpec))
        self.scheduler_block_size = layout.scheduler_block_size

    def num_cacheable_tokens(self, num_tokens: int) -> int:
        s = self.scheduler_block_size
        return num_tokens // s * s

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int]:
        """The fixed point of :meth:`reference.coordinator.HybridCoordinator...`."""
        alignment = self.cache_hit_alignment()
        num_groups = len(self.managers)
        blocks_of: list[BlockList | None] = [None] * num_groups
        length_of = [0] * num_groups
        simple = len(self.spec_groups) == 2 and isinstance(
            self.spec_groups[0].spec, FullAttentionSpec
        )
        hit = max_length
        while True:
            candidate = hit
            for sg in self.spec_groups:
                first = sg.group_ids[0]
                if isinstance(sg.spec, FullAttentionSpec) and blocks_of[first] is not None:
                    candidate = min(candidate, length_of[first])
                    continue
                found, candidate = sg.manager_cls.find_longest_cache_hit(
                    block_hashes, candidate, sg.group_ids, self.block_pool, sg.spec, alignment
                )
                for gid, lst in zip(sg.group_ids, found):
                    blocks_of[gid] = lst
                    length_of[gid] = candidate
            if candidate >= hit:
                break
            hit = candidate
            if simple:
                break
        for sg in self.spec_groups:
            if not isinstance(sg.spec, FullAttentionSpec):
                continue
            keep = cdiv(hit, sg.spec.block_size)
            for gid in sg.group_ids:
                if blocks_of[gid] is not None:
                    blocks_of[gid] = blocks_of[gid][:keep]
        return [lst if lst is not None else [] for lst in blocks_of], hit


def make_coordinator(
    layout: KVCacheLayout, max_num_reqs: int = DEFAULT_MAX_NUM_REQS
) -> KVCacheCoordinator:
    """No prefix cache, unitary (one group) or hybrid (several groups)."""
    if not layout.enable_caching:
        return NoPrefixCacheCoordinator(layout, max_num_reqs)
    if len(layout.groups) == 1:
        return UnitaryCoordinator(layout, max_num_reqs)
    return HybridCoordinator(layout, max_num_reqs)
