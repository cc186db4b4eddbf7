"""Mutants of the serving modes (:mod:`properties.core.modes`): the reference with ONE
bug in what asynchronous scheduling, drafts, the admission gate or a KV connector's
external hits need (caught by the ``production`` property, one by ``attention``).

Worked example, ``admission_gate_ignored``: 8 free blocks (bs 4), a waiting request of
40 tokens whose first chunk is 8: the gate (``full_sequence_must_fit``) needs 10 blocks,
so the reference returns None; the mutant drops the keyword and returns the chunk's 2
blocks (``exact_match``).
"""

from __future__ import annotations

from collections.abc import Sequence

from properties.core.allocation import Allocation
from properties.core.engine import BlockIds
from properties.core.modes import PRODUCTION_SETTINGS
from properties.mutants.assembly import MutantEngine, mutant_engine, mutated_manager
from properties.mutants.registry import REFERENCE_CATALOGUE, Registry, per_manager
from reference.block_pool import KVCacheBlock
from reference.kv_cache_manager import ComputedBlocks, KVCacheManager
from reference.layout import KVCacheLayout
from reference.managers import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    SlidingWindowManager,
)
from reference.request import Request
from reference.specs import cdiv

REGISTRY = Registry(REFERENCE_CATALOGUE, production_settings=PRODUCTION_SETTINGS)


class OptimisticFreeManager(KVCacheManager):
    """Frees out-of-window blocks on the optimistic computed count, ignoring the tokens
    still in flight (vLLM before PR #47728)."""

    def allocate_slots(self, request: Request, *args, **kwargs):
        in_flight, request.num_in_flight_tokens = request.num_in_flight_tokens, 0  # BUG
        try:
            return super().allocate_slots(request, *args, **kwargs)
        finally:
            request.num_in_flight_tokens = in_flight


