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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from properties.core.engine import (
    BlockIds,
    CacheHit,
    KVCacheEngine,
    PlansSteps,
    RequestInput,
    SlotRequest,
)
from properties.core.trace import Abort, Arrive, Operation, Preempt, ResetPrefixCache, Step
from reference.errors import KVConformError
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


@dataclass
class StepRecord:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)


#: Called after scheduling and before the step runs: (scheduler, record).
StepObserver = Callable[["Scheduler", StepRecord], None]


class Scheduler:
    """Turns trace operations into engine calls (see the module docstring)."""

    def __init__(
        self, engine: KVCacheEngine, layout: KVCacheLayout, on_scheduled: StepObserver | None = None
    ) -> None:
        self.engine = engine
        self.layout = layout
        self.on_scheduled = on_scheduled
        self.requests: dict[str, RequestState] = {}
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.finished: list[str] = []
        mamba_sizes = [s.block_size for s in layout.specs if isinstance(s, MambaSpec)]
        self.mamba_block_size = max(mamba_sizes) if mamba_sizes else None
        self.num_steps = 0
        #: Running requests are allocated in batches when the engine plans steps.
        self.batched = isinstance(engine, PlansSteps)

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
        if state.holds_blocks:
            self.engine.free(request_id)
        self._forget(request_id)

    def preempt(self, request_id: str) -> None:
        if request_id not in self.running:
            return
        self._preempt(request_id)

    # -- the step ------------------------------------------------------------------
    def step(self, token_budget: int, num_lookahead_tokens: int = 0) -> StepRecord:
        if token_budget < 1:
            raise TraceError(f"Step.token_budget must be >= 1, got {token_budget}")
        self.num_steps += 1
        self.engine.new_step()
        record = StepRecord()
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
            new = None
            first_try = True
            while True:
                if first_try and self.batched and rid not in planned:
                    planned = self._plan_running(i, budget, num_lookahead_tokens)
                if first_try and rid in planned:
                    new = planned.pop(rid)
                else:
                    new = self.engine.allocate_slots(rid, n, 0, None, num_lookahead_tokens)
                first_try = False
                if new is not None:
                    break
                victim = self.running[-1]
                self._preempt(victim)
                record.preempted.append(victim)
                if victim == rid:
                    break
            if new is None:
                continue
            record.scheduled.append(ScheduledRequest(rid, state.num_computed_tokens, n, 0, new))
            budget -= n
            i += 1
        if not record.preempted:
            while self.waiting and budget > 0:
                rid = self.waiting[0]
                state = self.requests[rid]
                hit = self.engine.get_computed_blocks(rid)
                n = self._chunk(state, hit.num_tokens, budget)
                if n <= 0:
                    break
                new = self.engine.allocate_slots(rid, n, hit.num_tokens, hit, num_lookahead_tokens)
                if new is None:
                    break
                self.waiting.pop(0)
                self.running.append(rid)
                state.holds_blocks = True
                state.num_computed_tokens = hit.num_tokens
                record.scheduled.append(
                    ScheduledRequest(rid, hit.num_tokens, n, hit.num_tokens, new)
                )
                budget -= n
        if self.on_scheduled is not None:
            self.on_scheduled(self, record)
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
                items.append(SlotRequest(rid, n, lookahead))
                budget -= n
        results = self.engine.schedule_step(items)
        return {item.request_id: r for item, r in zip(items, results)}

    def _chunk(self, state: RequestState, start: int, budget: int) -> int:
        """Tokens to schedule from ``start``: ``min(left, budget)``; with a Mamba group, a
        prefill chunk ending before ``max(P, N - 1)`` is cut back to a multiple of the
        Mamba block size (possibly to 0: the request waits for a larger budget), so
        that every state the manager caches at a block boundary is really written
        there. Example: Mamba bs 4, prefill from 0 with budget 6 -> 4 tokens."""
        n = min(state.num_tokens - start, budget)
        if self.mamba_block_size is None:
            return n
        prefill_end = max(len(state.input.prompt_token_ids), state.num_tokens - 1)
        if start >= prefill_end or start + n >= prefill_end:
            return n
        bs = self.mamba_block_size
        return (start + n) // bs * bs - start

    def _run(self, record: StepRecord) -> None:
        for item in record.scheduled:
            state = self.requests[item.request_id]
            state.num_computed_tokens = item.start + item.num_tokens
            self.engine.set_num_computed_tokens(item.request_id, state.num_computed_tokens)
            if state.num_computed_tokens < state.num_tokens:
                continue
            if state.num_generated < len(state.output):
                token = state.output[state.num_generated]
                state.num_generated += 1
                self.engine.append_output_tokens(item.request_id, [token])
            if state.num_generated >= len(state.output):
                self.engine.free(item.request_id)
                self._forget(item.request_id)
                self.finished.append(item.request_id)
                record.finished.append(item.request_id)

    # -- helpers -------------------------------------------------------------------
    def _state(self, request_id: str, what: str) -> RequestState:
        state = self.requests.get(request_id)
        if state is None:
            raise TraceError(f"{what}: unknown request {request_id!r}")
        return state

    def _preempt(self, request_id: str) -> None:
        state = self.requests[request_id]
        self.engine.free(request_id)
        state.holds_blocks = False
        state.num_computed_tokens = 0
        state.num_preemptions += 1
        self.engine.set_num_computed_tokens(request_id, 0)
        self.running.remove(request_id)
        self.waiting.insert(0, request_id)

    def _forget(self, request_id: str) -> None:
        self.engine.remove_request(request_id)
        self.requests.pop(request_id, None)
        for queue in (self.running, self.waiting):
            if request_id in queue:
                queue.remove(request_id)

    def is_idle(self) -> bool:
        return not self.running and not self.waiting

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
