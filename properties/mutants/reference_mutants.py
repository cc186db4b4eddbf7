"""Mutant engines: the reference with ONE realistic bug each.

Every mutant is a factory ``make_<name>(layout) -> KVCacheEngine`` usable as
``--engine properties.mutants.reference_mutants:make_<name>``. Each subclasses one reference class
(block pool, single-type manager, hybrid coordinator or request-level manager) and
overrides the least it can; the line carrying the bug is marked ``# BUG``.
:data:`MUTANTS` maps the name to its ``module:factory``, :data:`MUTANT_INFO` says
what the bug is, which level of the suite catches it and which checks fire.

Worked example, ``swa_off_by_one``: window ``w = 4``, block size 2. Before the step
that starts at 6 computed tokens the reference frees the blocks before token
``num_skipped_tokens(6) = 3`` (block 0); the mutant frees those before token 4
(blocks 0 and 1). The query at 6 reads keys ``[3, 6]``, and token 3 was in block 1:
``window_liveness`` reports it.

The mutants are assembled by :func:`mutated_manager`, which replaces, in a freshly
built :class:`reference.kv_cache_manager.KVCacheManager`, the block pool, some
manager classes or the hybrid coordinator before any call is made.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from properties.core.modes import PRODUCTION_SETTINGS
from properties.engines.reference import ReferenceEngine
from reference.block_pool import BlockPool, KVCacheBlock
from reference.coordinator import HybridCoordinator
from reference.hashing import block_extra_keys, extend_block_hashes, hash_block_tokens
from reference.kv_cache_manager import ComputedBlocks, KVCacheManager
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
from reference.specs import KVCacheSpec, cdiv

ManagerClass = type[SingleTypeKVCacheManager]


# ---------------------------------------------------------------------------
# Assembly


class MutantEngine(ReferenceEngine):
    """The reference engine driving a mutated :class:`KVCacheManager`."""

    def __init__(self, layout: KVCacheLayout, manager: KVCacheManager, name: str) -> None:
        super().__init__(layout)
        self.manager = manager
        self.name = f"mutant:{name}"


def mutated_manager(
    layout: KVCacheLayout,
    manager_cls: type[KVCacheManager] = KVCacheManager,
    pool_cls: type[BlockPool] | None = None,
    managers: Mapping[ManagerClass, ManagerClass] | None = None,
    hybrid_coordinator_cls: type[HybridCoordinator] | None = None,
) -> KVCacheManager:
    """A fresh ``manager_cls(layout)`` with its pool, some single-type manager classes
    (``{reference class: mutant class}``) or its hybrid coordinator replaced.

    The hybrid coordinator is replaced only when the layout builds one (caching on,
    several groups); other layouts keep the reference behaviour.
    """
    kv = manager_cls(layout)
    if hybrid_coordinator_cls is not None and isinstance(kv.coordinator, HybridCoordinator):
        kv.coordinator = hybrid_coordinator_cls(layout)
        kv.block_pool = kv.coordinator.block_pool
    coord = kv.coordinator
    if pool_cls is not None:
        pool = pool_cls(layout.num_blocks, layout.enable_caching, layout.hash_block_size)
        coord.block_pool = kv.block_pool = pool
        for m in coord.managers:
            m.block_pool = pool
    if managers:
        replaced = []
        for m in coord.managers:
            r = managers.get(type(m), type(m))(
                m.spec,
                m.block_pool,
                m.group_id,
                m.enable_caching,
                m.cache_hit_alignment,
                m.retention_interval,
                m.scheduler_block_size,
            )
            r.max_admission_blocks = m.max_admission_blocks
            r.use_eagle, r.eagle_replay = m.use_eagle, m.eagle_replay
            replaced.append(r)
        coord.managers = replaced
        if isinstance(coord, HybridCoordinator):
            for sg in coord.spec_groups:
                sg.manager_cls = type(coord.managers[sg.group_ids[0]])
    return kv


# ---------------------------------------------------------------------------
# Single-type managers


class SlidingWindowOffByOne(SlidingWindowManager):
    """Frees out-of-window blocks as if one more token had left the window."""

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        super().remove_skipped_blocks(request_id, num_computed_tokens + 1)  # BUG: + 1


class SlidingWindowDoubleFree(SlidingWindowManager):
    """Frees out-of-window blocks but leaves them in the table (not nulled), so they are
    freed again at the next step and when the request is freed."""

    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        blocks = self.req_to_blocks.get(request_id, [])
        leaving = [b for b in reversed(blocks[first:last]) if not b.is_null]
        self.block_pool.free_blocks(leaving)  # BUG: the table entries are not nulled


class ChunkedLocalEarly(ChunkedLocalAttentionManager):
    """Moves to the next chunk one token early: when the computed tokens end one token
    before a chunk boundary, the whole current chunk is freed although the chunk's last
    query still reads it. Example, C 4, bs 2: at 7 computed tokens blocks 2, 3 go."""

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        super().remove_skipped_blocks(request_id, num_computed_tokens + 1)  # BUG: + 1


class MambaSameStepHit(MambaManager):
    """Does not remember the states cached in the current step, so a hit on a state the
    running step has not written yet is accepted instead of refused."""

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        SingleTypeKVCacheManager.cache_blocks(self, request, num_tokens)  # BUG: no record


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


# ---------------------------------------------------------------------------
# Block pools


class EvictInUsePool(BlockPool):
    """``touch`` revives a cached free block without taking it out of the free queue, so a
    later allocation can evict and hand out a block a request is still using."""

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            if not block.is_null:
                block.ref_cnt += 1  # BUG: a block with ref 0 stays in the free queue


class NullBlockInQueuePool(BlockPool):
    """Builds the free queue with the null block still in it (at the back), so the last
    free "block" an allocation takes is block 0."""

    def __init__(self, num_blocks: int, enable_caching: bool, hash_block_size: int) -> None:
        super().__init__(num_blocks, enable_caching, hash_block_size)
        self.free_block_queue.append_n([self.null_block])  # BUG


class ResetWhileHeldPool(BlockPool):
    """``reset_prefix_cache`` forgets every key even while requests hold blocks."""

    def reset_prefix_cache(self) -> bool:
        for block in self.blocks:  # BUG: no check that every block is free
            self._evict(block)
        return True


# ---------------------------------------------------------------------------
# Hybrid coordinators


class SkipLastSpecGroupCoordinator(HybridCoordinator):
    """The hybrid hit search forgets its last spec group (the loop stops one short):
    that group's hit is empty whatever the length agreed by the others."""

    def __init__(self, layout: KVCacheLayout) -> None:
        super().__init__(layout)
        if len(self.spec_groups) > 1:
            del self.spec_groups[-1]  # BUG


