"""A small deterministic scheduler: the same trace gives the same calls on every engine.

Rules of one ``Step(token_budget, num_lookahead_tokens)``:

1. ``new_step()``.
2. Running requests first, in admission order (an engine with ``schedule_step`` gets
   them in batches, which stop after the first None: the same calls, batched). Each gets
   ``n = min(tokens left to compute, budget left)`` (layouts with a Mamba group cut a
   prefill chunk back to a Mamba block boundary, see ``_chunk``). When
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

Serving modes (:class:`properties.core.modes.ServingMode`):

* ``admission_gate``: step 3 calls ``allocate_slots(..., full_sequence_must_fit=True)``.
* ``num_draft_tokens``: a decoding running request schedules its next token plus up to
  that many drafts (:meth:`Scheduler._drafts`); after the step the accepted ones
  (:meth:`Scheduler.accepted_drafts`) and a bonus token are appended, the rejected
  ones roll ``num_computed_tokens`` back, and ``cache_blocks`` commits the result.
* ``async_scheduling``: step 4 is split. After planning, each scheduled request's
  computed tokens advance at once (optimistically) and its tokens join the flight; a
  chunk that reaches the last known token samples an output, which stays *pending*
  (a placeholder the next step can already schedule) until processed
  (``set_in_flight(id, in_flight, pending)``). Then the *previous* step's output is
  processed: its tokens leave the flight, its sampled tokens are appended, the
  processed tokens are committed (``cache_blocks(id, computed - in_flight)``, as
  vLLM's ``update_from_output`` does for requests with placeholders) and requests
  that finished are freed. A request is never freed, preempted or aborted while
  tokens of it are in flight: a finish or an ``Abort`` is deferred until its last
  step is processed, a ``Preempt`` of it is ignored, and allocation failures only
  preempt requests with nothing in flight (otherwise the request waits a step).
* ``external_hits`` (no Mamba group): the scheduler is the KV connector. It owns a
  :class:`reference.host_tier.HostTier` (capacity twice the pool) and offloads blocks to
  it when they leave the primary pool: a sliding-window or chunked-local block once its
  tokens are all below the group's skip boundary on the processed basis (*detach*,
  :meth:`Scheduler._detach`, after a step's output is processed), and every full
  computed block of a request's table when the request is freed (finished, preempted,
  aborted). Step 3 asks the tier for the tokens it holds beyond the device hit ``h``
  (``e``: every group must serve ``h + e``), calls ``allocate_slots(n, h, hit blocks,
  ..., num_external_computed_tokens=e)`` with ``n = min(num_tokens - h - e, budget
  left)``, the connector loads ``[h, h + e)`` into the request's blocks (``on_load``),
  and the request computes from ``h + e``. ``on_offload`` and ``on_load`` let the
  attention check copy content out of and back into the paged cache.
* ``async_loads``: step 3 admits a request with external tokens by
  ``allocate_slots(0, h, hit blocks, 0, num_external_computed_tokens=e,
  delay_cache_blocks=True)`` and puts it in ``loading`` (no budget used); the load
  completes at the start of the next step (``on_load``, then ``cache_blocks(id, h +
  e)``), and the request joins the running ones. An ``Abort`` of a loading request is
  deferred until its load completes.
* ``load_failures``: a load that fails (:func:`properties.core.modes.load_fails`) is not
  copied in; the request's computed tokens go back to 0 and its blocks are freed
  (:meth:`Scheduler._fail_load`), and it waits again at the front of the queue.
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
    KVCacheEngine,
    PlansSteps,
    RequestInput,
    SlotRequest,
    StepUpdate,
)
from properties.core.modes import SYNC, ServingMode, load_fails
from properties.core.trace import Abort, Arrive, Operation, Preempt, ResetPrefixCache, Step
from reference.block_table import NULL_BLOCK_ID
from reference.errors import KVConformError
from reference.host_tier import HostTier, num_detached_blocks
from reference.layout import KVCacheLayout
from reference.specs import MambaSpec


class TraceError(KVConformError):
    """A trace asks for something impossible (unknown request, too long, ...)."""


@dataclass
class RequestState:
    """The scheduler's view of one request."""

    input: RequestInput
    output: tuple[int, ...]
    num_generated: int = 0
    num_computed_tokens: int = 0
    holds_blocks: bool = False
    num_preemptions: int = 0
    #: asynchronous scheduling: tokens planned but not processed, sampled tokens not
    #: appended yet, and a deferred release ("finish" or "abort") waiting for the flight
    num_in_flight: int = 0
    num_pending: int = 0
    release: str | None = None
    #: external hits: (local hit, external tokens) of a load not read by a step yet
    loaded: tuple[int, int] | None = None
    #: external hits: per group, the leading blocks already detached to the host tier
    detached: list[int] = field(default_factory=list)
    #: asynchronous loads started for this request (``load_failures``: a retry never fails)
    num_load_attempts: int = 0

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
#: Called when a block leaves the primary pool for the host tier:
#: (request, group, block index, block id it leaves).
OffloadObserver = Callable[[RequestState, int, int, int], None]
#: Called when the connector loads positions ``[start, end)`` of a request into its
#: blocks: (request, start, end).
LoadObserver = Callable[[RequestState, int, int], None]


