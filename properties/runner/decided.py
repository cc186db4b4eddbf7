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
from properties.core.scheduler_options import DEFAULT_OPTIONS, SchedulerOptions, connector_saves
from properties.core.trace import Abort, Arrive, Operation, Preempt, ResetPrefixCache, Step, Trace
from properties.engines.reference import make_engine as make_reference
from properties.runner.async_scheduler import AsyncRequestState, AsyncScheduler
from properties.runner.connector import Connector
from properties.runner.scheduler import (
    Drafts,
    RequestState,
    ScheduledRequest,
    Scheduler,
    StepRecord,
)
from properties.runner.serving import connector_host_tier
from reference.errors import KVConformError
from reference.host_tier import HostTier
from reference.layout import KVCacheLayout
from reference.specs import cdiv


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

    def start_load(self, request_id: str, hit_tokens: int, external_tokens: int) -> None:
        super().start_load(request_id, hit_tokens, external_tokens)
        self.started.append(request_id)

    def take_started(self) -> list[str]:
        """The asynchronous loads started since the last call."""
        started, self.started = self.started, []
        return started

    def report(self, scheduler: Scheduler, request_ids: list[str]) -> None:
        """The worker reports the loads of ``request_ids`` (synchronous scheduling: at
        the end of the step that started them; asynchronous: when that step's output is
        processed); a failing one sets the request's computed tokens back to 0."""
        for rid in request_ids:
            attempt = self.num_load_attempts.get(rid, 0)
            state = scheduler.requests.get(rid)
            if state is not None and self.failures and load_fails(rid, attempt):
                state.num_computed_tokens = 0
                self.engine.set_num_computed_tokens(rid, 0)


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
        #: loads completed and not scheduled since (the engine's waiting requests that
        #: hold blocks), in order
        self.loaded: list[str] = []
        #: block ids the engine's connector was told at each request's end (the engine
        #: side fills it; check 4 reads it)
        self.told_at_end: dict[str, tuple[tuple[int, ...], ...]] = {}
        #: a request is ending (finished or aborted): check 4 runs when it is freed
        self._ending = False
        #: requests that ended (finished or aborted) since the last step was scheduled
        self.ended: set[str] = set()
        #: whether the engine's connector saves a request's blocks at its end (kept
        #: until the save is reported: ``SchedulerOptions.delayed_frees``)
        self.saves: Callable[[str], bool] = _never
        #: ended requests whose blocks a save keeps: id -> (state, the step with whose
        #: output the save is reported)
        self._held: dict[str, tuple[RequestState, int]] = {}
        #: a ``ResetPrefixCache`` resets the connector's store too
        self.reset_connector = False

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
        if d is None and state.request_id in self._victims and state.request_id in self.running:
            # the engine preempted this running request when its own allocation failed:
            # the reference tries kvconform's chunk and must fail the same way; where
            # kvconform's Mamba rule cuts the chunk to 0 (a Mamba block wider than the
            # step's budget), vLLM's scheduler advances sub-block: the uncut chunk
            # (Mamba bs 22, computed 110, budget 19: 19 tokens, not 0)
            n = super()._chunk(state, start, budget)
            return n if n > 0 else min(self._end(state) - start, budget)
        if d is None:
            # an asynchronous load computes nothing: any positive chunk (the load
            # allocates none) lets kvconform's admission rule start it
            return 1 if self._loads_asynchronously(state.request_id) else 0
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
        if d is None and state.request_id in self._victims:
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
        ``reset_connector``, the connector's store is emptied too."""
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
        want = tuple(
            tuple(row[: cdiv(state.num_computed_tokens, g.spec.block_size)])
            for row, g in zip(table, self.layout.groups)
        )
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
        manager = getattr(self.engine, "manager", None)
        if manager is None:
            raise KVConformError(
                "DecidedScheduler with a connector runs on the reference engine (it frees "
                "a request's skipped blocks through its manager)"
            )
        manager.coordinator.remove_skipped_blocks(request_id, num_processed_tokens)

    def _forget(self, request_id: str, removed: bool = False) -> None:
        """A finished or aborted request is forgotten: it ended. A save keeps it (and
        its blocks, :meth:`_free`) until the save is reported; the engine's connector is
        told at every end, so a request with no blocks left (aborted while waiting,
        finished by a stale token) is kept too, unless its load is not reported yet
        (nothing to save)."""
        state = self.requests.get(request_id)
        if state is not None:
            self.ended.add(request_id)
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
        """Asynchronous loads the worker has not reported (none: synchronous scheduling
        reports a step's loads at its end)."""
        return []

    def _end_step(self, record: StepRecord) -> StepRecord:
        self.ended = set()  # vLLM clears its finished ids when a step is scheduled
        record = super()._end_step(record)
        if isinstance(self.connector, DecidedConnector) and not self.asynchronous:
            self.connector.report(self, self.connector.take_started())
            self._release_saved(self.num_steps)
        return record

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
        return self._loads_in_flight + started

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

    def _process(self, previous: StepRecord, record: StepRecord) -> None:
        """With a connector: the deferred frees the step releases go back first, then
        its output, then the worker's report of the loads it started."""
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
            self.connector.report(self, loads)
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
