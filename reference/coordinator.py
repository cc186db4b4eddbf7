"""Coordinators: one block pool, one manager per group, one hit for all groups.

* No prefix cache: lookups return nothing; everything else is delegated.
* Unitary (one group): the group's own hit, aligned to its block size.
* Hybrid (several groups): groups with equal specs are looked up together (a block
  hits only if it hits in every member). Full-attention spec groups go first. The
  candidate length starts at ``max_length``; each spec group in turn returns its
  longest hit ``<=`` the current candidate, which becomes the new candidate. A full
  attention result is reused (never re-queried) because full attention is downward
  closed. The pass repeats until a whole pass leaves the candidate unchanged, except
  for exactly one full and one other spec group, where one pass suffices. Full
  attention lists are then cut to the final length.

  Worked example: full (bs 4) + SWA (w 5, bs 4), ``max 15``. Full hits 12 (3 blocks).
  SWA, asked for ``<= 12``, needs blocks 1 and 2 (``cdiv(4, 4) = 1``... one block
  before 12: block 2): if block 2 was freed after caching, SWA may answer 8, and the
  full list is cut to 2 blocks. Hit 8.

Cached token counts: hybrid coordinators cache only up to a multiple of the
scheduler block size (the LCM), since no hit can end elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from reference.block_pool import BlockPool
from reference.layout import KVCacheLayout
from reference.managers import SingleTypeKVCacheManager, manager_class_for
from reference.managers.base import BlockList
from reference.request import Request
from reference.specs import FullAttentionSpec, KVCacheSpec, cdiv


@dataclass
class SpecGroup:
    """Groups with one spec, looked up together."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]


class KVCacheCoordinator:
    """Shared pool and per-group managers; subclasses choose the hit search."""

    def __init__(self, layout: KVCacheLayout) -> None:
        self.layout = layout
        self.enable_caching = layout.enable_caching
        self.block_pool = BlockPool(
            layout.num_blocks, layout.enable_caching, layout.hash_block_size
        )
        alignment = self.cache_hit_alignment()
        self.managers: list[SingleTypeKVCacheManager] = [
            manager_class_for(g.spec)(
                g.spec, self.block_pool, gid, layout.enable_caching, alignment
            )
            for gid, g in enumerate(layout.groups)
        ]

    def cache_hit_alignment(self) -> int:
        """Hit lengths are multiples of this (:attr:`KVCacheLayout.cache_hit_alignment`)."""
        return self.layout.cache_hit_alignment

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int]:
        raise NotImplementedError

    def num_cacheable_tokens(self, num_tokens: int) -> int:
        return num_tokens

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        hit_blocks: Sequence[Sequence],
        total_computed: int,
        num_tokens_main: int,
    ) -> int:
        return sum(
            m.get_num_blocks_to_allocate(
                request_id, num_tokens, hit_blocks[i], total_computed, num_tokens_main
            )
            for i, m in enumerate(self.managers)
        )

    def allocate_new_computed_blocks(
        self, request_id: str, hit_blocks: Sequence[Sequence], num_local_computed_tokens: int
    ) -> None:
        """Adopt a hit in every group; nothing for a request that already holds blocks."""
        if any(request_id in m.num_cached_block for m in self.managers):  # pragma: no cover
            return  # a request holding blocks is never offered a hit (it is not waiting)
        for i, m in enumerate(self.managers):
            m.add_local_computed_blocks(request_id, hit_blocks[i], num_local_computed_tokens)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main: int
    ) -> list[BlockList]:
        return [
            m.allocate_new_blocks(request_id, num_tokens, num_tokens_main) for m in self.managers
        ]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        cacheable = self.num_cacheable_tokens(num_tokens)
        for m in self.managers:
            m.cache_blocks(request, cacheable)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def new_step_starts(self) -> None:
        for m in self.managers:
            m.new_step_starts()

    def get_blocks(self, request_id: str) -> list[BlockList]:
        return [list(m.req_to_blocks.get(request_id, ())) for m in self.managers]


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    def find_longest_cache_hit(  # pragma: no cover - no lookup without caching (manager)
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int]:
        return [[] for _ in self.managers], 0


class UnitaryCoordinator(KVCacheCoordinator):
    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int]:
        m = self.managers[0]
        return m.find_longest_cache_hit(
            block_hashes, max_length, [0], self.block_pool, m.spec, self.cache_hit_alignment()
        )


class HybridCoordinator(KVCacheCoordinator):
    def __init__(self, layout: KVCacheLayout) -> None:
        super().__init__(layout)
        self.spec_groups: list[SpecGroup] = []
        for gid, m in enumerate(self.managers):
            for sg in self.spec_groups:
                if sg.spec == m.spec and sg.manager_cls is type(m):
                    sg.group_ids.append(gid)
                    break
            else:
                self.spec_groups.append(SpecGroup(m.spec, [gid], type(m)))
        self.spec_groups.sort(key=lambda sg: not isinstance(sg.spec, FullAttentionSpec))

    def num_cacheable_tokens(self, num_tokens: int) -> int:
        s = self.layout.scheduler_block_size
        return num_tokens // s * s

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int]:
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
                if blocks_of[gid] is not None:  # pragma: no branch - full groups search first
                    blocks_of[gid] = blocks_of[gid][:keep]
        return [lst if lst is not None else [] for lst in blocks_of], hit


def make_coordinator(layout: KVCacheLayout) -> KVCacheCoordinator:
    """No prefix cache, unitary (one group) or hybrid (several groups)."""
    if not layout.enable_caching:
        return NoPrefixCacheCoordinator(layout)
    if len(layout.groups) == 1:
        return UnitaryCoordinator(layout)
    return HybridCoordinator(layout)