class UnalignedHybridCoordinator(HybridCoordinator):
    """Hybrid hits aligned to the hash block size (the gcd) instead of the LCM."""

    def cache_hit_alignment(self) -> int:
        return self.layout.hash_block_size  # BUG: should be the scheduler block size


# ---------------------------------------------------------------------------
# Requests and the request-level manager


def extend_hashes_without_parent(
    hashes: list[bytes],
    token_ids: Sequence[int],
    hash_block_size: int,
    cache_salt: str | None,
    lora_name: str | None,
) -> None:
    """Like :func:`reference.hashing.extend_block_hashes` but every link hashes only its
    own tokens: equal blocks behind different prefixes get equal hashes."""
    h = hash_block_size
    while (len(hashes) + 1) * h <= len(token_ids):
        j = len(hashes)
        hashes.append(
            hash_block_tokens(
                None,
                token_ids[j * h : (j + 1) * h],  # BUG: None
                block_extra_keys(j, cache_salt, lora_name),
            )
        )


class ParentlessHashRequest(Request):
    """A request whose block hashes ignore the parent hash."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        hash_block_size: int,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        super().__init__(request_id, prompt_token_ids, hash_block_size, cache_salt, lora_name)
        self.block_hashes = []
        self._extend_hashes()

    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        self.output_token_ids.extend(int(t) for t in token_ids)
        self._extend_hashes()

    def _extend_hashes(self) -> None:
        extend_hashes_without_parent(
            self.block_hashes,
            self.all_token_ids,
            self.hash_block_size,
            self.cache_salt,
            self.lora_name,
        )


class ParentlessHashManager(KVCacheManager):
    def make_request(
        self,
        request_id: str,
        prompt_token_ids,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> Request:
        super().make_request(request_id, prompt_token_ids, cache_salt, lora_name)  # validation
        return ParentlessHashRequest(
            request_id, prompt_token_ids, self.layout.hash_block_size, cache_salt, lora_name
        )


class SaltIgnoredManager(KVCacheManager):
    """Builds every request's hashes without its cache salt."""

    def make_request(
        self,
        request_id: str,
        prompt_token_ids,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> Request:
        return super().make_request(request_id, prompt_token_ids, None, lora_name)  # BUG


class UncappedLookupManager(KVCacheManager):
    """Looks up ``num_tokens`` tokens instead of ``num_tokens - 1``: a whole cached prompt
    hits, leaving no token to compute for the logits."""

    def get_computed_blocks(self, request: Request) -> tuple[ComputedBlocks, int]:
        if not self.enable_caching:
            return self.empty_computed_blocks(), 0
        blocks, hit, uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens
        )  # BUG: no -1
        request.shared_prefix_boundary = hit + uncached if uncached else 0
        return ComputedBlocks(tuple(tuple(b) for b in blocks)), hit