class Scheduler:
    """Turns trace operations into engine calls (see the module docstring)."""

    def __init__(
        self,
        engine: KVCacheEngine,
        layout: KVCacheLayout,
        on_scheduled: StepObserver | None = None,
        mode: ServingMode = SYNC,
        on_offload: OffloadObserver | None = None,
        on_load: LoadObserver | None = None,
    ) -> None:
        self.engine = engine
        self.on_offload = on_offload
        self.on_load = on_load
        self.mode = mode
        #: asynchronous scheduling: the planned step whose output is not processed yet
        self.in_flight: StepRecord | None = None
        self.layout = layout
        self.on_scheduled = on_scheduled
        self.requests: dict[str, RequestState] = {}
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.finished: list[str] = []
        #: async loads: requests whose connector load completes at the next step
        self.loading: list[str] = []
        mamba_sizes = [s.block_size for s in layout.specs if isinstance(s, MambaSpec)]
        self.mamba_block_size = max(mamba_sizes) if mamba_sizes else None
        #: external hits: the host tier a KV connector loads from (None: no connector)
        self.host_tier: HostTier | None = None
        if mode.external_hits and self.mamba_block_size is None:
            self.host_tier = HostTier(layout, 2 * layout.num_blocks)
        self.num_steps = 0
        #: Running requests are allocated in batches when the engine plans steps.
        self.batched = isinstance(engine, PlansSteps)
        #: The end of a step goes to the engine in one call when it commits steps.
        self.commits = isinstance(engine, CommitsSteps)

    # -- operations --------------------------------------------------------------
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
        self.requests[op.request_id] = RequestState(req, tuple(op.output))
        self.engine.add_request(req)
        self.waiting.append(op.request_id)

    def abort(self, request_id: str) -> None:
        if request_id in self.finished:
            return
        state = self._state(request_id, "Abort")
        if state.num_in_flight > 0 or request_id in self.loading:
            # asynchronous scheduling: released once its last step is processed
            state.release = "abort"
            for queue in (self.running, self.waiting):
                if request_id in queue:
                    queue.remove(request_id)
            return
        if state.holds_blocks:
            self._free(state)
        self._forget(request_id)

    def preempt(self, request_id: str) -> None:
        if request_id not in self.running or self.requests[request_id].num_in_flight > 0:
            return
        self._preempt(request_id)

    # -- the step ------------------------------------------------------------------
    def step(self, token_budget: int, num_lookahead_tokens: int = 0) -> StepRecord:
        if token_budget < 1:
            raise TraceError(f"Step.token_budget must be >= 1, got {token_budget}")
        self.num_steps += 1
        self.engine.new_step()
        record = StepRecord()
        self._complete_loads(record)
        budget = token_budget
        i = 0
        planned: dict[str, BlockIds | None] = {}
        while i < len(self.running) and budget > 0:
            rid = self.running[i]
            state = self.requests[rid]
            n = self._chunk(state, state.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            drafts = self._drafts(state, n, budget)
            if drafts:
                n += drafts
                self.engine.set_in_flight(rid, 0, drafts)
            new = None
            first_try = True
            while True:
                if first_try and self.batched and rid not in planned:
                    planned = self._plan_running(i, budget, num_lookahead_tokens)
                if first_try and rid in planned:
                    new = planned.pop(rid)
                else:
                    new = allocate(self.engine, Allocation(rid, n, 0, None, num_lookahead_tokens))
                first_try = False
                if new is not None:
                    break
                victim = self._victim(i)
                if victim is None:
                    break
                self._preempt(victim)
                record.preempted.append(victim)
                if victim == rid:
                    break
            if new is None:
                if rid in self.running:
                    i += 1  # asynchronous scheduling: no victim, the request waits a step
                continue
            local, external = state.loaded if state.loaded is not None else (0, 0)
            state.loaded = None
            record.scheduled.append(
                ScheduledRequest(
                    rid,
                    state.num_computed_tokens,
                    n,
                    local,
                    new,
                    num_drafts=drafts,
                    external_tokens=external,
                )
            )
            budget -= n
            i += 1
        if not record.preempted:
            while self.waiting and budget > 0:
                rid = self.waiting[0]
                state = self.requests[rid]
                hit = self.engine.get_computed_blocks(rid)
                external = self._external_tokens(state, hit.num_tokens)
                n = self._chunk(state, hit.num_tokens + external, budget)
                if n <= 0:
                    break
                admission = Allocation(
                    rid,
                    n,
                    hit.num_tokens,
                    hit,
                    num_lookahead_tokens,
                    full_sequence_must_fit=self.mode.admission_gate,
                    num_external_computed_tokens=external,
                )
                if external and self.mode.async_loads:
                    load = replace(
                        admission, num_new_tokens=0, num_lookahead_tokens=0, delay_cache_blocks=True
                    )
                    if allocate(self.engine, load) is None:
                        break
                    self.waiting.pop(0)
                    self.loading.append(rid)
                    state.holds_blocks = True
                    state.num_computed_tokens = hit.num_tokens + external
                    state.loaded = (hit.num_tokens, external)
                    self.engine.set_num_computed_tokens(rid, state.num_computed_tokens)
                    continue
                new = allocate(self.engine, admission)
                if new is None:
                    break
                self.waiting.pop(0)
                self.running.append(rid)
                state.holds_blocks = True
                state.num_computed_tokens = hit.num_tokens + external
                if external:
                    self._load(state, hit.num_tokens, hit.num_tokens + external)
                record.scheduled.append(
                    ScheduledRequest(
                        rid,
                        hit.num_tokens + external,
                        n,
                        hit.num_tokens,
                        new,
                        external_tokens=external,
                    )
                )
                budget -= n
        if self.on_scheduled is not None:
            self.on_scheduled(self, record)
        if self.mode.async_scheduling:
            record = self._plan(record)
            previous, self.in_flight = self.in_flight, record
            if previous is not None:
                self._process(previous, record)
        else:
            self._run(record)
        return record

    def _complete_loads(self, record: StepRecord) -> None:
        """Async loads: every load started in an earlier step completes now: its blocks
        are committed (``cache_blocks``) and the request runs, or, aborted during the
        load, is freed now."""
        failed: list[str] = []
        for rid in self.loading:
            state = self.requests[rid]
            assert state.loaded is not None
            attempt = state.num_load_attempts
            state.num_load_attempts += 1
            if self.mode.load_failures and load_fails(rid, attempt):
                self._fail_load(state)
                if state.release is not None:
                    self._forget(rid)
                else:
                    failed.append(rid)
                continue
            self._load(state, state.loaded[0], state.num_computed_tokens)
            self.engine.cache_blocks(rid, state.num_computed_tokens)
            if state.release is not None:
                self._free(state)
                self._forget(rid)
            else:
                self.running.append(rid)
        self.loading = []
        self.waiting[0:0] = failed

    def _fail_load(self, state: RequestState) -> None:
        """``load_failures``: the whole load failed (vLLM's failed receive, ``recompute``
        policy): computed tokens back to 0, the blocks freed uncached (nothing of the load
        was written, so nothing is offloaded either); the caller queues it again."""
        state.num_computed_tokens = 0
        self.engine.set_num_computed_tokens(state.request_id, 0)
        state.loaded = None
        self._free(state)
        state.holds_blocks = False

    def _victim(self, current: int) -> str | None:
        """The request to preempt: the newest running one (asynchronous scheduling: the
        newest with nothing in flight among those not scheduled yet in this step, from
        index ``current`` on, or None)."""
        if not self.mode.async_scheduling:
            return self.running[-1]
        idle = [r for r in self.running[current:] if self.requests[r].num_in_flight == 0]
        return idle[-1] if idle else None

    def _end(self, state: RequestState) -> int:
        """The position scheduling may reach: every known token (synchronous), plus the
        pending sampled ones (asynchronous; none once every output is sampled)."""
        if not self.mode.async_scheduling:
            return state.num_tokens
        if state.release is not None:
            return state.num_computed_tokens
        if not state.output:
            return len(state.input.prompt_token_ids)
        if state.num_generated + state.num_pending < len(state.output):
            return state.num_tokens + state.num_pending
        return state.num_computed_tokens

    def _plan(self, record: StepRecord) -> StepRecord:
        """Asynchronous scheduling: computed tokens advance now, the tokens join the
        flight, a chunk reaching the last known (or pending) token samples an output."""
        planned = []
        for item in record.scheduled:
            state = self.requests[item.request_id]
            end = item.start + item.num_tokens
            samples = (
                bool(state.output)
                and end == state.num_tokens + state.num_pending
                and state.num_generated + state.num_pending < len(state.output)
            )
            state.num_in_flight += item.num_tokens
            state.num_pending += int(samples)
            self.engine.set_in_flight(item.request_id, state.num_in_flight, state.num_pending)
            state.num_computed_tokens = end
            self.engine.set_num_computed_tokens(item.request_id, end)
            planned.append(replace(item, samples=samples))
        record.scheduled = planned
        return record

    def _process(self, previous: StepRecord, record: StepRecord) -> None:
        """Asynchronous scheduling: the previous step's output is processed (its finished
        requests are reported in ``record``, the step being planned now)."""
        for item in previous.scheduled:
            rid = item.request_id
            state = self.requests[rid]
            state.num_in_flight -= item.num_tokens
            if item.samples:
                state.num_pending -= 1
                if state.release is None:
                    token = state.output[state.num_generated]
                    state.num_generated += 1
                    self.engine.append_output_tokens(rid, [token])
            self.engine.set_in_flight(rid, state.num_in_flight, state.num_pending)
            if item.samples and state.release is None:
                self.engine.cache_blocks(rid, state.num_computed_tokens - state.num_in_flight)
            self._detach(state)
            if (
                state.release is None
                and state.num_generated >= len(state.output)
                and state.num_computed_tokens >= len(state.input.prompt_token_ids)
            ):
                state.release = "finish"
            if state.release is not None and state.num_in_flight == 0:
                if state.holds_blocks:
                    self._free(state)
                self._forget(rid)
                if state.release == "finish":
                    self.finished.append(rid)
                    record.finished.append(rid)

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
                drafts = self._drafts(state, n, budget)
                if drafts:
                    self.engine.set_in_flight(rid, 0, drafts)
                items.append(SlotRequest(rid, n + drafts, lookahead))
                budget -= n + drafts
        results = self.engine.schedule_step(items)
        return {item.request_id: r for item, r in zip(items, results)}

    def _chunk(self, state: RequestState, start: int, budget: int) -> int:
        """Tokens to schedule from ``start``: ``min(left, budget)``; with a Mamba group, a
        prefill chunk ending before ``max(P, N - 1)`` is cut back to a multiple of the
        Mamba block size (possibly to 0: the request waits for a larger budget), so
        that every state the manager caches at a block boundary is really written
        there. Example: Mamba bs 4, prefill from 0 with budget 6 -> 4 tokens."""
        n = min(self._end(state) - start, budget)
        if self.mamba_block_size is None:
            return n
        prefill_end = max(len(state.input.prompt_token_ids), state.num_tokens - 1)
        if start >= prefill_end or start + n >= prefill_end:
            return n
        bs = self.mamba_block_size
        return (start + n) // bs * bs - start

    def _drafts(self, state: RequestState, n: int, budget: int) -> int:
        """Draft tokens a decode step adds (speculative decoding): up to
        ``num_draft_tokens``, never past the request's last output or the budget, and
        none with a Mamba group."""
        k = self.mode.num_draft_tokens
        decoding = state.num_computed_tokens == state.num_tokens - 1 and state.num_generated > 0
        if not k or not decoding or n != 1 or self.mamba_block_size is not None:
            return 0
        room = min(
            len(state.output) - state.num_generated - 1,
            budget - 1,
            self.layout.max_model_len - state.num_tokens,
        )
        return max(0, min(k, room))

    @staticmethod
    def accepted_drafts(request_id: str, position: int, num_drafts: int) -> int:
        """How many of ``num_drafts`` drafts the step accepts: a deterministic function of
        the request and the position (``sha256``), uniform over ``0..num_drafts``."""
        digest = hashlib.sha256(f"{request_id}:{position}".encode()).digest()
        return int.from_bytes(digest[:4], "big") % (num_drafts + 1)

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
        for item, update, done in plan:
            if update is None:
                self._run_drafts(item, self.requests[item.request_id], record)
                continue
            rid = update.request_id
            if not self.commits:
                self.engine.set_num_computed_tokens(rid, update.num_computed_tokens)
                if update.output_token is not None:
                    self.engine.append_output_tokens(rid, [update.output_token])
            if update.output_token is not None and self.mode.num_draft_tokens:
                self.engine.cache_blocks(rid, update.num_computed_tokens)
            if done:
                self._free(self.requests[rid])
                self._forget(rid)
                self.finished.append(rid)
                record.finished.append(rid)
        for item in record.scheduled:
            state = self.requests.get(item.request_id)
            if state is not None:
                self._detach(state)

    def _run_drafts(self, item: ScheduledRequest, state: RequestState, record: StepRecord) -> None:
        """A decode step with drafts ran: ``a`` accepted, the rest rolled back."""
        rid = item.request_id
        accepted = self.accepted_drafts(rid, item.start, item.num_drafts)
        state.num_computed_tokens = item.start + 1 + accepted
        self.engine.set_num_computed_tokens(rid, state.num_computed_tokens)
        self.engine.set_in_flight(rid, 0, 0)
        new = state.output[state.num_generated : state.num_generated + accepted + 1]
        state.num_generated += len(new)
        self.engine.append_output_tokens(rid, list(new))
        self.engine.cache_blocks(rid, state.num_computed_tokens)
        if state.num_generated >= len(state.output):
            self._free(state)
            self._forget(rid)
            self.finished.append(rid)
            record.finished.append(rid)

    # -- helpers -------------------------------------------------------------------
    def _state(self, request_id: str, what: str) -> RequestState:
        state = self.requests.get(request_id)
        if state is None:
            raise TraceError(f"{what}: unknown request {request_id!r}")
        return state

    def _preempt(self, request_id: str) -> None:
        state = self.requests[request_id]
        self._free(state)
        state.loaded = None
        state.holds_blocks = False
        state.num_computed_tokens = 0
        state.num_preemptions += 1
        self.engine.set_num_computed_tokens(request_id, 0)
        self.running.remove(request_id)
        self.waiting.insert(0, request_id)

    def _free(self, state: RequestState) -> None:
        """Free a request's blocks; with a host tier, every full computed block of its
        table is offloaded there first (the blocks leave the primary pool)."""
        if self.host_tier is not None and state.holds_blocks:
            processed = state.num_computed_tokens - state.num_in_flight
            table = self.engine.get_block_ids(state.request_id)
            for gid, row in enumerate(table):
                bs = self.layout.groups[gid].spec.block_size
                first = state.detached[gid] if state.detached else 0  # stored at detach
                for k in range(first, min(len(row), processed // bs)):
                    self._offload(state, gid, k, row[k])
        state.detached = []
        self.engine.free(state.request_id)

    def _detach(self, state: RequestState) -> None:
        """External hits: offload the sliding-window and chunked-local blocks that fell
        below their group's skip boundary on the processed basis since the last call
        (:func:`reference.host_tier.num_detached_blocks`; the engine releases them at the
        request's next allocation, so they still hold their content now)."""
        if self.host_tier is None or not state.holds_blocks:
            return
        processed = state.num_computed_tokens - state.num_in_flight
        groups = range(len(self.layout.groups))
        if not state.detached:
            state.detached = [0 for _ in groups]
        table: BlockIds | None = None
        for gid in groups:
            n = num_detached_blocks(self.layout, gid, processed)
            if n <= state.detached[gid]:
                continue
            if table is None:
                table = self.engine.get_block_ids(state.request_id)
            row = table[gid]
            for k in range(state.detached[gid], min(n, len(row))):
                self._offload(state, gid, k, row[k])
            state.detached[gid] = n

    def _offload(self, state: RequestState, group_id: int, block_index: int, block: int) -> None:
        """One block leaves the primary pool for the host tier (null entries hold nothing)."""
        if block == NULL_BLOCK_ID:
            return
        assert self.host_tier is not None
        req = state.input
        self.host_tier.offload(
            group_id, req.cache_salt, req.lora_name, state.token_ids, block_index
        )
        if self.on_offload is not None:
            self.on_offload(state, group_id, block_index, block)

    def _load(self, state: RequestState, start: int, end: int) -> None:
        """The connector loads positions ``[start, end)`` into the request's blocks."""
        if self.on_load is not None:
            self.on_load(state, start, end)

    def _external_tokens(self, state: RequestState, device_tokens: int) -> int:
        """External hits: the tokens the host tier holds beyond the device hit."""
        if self.host_tier is None:
            return 0
        req = state.input
        return self.host_tier.num_external_tokens(
            req.cache_salt, req.lora_name, state.token_ids, device_tokens
        )

    def _forget(self, request_id: str) -> None:
        self.engine.remove_request(request_id)
        self.requests.pop(request_id, None)
        for queue in (self.running, self.waiting):
            if request_id in queue:
                queue.remove(request_id)

    def is_idle(self) -> bool:
        return (
            not self.running
            and not self.waiting
            and not self.loading
            and not self.in_flight_requests()
        )

    def in_flight_requests(self) -> list[str]:
        """Requests with tokens in flight (asynchronous scheduling)."""
        return [r for r, s in self.requests.items() if s.num_in_flight > 0]

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
