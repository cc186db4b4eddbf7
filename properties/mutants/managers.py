"""Mutants of the single-type managers and the hybrid coordinator: the reference with
ONE bug in a manager class (window and chunk frees, Mamba states, hit search, retention,
EAGLE, the allocation estimate), replaced by :func:`properties.mutants.assembly.mutated_manager`.

Worked example, ``swa_off_by_one``: window ``w = 4``, block size 2. Before the step
that starts at 6 computed tokens the reference frees the blocks before token
``num_skipped_tokens(6) = 3`` (block 0); the mutant frees those before token 4
(blocks 0 and 1). The query at 6 reads keys ``[3, 6]``, and token 3 was in block 1:
``window_liveness`` reports it.
"""

from __future__ import annotations

from collections.abc import Sequence

from properties.core.modes import PRODUCTION_SETTINGS
from properties.mutants.assembly import MutantEngine, mutant_engine
from properties.mutants.registry import REFERENCE_CATALOGUE, Registry, per_manager
from reference.block_pool import BlockPool, KVCacheBlock
from reference.coordinator import HybridCoordinator
from reference.layout import KVCacheLayout
from reference.managers import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from reference.managers.base import BlockList
from reference.request import Request
from reference.specs import KVCacheSpec

REGISTRY = Registry(REFERENCE_CATALOGUE, production_settings=PRODUCTION_SETTINGS)


class SlidingWindowOffByOne(SlidingWindowManager):
    """Frees out-of-window blocks as if one more token had left the window."""

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        super().remove_skipped_blocks(request_id, num_computed_tokens + 1)  # BUG: + 1


@REGISTRY.mutant(
    "universal",
    ["window_liveness"],
    "sliding window frees blocks one token early (a block still in the window)",
)
def make_swa_off_by_one(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "swa_off_by_one", layout, managers={SlidingWindowManager: SlidingWindowOffByOne}
    )


class SkipLastSpecGroupCoordinator(HybridCoordinator):
    """The hybrid hit search forgets its last spec group (the loop stops one short):
    that group's hit is empty whatever the length agreed by the others."""

    def __init__(self, layout: KVCacheLayout) -> None:
        super().__init__(layout)
        if len(self.spec_groups) > 1:
            del self.spec_groups[-1]  # BUG


@REGISTRY.mutant(
    "universal",
    ["hit_soundness"],
    "hybrid hit search skips its last spec group (its hit blocks are empty)",
)
def make_hybrid_group_skipped(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "hybrid_group_skipped", layout, hybrid_coordinator_cls=SkipLastSpecGroupCoordinator
    )


class SlidingWindowDoubleFree(SlidingWindowManager):
    """Frees out-of-window blocks but leaves them in the table (not nulled), so they are
    freed again at the next step and when the request is freed."""

    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        blocks = self.req_to_blocks.get(request_id, [])
        leaving = [b for b in reversed(blocks[first:last]) if not b.is_null]
        self.block_pool.free_blocks(leaving)  # BUG: the table entries are not nulled


@REGISTRY.mutant(
    "universal",
    ["ref_counts_match_owners", "pool_accounting", "free_queue_contents"],
    "sliding window frees out-of-window blocks without nulling them (freed twice)",
)
def make_double_free(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "double_free", layout, managers={SlidingWindowManager: SlidingWindowDoubleFree}
    )


class UnalignedHybridCoordinator(HybridCoordinator):
    """Hybrid hits aligned to the hash block size (the gcd) instead of the LCM."""

    def cache_hit_alignment(self) -> int:
        return self.layout.hash_block_size  # BUG: should be the scheduler block size


