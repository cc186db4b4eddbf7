"""A small deterministic scheduler: the same trace gives the same calls on every engine.

Rules of one ``Step(token_budget, num_lookahead_tokens)``:

1. ``new_step()``.
2. Running requests first, in admission order (an engine with ``schedule_step`` gets
   them in batches, which stop after the first None: the same calls, batched). Each gets
   ``n = min(tokens left to compute, budget left)`` (layouts with an ``"align"`` Mamba
   group cut a prefill chunk back to a Mamba block boundary, see ``_chunk``). When
   ``allocate_slots`` returns None, the newest running request is preempted
   (freed, back to the front of the waiting queue, its computed tokens reset to 0)
   and the allocation is retried; if the newest is the request itself, it stops.
3. Waiting requests, only when nothing was preempted in this step, in queue
   order: ``get_computed_blocks``, then ``allocate_slots(n, hit, hit blocks)`` for
   ``n = min(num_tokens - hit, budget left)``. The first that does not fit stops
   admission.
4. The step runs: every scheduled request's computed tokens advance by ``n``. A
   request whose tokens are all computed decodes its next output token (appended);
   after its last output token it finishes and is freed. A request with no output
   finishes after its prefill.

``Preempt`` frees a running request and puts it first in the waiting queue;
``Abort`` frees a request wherever it is and forgets it; ``ResetPrefixCache``
calls ``reset_prefix_cache()`` (it fails while any request holds blocks).

Serving modes (:class:`properties.core.modes.ServingMode`) are served by parts, which
:func:`properties.runner.serving.make_scheduler` picks:

* ``admission_gate`` (here): step 3 calls ``allocate_slots(...,
  full_sequence_must_fit=True)``.
* ``num_draft_tokens`` (here, the one drafts hook :class:`Drafts`): a decoding running
  request schedules its next token plus up to that many drafts (:meth:`Drafts.propose`);
  after the step the accepted ones (:meth:`Drafts.accepted_drafts`) and a bonus token
  are appended, the rejected ones roll ``num_computed_tokens`` back, and
  ``cache_blocks`` commits the result (:meth:`Drafts.settle`).
* ``async_scheduling``: :class:`properties.runner.async_scheduler.AsyncScheduler`
  (step 4 split into plan and process, one step apart).
* ``external_hits``, ``async_loads``, ``load_failures``: a
  :class:`properties.runner.connector.Connector` over a host tier, called at admission
  (step 3, and the start of a step for asynchronous loads), when a request is freed, and
  after a step's output is processed.

Worked example (one full group, bs 4, budget 64): ``Arrive r0`` (prompt 8, output
``(1, 2)``) then ``Step``: ``get_computed_blocks`` (no hit), ``allocate_slots(r0, 8, 0,
...)`` -> blocks ``(1, 2)``; the step computes 8 tokens and appends output 1. The next
``Step`` allocates position 8 (block 3), appends output 2, and frees ``r0``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from properties.core.allocation import Allocation, allocate
from properties.core.engine import (
    BlockIds,
    CacheHit,
    CommitsSteps,
    FreesInBatch,
    KVCacheEngine,
    PlansSteps,
    RequestInput,
    SlotRequest,
    StepUpdate,
)
from properties.core.modes import SYNC, ServingMode, proposed_drafts
from properties.core.trace import Abort, Arrive, Operation, Preempt, ResetPrefixCache, Step
from properties.runner.connector import Connector
from reference.errors import KVConformError
from reference.host_tier import HostTier
from reference.layout import KVCacheLayout, draft_token_limit
from reference.specs import MambaSpec


class TraceError(KVConformError):
    """A trace asks for something impossible (unknown request, too long, ...)."""


@dataclass
class RequestState:
    """The scheduler's view of one request (what every serving mode needs; a part keeps
    its own per-request state)."""

    input: RequestInput
    output: tuple[int, ...]
    num_generated: int = 0
    num_computed_tokens: int = 0
    holds_blocks: bool = False
    num_preemptions: int = 0

    @property
    def request_id(self) -> str:
        return self.input.request_id

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.input.prompt_token_ids + self.output[: self.num_generated]

    @property
    def num_tokens(self) -> int:
        return len(self.input.prompt_token_ids) + self.num_generated


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: positions ``[start, start + num_tokens)``."""

    request_id: str
    start: int
    num_tokens: int
    hit_tokens: int
    new_block_ids: BlockIds
    samples: bool = False
    num_drafts: int = 0
    #: tokens a KV connector loads from the host tier: positions ``[hit_tokens, start)``
    external_tokens: int = 0


