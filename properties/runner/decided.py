"""The scheduler level: an engine's own scheduler against the reference on the same decisions.

An engine's scheduler (today vLLM's, :mod:`properties.engines.vllm_scheduler`) runs a
trace and reports, step by step, what it decided (:class:`StepDecisions`: which
requests ran from which position with how many tokens and drafts, which were
preempted). :class:`DecidedScheduler` is kvconform's own scheduler
(:class:`properties.runner.scheduler.Scheduler`) with its three choices taken from those
decisions instead of its rules: the chunk of each request (``_chunk``), its drafts
(``_propose_drafts``) and the victim of a failed allocation (``_victim``). Everything
else is kvconform's: the calls into the reference's cache manager, their arguments
(``num_new_tokens``, the hit, lookahead, ``cache_blocks`` after drafts), when a
preempted or finished request is freed, the computed tokens after a step.

Checks (:func:`run_decided`, each a :class:`DecisionMismatch` naming the step):

1. during the step, the reference runs the same requests in the same order, each from
   the same position (for an admitted request: the same prefix-cache hit length), and
   its allocation fails exactly where the engine preempted (a victim it did not need,
   or an allocation that fails with no victim left, is a mismatch);
2. after the step, per live request the same block ids in every group and the same
   computed tokens, and the same number of free blocks.

With a KV connector (the ``external_hits`` modes, synchronous scheduling) the reference
runs kvconform's :class:`properties.runner.connector.Connector` over a host tier that
also answers the engine's connector (:func:`run_decided` gives the engine side
``lookup``: the tier's tokens beyond a computed prefix, read without touching it), and
the admission phase replays the engine's connector events in order
(:class:`DecidedScheduler`, "Connector events"). Further checks:

3. every admission tells the connector the request's whole block table after its
   allocation and the external tokens the reference's rule gives (hit extended by the
   tier; asynchronously in ``async_loads``);
4. a finished or aborted request's end tells the connector its blocks covering the
   computed tokens, after its out-of-window blocks were freed on the processed basis
   (``remove_skipped_blocks``, so they go back to the pool before the rest).

Worked example: vLLM's scheduler passes ``num_lookahead_tokens=2`` too many to
``allocate_slots`` for a running request at position 7 (bs 4): vLLM's table gets block
3 for positions 8..9 that the reference does not allocate; after the step the block
tables differ (``r0 group 0: engine (1, 2, 3), reference (1, 2)``) and the free counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from properties.core.allocation import Allocation, allocate
from properties.core.decisions import (
    ALLOCATED,
    PROMOTE,
    Accounting,
    ConnectorEvent,
    StepDecisions,
)
from properties.core.engine import KVCacheEngine
from properties.core.modes import ServingMode, load_fails
from properties.core.scheduler_options import (
    DEFAULT_OPTIONS,
    SchedulerOptions,
    connector_saves,
    invalid_load_block,
)
from properties.core.trace import Abort, Arrive, Operation, Preempt, ResetPrefixCache, Step, Trace
from properties.engines.reference import make_engine as make_reference
from properties.runner.async_scheduler import AsyncRequestState, AsyncScheduler
from properties.runner.connector import Connector, RequestView
from properties.runner.load_failures import ScannedRequest, error_order, scan
from properties.runner.scheduler import (
    Drafts,
    RequestState,
    ScheduledRequest,
    Scheduler,
    StepRecord,
)
from properties.runner.serving import connector_host_tier
from reference.connector_blocks import blocks_covering
from reference.errors import KVConformError
from reference.host_tier import HostTier
from reference.layout import KVCacheLayout


def _never(request_id: str) -> bool:
    return False


class DecisionMismatch(KVConformError):
    """The engine's scheduler and the reference disagree (the message says where)."""


