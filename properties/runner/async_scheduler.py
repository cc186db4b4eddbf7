"""Asynchronous scheduling (``async_scheduling``): step ``N + 1`` is planned before step
``N``'s output is processed, as a deployed vLLM does.

:class:`AsyncScheduler` keeps the synchronous rules of
:class:`properties.runner.scheduler.Scheduler` and splits rule 4 (the step runs) in two:

* **Plan** (:meth:`AsyncScheduler._plan`). After scheduling, each scheduled request's
  computed tokens advance at once (optimistically) and its tokens join the flight; a
  chunk that reaches the last known token samples an output, which stays *pending* (a
  placeholder the next step can already schedule) until processed
  (``set_in_flight(id, in_flight, pending)``, then ``set_num_computed_tokens``).
* **Process** (:meth:`AsyncScheduler._process`). Then the *previous* step's output is
  processed: its tokens leave the flight, its sampled tokens are appended, the processed
  tokens are committed (``cache_blocks(id, computed - in_flight)``, as vLLM's
  ``update_from_output`` does for requests with placeholders), the connector's *output
  processed* hook runs, and requests that finished are freed.

kvconform's own rules never free, preempt or abort a request while tokens of it are in
flight: a finish or an ``Abort`` is deferred until its last step is processed
(``release``), a ``Preempt`` of it is ignored, and allocation failures only preempt
requests with nothing in flight among those not scheduled yet in the step (otherwise the
request waits a step, :meth:`AsyncScheduler._victim`). Scheduling reaches the known
tokens plus the pending ones (:meth:`AsyncScheduler._end`); blocks are freed on the
processed basis ``num_computed_tokens - num_in_flight``.

**Stale output** (a subclass that takes an engine's victims and ``Preempt`` timing, as
vLLM's scheduler does: :class:`properties.runner.decided.DecidedAsyncScheduler`). A
request preempted with tokens in flight is preempted at once (blocks freed, computed
tokens 0, pending tokens dropped) and its in-flight tokens become *stale*
(``num_stale``): when their step is processed they leave the flight and a sampled token
is still appended (the model did sample it), but nothing is committed (no
``cache_blocks``); the request is not re-admitted while stale tokens are in flight (it
keeps its place at the head of the waiting queue, later requests may pass it); if the
stale token was its last output (or the stale step completed the prompt of a request
with no output) it finishes there.

Worked example (a 6-token prompt with one output token, budget 8): step 1 plans the
prefill (computed 6, in flight 6, one pending token); step 2 plans position 6 (computed 7,
in flight 7), then step 1's output is processed (in flight 1, the token is appended,
pending 0 + 1 for step 2's own sample); step 3 plans nothing, processes step 2 and
finishes the request.

Worked example of stale output (bs 2, 6 usable blocks, budget 16; ``r0`` and ``r1``:
prompt 4, 6 outputs each; ``tests/properties/engines/test_vllm_scheduler.py``): steps
1-3 leave ``r0`` (1, 2, 5) and ``r1`` (3, 4, 6) at computed 6, 0 free, each with its
step-3 token in flight. Step 4: ``r0`` at position 6 needs a block; the engine preempts
``r1`` (stale 1): its blocks go back at once (6, not cached, to the front), ``r0`` takes
6, 2 free. Step 3 is then processed: ``r1``'s stale token is appended (3 outputs),
nothing is cached, stale 0, and ``r1`` waits with nothing in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from properties.core.engine import KVCacheEngine
from properties.core.modes import ServingMode
from properties.runner.connector import Connector
from properties.runner.scheduler import (
    RequestState,
    ScheduledRequest,
    Scheduler,
    StepObserver,
    StepRecord,
)
from reference.layout import KVCacheLayout


@dataclass
class AsyncRequestState(RequestState):
    """A request under asynchronous scheduling: tokens planned but not processed, sampled
    tokens not appended yet, and a deferred release (``"finish"`` or ``"abort"``)
    waiting for the flight."""

    num_in_flight: int = 0
    num_pending: int = 0
    release: str | None = None
    #: in-flight tokens of a preemption (their output is appended, nothing committed)
    num_stale: int = 0
    #: the stale output is dropped instead (a preemption that resets the prefix cache):
    #: nothing of it is appended, and the request may run again before it drains
    drop_stale: bool = False


class AsyncScheduler(Scheduler):
    """The scheduler of ``async_scheduling`` (see the module docstring)."""

    asynchronous = True
    state_type = AsyncRequestState

    def __init__(
        self,
        engine: KVCacheEngine,
        layout: KVCacheLayout,
        mode: ServingMode,
        on_scheduled: StepObserver | None = None,
        connector: Connector | None = None,
    ) -> None:
        super().__init__(engine, layout, mode, on_scheduled, connector)
        #: the planned step whose output is not processed yet
        self.in_flight: StepRecord | None = None

    def _async_state(self, request_id: str) -> AsyncRequestState:
        state = self.requests[request_id]
        assert isinstance(state, AsyncRequestState)
        return state

    # -- operations ------------------------------------------------------------------
    def _defers_abort(self, state: RequestState) -> bool:
        """Tokens in flight: released once its last step is processed."""
        assert isinstance(state, AsyncRequestState)
        if state.num_in_flight > 0:
            state.release = "abort"
            return True
        return super()._defers_abort(state)

    def preempt(self, request_id: str) -> None:
        if request_id in self.running and self._async_state(request_id).num_in_flight > 0:
            return
        super().preempt(request_id)

    def _preempt(self, request_id: str) -> None:
        """Preempted at once; tokens in flight become stale (module docstring); an earlier
        dropped stale output not drained yet stays dropped."""
        state = self._async_state(request_id)
        super()._preempt(request_id)
        state.drop_stale = state.drop_stale and state.num_stale > 0
        state.num_stale = state.num_in_flight
        state.num_pending = 0
        if state.num_stale:
            self.engine.set_in_flight(request_id, state.num_in_flight, 0)

    def preempt_dropping(self, request_id: str) -> None:
        """Preempt a running request at once, its in-flight output to be dropped (a
        reset of the prefix cache that preempts every running request: vLLM's
        ``drop_stale_output``). Example: ``r0`` with position 9 in flight: freed now;
        when that step is processed no token is appended, and ``r0`` may be admitted
        again before."""
        state = self._async_state(request_id)
        self._preempt(request_id)
        state.drop_stale = True

    def _admit_waiting(self, record: StepRecord, budget: int, lookahead: int) -> None:
        """Rule 3 without the requests whose stale tokens are still in flight (they keep
        their places at the head of the queue), unless their stale output is dropped."""
        held = [
            r
            for r in self.waiting
            if self._async_state(r).num_stale > 0 and not self._async_state(r).drop_stale
        ]
        if not held:
            super()._admit_waiting(record, budget, lookahead)
            return
        self.waiting = [r for r in self.waiting if r not in held]
        try:
            super()._admit_waiting(record, budget, lookahead)
        finally:
            self.waiting = held + self.waiting

    def is_idle(self) -> bool:
        return super().is_idle() and not self.in_flight_requests()

    def in_flight_requests(self) -> list[str]:
        """Requests with tokens in flight."""
        return [r for r in self.requests if self._async_state(r).num_in_flight > 0]

    # -- the rules that differ -------------------------------------------------------------
    def _victim(self, current: int) -> str | None:
        """The newest running request with nothing in flight among those not scheduled yet
        in this step (from index ``current`` on), or None."""
        idle = [r for r in self.running[current:] if self._async_state(r).num_in_flight == 0]
        return idle[-1] if idle else None

    def _end(self, state: RequestState) -> int:
        """Every known token plus the pending sampled ones (none once every output is
        sampled; nothing more once a release is deferred)."""
        assert isinstance(state, AsyncRequestState)
        if state.release is not None:
            return state.num_computed_tokens
        if not state.output:
            return len(state.input.prompt_token_ids)
        if state.num_generated + state.num_pending < len(state.output):
            return state.num_tokens + state.num_pending
        return state.num_computed_tokens

    def _processed(self, state: RequestState) -> int:
        """Computed tokens not in flight."""
        assert isinstance(state, AsyncRequestState)
        return state.num_computed_tokens - state.num_in_flight

    def _end_step(self, record: StepRecord) -> StepRecord:
        """The step is planned; then the previous one is processed."""
        record = self._plan(record)
        previous, self.in_flight = self.in_flight, record
        if previous is not None:
            self._process(previous, record)
        return record

    # -- plan and process ----------------------------------------------------------------
    def _plan(self, record: StepRecord) -> StepRecord:
        """Computed tokens advance now, the tokens join the flight, a chunk reaching the
        last known (or pending) token samples an output."""
        planned = []
        for item in record.scheduled:
            state = self._async_state(item.request_id)
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
        """The previous step's output is processed (its finished requests are reported in
        ``record``, the step being planned now)."""
        for item in previous.scheduled:
            rid = item.request_id
            if rid not in self.requests:
                continue  # aborted at once while in flight (a subclass's rule)
            state = self._async_state(rid)
            state.num_in_flight -= item.num_tokens
            if state.num_stale > 0:
                self._process_stale(item, state, record)
                continue
            if item.samples:
                state.num_pending -= 1
                if state.release is None:
                    token = state.output[state.num_generated]
                    state.num_generated += 1
                    self.engine.append_output_tokens(rid, [token])
            self.engine.set_in_flight(rid, state.num_in_flight, state.num_pending)
            if item.samples and state.release is None:
                self.engine.cache_blocks(rid, state.num_computed_tokens - state.num_in_flight)
            self._output_processed(state)
            if (
                state.release is None
                and state.num_generated >= len(state.output)
                and state.num_computed_tokens >= len(state.input.prompt_token_ids)
            ):
                state.release = "finish"
            if state.release is not None and self._releasable(state):
                if state.holds_blocks:
                    self._free(state)
                self._forget(rid)
                if state.release == "finish":
                    self.finished.append(rid)
                    record.finished.append(rid)

    def _releasable(self, state: AsyncRequestState) -> bool:
        """Whether a request with a release is freed now: once nothing of it is in
        flight (a subclass may free some at once: an engine's error end)."""
        return state.num_in_flight == 0

    def _process_stale(
        self, item: ScheduledRequest, state: AsyncRequestState, record: StepRecord
    ) -> None:
        """Stale output (module docstring): the flight drains, a sampled token is
        appended, nothing is committed; the last output finishes the request."""
        rid = item.request_id
        state.num_stale -= item.num_tokens
        self.engine.set_in_flight(rid, state.num_in_flight, state.num_pending)
        if state.drop_stale:  # dropped: nothing appended, nothing ends
            return
        if item.samples:
            state.num_generated += 1
            self.engine.append_output_tokens(rid, [state.output[state.num_generated - 1]])
        # the step completed the prompt and every output is known (a request with no
        # output finishes after its prefill, as in the synchronous rule)
        completes = item.start + item.num_tokens >= len(state.input.prompt_token_ids)
        if completes and state.num_generated >= len(state.output) and state.num_in_flight == 0:
            self._forget(rid)
            self.finished.append(rid)
            record.finished.append(rid)