@REGISTRY.mutant(
    "exact",
    ["exact_match", "hit_bounds"],
    "hybrid hits aligned to the gcd of the block sizes, not their LCM",
)
def make_lcm_forgotten(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("lcm_forgotten", layout, hybrid_coordinator_cls=UnalignedHybridCoordinator)


class ChunkedLocalEarly(ChunkedLocalAttentionManager):
    """Moves to the next chunk one token early: when the computed tokens end one token
    before a chunk boundary, the whole current chunk is freed although the chunk's last
    query still reads it. Example, C 4, bs 2: at 7 computed tokens blocks 2, 3 go."""

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        super().remove_skipped_blocks(request_id, num_computed_tokens + 1)  # BUG: + 1


@REGISTRY.mutant(
    "universal",
    ["window_liveness"],
    "chunked local attention frees the current chunk one token early",
)
def make_chunked_early(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "chunked_early", layout, managers={ChunkedLocalAttentionManager: ChunkedLocalEarly}
    )


class MambaSameStepHit(MambaManager):
    """Does not remember the states cached in the current step, so a hit on a state the
    running step has not written yet is accepted instead of refused."""

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        SingleTypeKVCacheManager.cache_blocks(self, request, num_tokens)  # BUG: no record


@REGISTRY.mutant(
    "universal",
    ["window_liveness"],
    "Mamba accepts a hit on a state cached in the current step (not yet written)",
)
def make_mamba_same_step(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("mamba_same_step", layout, managers={MambaManager: MambaSameStepHit})


class MambaLeftmostHit(MambaManager):
    """Returns the leftmost cached state instead of the rightmost one."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        group_ids: Sequence[int],
        pool: BlockPool,
        spec: KVCacheSpec,
        alignment: int,
        drop_eagle: bool = False,
    ) -> tuple[list[BlockList], int]:
        for length in range(spec.block_size, max_length + 1, spec.block_size):  # BUG: upwards
            found, hit = super().find_longest_cache_hit(
                block_hashes, length, group_ids, pool, spec, alignment
            )
            if hit:
                return found, hit
        return [[] for _ in group_ids], 0


@REGISTRY.mutant(
    "universal",
    ["hit_maximality"],
    "Mamba hit returns the leftmost cached state instead of the rightmost",
)
def make_mamba_leftmost(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("mamba_leftmost", layout, managers={MambaManager: MambaLeftmostHit})


class _FalsySparseRetention:
    """Reads the retention interval with ``or``: sparse (``0``) becomes dense (sliding
    window and Mamba managers)."""

    def cacheable_block_mask(self, request: Request, start: int, end: int):
        saved = self.retention_interval  # type: ignore[attr-defined]
        self.retention_interval = saved or None  # BUG: 0 is falsy -> dense retention
        try:
            return super().cacheable_block_mask(request, start, end)  # type: ignore[misc]
        finally:
            self.retention_interval = saved


@REGISTRY.mutant(
    "exact",
    ["exact_match"],
    "retention interval read with `or`: sparse (0) caches like dense (None)",
    "production",
)
def make_sparse_retention_as_dense(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "sparse_retention_as_dense",
        layout,
        managers=per_manager(_FalsySparseRetention, SlidingWindowManager, MambaManager),
    )


class _EagleDropIgnored:
    """Lookup that forgets the EAGLE drop (its last block is reused although EAGLE must
    recompute it), in the full-attention and sliding-window managers."""

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes, max_length, group_ids, pool, spec, alignment, drop_eagle=False
    ):
        return super().find_longest_cache_hit(  # type: ignore[misc]
            block_hashes,
            max_length,
            group_ids,
            pool,
            spec,
            alignment,
            False,  # BUG
        )


@REGISTRY.mutant(
    "exact",
    ["exact_match"],
    "prefix lookup forgets the EAGLE drop of its last block",
    "production",
)
def make_eagle_drop_ignored(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "eagle_drop_ignored",
        layout,
        managers=per_manager(_EagleDropIgnored, FullAttentionManager, SlidingWindowManager),
    )


class _EvictableHitsForgotten:
    """Estimates a prefix hit's blocks as already held: the hit blocks that sit evictable
    in the free queue (ref count 0), which adopting them takes out of it, are left out of
    ``get_num_blocks_to_allocate``. Example (bs 4, a fresh request re-hitting its own
    freed 8-token prefix, 4 new tokens): the estimate is 1 block, the call takes 3."""

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        held = [self.null_block] * len(new_computed_blocks)  # type: ignore[attr-defined]
        return super().get_num_blocks_to_allocate(  # type: ignore[misc]
            request_id,
            num_tokens,
            held,  # BUG: the hit's evictable blocks are not counted
            total_computed_tokens,
            num_tokens_main,
            apply_admission_cap,
            prefill_end,
        )


@REGISTRY.mutant(
    "universal",
    ["estimate_matches_pulls"],
    "allocation estimate leaves out the hit blocks that are evictable (adopting "
    "them takes them out of the free queue)",
)
def make_estimate_without_evictable_hits(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "estimate_without_evictable_hits",
        layout,
        managers=per_manager(
            _EvictableHitsForgotten,
            FullAttentionManager,
            SlidingWindowManager,
            ChunkedLocalAttentionManager,
        ),
    )