class HeadFirstFreeManager(KVCacheManager):
    """Frees a request's blocks head first: the chain's head reaches the eviction end of
    the free queue before its tail."""

    def free(self, request: Request) -> None:
        held = [m.pop_blocks_for_free(request.request_id) for m in self.coordinator.managers]
        super().free(request)  # the tables are already empty: frees nothing
        for blocks in held:
            self.block_pool.free_blocks(blocks)  # BUG: not reversed


class LeakyFailedAllocationManager(KVCacheManager):
    """Takes references on the hit blocks before the capacity check and, when the check
    fails and ``None`` is returned, does not give them back (observably the same as
    touching on the failure path, which is how it is written here)."""

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[list[KVCacheBlock]] | None:
        new = super().allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
        )
        if new is None and new_computed_blocks is not None:
            hit = [b for group in new_computed_blocks.blocks for b in group]
            self.block_pool.touch(hit)  # BUG: the hit's references leak
        return new


class FalsySparseRetentionSlidingWindow(SlidingWindowManager):
    """Reads the retention interval with ``or``: sparse (``0``) becomes dense."""

    def cacheable_block_mask(self, request: Request, start: int, end: int):
        saved = self.retention_interval
        self.retention_interval = saved or None  # BUG: 0 is falsy -> dense retention
        try:
            return super().cacheable_block_mask(request, start, end)
        finally:
            self.retention_interval = saved


class FalsySparseRetentionMamba(MambaManager):
    """The Mamba side of the same bug."""

    def cacheable_block_mask(self, request: Request, start: int, end: int):
        saved = self.retention_interval
        self.retention_interval = saved or None  # BUG: 0 is falsy -> dense retention
        try:
            return super().cacheable_block_mask(request, start, end)
        finally:
            self.retention_interval = saved


class OptimisticFreeManager(KVCacheManager):
    """Frees out-of-window blocks on the optimistic computed count, ignoring the tokens
    still in flight (vLLM before PR #47728)."""

    def allocate_slots(self, request: Request, *args, **kwargs):
        in_flight, request.num_in_flight_tokens = request.num_in_flight_tokens, 0  # BUG
        try:
            return super().allocate_slots(request, *args, **kwargs)
        finally:
            request.num_in_flight_tokens = in_flight


class UncappedAdmissionManager(KVCacheManager):
    """The admission gate reserves a windowed group's whole sequence instead of its
    recycling bound (issue #39734: long prompts never admitted on SWA models)."""

    def __init__(self, layout: KVCacheLayout) -> None:
        super().__init__(layout)
        for m in self.coordinator.managers:
            m.max_admission_blocks = None  # BUG: no per-request admission cap


class EagleDropIgnoredFull(FullAttentionManager):
    """Lookup that forgets the EAGLE drop (its last block is reused although EAGLE must
    recompute it): the full-attention side."""

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes, max_length, group_ids, pool, spec, alignment, drop_eagle=False
    ):
        return super().find_longest_cache_hit(
            block_hashes,
            max_length,
            group_ids,
            pool,
            spec,
            alignment,
            False,  # BUG
        )


class EagleDropIgnoredSlidingWindow(SlidingWindowManager):
    """The sliding-window side of the same bug."""

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes, max_length, group_ids, pool, spec, alignment, drop_eagle=False
    ):
        return super().find_longest_cache_hit(
            block_hashes,
            max_length,
            group_ids,
            pool,
            spec,
            alignment,
            False,  # BUG
        )