class DecidedConnector(Connector):
    """kvconform's connector with the engine's worker timing: every asynchronous load
    started in a step is reported at the end of that step, a failing one
    (:func:`properties.core.modes.load_fails`) setting the request's computed tokens
    back to 0 at once (vLLM's ``recompute`` policy: ``_handle_failed_recving``); the load
    completes (cached, or freed) when the engine's scheduler completes it
    (:meth:`DecidedScheduler.promote`). Example: ``r1`` (hit 0, 8 external tokens)
    starts loading in step 3 and its first load fails: after step 3 ``r1`` holds its
    blocks with 0 computed tokens."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: asynchronous loads started in the current step
        self.started: list[str] = []
        #: the worker reports blocks it could not write (``invalid_load_block``)
        self.invalid_blocks = False
        #: vLLM's ``fail`` load-failure policy (else ``recompute``)
        self.fail = False
        #: asynchronous loads that kept a valid prefix (an invalid block, ``recompute``):
        #: request id -> computed tokens
        self.partial: dict[str, int] = {}

    def start_load(self, request_id: str, hit_tokens: int, external_tokens: int) -> None:
        super().start_load(request_id, hit_tokens, external_tokens)
        self.started.append(request_id)

    def take_started(self) -> list[str]:
        """The asynchronous loads started since the last call."""
        started, self.started = self.started, []
        return started

    def report(self, scheduler: Scheduler, request_ids: list[str]) -> tuple[list[str], list[str]]:
        """The worker reports the loads of ``request_ids`` (synchronous scheduling: at
        the end of the step that started them; asynchronous: when that step's output is
        processed); a wholly failing one sets the request's computed tokens back to 0
        (``recompute``); with ``invalid_blocks`` one with an invalid block falls back to
        that block's start (:func:`properties.runner.load_failures.scan`) and, under
        ``recompute``, keeps that prefix (:meth:`complete_load`). Returns the whole
        failures and the requests an invalid block affected (``fail`` ends both)."""
        failed, scanned = [], []
        invalid: set[int] = set()
        for rid in request_ids:
            attempt = self.num_load_attempts.get(rid, 0)
            state = scheduler.requests.get(rid)
            if state is None:
                continue
            if self.failures and load_fails(rid, attempt):
                failed.append(rid)
                if not self.fail:
                    state.num_computed_tokens = 0
                    self.engine.set_num_computed_tokens(rid, 0)
                continue
            hit, external = self.loaded.get(rid, (0, 0))
            block = self.invalid_block(rid, attempt, hit, hit + external)
            if block is not None:
                invalid.add(block)
                table = self.engine.get_block_ids(rid)[0]
                scanned.append(ScannedRequest(rid, tuple(table), state.num_computed_tokens))
        result = scan(scanned, invalid, self.layout.groups[0].spec.block_size)
        for rid in result.affected:
            computed = result.num_computed[rid]
            scheduler.requests[rid].num_computed_tokens = computed
            self.engine.set_num_computed_tokens(rid, computed)
            if not self.fail:
                self.partial[rid] = computed
        return failed, list(result.affected)

    def invalid_block(self, request_id: str, attempt: int, start: int, end: int) -> int | None:
        """The block id the worker reports invalid for attempt ``attempt`` of the load of
        positions ``[start, end)``, or None (``invalid_load_block``: the block of the
        range the load wrote, not a null entry; one group only)."""
        if not self.invalid_blocks or len(self.layout.groups) != 1:
            return None
        k = invalid_load_block(request_id, attempt)
        bs = self.layout.groups[0].spec.block_size
        if k is None or start // bs + k >= end // bs:
            return None
        block = self.engine.get_block_ids(request_id)[0][start // bs + k]
        return block or None  # a null entry (a window's skipped block) was not written

    def complete_load(self, state: RequestView) -> bool:
        """A load that kept a valid prefix (:attr:`partial`) caches it and the request
        runs from there; none kept (the first block invalid), it fails as a whole."""
        rid = state.request_id
        if rid not in self.partial:
            return super().complete_load(state)
        self.num_load_attempts[rid] = self.num_load_attempts.get(rid, 0) + 1
        computed = self.partial.pop(rid)
        if computed == 0:
            self.loaded.pop(rid, None)
            return False
        self.engine.cache_blocks(rid, computed)
        return True


class DecidedScheduler(Scheduler):
    """kvconform's scheduler with the engine's decisions (see the module docstring).

    Example: ``DecidedScheduler(engine, layout, ServingMode()).step_as(StepDecisions((
    ScheduledDecision("r0", 0, 8),)), 64)`` admits ``r0`` with 8 tokens whatever the
    budget rule would give, and fails if ``r0``'s hit is not 0. With
    ``mode.async_scheduling`` use :func:`decided_scheduler` (the same overrides on
    :class:`AsyncScheduler`).

    Connector events (with a :class:`DecidedConnector`): the admission phase replays the
    step's :class:`ConnectorEvent` list in order instead of walking the waiting queue:
    ``PROMOTE`` completes the request's load (``cache_blocks``; a failed one is freed
    and queued first, to be looked up anew), the request then waits to be scheduled;
    ``ALLOCATED`` admits the request: a loaded one with ``allocate_slots(n, 0, None,
    lookahead)`` (no lookup), any other by kvconform's admission rule (device hit,
    external tokens from the tier, synchronous or asynchronous load), and checks 3.
    An ``Abort`` frees a loading request at once (the engine's worker has reported
    its load by then), and a finished or aborted request's end runs check 4."""

    def __init__(
        self,
        engine: KVCacheEngine,
        layout: KVCacheLayout,
        mode: ServingMode,
        connector: Connector | None = None,
    ) -> None:
        super().__init__(engine, layout, mode, self._check_scheduled, connector)
        self._decisions = StepDecisions()
        self._victims: list[str] = []
        self._failed: list[str] = []
        #: loads completed and not scheduled since (the engine's waiting requests that
        #: hold blocks), in order
        self.loaded: list[str] = []
        #: block ids the engine's connector was told at each request's end (the engine
        #: side fills it; check 4 reads it)
        self.told_at_end: dict[str, tuple[tuple[int, ...], ...]] = {}
        #: a request is ending (finished or aborted): check 4 runs when it is freed
        self._ending = False
        #: requests that ended (finished or aborted) since the last step was scheduled,
        #: and since the engine last reported its finished requests
        self.ended: set[str] = set()
        self.ended_since_report: set[str] = set()
        #: whether the engine's connector saves a request's blocks at its end (kept
        #: until the save is reported: ``SchedulerOptions.delayed_frees``)
        self.saves: Callable[[str], bool] = _never
        #: ended requests whose blocks a save keeps: id -> (state, the step with whose
        #: output the save is reported)
        self._held: dict[str, tuple[RequestState, int]] = {}
        #: a ``ResetPrefixCache`` resets the connector's store too, or preempts every
        #: running request first
        self.reset_connector = False
        self.reset_running = False
        #: the loads being reported (their requests have nothing a save could keep)
        self._reporting: list[str] = []
        #: ended requests whose failed load frees their blocks when it is reported
        self._failed_loads: list[str] = []
        #: requests a grammar rejection ends in the output being processed
        self._rejected: set[str] = set()

    def accounting(self) -> Accounting:
        """The reference's :class:`Accounting`: running requests; waiting ones (loading
        and loaded included); whether a request ended since the last step was
        scheduled, or ended and is still kept (a save, a load not reported)."""
        loading = [] if self.connector is None else self.connector.loading
        waiting = len(self.waiting) + len(loading) + len(self.loaded)
        held = bool(self._held) or bool(getattr(self, "_aborted_loads", None))
        return Accounting(len(self.running), waiting, bool(self.ended) or held)

    def step_as(self, decisions: StepDecisions, token_budget: int) -> StepRecord:
        """One step on ``decisions`` (checks 1 run before the step's output)."""
        self._decisions = decisions
        self._victims = list(decisions.preempted)
        self._failed = list(decisions.failed_allocations)
        if self.drafts is not None:
            # the model's verdict on the drafts: the decided count (an instance attribute
            # shadows Drafts.accepted_drafts for this scheduler's hook only)
            self.drafts.accepted_drafts = self._accepted  # type: ignore[method-assign]
        return self.step(token_budget)

    def _accepted(self, request_id: str, position: int, num_drafts: int) -> int:
        d = self._decisions.of(request_id)
        return 0 if d is None else d.num_accepted

    def _chunk(self, state: RequestState, start: int, budget: int) -> int:
        """The decided tokens; a running request's drafts come from
        :meth:`_propose_drafts`, an admitted one's (vLLM pads a 1-token admission with
        drafts) are announced here. A running request the engine preempted instead of
        scheduling gets kvconform's own chunk: its allocation must fail."""
        d = self._decisions.of(state.request_id)
        failed = state.request_id in self._victims or state.request_id in self._failed
        if d is None and failed and state.request_id in self.running:
            # the engine preempted this running request when its own allocation failed,
            # or stopped there (no victim it could take): the reference tries
            # kvconform's chunk and must fail the same way (its out-of-window blocks
            # are freed all the same: allocate_slots step 5); where
            # kvconform's Mamba rule cuts the chunk to 0 (a Mamba block wider than the
            # step's budget), vLLM's scheduler advances sub-block: the uncut chunk
            # (Mamba bs 22, computed 110, budget 19: 19 tokens, not 0)
            n = super()._chunk(state, start, budget)
            return n if n > 0 else min(self._end(state) - start, budget)
        if d is None:
            # an asynchronous load computes nothing: any positive chunk (the load
            # allocates none) lets kvconform's admission rule start it
            return 1 if self._loads_asynchronously(state.request_id) else 0
        if d.num_tokens - d.num_drafts > self._end(state) - start:
            raise DecisionMismatch(
                f"step {self.num_steps} ({self._decisions.describe()}): the engine "
                f"scheduled {d.num_tokens - d.num_drafts} tokens of {state.request_id} from "
                f"{start}, past the {self._end(state)} tokens it has on the reference"
            )
        if state.request_id in self.running:
            return d.num_tokens - d.num_drafts
        if d.num_drafts:
            self.engine.set_in_flight(state.request_id, 0, d.num_drafts)
        return d.num_tokens

    def _propose_drafts(self, state: RequestState, n: int, budget: int) -> int:
        """The decided drafts; a running request the engine preempted instead of
        scheduling tries the drafts it carried (within the budget)."""
        d = self._decisions.of(state.request_id)
        drafts = 0 if d is None else d.num_drafts
        if d is None and (state.request_id in self._victims or state.request_id in self._failed):
            carried = dict(self._decisions.proposed_drafts).get(state.request_id, 0)
            drafts = max(0, min(carried, budget - n))
        if drafts:
            self.engine.set_in_flight(state.request_id, 0, drafts)
        return drafts

    def _loads_asynchronously(self, request_id: str) -> bool:
        return any(
            e.kind == ALLOCATED and e.request_id == request_id and e.asynchronous
            for e in self._decisions.connector_events
        )

    # -- the KV connector (see the class docstring) ------------------------------------
    def _complete_loads(self) -> None:
        """Loads complete at the engine's ``PROMOTE`` events, not at a step's start."""

    def _defers_abort(self, state: RequestState) -> bool:
        """An ``Abort`` of a loading or loaded request frees it at once."""
        if self.connector is not None:
            rid = state.request_id
            if rid in self.connector.loading:
                self.connector.loading.remove(rid)
            if rid in self.loaded:
                self.loaded.remove(rid)
            return False
        return super()._defers_abort(state)

    def abort(self, request_id: str) -> None:
        self._ending = True
        try:
            super().abort(request_id)
        finally:
            self._ending = False

    def _finish(self, request_id: str, record: StepRecord) -> None:
        self._ending = True
        try:
            super()._finish(request_id, record)
        finally:
            self._ending = False

    def _free(self, state: RequestState) -> None:
        """Check 4 at a request's end with a connector (its skipped blocks freed first),
        then kvconform's free."""
        if self.connector is None or not self._ending:
            super()._free(state)
            return
        self._end_with_connector(state)
        rid = state.request_id
        if self.saves(rid) and rid not in self._unreported_loads():  # kept until reported
            self._held[rid] = (state, self.num_steps + 1)
            return
        self._free_blocks(state)

    def _release_saved(self, reported_step: int) -> None:
        """The worker reported the saves started before step ``reported_step`` (and
        earlier): their blocks go back (vLLM's ``finished_sending``). vLLM frees them in
        the iteration order of the reported set, which the harness builds from the saves
        in the order they started; an equal set built in the same order iterates in the
        same order (CPython), so the reference iterates one."""
        reported = [rid for rid, (_, step) in self._held.items() if step <= reported_step]
        for rid in set(reported):
            state, _ = self._held.pop(rid)
            if state.holds_blocks:
                self.engine.free(rid)
            self.engine.remove_request(rid)

    def reset_prefix_cache(self) -> bool:
        """``ResetPrefixCache``: the engine's ``reset_prefix_cache``; with
        ``reset_running``, every running request is preempted first, newest first (its
        in-flight output dropped); with ``reset_connector``, the connector's store is
        emptied too."""
        if self.reset_running:
            for rid in reversed(list(self.running)):
                if isinstance(self, AsyncScheduler):
                    self.preempt_dropping(rid)
                else:
                    self._preempt(rid)
        ok = self.engine.reset_prefix_cache()
        if self.reset_connector and self.connector is not None:
            self.connector.host_tier.clear()
        return ok

    def _end_with_connector(self, state: RequestState) -> None:
        """A request's end with a connector before its blocks are freed (vLLM's
        ``_connector_finished``): offloaded, its skipped blocks freed on the processed
        basis, and check 4 on the block ids the engine told its connector."""
        assert self.connector is not None
        rid = state.request_id
        self.connector.release(state, self._processed(state))
        if state.holds_blocks:
            self._remove_skipped_blocks(rid, self._processed(state))
        table = self.engine.get_block_ids(rid)
        want = blocks_covering(self.layout, table, state.num_computed_tokens)
        told = self.told_at_end.pop(rid, None)
        if told != want:
            raise DecisionMismatch(
                f"step {self.num_steps}: at {rid}'s end the engine told its connector block "
                f"ids {told}, the reference's blocks covering its "
                f"{state.num_computed_tokens} computed tokens are {want}"
            )

    def _remove_skipped_blocks(self, request_id: str, num_processed_tokens: int) -> None:
        """The reference manager's ``remove_skipped_blocks`` (not an engine protocol
        call: the replay runs on the reference engine, :func:`run_decided`)."""
        self._manager().coordinator.remove_skipped_blocks(request_id, num_processed_tokens)

    def _manager(self) -> Any:
        """The reference engine's manager (calls that are not engine protocol calls)."""
        manager = getattr(self.engine, "manager", None)
        if manager is None:
            raise KVConformError(
                "DecidedScheduler with a connector runs on the reference engine (it reaches "
                "the manager for calls beyond the engine protocol)"
            )
        return manager

    def _forget(self, request_id: str, removed: bool = False) -> None:
        """A finished or aborted request is forgotten: it ended. A save keeps it (and
        its blocks, :meth:`_free`) until the save is reported; the engine's connector is
        told at every end, so a request with no blocks left (aborted while waiting,
        finished by a stale token) is kept too, unless its load is not reported yet
        (nothing to save)."""
        state = self.requests.get(request_id)
        if state is not None:
            self.ended.add(request_id)
            self.ended_since_report.add(request_id)
            if (
                self.connector is not None
                and request_id not in self._held
                and not state.holds_blocks
                and self.saves(request_id)
                and request_id not in self._unreported_loads()
            ):
                self._held[request_id] = (state, self.num_steps + 1)
        super()._forget(request_id, removed or request_id in self._held)

    def _unreported_loads(self) -> list[str]:
        """Asynchronous loads the worker has not reported (synchronous scheduling: those
        being reported at the step's end)."""
        return self._reporting

    def _end_step(self, record: StepRecord) -> StepRecord:
        """The step runs; with a connector (synchronous scheduling), in vLLM's order of
        ``update_from_output``: the worker's invalid blocks of the step's synchronous
        loads first (the requests they affect skip their output), the outputs, the
        report of its asynchronous loads, the requests the ``fail`` policy ends, then
        the loads and saves the worker reported done free their blocks."""
        self.ended = set()  # vLLM clears its finished ids when a step is scheduled
        if self.asynchronous:  # plan, then process the previous step (_process)
            return super()._end_step(record)
        ran = self._truncate_rejected(record)
        connector = self.connector
        if not isinstance(connector, DecidedConnector):
            record = super()._end_step(record)
            self._end_compile_failures(ran)
            return record
        affected = self._invalid_synchronous_loads(record)
        record = super()._end_step(record)
        self._end_compile_failures(ran)
        loads = connector.take_started()
        self._reporting = loads
        failed, async_affected = connector.report(self, loads)
        if connector.fail:
            ended = frozenset(r for r in failed if r not in self.requests)
            for rid in error_order(failed, async_affected, affected, ended):
                self._end_with_error(rid)
            for rid in set(loads):  # the reported set's order (_release_saved)
                if rid in self._failed_loads:
                    self._failed_loads.remove(rid)
                    self.engine.free(rid)
                    self.engine.remove_request(rid)
        self._reporting = []
        self._release_saved(self.num_steps)
        return record

    def _truncate_rejected(self, record: StepRecord) -> set[str]:
        """Structured output: a request of ``record`` whose grammar the engine reports
        rejected a token sampled in this step ends with it (the tokens it sampled are
        still appended, as vLLM appends them before asking the grammar): its outputs are
        cut after them, so the step ends it in order with the others. Returns the
        requests the step ran."""
        ran = {item.request_id for item in record.scheduled}
        for rid in self._decisions.grammar_errors:
            if rid not in ran:
                continue
            state = self.requests[rid]
            d = self._decisions.of(rid)
            sampled = 1 + (0 if d is None else d.num_accepted)
            state.output = state.output[: state.num_generated + sampled]
            self._rejected.add(rid)
        return ran

    def _end_compile_failures(self, ran: set[str]) -> None:
        """Structured output: a waiting request whose grammar failed to compile ends
        with an error after the step's outputs (vLLM's ``grammar_compile_error_reqs``)."""
        for rid in self._decisions.grammar_errors:
            if rid not in ran and rid in self.requests:
                self.abort(rid)
                self.finished.append(rid)
        self._rejected = set()

    def _invalid_synchronous_loads(self, record: StepRecord) -> list[str]:
        """The worker's invalid blocks of the step's synchronous loads (attempts counted
        per request, as the worker counts them), scanned over the running requests
        (:func:`properties.runner.load_failures.scan`): each affected request falls back,
        leaves the step's record (no output, its drafts dropped); under ``fail`` the
        blocks from each first invalid one on lose their hashes. Returns the affected
        requests."""
        connector = self.connector
        assert isinstance(connector, DecidedConnector)
        invalid: set[int] = set()
        for item in record.scheduled:
            if not item.external_tokens:
                continue
            rid = item.request_id
            attempt = connector.num_load_attempts.get(rid, 0)
            connector.num_load_attempts[rid] = attempt + 1
            block = connector.invalid_block(rid, attempt, item.hit_tokens, item.start)
            if block is not None:
                invalid.add(block)
        if not invalid:
            return []
        scanned = [
            ScannedRequest(
                rid,
                tuple(self.engine.get_block_ids(rid)[0]),
                self.requests[rid].num_computed_tokens,
            )
            for rid in self.running
        ]
        result = scan(scanned, invalid, self.layout.groups[0].spec.block_size)
        if connector.fail and result.to_evict:
            self._manager().block_pool.evict_blocks(sorted(result.to_evict))
        for rid in result.affected:
            computed = result.num_computed[rid]
            self.requests[rid].num_computed_tokens = computed
            self.engine.set_num_computed_tokens(rid, computed)
            for k, item in enumerate(record.scheduled):
                if item.request_id == rid:
                    del record.scheduled[k]
                    if item.num_drafts:
                        self.engine.set_in_flight(rid, 0, 0)
                    break
        return list(result.affected)

    def _end_with_error(self, request_id: str) -> None:
        """vLLM's ``fail`` policy ends a request whose load failed (``FINISHED_ERROR``):
        as an abort, except that a request still waiting for its load keeps its blocks
        until the load's report frees them (at the end of the same output)."""
        state = self.requests.get(request_id)
        if state is None:
            return
        connector = self.connector
        assert connector is not None
        if request_id in connector.loading:
            connector.loading.remove(request_id)
            self._ending = True
            try:
                self._end_with_connector(state)
            finally:
                self._ending = False
            self._failed_loads.append(request_id)
            self._forget(request_id, removed=True)
        else:
            self.abort(request_id)
        self.finished.append(request_id)  # a later Abort of it is a no-op, as in vLLM

    def _admit_waiting(self, record: StepRecord, budget: int, lookahead: int) -> None:
        """The engine's admissions in its order (it may pass over waiting requests: a
        LoRA limit, priorities, a pause, stale output in flight), each by kvconform's
        admission rule (:meth:`_admit_only`); the first the reference cannot admit stops
        (check 1 then names it). With a connector, the engine's connector events in order
        (class docstring)."""
        if self.connector is None:
            for d in self._decisions.scheduled:
                if d.request_id not in self.waiting:
                    continue
                before = len(record.scheduled)
                if not self._admit_only(d.request_id, record, budget, lookahead):
                    return
                budget -= sum(s.num_tokens for s in record.scheduled[before:])
            return
        for event in self._decisions.connector_events:
            if event.kind == PROMOTE:
                self.promote(event.request_id)
            else:
                budget = self._admit_one(record, event, budget, lookahead)

    def promote(self, request_id: str) -> None:
        """The engine completes ``request_id``'s load: cached (then it waits to be
        scheduled), or, failed, freed and queued first."""
        connector = self.connector
        assert connector is not None
        where = f"step {self.num_steps} ({self._decisions.describe()})"
        if request_id not in connector.loading:
            raise DecisionMismatch(
                f"{where}: the engine completed {request_id}'s load, which the reference "
                f"is not loading (loading: {connector.loading})"
            )
        connector.loading.remove(request_id)
        state = self.requests[request_id]
        if connector.complete_load(state):
            self.loaded.append(request_id)
            return
        self._fail_load(state)
        self.waiting.insert(0, request_id)

    def _admit_one(
        self, record: StepRecord, event: ConnectorEvent, budget: int, lookahead: int
    ) -> int:
        """The admission of ``event``'s request on the reference, then check 3; returns
        the budget left."""
        connector = self.connector
        assert connector is not None
        rid = event.request_id
        where = f"step {self.num_steps} ({self._decisions.describe()})"
        before = len(record.scheduled)
        if rid in self.loaded:
            d = self._decisions.of(rid)
            state = self.requests[rid]
            n = 0 if d is None else d.num_tokens
            if d is not None and d.num_drafts:  # vLLM pads a 1-token admission
                self.engine.set_in_flight(rid, 0, d.num_drafts)
            gate = self.mode.admission_gate
            new = allocate(self.engine, Allocation(rid, n, 0, None, lookahead, gate))
            if new is None:
                raise DecisionMismatch(
                    f"{where}: the engine allocated {n} tokens for loaded {rid}, the "
                    "reference cannot"
                )
            self.loaded.remove(rid)
            self.running.append(rid)
            hit, external = connector.take_loaded(rid)
            start = state.num_computed_tokens
            drafts = 0 if d is None else d.num_drafts
            record.scheduled.append(ScheduledRequest(rid, start, n, hit, new, num_drafts=drafts))
            told_external, asynchronous = 0, False
        else:
            if rid not in self.waiting:
                raise DecisionMismatch(
                    f"{where}: the engine admitted {rid}, which is not waiting on the "
                    f"reference (waiting: {self.waiting})"
                )
            if not self._admit_only(rid, record, budget, lookahead):
                raise DecisionMismatch(
                    f"{where}: the engine admitted {rid}, the reference's admission of it "
                    "fails on the same decisions"
                )
            asynchronous = rid in connector.loading
            if asynchronous:
                told_external = connector.loaded[rid][1]
            else:
                told_external = record.scheduled[-1].external_tokens
        want = tuple(map(tuple, self.engine.get_block_ids(rid)))
        got = (event.external_tokens, event.asynchronous, event.block_ids)
        if got != (told_external, asynchronous, want):
            raise DecisionMismatch(
                f"{where}: {rid}'s admission told the engine's connector (external tokens, "
                f"asynchronous, block ids) {got}, the reference's "
                f"{(told_external, asynchronous, want)}"
            )
        return budget - sum(s.num_tokens for s in record.scheduled[before:])

    def _admit_only(self, request_id: str, record: StepRecord, budget: int, lookahead: int) -> bool:
        """Rule 3 (kvconform's admission of a waiting request, with its connector) for
        ``request_id`` alone, the rest of the queue kept in order; whether it was
        admitted (or started its load)."""
        queue = self.waiting
        self.waiting = [request_id]
        try:
            super()._admit_waiting(record, budget, lookahead)
        finally:
            admitted = not self.waiting
            self.waiting = [r for r in queue if r != request_id or not admitted]
        return admitted

    def _victim(self, current: int) -> str | None:
        rid = self.running[current]
        if not self._victims and rid in self._failed:
            return None  # the engine stopped at this request's failed allocation
        if not self._victims:
            raise DecisionMismatch(
                f"step {self.num_steps}: the reference cannot allocate {rid}'s tokens and "
                "the engine preempted no (further) request"
            )
        victim = self._victims.pop(0)
        if victim not in self.running:
            raise DecisionMismatch(
                f"step {self.num_steps}: the engine preempted {victim}, which the reference "
                f"does not run (running: {self.running})"
            )
        return victim

    def _check_scheduled(self, scheduler: Scheduler, record: StepRecord) -> None:
        for i, item in enumerate(record.scheduled):  # drafts of admitted requests
            d = self._decisions.of(item.request_id)
            if d is not None and d.num_drafts != item.num_drafts:
                record.scheduled[i] = replace(item, num_drafts=d.num_drafts)
        want = [(d.request_id, d.start, d.num_tokens) for d in self._decisions.scheduled]
        got = [(s.request_id, s.start, s.num_tokens) for s in record.scheduled]
        where = f"step {self.num_steps} ({self._decisions.describe()})"
        if want != got:
            raise DecisionMismatch(
                f"{where}: the engine scheduled (request, start, tokens) {want}, the "
                f"reference on the same decisions {got} (a start is a hit length for an "
                "admitted request; a missing request did not fit on the reference)"
            )
        if self._victims:
            raise DecisionMismatch(
                f"{where}: the engine preempted {self._victims} although the reference had "
                "room for every scheduled request"
            )