@dataclass
class StepRecord:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)


#: Called after scheduling and before the step runs: (scheduler, record).
StepObserver = Callable[["Scheduler", StepRecord], None]


def mamba_block_size(layout: KVCacheLayout) -> int | None:
    """The largest Mamba block size of the layout, None without a Mamba group."""
    sizes = [s.block_size for s in layout.specs if isinstance(s, MambaSpec)]
    return max(sizes) if sizes else None


def aligned_mamba_block_size(layout: KVCacheLayout) -> int | None:
    """The largest block size of the layout's ``"align"`` Mamba groups (whose states are
    written at chunk ends, so prefill chunks end on their boundaries, as vLLM's scheduler
    splits them), None without one. Example: full bs 16 + Mamba bs 64 in mode ``"none"``
    -> None."""
    sizes = [s.block_size for s in layout.specs if isinstance(s, MambaSpec) and s.is_align]
    return max(sizes) if sizes else None


class Drafts:
    """Speculative decoding (``num_draft_tokens = k``), the scheduler's drafts hook:
    :meth:`propose` when a running request is scheduled, :meth:`settle` after the step.

    Example: k 2, a request decoding position 8 of 4 outputs (1 generated) with budget
    64 proposes 2 drafts (3 tokens); if ``accepted_drafts(id, 8, 2)`` is 1, computed
    tokens become 10 and 2 outputs are appended. With a Mamba group of one speculative
    block the same step proposes 1 draft."""

    def __init__(
        self,
        engine: KVCacheEngine,
        layout: KVCacheLayout,
        num_draft_tokens: int,
        varying: bool = False,
    ):
        self.engine = engine
        self.layout = layout
        limit = draft_token_limit(layout)
        #: ``k``, at most the speculative blocks of the Mamba groups (vLLM sizes them by
        #: the speculative token count)
        self.num_draft_tokens = num_draft_tokens if limit is None else min(num_draft_tokens, limit)
        #: the proposer offers :func:`properties.core.modes.proposed_drafts` drafts, not ``k``
        self.varying = varying

    def propose(self, state: RequestState, n: int, budget: int) -> int:
        """Draft tokens a decode step of ``n == 1`` token adds: the proposer's count (``k``,
        or :func:`properties.core.modes.proposed_drafts` with ``varying``), never past
        the request's last output, the budget or ``max_model_len``; announced as pending
        tokens (``set_in_flight(id, 0, drafts)``)."""
        decoding = state.num_computed_tokens == state.num_tokens - 1 and state.num_generated > 0
        if not decoding or n != 1:
            return 0
        room = min(
            len(state.output) - state.num_generated - 1,
            budget - 1,
            self.layout.max_model_len - state.num_tokens,
        )
        offered = self.num_draft_tokens
        if self.varying:
            offered = proposed_drafts(state.request_id, state.num_computed_tokens, offered)
        drafts = max(0, min(offered, room))
        if drafts:
            self.engine.set_in_flight(state.request_id, 0, drafts)
        return drafts

    @staticmethod
    def accepted_drafts(request_id: str, position: int, num_drafts: int) -> int:
        """How many of ``num_drafts`` drafts the step accepts: a deterministic function of
        the request and the position (``sha256``), uniform over ``0..num_drafts``."""
        digest = hashlib.sha256(f"{request_id}:{position}".encode()).digest()
        return int.from_bytes(digest[:4], "big") % (num_drafts + 1)

    def settle(self, item: ScheduledRequest, state: RequestState) -> bool:
        """A decode step with drafts ran: ``a`` accepted, the rest rolled back, ``a + 1``
        outputs appended and committed; True when the request has all its outputs."""
        rid = item.request_id
        accepted = self.accepted_drafts(rid, item.start, item.num_drafts)
        state.num_computed_tokens = item.start + 1 + accepted
        self.engine.set_num_computed_tokens(rid, state.num_computed_tokens)
        self.engine.set_in_flight(rid, 0, 0)
        new = state.output[state.num_generated : state.num_generated + accepted + 1]
        state.num_generated += len(new)
        self.engine.append_output_tokens(rid, list(new))
        self.engine.cache_blocks(rid, state.num_computed_tokens)
        return state.num_generated >= len(state.output)