class LookaheadIgnoredRequest(Request):
    """Hashes blocks as if there were no lookahead tokens (the next tokens are not keyed)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_hash_lookahead_tokens = 0  # BUG: lookahead hashes dropped
        self.block_hashes.clear()
        extend_block_hashes(
            self.block_hashes,
            self.prompt_token_ids,
            self.hash_block_size,
            self.cache_salt,
            self.lora_name,
        )


class LookaheadIgnoredManager(KVCacheManager):
    def make_request(self, request_id, prompt_token_ids, cache_salt=None, lora_name=None):
        base = super().make_request(request_id, prompt_token_ids, cache_salt, lora_name)
        return LookaheadIgnoredRequest(
            request_id,
            prompt_token_ids,
            base.hash_block_size,
            cache_salt,
            lora_name,
            base.num_hash_lookahead_tokens,
        )


# ---------------------------------------------------------------------------
# Factories


def _engine(name: str, layout: KVCacheLayout, **parts) -> MutantEngine:
    return MutantEngine(layout, mutated_manager(layout, **parts), name)


def make_sparse_retention_as_dense(layout: KVCacheLayout) -> MutantEngine:
    return _engine(
        "sparse_retention_as_dense",
        layout,
        managers={
            SlidingWindowManager: FalsySparseRetentionSlidingWindow,
            MambaManager: FalsySparseRetentionMamba,
        },
    )


class RollbackIgnoredEngine(MutantEngine):
    """Keeps the optimistic computed count when drafts are rejected: the manager then
    frees and allocates as if the rejected drafts had been computed."""

    def set_num_computed_tokens(self, request_id: str, num_computed_tokens: int) -> None:
        req = self._request(request_id)
        if 0 < num_computed_tokens < req.num_computed_tokens:
            return  # BUG: the rollback of rejected drafts is lost
        super().set_num_computed_tokens(request_id, num_computed_tokens)

    def allocate_slots(self, request_id, num_new_tokens, *args, **kwargs):
        req = self._request(request_id)
        out = super().allocate_slots(request_id, num_new_tokens, *args, **kwargs)
        if out is not None and num_new_tokens > 1 and req.num_output_placeholders:
            req.num_computed_tokens += num_new_tokens  # the optimistic count of the step
        return out


def make_draft_rollback_ignored(layout: KVCacheLayout) -> MutantEngine:
    return RollbackIgnoredEngine(layout, mutated_manager(layout), "draft_rollback_ignored")


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
    ) -> int:
        held = [self.null_block] * len(new_computed_blocks)  # type: ignore[attr-defined]
        return super().get_num_blocks_to_allocate(  # type: ignore[misc]
            request_id,
            num_tokens,
            held,  # BUG: the hit's evictable blocks are not counted
            total_computed_tokens,
            num_tokens_main,
            apply_admission_cap,
        )


class EvictableHitsForgottenFull(_EvictableHitsForgotten, FullAttentionManager):
    pass


class EvictableHitsForgottenSlidingWindow(_EvictableHitsForgotten, SlidingWindowManager):
    pass


class EvictableHitsForgottenChunked(_EvictableHitsForgotten, ChunkedLocalAttentionManager):
    pass


def make_estimate_without_evictable_hits(layout: KVCacheLayout) -> MutantEngine:
    return _engine(
        "estimate_without_evictable_hits",
        layout,
        managers={
            FullAttentionManager: EvictableHitsForgottenFull,
            SlidingWindowManager: EvictableHitsForgottenSlidingWindow,
            ChunkedLocalAttentionManager: EvictableHitsForgottenChunked,
        },
    )


class _HeldFromComputedTokens:
    """Counts the blocks a running request holds from its computed tokens,
    ``cdiv(num_computed_tokens, bs)``, instead of its table: the blocks it holds past them
    (slots of rejected drafts, unused lookahead slots) are allocated again, appended
    behind the ones it has. Example (bs 4): 3 drafts at 9 computed tokens take block 3
    (positions 12..15); two are rejected (computed 11); the next step asks for 15 slots:
    ``cdiv(15, 4) - cdiv(11, 4) = 1`` block more, a 5th block nobody will write."""

    #: the computed tokens of the request being allocated (set by the manager below)
    num_computed_tokens = 0

    def _held(self, request_id: str) -> int:
        return cdiv(self.num_computed_tokens, self.block_size)  # type: ignore[attr-defined]

    def get_num_blocks_to_allocate(self, request_id, num_tokens, *args, **kwargs) -> int:
        need = super().get_num_blocks_to_allocate(  # type: ignore[misc]
            request_id, num_tokens, *args, **kwargs
        )
        if request_id in self.num_cached_block:  # type: ignore[attr-defined]
            # BUG: held blocks counted from the computed tokens
            need = max(cdiv(num_tokens, self.block_size) - self._held(request_id), 0)  # type: ignore[attr-defined]
        return need

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main: int):
        if request_id not in self.num_cached_block:  # type: ignore[attr-defined]
            return super().allocate_new_blocks(  # type: ignore[misc]
                request_id, num_tokens, num_tokens_main
            )
        blocks = self.blocks_of(request_id)  # type: ignore[attr-defined]
        num_new = cdiv(num_tokens, self.block_size) - self._held(request_id)  # type: ignore[attr-defined]
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)  # type: ignore[attr-defined]
        blocks.extend(new_blocks)
        return new_blocks


class HeldFromComputedFull(_HeldFromComputedTokens, FullAttentionManager):
    pass


class HeldFromComputedSlidingWindow(_HeldFromComputedTokens, SlidingWindowManager):
    pass


class HeldFromComputedManager(KVCacheManager):
    """Hands each allocation's computed tokens to its single-type managers."""

    def allocate_slots(self, request: Request, *args, **kwargs):
        for m in self.coordinator.managers:
            m.num_computed_tokens = request.num_computed_tokens  # type: ignore[attr-defined]
        return super().allocate_slots(request, *args, **kwargs)