class DecidedAsyncScheduler(DecidedScheduler, AsyncScheduler):
    """:class:`DecidedScheduler`'s overrides on kvconform's :class:`AsyncScheduler` (plan
    a step, then process the previous one), with the engine's timing of the two releases
    of a request with tokens in flight (the spec's: without a KV connector neither waits
    for the step):

    * a victim with tokens in flight (the engine's, or a trace's ``Preempt``) is
      preempted at once, its in-flight output stale (:class:`AsyncScheduler`'s
      stale-output rule);
    * an ``Abort`` frees the request's blocks at once; the output of its step in flight
      is dropped when processed.

    With a KV connector (vLLM 0.33 defers block frees for a consumer connector when
    batches overlap, ``defer_block_free``: a load into reused blocks is not ordered
    against a write of the step in flight):

    * **deferred frees**: a request freed while tokens of it are in flight (a
      ``Preempt`` or ``Abort`` between steps) gives up its blocks at once
      (``pop_blocks_for_free``) but the pool gets them back only when the step in
      flight is processed, before its output is handled, tail first over all groups
      (``free_popped_blocks``); the engine never picks a victim with tokens in flight;
    * **loads** started in a step are reported when that step's output is processed
      (a failing one: computed tokens back to 0 then), and completed (``PROMOTE``) by a
      later step's admission;
    * an ``Abort`` of a request whose load is not reported yet ends it at once (check
      4, its skipped blocks freed) but its blocks go back only when the load is
      reported (vLLM's ``delay_free_blocks``).

    Example: ``r1`` (8 tokens in flight, blocks 3-4) is aborted: the reference frees
    blocks 3-4 at once (2 more free blocks, as vLLM's ``finish_requests``), and the
    next step's processing skips ``r1``. With a connector the 2 blocks come back only
    after the next step is scheduled, when the step in flight is processed."""

    def __init__(
        self,
        engine: KVCacheEngine,
        layout: KVCacheLayout,
        mode: ServingMode,
        connector: Connector | None = None,
    ) -> None:
        super().__init__(engine, layout, mode, connector)
        #: non-empty steps planned and processed (vLLM's ``sched_step_seq`` and
        #: ``processed_step_seq``)
        self.sched_seq = 0
        self.processed_seq = 0
        #: deferred frees in order: (the step that must be processed first, blocks)
        self.deferred_frees: list[tuple[int, list[Any]]] = []
        #: the loads started in the step in flight (reported when it is processed)
        self._loads_in_flight: list[str] = []
        #: aborted requests whose load is not reported yet: their blocks wait for it
        self._aborted_loads: dict[str, RequestState] = {}

    def _defers_abort(self, state: RequestState) -> bool:
        """Never (see the class docstring); with a connector the loading request's
        state is dropped first (:meth:`DecidedScheduler._defers_abort`), and one whose
        load is not reported keeps its blocks until it is."""
        if self.connector is None:
            return False
        rid = state.request_id
        super()._defers_abort(state)
        if rid not in self._loads_in_flight:
            return False
        self._aborted_loads[rid] = state
        self._end_with_connector(state)
        self._forget(rid, removed=True)
        return True

    def preempt(self, request_id: str) -> None:
        """A trace's ``Preempt`` of a running request, at once also with tokens in flight
        (stale output, as the engine's own preemptions)."""
        if request_id in self.running:
            self._preempt(request_id)

    def _unreported_loads(self) -> list[str]:
        started = [] if self.connector is None else self.connector.started
        return self._loads_in_flight + started + self._reporting

    def _free_blocks(self, state: RequestState) -> None:
        """With a connector, the blocks of a request with tokens in flight come back
        when the step in flight is processed (class docstring)."""
        assert isinstance(state, AsyncRequestState)
        if self.connector is None or state.num_in_flight == 0:
            super()._free_blocks(state)
            return
        blocks = self.engine.pop_blocks_for_free(state.request_id)
        if blocks:
            self.deferred_frees.append((self.sched_seq, blocks))

    def _end_step(self, record: StepRecord) -> StepRecord:
        started = [] if self.connector is None else self.connector.take_started()
        record = super()._end_step(record)
        self._loads_in_flight = started
        return record

    def _plan(self, record: StepRecord) -> StepRecord:
        record = super()._plan(record)
        if record.scheduled:
            self.sched_seq += 1
        return record

    def _releasable(self, state: AsyncRequestState) -> bool:
        """A grammar rejection ends the request at once, also with tokens in flight (as
        vLLM frees it)."""
        return state.request_id in self._rejected or super()._releasable(state)

    def _process(self, previous: StepRecord, record: StepRecord) -> None:
        """With a connector: the deferred frees the step releases go back first, then
        its output, then the worker's report of the loads it started. The requests a
        grammar ended when the step's output was processed end with it
        (:meth:`DecidedScheduler._truncate_rejected`), those whose grammar failed to
        compile after it."""
        ran = self._truncate_rejected(previous)
        self._process_connector(previous, record)
        self._end_compile_failures(ran)

    def _process_connector(self, previous: StepRecord, record: StepRecord) -> None:
        if self.connector is not None and previous.scheduled:
            self.processed_seq += 1
            while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_seq:
                _, blocks = self.deferred_frees.pop(0)
                self.engine.free_popped_blocks(blocks)
        self._ending = True  # a request freed while an output is processed ends (check 4)
        try:
            super()._process(previous, record)
        finally:
            self._ending = False
        if isinstance(self.connector, DecidedConnector):
            loads, self._loads_in_flight = self._loads_in_flight, []
            self._reporting = loads
            self.connector.report(self, loads)
            self._reporting = []
            for rid in set(loads):  # the reported set's order (_release_saved)
                state = self._aborted_loads.pop(rid, None)
                if state is not None:
                    self.engine.free(rid)
                    self.engine.remove_request(rid)
                    self.connector.forget(rid)
            self._release_saved(self.num_steps - 1)


