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

A request is never freed, preempted or aborted while tokens of it are in flight: a finish
or an ``Abort`` is deferred until its last step is processed (``release``), a ``Preempt``
of it is ignored, and allocation failures only preempt requests with nothing in flight
among those not scheduled yet in the step (otherwise the request waits a step,
:meth:`AsyncScheduler._victim`). Scheduling reaches the known tokens plus the pending
ones (:meth:`AsyncScheduler._end`); blocks are freed on the processed basis
``num_computed_tokens - num_in_flight``.

Worked example (a 6-token prompt with one output token, budget 8): step 1 plans the
prefill (computed 6, in flight 6, one pending token); step 2 plans position 6 (computed 7,
in flight 7), then step 1's output is processed (in flight 1, the token is appended,
pending 0 + 1 for step 2's own sample); step 3 plans nothing, processes step 2 and
finishes the request.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from properties.core.engine import KVCacheEngine
from properties.core.modes import ServingMode
from properties.runner.connector import Connector
from properties.runner.scheduler import RequestState, Scheduler, StepObserver, StepRecord
from reference.layout import KVCacheLayout


@dataclass
class AsyncRequestState(RequestState):
    """A request under asynchronous scheduling: tokens planned but not processed, sampled
    tokens not appended yet, and a deferred release (``"finish"`` or ``"abort"``)
    waiting for the flight."""

    num_in_flight: int = 0
    num_pending: int = 0
    release: str | None = None


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
            state = self._async_state(rid)
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
            self._output_processed(state)
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