def make_rolled_back_slots_reallocated(layout: KVCacheLayout) -> MutantEngine:
    return _engine(
        "rolled_back_slots_reallocated",
        layout,
        manager_cls=HeldFromComputedManager,
        managers={
            FullAttentionManager: HeldFromComputedFull,
            SlidingWindowManager: HeldFromComputedSlidingWindow,
        },
    )


class RejectedDraftsCommittedEngine(MutantEngine):
    """Commits (``cache_blocks``) up to the end its last step was allocated for, capped at
    the known tokens, instead of the rolled-back count it is given: after a draft step
    with rejections the block of the bonus token is registered although its slot still
    holds a rejected draft's KV (the bonus token is computed only in the next step)."""

    def __init__(self, layout: KVCacheLayout, manager: KVCacheManager, name: str) -> None:
        super().__init__(layout, manager, name)
        self._step_end: dict[str, int] = {}

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        hit=None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ):
        req = self._request(request_id)
        start = req.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        out = super().allocate_slots(
            request_id,
            num_new_tokens,
            num_new_computed_tokens,
            hit,
            num_lookahead_tokens,
            full_sequence_must_fit,
            num_external_computed_tokens,
            delay_cache_blocks,
        )
        if out is not None:
            self._step_end[request_id] = start + num_new_tokens
        return out

    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        req = self._request(request_id)
        end = min(self._step_end.get(request_id, 0), req.num_tokens)
        super().cache_blocks(request_id, max(num_tokens, end))  # BUG: the step's end

    def free(self, request_id: str) -> None:
        self._step_end.pop(request_id, None)
        super().free(request_id)


def make_rejected_drafts_committed(layout: KVCacheLayout) -> MutantEngine:
    return RejectedDraftsCommittedEngine(
        layout, mutated_manager(layout), "rejected_drafts_committed"
    )


def make_async_optimistic_free(layout: KVCacheLayout) -> MutantEngine:
    return _engine("async_optimistic_free", layout, manager_cls=OptimisticFreeManager)


class _ExternalCountedTwice:
    """Takes the external tokens as part of the local hit as well: the group's table
    grows to ``cdiv(local + 2 * external, bs)`` blocks (the double allocation that
    external hits caused in real engines)."""

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int
    ):
        return super().allocate_external_computed_blocks(  # type: ignore[misc]
            request_id,
            num_local_computed_tokens + num_external_computed_tokens,  # BUG: counted twice
            num_external_computed_tokens,
        )


class ExternalCountedTwiceFull(_ExternalCountedTwice, FullAttentionManager):
    pass


class ExternalCountedTwiceSlidingWindow(_ExternalCountedTwice, SlidingWindowManager):
    pass


def make_external_counted_twice(layout: KVCacheLayout) -> MutantEngine:
    return _engine(
        "external_counted_twice",
        layout,
        managers={
            FullAttentionManager: ExternalCountedTwiceFull,
            SlidingWindowManager: ExternalCountedTwiceSlidingWindow,
        },
    )


class DelayCacheIgnoredManager(KVCacheManager):
    """Ignores ``delay_cache_blocks``: blocks a connector is still loading are cached
    (findable by other requests' lookups) before their content has arrived."""

    def allocate_slots(self, *args, **kwargs):
        kwargs.pop("delay_cache_blocks", None)  # BUG: caches before the load completes
        return super().allocate_slots(*args, **kwargs)


def make_delay_cache_ignored(layout: KVCacheLayout) -> MutantEngine:
    return _engine("delay_cache_ignored", layout, manager_cls=DelayCacheIgnoredManager)


class _ExternalWindowNotSkipped:
    """Adopts a hit with external tokens skipping only the blocks out of the window at
    the *local* hit (the external tokens forgotten): every external position gets a
    real block, out-of-window ones included, and the connector is asked to load blocks
    the window no longer reads (which the host tier need not hold)."""

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int = 0,
    ) -> None:
        super().add_local_computed_blocks(  # type: ignore[misc]
            request_id,
            new_computed_blocks,
            num_local_computed_tokens,
            0,  # BUG: external
        )


class ExternalWindowNotSkippedSlidingWindow(_ExternalWindowNotSkipped, SlidingWindowManager):
    pass


class ExternalWindowNotSkippedChunked(_ExternalWindowNotSkipped, ChunkedLocalAttentionManager):
    pass


def make_external_window_not_skipped(layout: KVCacheLayout) -> MutantEngine:
    return _engine(
        "external_window_not_skipped",
        layout,
        managers={
            SlidingWindowManager: ExternalWindowNotSkippedSlidingWindow,
            ChunkedLocalAttentionManager: ExternalWindowNotSkippedChunked,
        },
    )