def decided_scheduler(
    engine: KVCacheEngine,
    layout: KVCacheLayout,
    mode: ServingMode,
    host_tier: HostTier | None = None,
) -> DecidedScheduler:
    """The decided scheduler for ``mode`` (asynchronous or not; with a
    :class:`DecidedConnector` over ``host_tier`` when one is given)."""
    cls = DecidedAsyncScheduler if mode.async_scheduling else DecidedScheduler
    if host_tier is None:
        return cls(engine, layout, mode)
    return cls(engine, layout, mode, DecidedConnector(engine, layout, mode, host_tier))


@dataclass(frozen=True)
class View:
    """Per live request its block ids and computed tokens, and the free block count."""

    block_ids: dict[str, tuple[tuple[int, ...], ...]]
    num_computed_tokens: dict[str, int]
    num_free_blocks: int
    #: the request accounting (compared when both sides give one)
    accounting: Accounting | None = None


def reference_view(scheduler: DecidedScheduler) -> View:
    """The reference side's :class:`View`."""
    engine = scheduler.engine
    blocks = {rid: tuple(map(tuple, engine.get_block_ids(rid))) for rid in scheduler.requests}
    computed = {rid: s.num_computed_tokens for rid, s in scheduler.requests.items()}
    return View(blocks, computed, engine.num_free_blocks(), scheduler.accounting())