class RequestQueues:
    """The requests of a trace and their queues: what every serving mode needs.

    ``Arrive`` adds a request to the waiting queue; ``Abort`` frees it wherever it is and
    forgets it; ``Preempt`` frees a running request and puts it first in the waiting
    queue, its computed tokens back to 0. Freeing calls the connector's *free* hook first
    (:meth:`_free`); a connector's asynchronous loads complete into the queues
    (:meth:`_complete_loads`). :class:`Scheduler` adds the step rules."""

    #: the request state it keeps
    state_type: type[RequestState] = RequestState

    def __init__(
        self, engine: KVCacheEngine, layout: KVCacheLayout, connector: Connector | None
    ) -> None:
        self.engine = engine
        self.layout = layout
        #: the KV connector of the connector modes (None: no host tier)
        self.connector = connector
        self.requests: dict[str, RequestState] = {}
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.finished: list[str] = []

    @property
    def host_tier(self) -> HostTier | None:
        """The connector's host tier (None without a connector)."""
        return None if self.connector is None else self.connector.host_tier

    def arrive(self, op: Arrive) -> None:
        if op.request_id in self.requests or op.request_id in self.finished:
            raise TraceError(f"Arrive: request id {op.request_id!r} is used already")
        total = len(op.prompt) + len(op.output)
        if total > self.layout.max_model_len:
            raise TraceError(
                f"Arrive {op.request_id!r}: prompt {len(op.prompt)} + output {len(op.output)} "
                f"tokens exceed max_model_len {self.layout.max_model_len}"
            )
        req = RequestInput(op.request_id, tuple(op.prompt), op.cache_salt, op.lora_name)
        self.requests[op.request_id] = self.state_type(req, tuple(op.output))
        self.engine.add_request(req)
        self.waiting.append(op.request_id)

    def abort(self, request_id: str) -> None:
        if request_id in self.finished:
            return
        state = self._state(request_id, "Abort")
        if self._defers_abort(state):
            for queue in (self.running, self.waiting):
                if request_id in queue:
                    queue.remove(request_id)
            return
        if state.holds_blocks:
            self._free(state)
        self._forget(request_id)

    def _defers_abort(self, state: RequestState) -> bool:
        """Whether an ``Abort`` waits (here: for the request's connector load)."""
        return self.connector is not None and self.connector.defer_abort(state.request_id)

    def preempt(self, request_id: str) -> None:
        if request_id not in self.running:
            return
        self._preempt(request_id)

    def _state(self, request_id: str, what: str) -> RequestState:
        state = self.requests.get(request_id)
        if state is None:
            raise TraceError(f"{what}: unknown request {request_id!r}")
        return state

    def _finish(self, request_id: str, record: StepRecord) -> None:
        """A request has all its outputs: freed, forgotten, reported finished."""
        self._free(self.requests[request_id])
        self._forget(request_id)
        self.finished.append(request_id)
        record.finished.append(request_id)

    def _finish_all(self, request_ids: list[str], record: StepRecord) -> None:
        """:meth:`_finish` of each id in order, the engine's frees in one ``free_requests``
        call (two or more ids): the connector's release hooks first, in order, then the
        frees, then the engine's ``remove_requests`` of the same ids, then each request
        forgotten and reported finished. Same engine state as
        the successive ``_finish`` calls (each free touches its own request only)."""
        if len(request_ids) < 2:
            for request_id in request_ids:
                self._finish(request_id, record)
            return
        if self.connector is not None:
            for request_id in request_ids:
                state = self.requests[request_id]
                self.connector.release(state, self._processed(state))
        self.engine.free_requests(request_ids)  # type: ignore[attr-defined]
        self.engine.remove_requests(request_ids)  # type: ignore[attr-defined]
        for request_id in request_ids:
            self._forget(request_id, removed=True)
            self.finished.append(request_id)
            record.finished.append(request_id)

    def _preempt(self, request_id: str) -> None:
        state = self.requests[request_id]
        self._free(state)
        state.holds_blocks = False
        state.num_computed_tokens = 0
        state.num_preemptions += 1
        self.engine.set_num_computed_tokens(request_id, 0)
        self.running.remove(request_id)
        self.waiting.insert(0, request_id)

    def _free(self, state: RequestState) -> None:
        """Free a request's blocks (the connector's *free* hook first: with a host tier,
        every full computed block of its table is offloaded there)."""
        if self.connector is not None:
            self.connector.release(state, self._processed(state))
        self._free_blocks(state)

    def _free_blocks(self, state: RequestState) -> None:
        """The engine's ``free`` of the request's blocks (a subclass may defer it:
        :class:`properties.runner.decided.DecidedAsyncScheduler`)."""
        self.engine.free(state.request_id)

    def _processed(self, state: RequestState) -> int:
        """The tokens whose output is processed: every computed token."""
        return state.num_computed_tokens

    def _output_processed(self, state: RequestState) -> None:
        """A step's output for the request was processed (the connector's hook: detach)."""
        if self.connector is not None:
            self.connector.processed(state, self._processed(state))

    def _forget(self, request_id: str, removed: bool = False) -> None:
        """Drop a request (from the engine too, unless ``removed`` there already)."""
        if not removed:
            self.engine.remove_request(request_id)
        self.requests.pop(request_id, None)
        if self.connector is not None:
            self.connector.forget(request_id)
        for queue in (self.running, self.waiting):
            if request_id in queue:
                queue.remove(request_id)

    def is_idle(self) -> bool:
        return (
            not self.running
            and not self.waiting
            and (self.connector is None or not self.connector.loading)
        )

    def _complete_loads(self) -> None:
        """Asynchronous loads: every load started in an earlier step completes now: the
        request runs, or, aborted during the load, is freed now; a failed load
        (:meth:`_fail_load`) queues the request again at the front."""
        if self.connector is None:
            return
        failed: list[str] = []
        for rid in self.connector.take_loads():
            state = self.requests[rid]
            aborted = rid in self.connector.aborted
            if self.connector.complete_load(state):
                if aborted:
                    self._free(state)
                    self._forget(rid)
                else:
                    self.running.append(rid)
                continue
            self._fail_load(state)
            if aborted:
                self._forget(rid)
            else:
                failed.append(rid)
        self.waiting[0:0] = failed

    def _fail_load(self, state: RequestState) -> None:
        """``load_failures``: the whole load failed (vLLM's failed receive, ``recompute``
        policy): computed tokens back to 0, the blocks freed uncached (nothing of the load
        was written, so nothing is offloaded either); the caller queues it again."""
        state.num_computed_tokens = 0
        self.engine.set_num_computed_tokens(state.request_id, 0)
        self._free(state)
        state.holds_blocks = False