class LocalHitDroppedManager(KVCacheManager):
    """When a connector reports external tokens, takes the device hit as external too:
    fresh blocks for the whole prefix instead of the cached hit blocks, so the hit's
    positions are never written (the connector loads only the tokens beyond the device
    hit)."""

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        **kwargs,
    ):
        if num_external_computed_tokens > 0 and num_new_computed_tokens > 0:
            num_external_computed_tokens += num_new_computed_tokens  # BUG: hit not adopted
            num_new_computed_tokens, new_computed_blocks = 0, None
        return super().allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            **kwargs,
        )


def make_local_hit_dropped_on_external(layout: KVCacheLayout) -> MutantEngine:
    return _engine("local_hit_dropped_on_external", layout, manager_cls=LocalHitDroppedManager)


class AdmissionGateIgnoredManager(KVCacheManager):
    """Drops ``full_sequence_must_fit`` (a refactor that lost the argument): a request is
    admitted when its first chunk fits, although its whole sequence does not, and is
    preempted later in the middle of its prefill."""

    def allocate_slots(self, *args, **kwargs):
        kwargs.pop("full_sequence_must_fit", None)  # BUG: the admission gate is never applied
        return super().allocate_slots(*args, **kwargs)


def make_admission_gate_ignored(layout: KVCacheLayout) -> MutantEngine:
    return _engine("admission_gate_ignored", layout, manager_cls=AdmissionGateIgnoredManager)


def make_admission_cap_ignored(layout: KVCacheLayout) -> MutantEngine:
    return _engine("admission_cap_ignored", layout, manager_cls=UncappedAdmissionManager)


def make_eagle_drop_ignored(layout: KVCacheLayout) -> MutantEngine:
    return _engine(
        "eagle_drop_ignored",
        layout,
        managers={
            FullAttentionManager: EagleDropIgnoredFull,
            SlidingWindowManager: EagleDropIgnoredSlidingWindow,
        },
    )


def make_lookahead_hashes_ignored(layout: KVCacheLayout) -> MutantEngine:
    return _engine("lookahead_hashes_ignored", layout, manager_cls=LookaheadIgnoredManager)


def make_swa_off_by_one(layout: KVCacheLayout) -> MutantEngine:
    return _engine("swa_off_by_one", layout, managers={SlidingWindowManager: SlidingWindowOffByOne})


def make_hybrid_group_skipped(layout: KVCacheLayout) -> MutantEngine:
    return _engine(
        "hybrid_group_skipped", layout, hybrid_coordinator_cls=SkipLastSpecGroupCoordinator
    )


def make_no_hit_cap(layout: KVCacheLayout) -> MutantEngine:
    return _engine("no_hit_cap", layout, manager_cls=UncappedLookupManager)


def make_free_head_first(layout: KVCacheLayout) -> MutantEngine:
    return _engine("free_head_first", layout, manager_cls=HeadFirstFreeManager)


def make_hash_no_parent(layout: KVCacheLayout) -> MutantEngine:
    return _engine("hash_no_parent", layout, manager_cls=ParentlessHashManager)


def make_double_free(layout: KVCacheLayout) -> MutantEngine:
    return _engine("double_free", layout, managers={SlidingWindowManager: SlidingWindowDoubleFree})


def make_leaky_failed_allocation(layout: KVCacheLayout) -> MutantEngine:
    return _engine("leaky_failed_allocation", layout, manager_cls=LeakyFailedAllocationManager)


def make_lcm_forgotten(layout: KVCacheLayout) -> MutantEngine:
    return _engine("lcm_forgotten", layout, hybrid_coordinator_cls=UnalignedHybridCoordinator)


def make_evict_in_use(layout: KVCacheLayout) -> MutantEngine:
    return _engine("evict_in_use", layout, pool_cls=EvictInUsePool)


def make_null_block_handed_out(layout: KVCacheLayout) -> MutantEngine:
    return _engine("null_block_handed_out", layout, pool_cls=NullBlockInQueuePool)


def make_chunked_early(layout: KVCacheLayout) -> MutantEngine:
    return _engine(
        "chunked_early", layout, managers={ChunkedLocalAttentionManager: ChunkedLocalEarly}
    )


def make_mamba_same_step(layout: KVCacheLayout) -> MutantEngine:
    return _engine("mamba_same_step", layout, managers={MambaManager: MambaSameStepHit})


def make_mamba_leftmost(layout: KVCacheLayout) -> MutantEngine:
    return _engine("mamba_leftmost", layout, managers={MambaManager: MambaLeftmostHit})


def make_salt_ignored(layout: KVCacheLayout) -> MutantEngine:
    return _engine("salt_ignored", layout, manager_cls=SaltIgnoredManager)


def make_reset_while_held(layout: KVCacheLayout) -> MutantEngine:
    return _engine("reset_while_held", layout, pool_cls=ResetWhileHeldPool)