def compare_views(engine: Any, reference: View, where: str) -> None:
    """Check 2: ``engine`` (any object with the :class:`View` fields) equals the
    reference; the first difference is a :class:`DecisionMismatch`."""
    if set(engine.block_ids) != set(reference.block_ids):
        raise DecisionMismatch(
            f"{where}: live requests differ: engine {sorted(engine.block_ids)}, reference "
            f"{sorted(reference.block_ids)}"
        )
    for rid in sorted(reference.block_ids):
        mine, ref = engine.block_ids[rid], reference.block_ids[rid]
        if mine != ref:
            raise DecisionMismatch(
                f"{where}: {rid}'s block ids differ: engine {mine}, reference {ref}"
            )
        if engine.num_computed_tokens[rid] != reference.num_computed_tokens[rid]:
            raise DecisionMismatch(
                f"{where}: {rid}'s computed tokens differ: engine "
                f"{engine.num_computed_tokens[rid]}, reference "
                f"{reference.num_computed_tokens[rid]}"
            )
    if engine.num_free_blocks != reference.num_free_blocks:
        raise DecisionMismatch(
            f"{where}: free blocks differ: engine {engine.num_free_blocks}, reference "
            f"{reference.num_free_blocks}"
        )
    mine, ref = getattr(engine, "accounting", None), reference.accounting
    if mine is not None and ref is not None and mine != ref:
        raise DecisionMismatch(
            f"{where}: request accounting differs: engine {mine}, reference {ref}"
        )


