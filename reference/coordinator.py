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

  ``uncached = longest - hit``, where ``longest`` is the longest answer any queried
  spec group gave: a shared prefix some group caches but another does not (the
  manager turns it into the request's ``shared_prefix_boundary``).

  EAGLE: a spec group that drops looks ``bs`` tokens beyond the candidate (capped at
  the hashed tokens) and drops them, proving the block past the boundary exists; it
  drops at most once per candidate length (``verified``, cleared when a group without
  the drop shrinks the candidate). A Mamba spec group of the EAGLE groups looks no
  further than the candidate (its hit never drops) but counts as verified.

  Worked example: full (bs 4) + SWA (w 5, bs 4), ``max 15``. Full hits 12 (3 blocks).
  SWA, asked for ``<= 12``, needs blocks 1 and 2 (``cdiv(4, 4) = 1``... one block
  before 12: block 2): if block 2 was freed after caching, SWA may answer 8, and the
  full list is cut to 2 blocks. Hit 8.

Cached token counts: hybrid coordinators cache only up to a multiple of the
scheduler block size (the LCM), since no hit can end elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from reference.block_pool import BlockPool
from reference.layout import KVCacheLayout
from reference.managers import SingleTypeKVCacheManager, manager_class_for
from reference.managers.base import Block, BlockList
from reference.managers.mamba import MambaManager
from reference.request import Request
from reference.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, cdiv


@dataclass
class SpecGroup:
    """Groups with one spec, looked up together (``use_eagle``: any member drops)."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type
    use_eagle: bool = False


class KVCacheCoordinator:
    """Shared pool and per-group managers; subclasses choose the hit search."""

    def __init__(self, layout: KVCacheLayout) -> None:
        self.layout = layout
        self.enable_caching = layout.enable_caching
        self.block_pool = BlockPool(
            layout.num_blocks, layout.enable_caching, layout.hash_block_size
        )
        alignment = self.cache_hit_alignment()
        self.managers: list[SingleTypeKVCacheManager] = make_managers(
            layout, self.block_pool, alignment, manager_class_for
        )
        drop = layout.drop_eagle_group_ids if layout.enable_caching else frozenset()
        for gid, m in enumerate(self.managers):
            m.max_admission_blocks = m.spec.max_admission_blocks(
                layout.admission_in_flight_tokens(), layout.max_model_len
            )
            m.use_eagle = gid in drop
            m.eagle_replay = bool(drop)
        for m in self.managers:
            if isinstance(m, MambaManager):
                m.drop_eagle_checkpoint = bool(layout.drop_eagle_group_ids)
                m.num_hash_lookahead_tokens = layout.num_hash_lookahead_tokens

    def cache_hit_alignment(self) -> int:
        """Hit lengths are multiples of this (:attr:`KVCacheLayout.cache_hit_alignment`)."""
        return self.layout.cache_hit_alignment

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int, int]:
        """``(blocks per group, hit, uncached)``: ``uncached`` > 0 when some group
        caches a longer prefix than the reconciled hit (hybrid only)."""
        raise NotImplementedError

    def num_cacheable_tokens(self, num_tokens: int, group_id: int) -> int:
        return num_tokens

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        hit_blocks: Sequence[Sequence],
        total_computed: int,
        num_tokens_main: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """The blocks every group needs (summed). ``prefill_end``: where the request's
        prefill ends (``max(P, N - 1)``); only sparse retention (interval 0) passes it on
        (a Mamba group then reserves a prefill checkpoint only on the chunk reaching it),
        otherwise every group gets 0."""
        if self.layout.prefix_cache_retention_interval != 0:
            prefill_end = 0
        return sum(
            m.get_num_blocks_to_allocate(
                request_id,
                num_tokens,
                hit_blocks[i],
                total_computed,
                num_tokens_main,
                apply_admission_cap,
                prefill_end=prefill_end,
            )
            for i, m in enumerate(self.managers)
        )

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        hit_blocks: Sequence[Sequence],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int = 0,
    ) -> list[BlockList]:
        """Adopt a hit in every group, in two phases: first every group touches its
        local hit blocks, then every group allocates blocks for the external tokens
        (so no group's allocation can evict another group's untouched hit). Nothing
        for a request that already holds blocks. Returns the external blocks."""
        if any(request_id in m.num_cached_block for m in self.managers):  # pragma: no cover
            return [[] for _ in self.managers]  # a request holding blocks is never offered a hit
        for i, m in enumerate(self.managers):
            m.add_local_computed_blocks(
                request_id, hit_blocks[i], num_local_computed_tokens, num_external_computed_tokens
            )
        if num_external_computed_tokens <= 0:
            return [[] for _ in self.managers]
        # external computed tokens (the machine's external_hits mode, a host tier)
        return [
            m.allocate_external_computed_blocks(
                request_id, num_local_computed_tokens, num_external_computed_tokens
            )
            for m in self.managers
        ]

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main: int
    ) -> list[BlockList]:
        return [
            m.allocate_new_blocks(request_id, num_tokens, num_tokens_main) for m in self.managers
        ]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        for gid, m in enumerate(self.managers):
            m.cache_blocks(request, self.num_cacheable_tokens(num_tokens, gid))

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


def make_managers(
    layout: KVCacheLayout,
    pool,
    alignment: int,
    class_for: Callable[[KVCacheSpec], type],
    **extra: object,
) -> list:
    """One manager per group of ``layout``, in group order, for either engine: ``class_for
    (spec)(spec, pool, group id, caching, alignment, retention_interval=...,
    scheduler_block_size=..., **extra)`` (``extra``: the engine's own sizes). Example: a
    full + SWA layout -> ``[FullAttentionManager(g0), SlidingWindowManager(g1)]``."""
    return [
        class_for(g.spec)(
            g.spec,
            pool,
            gid,
            layout.enable_caching,
            alignment,
            retention_interval=layout.prefix_cache_retention_interval,
            scheduler_block_size=layout.scheduler_block_size,
            **extra,
        )
        for gid, g in enumerate(layout.groups)
    ]


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    def find_longest_cache_hit(  # pragma: no cover - no lookup without caching (manager)
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int, int]:
        return [[] for _ in self.managers], 0, 0


class UnitaryCoordinator(KVCacheCoordinator):
    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_length: int
    ) -> tuple[list[BlockList], int, int]:
        m = self.managers[0]
        blocks, hit = m.find_longest_cache_hit(
            block_hashes,
            max_length,
            [0],
            self.block_pool,
            m.spec,
            self.cache_hit_alignment(),
            m.use_eagle,
        )
        return blocks, hit, 0


def hybrid_coordinator_hit(
    coordinator, block_hashes: Sequence[bytes], max_length: int
) -> tuple[list[list], int, int]:
    """:func:`hybrid_cache_hit` over a hybrid ``coordinator`` of either engine: each spec
    group answers through its manager class's ``find_longest_cache_hit`` on the
    coordinator's pool (``coordinator`` needs ``spec_groups``, ``managers``,
    ``block_pool``, ``layout`` and ``cache_hit_alignment()``). The
    ``find_longest_cache_hit`` of both engines' hybrid coordinators."""
    alignment = coordinator.cache_hit_alignment()
    pool = coordinator.block_pool

    def find(sg: SpecGroup, limit: int, drop: bool) -> tuple[list[list], int]:
        return sg.manager_cls.find_longest_cache_hit(
            block_hashes, limit, sg.group_ids, pool, sg.spec, alignment, drop
        )

    hashed = len(block_hashes) * coordinator.layout.hash_block_size
    return hybrid_cache_hit(
        coordinator.spec_groups, len(coordinator.managers), max_length, hashed, find
    )


class HybridCoordinator(KVCacheCoordinator):
    def __init__(self, layout: KVCacheLayout) -> None:
        super().__init__(layout)
        self.spec_groups = spec_groups_of(self.managers)
        for sg in self.spec_groups:
            for gid in sg.group_ids:
                self.managers[gid].use_eagle = sg.use_eagle

    def num_cacheable_tokens(self, num_tokens: int, group_id: int) -> int:
        """Rounded down to the scheduler block size; an EAGLE group caches one block
        more (its hits read one block past the boundary, then drop it): ``min(n,
        floor(n/S)*S + bs)`` when ``floor(n/S)*S > 0``. Example: S 4, bs 2, n 11 -> 8,
        EAGLE 10."""
        s = self.layout.scheduler_block_size
        aligned = num_tokens // s * s
        m = self.managers[group_id]
        if m.use_eagle and aligned > 0:
            return min(num_tokens, aligned + m.block_size)
        return aligned

    find_longest_cache_hit = hybrid_coordinator_hit


def spec_groups_of(managers: Sequence) -> list[SpecGroup]:
    """The managers' groups gathered by equal spec and manager class (a spec group drops
    for EAGLE when any member does), full-attention spec groups first, then in group
    order. Example: groups full, SWA 4, full, SWA 8 -> ``[full: 0, 2], [SWA 4: 1],
    [SWA 8: 3]``. Managers need ``spec`` and ``use_eagle``."""
    spec_groups: list[SpecGroup] = []
    for gid, m in enumerate(managers):
        for sg in spec_groups:
            if sg.spec == m.spec and sg.manager_cls is type(m):
                sg.group_ids.append(gid)
                sg.use_eagle = sg.use_eagle or m.use_eagle
                break
        else:
            spec_groups.append(SpecGroup(m.spec, [gid], type(m), m.use_eagle))
    spec_groups.sort(key=lambda sg: not isinstance(sg.spec, FullAttentionSpec))
    return spec_groups


def hybrid_cache_hit(
    spec_groups: Sequence[SpecGroup],
    num_groups: int,
    max_length: int,
    hashed_tokens: int,
    find: Callable[[SpecGroup, int, bool], tuple[list[list[Block]], int]],
) -> tuple[list[list[Block]], int, int]:
    """The hybrid fixed-point search of the module docstring: ``(blocks per group, hit,
    uncached)``. ``find(spec_group, limit, drop)`` is the spec group's own hit
    ``<= limit`` (``drop``: the EAGLE drop), one block list per member group; both
    engines pass their managers' lookups. ``hashed_tokens`` caps an EAGLE group's look
    beyond the candidate.

    Worked example (full bs 4 + SWA, max 15): full answers 12 (3 blocks); SWA asked for
    ``<= 12`` answers 8; one full and one other spec group need one pass: hit 8, the
    full list cut to 2 blocks, uncached ``12 - 8 = 4`` (the longest answer minus hit).
    """
    blocks_of: list[list[Block] | None] = [None] * num_groups
    length_of = [0] * num_groups
    simple = len(spec_groups) == 2 and isinstance(spec_groups[0].spec, FullAttentionSpec)
    hit = max_length
    longest = 0
    verified: set[int] = set()
    while True:
        candidate = hit
        for idx, sg in enumerate(spec_groups):
            first = sg.group_ids[0]
            if isinstance(sg.spec, FullAttentionSpec) and blocks_of[first] is not None:
                candidate = min(candidate, length_of[first])
                continue
            drop = sg.use_eagle and idx not in verified
            limit = candidate
            if drop and not isinstance(sg.spec, MambaSpec):  # a Mamba hit never drops
                limit = min(candidate + sg.spec.block_size, hashed_tokens)
            found, new = find(sg, limit, drop)
            if drop:
                verified.add(idx)
            elif new < candidate:
                verified.clear()
            candidate = new
            for gid, lst in zip(sg.group_ids, found):
                blocks_of[gid] = lst
                length_of[gid] = candidate
            longest = max(longest, candidate)
        if candidate >= hit:
            break
        hit = candidate
        if simple:
            break
    for sg in spec_groups:
        if not isinstance(sg.spec, FullAttentionSpec):
            continue
        keep = cdiv(hit, sg.spec.block_size)
        for gid in sg.group_ids:
            lst = blocks_of[gid]
            if lst is not None:  # pragma: no branch - full groups search first
                blocks_of[gid] = lst[:keep]
    return [lst if lst is not None else [] for lst in blocks_of], hit, longest - hit


def make_coordinator(layout: KVCacheLayout) -> KVCacheCoordinator:
    """No prefix cache, unitary (one group) or hybrid (several groups)."""
    if not layout.enable_caching:
        return NoPrefixCacheCoordinator(layout)
    if len(layout.groups) == 1:
        return UnitaryCoordinator(layout)
    return HybridCoordinator(layout)