class LeakyFreePool(BlockPool):
    """Freeing a request forgets to release its last block."""

    def free_blocks(self, ordered_blocks) -> None:
        blocks = list(ordered_blocks)
        super().free_blocks(blocks[1:])  # BUG: the tail block keeps its reference


class BareEngine:
    """An engine answering only the calls every engine answers (no ref counts, free
    queue or cached blocks), over another engine."""

    def __init__(self, inner: MutantEngine) -> None:
        self.inner = inner
        self.name = inner.name

    def add_request(self, request) -> None:
        self.inner.add_request(request)

    def append_output_tokens(self, request_id, token_ids) -> None:
        self.inner.append_output_tokens(request_id, token_ids)

    def set_num_computed_tokens(self, request_id, num_computed_tokens) -> None:
        self.inner.set_num_computed_tokens(request_id, num_computed_tokens)

    def new_step(self) -> None:
        self.inner.new_step()

    def get_computed_blocks(self, request_id):
        return self.inner.get_computed_blocks(request_id)

    def allocate_slots(self, *args, **kwargs):
        return self.inner.allocate_slots(*args, **kwargs)

    def free(self, request_id) -> None:
        self.inner.free(request_id)

    def remove_request(self, request_id) -> None:
        self.inner.remove_request(request_id)

    def reset_prefix_cache(self) -> bool:
        return self.inner.reset_prefix_cache()

    def get_block_ids(self, request_id):
        return self.inner.get_block_ids(request_id)

    def num_free_blocks(self) -> int:
        return self.inner.num_free_blocks()


def make_bare_leaky_free(layout: KVCacheLayout) -> BareEngine:
    return BareEngine(_engine("bare_leaky_free", layout, pool_cls=LeakyFreePool))


# ---------------------------------------------------------------------------
# The catalogue


@dataclass(frozen=True)
class MutantInfo:
    """One mutant: its bug, the level that catches it and the checks seen firing.

    ``caught_by`` names :class:`properties.checks.invariants.PropertyViolation` names
    (``exact_match`` at the exact level) observed as the first failure under the
    ``ci`` profile; the test accepts any of them.
    """

    name: str
    description: str
    level: str
    caught_by: frozenset[str]

    factory: Callable[[KVCacheLayout], MutantEngine]
    #: the ``kvconform check`` property whose machine catches it: ``invariants``, or
    #: ``production`` for bugs of the deployed settings (retention, EAGLE, async, gate)
    prop: str = "invariants"

    @property
    def target(self) -> str:
        """``module:factory``, as ``--engine`` takes it."""
        return f"{__name__}:{self.factory.__name__}"


def _info(
    factory: Callable[[KVCacheLayout], MutantEngine],
    level: str,
    caught_by: Sequence[str],
    description: str,
    prop: str = "invariants",
) -> MutantInfo:
    name = factory.__name__.removeprefix("make_")
    return MutantInfo(name, description, level, frozenset(caught_by), factory, prop)