#: ``make_harness(layout, num_draft_tokens=, admission_gate=, accepted=)``: the engine side.
HarnessFactory = Callable[..., Any]


#: ``after(harness, reference, operation, index)``: called after each operation agreed.
OperationObserver = Callable[[Any, "DecidedScheduler", Operation, int], None]


def run_decided(
    trace: Trace,
    make_harness: HarnessFactory,
    options: SchedulerOptions = DEFAULT_OPTIONS,
    after: OperationObserver | None = None,
) -> int:
    """Run ``trace`` on the engine's scheduler and on :class:`DecidedScheduler` over the
    reference; raises :class:`DecisionMismatch` at the first disagreement, returns the
    number of steps run. ``trace.mode`` gives drafts and the admission gate, ``options``
    the engine scheduler's configuration (the reference follows its decisions);
    ``after`` observes both sides after every operation (tests)."""
    mode = trace.mode
    # the connector's store: made first, it answers both sides (None: no connector)
    tier = connector_host_tier(trace.layout, mode)
    requests: dict[str, RequestState] = {}

    def lookup(request_id: str, token_ids: tuple[int, ...], num_computed_tokens: int) -> int:
        """The tier's tokens beyond ``num_computed_tokens`` (read only: the reference's
        connector touches what it serves)."""
        assert tier is not None
        req = requests[request_id].input
        end = tier.longest_prefix(req.cache_salt, req.lora_name, token_ids, num_computed_tokens)
        return end - num_computed_tokens

    connector_kw: dict[str, Any] = {}
    if tier is not None:
        connector_kw = {
            "lookup": lookup,
            "async_loads": mode.async_loads,
            "load_failures": mode.load_failures,
        }
    harness = make_harness(
        trace.layout,
        num_draft_tokens=mode.num_draft_tokens,
        admission_gate=mode.admission_gate,
        accepted=Drafts.accepted_drafts,
        asynchronous=mode.async_scheduling,
        options=options,
        **connector_kw,
    )
    # the reference bounds unprocessed tokens as the engine does (vLLM: batches in
    # flight x the budget cap; the layout's default is max_model_len)
    layout = replace(trace.layout, max_in_flight_tokens=harness.max_in_flight_tokens)
    ref = decided_scheduler(make_reference(layout), layout, mode, tier)
    if options.delayed_frees:
        ref.saves = connector_saves
    ref.reset_connector = options.reset_connector
    ref.reset_running = options.reset_running
    if isinstance(ref.connector, DecidedConnector):
        ref.connector.invalid_blocks = options.invalid_blocks
        ref.connector.fail = options.fail_on_load_errors
    requests = ref.requests
    if tier is not None:
        ref.told_at_end = harness.told_at_end
    for index, op in enumerate(trace.operations):
        _apply(harness, ref, op, index)
        if after is not None:
            after(harness, ref, op, index)
    close = getattr(harness, "close", None)
    if close is not None:  # the engine's own end of a run (vLLM: shutdown)
        close()
    return ref.num_steps