@REGISTRY.mutant(
    "universal",
    ["in_flight_reads_held", "window_liveness"],
    "asynchronous scheduling: out-of-window blocks freed on the optimistic count "
    "while tokens that read them are in flight",
    "production",
)
def make_async_optimistic_free(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("async_optimistic_free", layout, manager_cls=OptimisticFreeManager)


class RollbackIgnoredEngine(MutantEngine):
    """Keeps the optimistic computed count when drafts are rejected: the manager then
    frees and allocates as if the rejected drafts had been computed."""

    def set_num_computed_tokens(self, request_id: str, num_computed_tokens: int) -> None:
        req = self._request(request_id)
        if 0 < num_computed_tokens < req.num_computed_tokens:
            return  # BUG: the rollback of rejected drafts is lost
        super().set_num_computed_tokens(request_id, num_computed_tokens)

    def allocate(self, allocation: Allocation) -> BlockIds | None:
        req = self._request(allocation.request_id)
        out = super().allocate(allocation)
        num_new_tokens = allocation.num_new_tokens
        if out is not None and num_new_tokens > 1 and req.num_output_placeholders:
            req.num_computed_tokens += num_new_tokens  # the optimistic count of the step
        return out


@REGISTRY.mutant(
    "exact",
    ["exact_match", "EngineError"],
    "rejected draft tokens are not rolled back (the optimistic count stays)",
    "production",
)
def make_draft_rollback_ignored(layout: KVCacheLayout) -> MutantEngine:
    return RollbackIgnoredEngine(layout, mutated_manager(layout), "draft_rollback_ignored")


class AdmissionGateIgnoredManager(KVCacheManager):
    """Drops ``full_sequence_must_fit`` (a refactor that lost the argument): a request is
    admitted when its first chunk fits, although its whole sequence does not, and is
    preempted later in the middle of its prefill."""

    def allocate_slots(self, *args, **kwargs):
        kwargs.pop("full_sequence_must_fit", None)  # BUG: the admission gate is never applied
        return super().allocate_slots(*args, **kwargs)


@REGISTRY.mutant(
    "exact",
    ["exact_match"],
    "full_sequence_must_fit dropped: a request whose whole sequence does not fit is "
    "admitted on its first chunk",
    "production",
)
def make_admission_gate_ignored(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("admission_gate_ignored", layout, manager_cls=AdmissionGateIgnoredManager)


class UncappedAdmissionManager(KVCacheManager):
    """The admission gate reserves a windowed group's whole sequence instead of its
    recycling bound (issue #39734: long prompts never admitted on SWA models)."""

    def __init__(self, layout: KVCacheLayout) -> None:
        super().__init__(layout)
        for m in self.coordinator.managers:
            m.max_admission_blocks = None  # BUG: no per-request admission cap


@REGISTRY.mutant(
    "exact",
    ["exact_match"],
    "admission gate without the per-request cap of windowed groups",
    "production",
)
def make_admission_cap_ignored(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("admission_cap_ignored", layout, manager_cls=UncappedAdmissionManager)


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


@REGISTRY.mutant(
    "exact",
    # table_covers_slots: the blocks past the loaded prefix are stray blocks (A5)
    ["exact_match", "EngineError", "table_covers_slots"],
    "external computed tokens counted twice (as local hit and as external): every "
    "group allocates blocks past the loaded prefix",
    "production",
)
def make_external_counted_twice(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "external_counted_twice",
        layout,
        managers=per_manager(_ExternalCountedTwice, FullAttentionManager, SlidingWindowManager),
    )


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


@REGISTRY.mutant(
    "universal",
    # its estimate skips the window at local + external, its adoption at the
    # local hit only: it takes more blocks than it estimated (A4); on a pool with no
    # block to spare the extra block is not there and its allocation raises
    # (EngineError: "cannot get 1 free blocks from the pool")
    ["external_hit_bounds", "estimate_matches_pulls", "EngineError"],
    "a hit with external tokens skips only the blocks out of the window at the "
    "local hit: the connector is asked to load out-of-window blocks the host tier "
    "does not hold",
    "production",
)
def make_external_window_not_skipped(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "external_window_not_skipped",
        layout,
        managers=per_manager(
            _ExternalWindowNotSkipped, SlidingWindowManager, ChunkedLocalAttentionManager
        ),
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


@REGISTRY.mutant(
    "universal",
    ["window_liveness", "attention"],
    "with external tokens the device hit is taken as external too: fresh, never "
    "written blocks stand for the cached prefix",
    "production",
)
def make_local_hit_dropped_on_external(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "local_hit_dropped_on_external", layout, manager_cls=LocalHitDroppedManager
    )


class DelayCacheIgnoredManager(KVCacheManager):
    """Ignores ``delay_cache_blocks``: blocks a connector is still loading are cached
    (findable by other requests' lookups) before their content has arrived."""

    def allocate_slots(self, *args, **kwargs):
        kwargs.pop("delay_cache_blocks", None)  # BUG: caches before the load completes
        return super().allocate_slots(*args, **kwargs)


@REGISTRY.mutant(
    "universal",
    ["attention"],
    "delay_cache_blocks ignored: blocks of an asynchronous connector load are "
    "cached before the load completes (read back with content that never arrived)",
    "attention",
)
def make_delay_cache_ignored(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("delay_cache_ignored", layout, manager_cls=DelayCacheIgnoredManager)


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


class HeldFromComputedManager(KVCacheManager):
    """Hands each allocation's computed tokens to its single-type managers."""

    def allocate_slots(self, request: Request, *args, **kwargs):
        for m in self.coordinator.managers:
            m.num_computed_tokens = request.num_computed_tokens  # type: ignore[attr-defined]
        return super().allocate_slots(request, *args, **kwargs)


@REGISTRY.mutant(
    "universal",
    ["table_covers_slots"],
    "a running request's held blocks counted from its computed tokens: the slots "
    "of rejected drafts and unused lookahead are allocated again",
    "production",
)
def make_rolled_back_slots_reallocated(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "rolled_back_slots_reallocated",
        layout,
        manager_cls=HeldFromComputedManager,
        managers=per_manager(_HeldFromComputedTokens, FullAttentionManager, SlidingWindowManager),
    )


class RejectedDraftsCommittedEngine(MutantEngine):
    """Commits (``cache_blocks``) up to the end its last step was allocated for, capped at
    the known tokens, instead of the rolled-back count it is given: after a draft step
    with rejections the block of the bonus token is registered although its slot still
    holds a rejected draft's KV (the bonus token is computed only in the next step)."""

    def __init__(self, layout: KVCacheLayout, manager: KVCacheManager, name: str) -> None:
        super().__init__(layout, manager, name)
        self._step_end: dict[str, int] = {}

    def allocate(self, allocation: Allocation) -> BlockIds | None:
        req = self._request(allocation.request_id)
        start = (
            req.num_computed_tokens
            + allocation.num_new_computed_tokens
            + allocation.num_external_computed_tokens
        )
        out = super().allocate(allocation)
        if out is not None:
            self._step_end[allocation.request_id] = start + allocation.num_new_tokens
        return out

    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        req = self._request(request_id)
        end = min(self._step_end.get(request_id, 0), req.num_tokens)
        super().cache_blocks(request_id, max(num_tokens, end))  # BUG: the step's end

    def free(self, request_id: str) -> None:
        self._step_end.pop(request_id, None)
        super().free(request_id)


@REGISTRY.mutant(
    "universal",
    ["committed_blocks_verified"],
    "after a draft step, commits up to the step's end instead of the rolled-back "
    "count: the bonus token's block is cached with a rejected draft's KV",
    "production",
)
def make_rejected_drafts_committed(layout: KVCacheLayout) -> MutantEngine:
    return RejectedDraftsCommittedEngine(
        layout, mutated_manager(layout), "rejected_drafts_committed"
    )