class Scheduler(RequestQueues):
    """Turns trace operations into engine calls (see the module docstring): the
    synchronous rules and batching; the parts of other serving modes plug in."""

    #: plans a step before the previous one is processed (:class:`AsyncScheduler`)
    asynchronous = False

    def __init__(
        self,
        engine: KVCacheEngine,
        layout: KVCacheLayout,
        mode: ServingMode = SYNC,
        on_scheduled: StepObserver | None = None,
        connector: Connector | None = None,
    ) -> None:
        super().__init__(engine, layout, connector)
        self.mode = mode
        self.on_scheduled = on_scheduled
        self.mamba_block_size = mamba_block_size(layout)
        #: prefill chunks end on this block size (``"align"`` Mamba groups; see _chunk)
        self.chunk_block_size = aligned_mamba_block_size(layout)
        self._check_parts(mode, connector)
        #: the drafts hook of speculative decoding (None: no drafts)
        self.drafts = (
            Drafts(engine, layout, mode.num_draft_tokens, mode.varying_drafts)
            if mode.num_draft_tokens
            else None
        )
        self.num_steps = 0
        #: Running requests are allocated in batches when the engine plans steps.
        self.batched = isinstance(engine, PlansSteps)
        #: The end of a step goes to the engine in one call when it commits steps.
        self.commits = isinstance(engine, CommitsSteps)
        #: Requests finishing in the same step are freed in one call when the engine frees
        #: in batch (not with drafts, nor in a subclass with its own ``_free``/``_finish``).
        self.frees_in_batch = (
            isinstance(engine, FreesInBatch)
            and self.drafts is None
            and type(self)._free is Scheduler._free
            and type(self)._finish is Scheduler._finish
        )
        #: batched allocations of this step not read yet (request id -> result)
        self._planned: dict[str, BlockIds | None] = {}

    def _check_parts(self, mode: ServingMode, connector: Connector | None) -> None:
        if mode.async_scheduling != self.asynchronous:
            raise KVConformError(
                f"{type(self).__name__} cannot serve mode {mode.describe()}: asynchronous "
                "scheduling is AsyncScheduler's (make_scheduler picks the parts)"
            )
        wants = mode.external_hits and self.mamba_block_size is None
        if wants != (connector is not None):
            raise KVConformError(
                f"mode {mode.describe()} on this layout needs "
                f"{'a' if wants else 'no'} Connector (make_scheduler picks the parts)"
            )

    def apply(self, op: Operation) -> StepRecord | None:
        if isinstance(op, Arrive):
            self.arrive(op)
        elif isinstance(op, Step):
            return self.step(op.token_budget, op.num_lookahead_tokens)
        elif isinstance(op, Abort):
            self.abort(op.request_id)
        elif isinstance(op, Preempt):
            self.preempt(op.request_id)
        elif isinstance(op, ResetPrefixCache):
            self.engine.reset_prefix_cache()
        else:
            raise TraceError(f"unknown trace operation {op!r}")
        return None

    def step(self, token_budget: int, num_lookahead_tokens: int = 0) -> StepRecord:
        if token_budget < 1:
            raise TraceError(f"Step.token_budget must be >= 1, got {token_budget}")
        self.num_steps += 1
        self.engine.new_step()
        record = StepRecord()
        self._complete_loads()
        budget = self._schedule_running(record, token_budget, num_lookahead_tokens)
        if not record.preempted:
            self._admit_waiting(record, budget, num_lookahead_tokens)
        if self.on_scheduled is not None:
            self.on_scheduled(self, record)
        return self._end_step(record)

    def _schedule_running(self, record: StepRecord, budget: int, lookahead: int) -> int:
        """Rule 2; returns the budget left."""
        i = 0
        self._planned = {}
        while i < len(self.running) and budget > 0:
            rid = self.running[i]
            state = self.requests[rid]
            n = self._chunk(state, state.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            drafts = self._propose_drafts(state, n, budget)
            n += drafts
            new, restored, shift = self._allocate_running(record, i, n, budget, lookahead)
            budget += restored
            i -= shift
            if new is None:
                if rid in self.running:
                    i += 1  # asynchronous scheduling: no victim, the request waits a step
                continue
            hit, external = (0, 0) if self.connector is None else self.connector.take_loaded(rid)
            record.scheduled.append(
                ScheduledRequest(
                    rid,
                    state.num_computed_tokens,
                    n,
                    hit,
                    new,
                    num_drafts=drafts,
                    external_tokens=external,
                )
            )
            budget -= n
            i += 1
        return budget

    def _allocate_running(
        self, record: StepRecord, i: int, n: int, budget: int, lookahead: int
    ) -> tuple[BlockIds | None, int, int]:
        """``n`` slots for running request ``i``, preempting victims until they fit (the
        first try is read from the batch when the engine plans steps); the blocks (None
        when the request itself was preempted or no victim is left), the budget the
        victims give back (those scheduled earlier in the step: :meth:`_unschedule`) and
        how many of them stood before index ``i``. kvconform's own victims come after
        ``i`` and were not scheduled yet (0 and 0); an engine's priority scheduling can
        pick any running request (:class:`properties.runner.decided.DecidedScheduler`).
        """
        rid = self.running[i]
        first_try = True
        restored = shift = 0
        while True:
            if first_try and self.batched and rid not in self._planned:
                self._planned = self._plan_running(i, budget, lookahead)
            if first_try and rid in self._planned:
                new = self._planned.pop(rid)
            else:
                new = allocate(self.engine, Allocation(rid, n, 0, None, lookahead))
            first_try = False
            if new is not None:
                return new, restored, shift
            victim = self._victim(i - shift)
            if victim is None:
                return None, restored, shift
            if self.running.index(victim) < i - shift:
                shift += 1
            restored += self._unschedule(record, victim)
            self._preempt(victim)
            record.preempted.append(victim)
            if victim == rid:
                return None, restored, shift

    def _unschedule(self, record: StepRecord, request_id: str) -> int:
        """A victim scheduled earlier in this step leaves it (vLLM's priority scheduling
        can preempt one): its share is dropped from ``record``, its drafts are no longer
        pending, and its tokens go back to the budget (returned; 0 when it was not
        scheduled). Example: ``r2`` ran 4 tokens, then ``r0`` needs its blocks: 4."""
        for k, item in enumerate(record.scheduled):
            if item.request_id == request_id:
                del record.scheduled[k]
                if item.num_drafts:
                    self.engine.set_in_flight(request_id, 0, 0)
                return item.num_tokens
        return 0

    def _admit_waiting(self, record: StepRecord, budget: int, lookahead: int) -> None:
        """Rule 3 (with a connector: external hits, synchronous or asynchronous loads)."""
        connector = self.connector
        while self.waiting and budget > 0:
            rid = self.waiting[0]
            state = self.requests[rid]
            hit = self.engine.get_computed_blocks(rid)
            h = hit.num_tokens
            external = 0 if connector is None else connector.external_tokens(state, h)
            n = self._chunk(state, h + external, budget)
            if n <= 0:
                break
            asynchronous = connector is not None and bool(external) and connector.asynchronous
            admission = Allocation(
                rid,
                n,
                h,
                hit,
                lookahead,
                full_sequence_must_fit=self.mode.admission_gate,
                num_external_computed_tokens=external,
            )
            if asynchronous:
                load = replace(
                    admission, num_new_tokens=0, num_lookahead_tokens=0, delay_cache_blocks=True
                )
                if allocate(self.engine, load) is None:
                    break
                self.waiting.pop(0)
                connector.start_load(rid, h, external)
                state.holds_blocks = True
                state.num_computed_tokens = h + external
                self.engine.set_num_computed_tokens(rid, state.num_computed_tokens)
                continue
            new = allocate(self.engine, admission)
            if new is None:
                break
            self.waiting.pop(0)
            self.running.append(rid)
            state.holds_blocks = True
            state.num_computed_tokens = h + external
            if connector is not None and external:
                connector.load(state, h, h + external)
            record.scheduled.append(
                ScheduledRequest(rid, h + external, n, h, new, external_tokens=external)
            )
            budget -= n

    def _end_step(self, record: StepRecord) -> StepRecord:
        """After scheduling: the step runs (rule 4)."""
        self._run(record)
        return record

    def _plan_running(self, first: int, budget: int, lookahead: int) -> dict:
        """Batched allocation (engines with ``schedule_step``) of the running requests from
        index ``first`` on, each with the chunk the loop above would give it if every
        earlier one succeeds; the engine stops after the first None, which the loop then
        handles (preemption and per-request retry) exactly as without batching."""
        items = []
        for rid in self.running[first:]:
            if budget <= 0:
                break
            state = self.requests[rid]
            n = self._chunk(state, state.num_computed_tokens, budget)
            if n > 0:
                drafts = self._propose_drafts(state, n, budget)
                items.append(SlotRequest(rid, n + drafts, lookahead))
                budget -= n + drafts
        results = self.engine.schedule_step(items)
        return {item.request_id: r for item, r in zip(items, results)}

    def _propose_drafts(self, state: RequestState, n: int, budget: int) -> int:
        return 0 if self.drafts is None else self.drafts.propose(state, n, budget)

    def _victim(self, current: int) -> str | None:
        """The request to preempt: the newest running one."""
        return self.running[-1]

    def _end(self, state: RequestState) -> int:
        """The position scheduling may reach: every known token."""
        return state.num_tokens

    def _chunk(self, state: RequestState, start: int, budget: int) -> int:
        """Tokens to schedule from ``start``: ``min(left, budget)``; with an ``"align"``
        Mamba group, a prefill chunk ending before ``max(P, N - 1)`` is cut back to a
        multiple of the Mamba block size (possibly to 0: the request waits for a larger
        budget), so
        that every state the manager caches at a block boundary is really written
        there. Example: Mamba bs 4, prefill from 0 with budget 6 -> 4 tokens."""
        n = min(self._end(state) - start, budget)
        if self.chunk_block_size is None:
            return n
        prefill_end = max(len(state.input.prompt_token_ids), state.num_tokens - 1)
        if start >= prefill_end or start + n >= prefill_end:
            return n
        bs = self.chunk_block_size
        return (start + n) // bs * bs - start

    def _run(self, record: StepRecord) -> None:
        """Rule 4. The engine sees, per scheduled request in order,
        ``set_num_computed_tokens``, ``append_output_tokens`` (when it decoded a token) and
        ``free`` (when it finished); an engine with ``commit_step`` gets the first two for
        the whole step in one call, before the frees (same state: each touches one request)."""
        plan: list[tuple[ScheduledRequest, StepUpdate | None, bool]] = []
        for item in record.scheduled:
            state = self.requests[item.request_id]
            if item.num_drafts:
                plan.append((item, None, False))  # applied in order below
                continue
            state.num_computed_tokens = item.start + item.num_tokens
            token = None
            done = False
            if state.num_computed_tokens >= state.num_tokens:
                if state.num_generated < len(state.output):
                    token = state.output[state.num_generated]
                    state.num_generated += 1
                done = state.num_generated >= len(state.output)
            plan.append((item, StepUpdate(item.request_id, state.num_computed_tokens, token), done))
        if self.commits:
            self.engine.commit_step([u for _, u, _ in plan if u is not None])
        ending: list[str] = []  # finished, freed together after the loop (frees_in_batch)
        for item, update, done in plan:
            if update is None:
                assert self.drafts is not None
                if self.drafts.settle(item, self.requests[item.request_id]):
                    self._finish(item.request_id, record)
                continue
            rid = update.request_id
            if not self.commits:
                self.engine.set_num_computed_tokens(rid, update.num_computed_tokens)
                if update.output_token is not None:
                    self.engine.append_output_tokens(rid, [update.output_token])
            if update.output_token is not None and self.drafts is not None:
                self.engine.cache_blocks(rid, update.num_computed_tokens)
            if done:
                if self.frees_in_batch:
                    ending.append(rid)
                else:
                    self._finish(rid, record)
        if ending:
            self._finish_all(ending, record)
        for item in record.scheduled:
            state = self.requests.get(item.request_id)
            if state is not None:
                self._output_processed(state)

    def drain(self, token_budget: int, max_steps: int = 10_000) -> None:
        """Run steps until every request has finished (a trace's natural end)."""
        for _ in range(max_steps):
            if self.is_idle():
                return
            self.step(token_budget)
        raise TraceError(
            f"requests still pending after {max_steps} steps: "
            f"running {self.running}, waiting {self.waiting}"
        )


__all__ = [
    "CacheHit",
    "RequestState",
    "ScheduledRequest",
    "Scheduler",
    "StepRecord",
    "TraceError",
]