def _apply(harness: Any, ref: DecidedScheduler, op: Operation, index: int) -> None:
    where = f"operation {index} ({type(op).__name__})"
    if isinstance(op, Arrive):
        harness.arrive(op)
        ref.arrive(op)
    elif isinstance(op, Abort):
        harness.abort(op.request_id)
        ref.abort(op.request_id)
    elif isinstance(op, Preempt):
        harness.preempt(op.request_id)
        ref.preempt(op.request_id)
    elif isinstance(op, ResetPrefixCache):
        resets = getattr(harness, "connector_resets", 0)
        mine, theirs = harness.reset_prefix_cache(), ref.reset_prefix_cache()
        if mine != theirs:
            raise DecisionMismatch(
                f"{where}: reset_prefix_cache returned {mine} on the engine, {theirs} on "
                "the reference"
            )
        reset = ref.reset_connector and ref.connector is not None
        if reset and getattr(harness, "connector_resets", 0) != resets + 1:
            raise DecisionMismatch(f"{where}: the engine did not reset its connector's store")
    elif isinstance(op, Step):
        decisions = harness.step(op.token_budget)
        ref.step_as(decisions, op.token_budget)
        where = f"{where}, step {ref.num_steps} ({decisions.describe()})"
        if decisions.finished_reported is not None:
            want = tuple(sorted(ref.ended_since_report))
            ref.ended_since_report = set()
            if decisions.finished_reported != want:
                raise DecisionMismatch(
                    f"{where}: the engine reported {decisions.finished_reported} finished, "
                    f"the requests that ended on the reference are {want}"
                )
    compare_views(harness.view(), reference_view(ref), where)


__all__ = [
    "DecidedAsyncScheduler",
    "DecidedConnector",
    "DecidedScheduler",
    "DecisionMismatch",
    "decided_scheduler",
    "View",
    "compare_views",
    "reference_view",
    "run_decided",
]
