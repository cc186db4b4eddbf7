"""The lockstep engine: the engine under test, optionally beside the reference.

It implements the engine protocol itself, so the scheduler drives it like any
engine. Every call goes to the engine under test through its boundary
(:mod:`properties.checks.boundary`: a deadline, exceptions become :class:`EngineError`
naming the call, every answer validated by :mod:`properties.checks.answers` before any
check sees it) and, at the ``exact`` level, to the reference too; results must agree
(hit length and blocks, new block ids, the request's table, free count, free queue).
After every call the :class:`properties.checks.checker.Checker` runs. Every call and
result is logged; the log is the ``observed`` part of a saved trace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from properties.checks.answers import check_new_blocks_are_tail
from properties.checks.boundary import engine_name, guard_engine, schedule_text
from properties.checks.checker import Checker
from properties.checks.registry import PropertyViolation
from properties.core.allocation import Allocation, allocate
from properties.core.diff import describe_mismatch
from properties.core.engine import (
    BlockIds,
    CacheHit,
    CommitsSteps,
    CopiesBlocks,
    ExposesFreeQueue,
    FreesInBatch,
    HostPoolUsage,
    HostTransfer,
    KVCacheEngine,
    OwnsHostTier,
    PlansSteps,
    ReportsAllocationEstimate,
    RequestInput,
    SlotRequest,
    StepUpdate,
)
from properties.core.proxy import EngineProxy
from reference.host_tier import HostTier
from reference.layout import KVCacheLayout


class LockstepEngine(EngineProxy):
    """See the module docstring. Its inner engine is the boundary around the engine
    under test (``self.engine``)."""

    def __init__(
        self,
        engine: KVCacheEngine,
        layout: KVCacheLayout,
        reference: KVCacheEngine | None = None,
        disabled: Iterable[str] = (),
        call_timeout: float = 0.0,
        host_tier: HostTier | None = None,
    ) -> None:
        """``host_tier``: the store a KV connector loads from, which bounds external hits
        (the checks', :class:`properties.checks.checker.Checker`)."""
        super().__init__(guard_engine(engine, layout, call_timeout))
        self.engine = self.inner
        self.reference = reference
        self.layout = layout
        self.checker = Checker(self.engine, layout, disabled, host_tier)
        self.log: list[dict[str, Any]] = []
        self._ref_hits: dict[str, CacheHit] = {}
        #: the call after which the free queues were last left uncompared (large tiers)
        self._queue_stale: str | None = None
        self.engine_name = engine_name(engine)
        self.reference_name = getattr(reference, "name", "reference")
        self._owns_host_tier = isinstance(self.engine, OwnsHostTier)
        #: observes the copies an engine with its own host tier makes (after the checker)
        self.on_host_transfers: Callable[[list[HostTransfer]], None] | None = None
        # the capabilities read on every call, once (a runtime Protocol check walks the
        # protocol's members each time)
        self._queues_compared = isinstance(self.engine, ExposesFreeQueue) and isinstance(
            reference, ExposesFreeQueue
        )
        self._reports_estimate = isinstance(self.engine, ReportsAllocationEstimate)
        self._plans_steps = isinstance(self.engine, PlansSteps)

    # -- plumbing -------------------------------------------------------------------
    def _call(self, fn, *args, names: Iterable[str] | None = None):
        """A call that may change the engine (through its boundary): the checks' cached
        reads of the engine are stale afterwards (``names``: the requests whose tables
        the call can change; ``None``: any, as for ``new_step``). An engine with its own
        host tier then reports the copies the call made, which the checker follows
        (:meth:`properties.checks.checker.Checker.on_host_transfers`) and hands to
        :attr:`on_host_transfers` (the attention check's copies)."""
        try:
            result = fn(*args)
        finally:
            self.checker.state.invalidate(names)
        if self._owns_host_tier:
            transfers = self.engine.take_host_transfers()
            self.checker.on_host_transfers(transfers)
            if transfers and self.on_host_transfers is not None:
                self.on_host_transfers(transfers)
        return result

    def _record(self, call: str, args: dict, result: Any) -> None:
        self.log.append({"call": call, **args, "result": result})

    def _diverge(self, what: str, expected: Any, observed: Any) -> None:
        """The engine's answer differs from the reference's: a diff of a few lines, never
        the whole lists (:func:`properties.core.diff.describe_mismatch`)."""
        names = (self.reference_name, self.engine_name)
        mismatch = describe_mismatch(expected, observed, names)
        sep = "\n" if "\n" in mismatch else " "
        raise PropertyViolation("exact_match", f"{what}:{sep}{mismatch}")

    def _compare_allocation(
        self, what: str, expected: BlockIds | None, result: BlockIds | None
    ) -> None:
        """The engine's answer to an allocation equals the reference's: both None, or the
        same new block ids."""
        if (expected is None) != (result is None):
            self._diverge(
                what,
                "None" if expected is None else _ids(expected),
                "None" if result is None else _ids(result),
            )
        if expected is not None and not _same_ids(expected, result):
            self._diverge(f"new blocks of {what}", _ids(expected), _ids(result))

    def _compare_state(self, after: str, request_id: str | None) -> None:
        if self.reference is None:
            return
        if (
            request_id is not None
            and self.checker.requests.get(request_id) is not None
            and self.checker.requests[request_id].holds_blocks
        ):
            exp = self.reference.get_block_ids(request_id)
            got = self.checker.state.table_of(request_id)
            if not _same_ids(exp, got):
                self._diverge(
                    f"block table of {request_id!r} after {after} (group by group)",
                    _ids(exp),
                    _ids(got),
                )
        exp_free = self.reference.num_free_blocks()
        got_free = self.checker.state.num_free()
        if exp_free != got_free:
            self._diverge(f"free block count after {after}", exp_free, got_free)
        if self.checker.check_every_call:
            self._compare_free_queue(after)
        else:  # large tiers: the O(pool) comparison at the next step boundary
            self._queue_stale = after

    def _compare_free_queue(self, after: str) -> None:
        """The free queue (front first) equals the reference's, when both expose it."""
        if self._queues_compared:
            exp_q, got_q = self.reference.free_queue(), self.checker.state.free_queue()
            if exp_q != got_q:
                self._diverge(f"free queue (front first) after {after}", exp_q, got_q)

    def on_step_boundary(self) -> None:
        """A step starts or a trace ends: the checks deferred at the large tiers run
        (``Checker.check_every_call`` off): the pool checks and the free-queue comparison
        with the reference, on the state after the last call."""
        self.checker.on_step_boundary()
        after, self._queue_stale = self._queue_stale, None
        if after is not None and self.reference is not None:
            self._compare_free_queue(f"{after} (compared at the step boundary)")

    # -- the protocol ---------------------------------------------------------------
    def add_request(self, request: RequestInput) -> None:
        self._call(self.engine.add_request, request, names=(request.request_id,))
        if self.reference is not None:
            self.reference.add_request(request)
        self.checker.on_add(
            request.request_id,
            request.prompt_token_ids,
            request.cache_salt,
            request.lora_name,
            request.mm_items,
            request.prompt_embeds,
        )

    def append_output_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._call(self.engine.append_output_tokens, request_id, token_ids, names=(request_id,))
        if self.reference is not None:
            self.reference.append_output_tokens(request_id, token_ids)
        self.checker.on_append(request_id, token_ids)

    def set_num_computed_tokens(self, request_id: str, num_computed_tokens: int) -> None:
        self._call(
            self.engine.set_num_computed_tokens,
            request_id,
            num_computed_tokens,
            names=(request_id,),
        )
        if self.reference is not None:
            self.reference.set_num_computed_tokens(request_id, num_computed_tokens)
        self.checker.on_set_computed(request_id, num_computed_tokens)

    def new_step(self) -> None:
        self.on_step_boundary()
        self._call(self.engine.new_step)
        if self.reference is not None:
            self.reference.new_step()
        self._record("new_step", {}, None)

    def get_computed_blocks(self, request_id: str) -> CacheHit:
        before = self.checker.snapshot()
        hit = self._call(self.engine.get_computed_blocks, request_id, names=(request_id,))
        self._record(
            "get_computed_blocks",
            {"request_id": request_id},
            {"num_tokens": hit.num_tokens, "block_ids": _ids(hit.block_ids)},
        )
        if self.reference is not None:
            ref_hit = self.reference.get_computed_blocks(request_id)
            self._ref_hits[request_id] = ref_hit
            if ref_hit.num_tokens != hit.num_tokens:
                self._diverge(f"hit length of {request_id!r}", ref_hit.num_tokens, hit.num_tokens)
            if not _same_ids(ref_hit.block_ids, hit.block_ids):
                self._diverge(
                    f"hit blocks of {request_id!r} (group by group)",
                    _ids(ref_hit.block_ids),
                    _ids(hit.block_ids),
                )
        self.checker.on_lookup(request_id, hit, before)
        return hit

    def allocate(self, allocation: Allocation) -> BlockIds | None:
        request_id, hit = allocation.request_id, allocation.hit
        before = self.checker.snapshot()
        # the keywords go only to engines driven in those modes (SupportsServingModes)
        gate = allocation.keywords()
        tracked = self.checker.requests.get(request_id)
        tables_before = (
            self.checker.state.table_of(request_id)
            if tracked is not None and tracked.holds_blocks
            else None
        )
        what = allocation.describe()
        result = self._call(allocate, self.engine, allocation, names=(request_id,))
        estimate = None
        if result is not None:
            table = self.checker.state.table_of(request_id)
            check_new_blocks_are_tail(f"{self.engine_name}: {what}", result, table, tables_before)
            if self._reports_estimate:
                estimate = self.engine.last_allocation_estimate()
        self._record(
            "allocate_slots",
            {
                "request_id": request_id,
                "num_new_tokens": allocation.num_new_tokens,
                "num_new_computed_tokens": allocation.num_new_computed_tokens,
                "num_lookahead_tokens": allocation.num_lookahead_tokens,
                **gate,
            },
            None if result is None else _ids(result),
        )
        if self.reference is not None:
            ref_hit = self._ref_hits.pop(request_id, None) if hit is not None else None
            expected = allocate(self.reference, replace(allocation, hit=ref_hit))
            self._compare_allocation(what, expected, result)
        self.checker.on_allocate(
            request_id,
            allocation.num_new_tokens,
            hit,
            result,
            before,
            tables_before,
            allocation.num_lookahead_tokens,
            allocation.full_sequence_must_fit,
            allocation.num_external_computed_tokens,
            estimate,
        )
        self._compare_state(what, request_id)
        return result

    # -- serving modes ----------------------------------------------------------------
    def set_in_flight(
        self, request_id: str, num_in_flight_tokens: int, num_pending_tokens: int
    ) -> None:
        self._call(
            self.engine.set_in_flight,
            request_id,
            num_in_flight_tokens,
            num_pending_tokens,
            names=(request_id,),
        )
        if self.reference is not None:
            self.reference.set_in_flight(request_id, num_in_flight_tokens, num_pending_tokens)
        self.checker.on_in_flight(request_id, num_in_flight_tokens, num_pending_tokens)

    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        what = f"cache_blocks({request_id!r}, {num_tokens})"
        self._call(self.engine.cache_blocks, request_id, num_tokens, names=(request_id,))
        self._record("cache_blocks", {"request_id": request_id, "num_tokens": num_tokens}, None)
        if self.reference is not None:
            self.reference.cache_blocks(request_id, num_tokens)
        self.checker.on_commit(request_id, num_tokens)
        self._compare_state(what, None)

    def schedule_step(self, items: Sequence[SlotRequest]) -> list[BlockIds | None]:
        """A batch of running requests' allocations (see :class:`PlansSteps`).

        An engine with ``schedule_step`` gets the whole batch in one call; the reference
        (``exact``) answers the same items one ``allocate_slots`` at a time and every
        result must agree, so the batched path is compared with per-request calls. The
        checker then sees each item as one allocation (batch items carry no hit, so the
        snapshot before the batch serves the failed-allocation check). Engines without
        the capability get per-request calls.
        """
        if not self._plans_steps:
            out: list[BlockIds | None] = []
            for item in items:
                out.append(self.allocate(_item_allocation(item)))
                if out[-1] is None:
                    break
            return out
        before = self.checker.snapshot()
        tables_before = {}
        for item in items:
            tracked = self.checker.requests.get(item.request_id)
            if tracked is not None and tracked.holds_blocks:
                tables_before[item.request_id] = self.engine.get_block_ids(item.request_id)
        what = schedule_text(items)
        results = self._call(
            self.engine.schedule_step, list(items), names=[i.request_id for i in items]
        )
        for item, result in zip(items, results):
            call = (
                f"allocate_slots({item.request_id!r}, num_new_tokens={item.num_new_tokens}, "
                f"num_lookahead_tokens={item.num_lookahead_tokens}) in {what}"
            )
            if result is not None:
                table = self.checker.state.table_of(item.request_id)
                check_new_blocks_are_tail(
                    f"{self.engine_name}: {call}", result, table, tables_before.get(item.request_id)
                )
            self._record(
                "allocate_slots",
                {
                    "request_id": item.request_id,
                    "num_new_tokens": item.num_new_tokens,
                    "num_new_computed_tokens": 0,
                    "num_lookahead_tokens": item.num_lookahead_tokens,
                    "batched": True,
                },
                None if result is None else _ids(result),
            )
            if self.reference is not None:
                expected = allocate(self.reference, _item_allocation(item))
                self._compare_allocation(call, expected, result)
        taken = 0  # blocks the earlier items of the batch got: a lower bound of the free
        for item, result in zip(items, results):  # count each later item met (A2)
            self.checker.on_allocate(
                item.request_id,
                item.num_new_tokens,
                None,
                result,
                # per-pool free counts are known only before the batch's first item
                (before[0] - taken, before[1], before[2], before[3] if taken == 0 else None),
                tables_before.get(item.request_id),
                item.num_lookahead_tokens,
            )
            taken += sum(len(g) for g in result or ())
            self._compare_state(f"{what} (request {item.request_id!r})", item.request_id)
        return results

    def free(self, request_id: str) -> None:
        self._call(self.engine.free, request_id, names=(request_id,))
        if self.reference is not None:
            self.reference.free(request_id)
        self._record("free", {"request_id": request_id}, None)
        self.checker.on_free(request_id)
        self._compare_state(f"free({request_id!r})", None)

    def remove_request(self, request_id: str) -> None:
        self._call(self.engine.remove_request, request_id, names=(request_id,))
        if self.reference is not None:
            self.reference.remove_request(request_id)
        self.checker.on_remove(request_id)

    def reset_prefix_cache(self) -> bool:
        ok = self._call(self.engine.reset_prefix_cache)
        self._record("reset_prefix_cache", {}, ok)
        if self.reference is not None:
            expected = self.reference.reset_prefix_cache()
            if bool(expected) != bool(ok):
                self._diverge("reset_prefix_cache()", expected, ok)
        self.checker.on_reset(ok)
        return ok


class LockstepCommits:
    """``commit_step`` for an engine that has it (:class:`CommitsSteps`): the engine gets
    the whole batch in one call, the reference and the checks each update in order, as
    the per-request calls would (a request's update never depends on another's), so the
    batched path is what the gate compares with the reference."""

    def commit_step(self: LockstepEngine, updates: Sequence[StepUpdate]) -> None:
        updates = list(updates)
        self._call(self.engine.commit_step, updates, names=[u.request_id for u in updates])
        for update in updates:
            rid, tokens = update.request_id, [update.output_token]
            if self.reference is not None:
                self.reference.set_num_computed_tokens(rid, update.num_computed_tokens)
            self.checker.on_set_computed(rid, update.num_computed_tokens)
            if update.output_token is not None:
                if self.reference is not None:
                    self.reference.append_output_tokens(rid, tokens)
                self.checker.on_append(rid, tokens)


class LockstepFrees:
    """``free_requests`` for an engine that has it (:class:`FreesInBatch`): one batched
    call on the engine, the reference freed one request at a time in the same order, the
    free checks run for each, then the state (tables, free counts, free queue) compared
    once: the batch must leave what the successive frees leave. ``remove_requests`` is
    passed on the same way (nothing to compare: the removed ids are no longer read)."""

    def free_requests(self: LockstepEngine, request_ids: Sequence[str]) -> None:
        ids = list(request_ids)
        self._call(self.engine.free_requests, ids, names=ids)
        for rid in ids:
            if self.reference is not None:
                self.reference.free(rid)
            self._record("free", {"request_id": rid}, None)
            self.checker.on_free(rid)
        self._compare_state(f"free_requests({ids!r})", None)

    def remove_requests(self: LockstepEngine, request_ids: Sequence[str]) -> None:
        """One batched ``remove_requests`` on the engine; the reference forgets each id."""
        ids = list(request_ids)
        self._call(self.engine.remove_requests, ids, names=ids)
        for rid in ids:
            if self.reference is not None:
                self.reference.remove_request(rid)
            self.checker.on_remove(rid)


class LockstepHostTier:
    """The host-tier calls of an engine with its own host tier (``OwnsHostTier``): the
    scheduler's connector asks ``host_hit`` at admission (the external tokens then show
    in the logged ``allocate_slots``); the pools and copies are the checker's."""

    def host_hit(self: LockstepEngine, request_id: str) -> int:
        return self.engine.host_hit(request_id)

    def host_pools(self: LockstepEngine) -> tuple[HostPoolUsage, ...]:
        return self.checker.state.host_pools()

    def take_host_transfers(self: LockstepEngine) -> list[HostTransfer]:
        """Taken after every call already (``_call``): none left for a caller."""
        return []


class LockstepCopies:
    """The block copies of an engine that has them (:class:`CopiesBlocks`): the scheduler
    takes them once a step is planned; the reference's must be the same, in the same
    order, and the checks learn that they ran and that their blocks were released."""

    def pending_block_copies(self: LockstepEngine) -> list[tuple[int, int]]:
        return self.engine.pending_block_copies()

    def take_block_copies(self: LockstepEngine) -> list[tuple[int, int]]:
        copies = list(self._call(self.engine.take_block_copies))
        self._record("take_block_copies", {}, [list(pair) for pair in copies])
        if self.reference is not None:
            expected = [tuple(pair) for pair in self.reference.take_block_copies()]
            if expected != copies:
                self._diverge("block copies of the step (source, destination)", expected, copies)
        self.checker.on_copies_taken(copies)
        self._compare_state("take_block_copies()", None)
        return copies


#: The batched calls the lockstep offers when the engine under test has them
#: (:meth:`LockstepEngine.around`); schedule_step it offers always (per-request calls for
#: an engine without it); the host tier's calls when it owns one; the block copies of an
#: engine that has them.
LockstepEngine.CAPABILITIES = (
    (CommitsSteps, LockstepCommits),
    (FreesInBatch, LockstepFrees),
    (OwnsHostTier, LockstepHostTier),
    (CopiesBlocks, LockstepCopies),
)


def _item_allocation(item: SlotRequest) -> Allocation:
    """A batch item's allocation (see :class:`SlotRequest`): no hit."""
    return Allocation(
        item.request_id, item.num_new_tokens, num_lookahead_tokens=item.num_lookahead_tokens
    )


def _ids(block_ids) -> list[list[int]]:
    return [[int(b) for b in group] for group in block_ids]


def _same_ids(a, b) -> bool:
    """``_ids(a) == _ids(b)``, without building the lists when both are tuples of tuples
    (the boundary's validated answers and the reference's tables are): equal tuples of
    ints are equal lists of ints. Example: ``_same_ids(((1, 2),), [[1, 2]])`` is True."""
    if type(a) is tuple and type(b) is tuple and a == b:
        return True
    return _ids(a) == _ids(b)