MUTANT_INFO: dict[str, MutantInfo] = {
    m.name: m
    for m in (
        _info(
            make_swa_off_by_one,
            "universal",
            ["window_liveness"],
            "sliding window frees blocks one token early (a block still in the window)",
        ),
        _info(
            make_hybrid_group_skipped,
            "universal",
            ["hit_soundness"],
            "hybrid hit search skips its last spec group (its hit blocks are empty)",
        ),
        _info(
            make_no_hit_cap,
            "universal",
            ["hit_bounds"],
            "prefix lookup not capped at num_tokens - 1 (a whole prompt can hit)",
        ),
        _info(
            make_free_head_first,
            "exact",
            ["exact_match"],
            "a request's blocks are freed head first instead of tail first",
        ),
        _info(
            make_hash_no_parent,
            "universal",
            ["hit_soundness"],
            "block hashes ignore the parent hash (equal blocks behind other prefixes hit)",
        ),
        _info(
            make_double_free,
            "universal",
            ["ref_counts_match_owners", "pool_accounting", "free_queue_contents"],
            "sliding window frees out-of-window blocks without nulling them (freed twice)",
        ),
        _info(
            make_leaky_failed_allocation,
            "universal",
            ["failed_allocation"],
            "a failed allocation keeps the references it took on its hit blocks",
        ),
        _info(
            make_lcm_forgotten,
            "exact",
            ["exact_match", "hit_bounds"],
            "hybrid hits aligned to the gcd of the block sizes, not their LCM",
        ),
        _info(
            make_evict_in_use,
            "universal",
            ["pool_accounting", "free_queue_contents"],
            "a revived cached block stays in the free queue (evictable while in use)",
        ),
        _info(
            make_null_block_handed_out,
            "universal",
            # its free queue holds block 0: a malformed answer (P1) as soon as it is read
            ["answers", "pool_accounting", "window_liveness", "reset_prefix_cache"],
            "the null block sits in the free queue and can be allocated",
        ),
        _info(
            make_chunked_early,
            "universal",
            ["window_liveness"],
            "chunked local attention frees the current chunk one token early",
        ),
        _info(
            make_mamba_same_step,
            "universal",
            ["window_liveness"],
            "Mamba accepts a hit on a state cached in the current step (not yet written)",
        ),
        _info(
            make_mamba_leftmost,
            "universal",
            ["hit_maximality"],
            "Mamba hit returns the leftmost cached state instead of the rightmost",
        ),
        _info(
            make_salt_ignored,
            "universal",
            ["hit_soundness"],
            "the cache salt is left out of block hashes (salted prefixes hit each other)",
        ),
        _info(
            make_sparse_retention_as_dense,
            "exact",
            ["exact_match"],
            "retention interval read with `or`: sparse (0) caches like dense (None)",
            "production",
        ),
        _info(
            make_eagle_drop_ignored,
            "exact",
            ["exact_match"],
            "prefix lookup forgets the EAGLE drop of its last block",
            "production",
        ),
        _info(
            make_lookahead_hashes_ignored,
            "exact",
            ["exact_match"],
            "lookahead hashes left out: a block is keyed without the tokens after it",
            "production",
        ),
        _info(
            make_async_optimistic_free,
            "universal",
            ["in_flight_reads_held", "window_liveness"],
            "asynchronous scheduling: out-of-window blocks freed on the optimistic count "
            "while tokens that read them are in flight",
            "production",
        ),
        _info(
            make_draft_rollback_ignored,
            "exact",
            ["exact_match", "EngineError"],
            "rejected draft tokens are not rolled back (the optimistic count stays)",
            "production",
        ),
        _info(
            make_admission_gate_ignored,
            "exact",
            ["exact_match"],
            "full_sequence_must_fit dropped: a request whose whole sequence does not fit is "
            "admitted on its first chunk",
            "production",
        ),
        _info(
            make_admission_cap_ignored,
            "exact",
            ["exact_match"],
            "admission gate without the per-request cap of windowed groups",
            "production",
        ),
        _info(
            make_external_counted_twice,
            "exact",
            ["exact_match", "EngineError"],
            "external computed tokens counted twice (as local hit and as external): every "
            "group allocates blocks past the loaded prefix",
            "production",
        ),
        _info(
            make_external_window_not_skipped,
            "universal",
            # its estimate skips the window at local + external, its adoption at the
            # local hit only: it takes more blocks than it estimated (A4)
            ["external_hit_bounds", "estimate_matches_pulls"],
            "a hit with external tokens skips only the blocks out of the window at the "
            "local hit: the connector is asked to load out-of-window blocks the host tier "
            "does not hold",
            "production",
        ),
        _info(
            make_local_hit_dropped_on_external,
            "universal",
            ["window_liveness", "attention"],
            "with external tokens the device hit is taken as external too: fresh, never "
            "written blocks stand for the cached prefix",
            "production",
        ),
        _info(
            make_delay_cache_ignored,
            "universal",
            ["attention"],
            "delay_cache_blocks ignored: blocks of an asynchronous connector load are "
            "cached before the load completes (read back with content that never arrived)",
            "attention",
        ),
        _info(
            make_estimate_without_evictable_hits,
            "universal",
            ["estimate_matches_pulls"],
            "allocation estimate leaves out the hit blocks that are evictable (adopting "
            "them takes them out of the free queue)",
        ),
        _info(
            make_rolled_back_slots_reallocated,
            "universal",
            ["table_covers_slots"],
            "a running request's held blocks counted from its computed tokens: the slots "
            "of rejected drafts and unused lookahead are allocated again",
            "production",
        ),
        _info(
            make_rejected_drafts_committed,
            "universal",
            ["committed_blocks_verified"],
            "after a draft step, commits up to the step's end instead of the rolled-back "
            "count: the bonus token's block is cached with a rejected draft's KV",
            "production",
        ),
        _info(
            make_reset_while_held,
            "universal",
            ["reset_prefix_cache"],
            "reset_prefix_cache succeeds (and forgets keys) while blocks are held",
        ),
        _info(
            make_bare_leaky_free,
            "universal",
            ["idle_pool_free", "allocation_fits"],
            "no optional capabilities, and free() keeps a reference to each freed "
            "tail block (only the capability-free checks see it)",
        ),
    )
}

for _mutant in MUTANT_INFO.values():
    # a mutant is the reference with one bug: it takes every production setting
    _mutant.factory.production_settings = PRODUCTION_SETTINGS  # type: ignore[attr-defined]

#: Mutant name -> ``module:factory`` (for ``--engine``).
MUTANTS: dict[str, str] = {name: info.target for name, info in MUTANT_INFO.items()}
