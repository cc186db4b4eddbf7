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

Worked example: vLLM's scheduler passes ``num_lookahead_tokens=2`` too many to
``allocate_slots`` for a running request at position 7 (bs 4): vLLM's table gets block
3 for positions 8..9 that the reference does not allocate; after the step the block
tables differ (``r0 group 0: engine (1, 2, 3), reference (1, 2)``) and the free counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from properties.core.decisions import StepDecisions
from properties.core.engine import KVCacheEngine
from properties.core.modes import ServingMode
from properties.core.trace import Abort, Arrive, Operation, Preempt, ResetPrefixCache, Step, Trace
from properties.engines.reference import make_engine as make_reference
from properties.runner.async_scheduler import AsyncScheduler
from properties.runner.scheduler import Drafts, RequestState, Scheduler, StepRecord
from reference.errors import KVConformError
from reference.layout import KVCacheLayout


class DecisionMismatch(KVConformError):
    """The engine's scheduler and the reference disagree (the message says where)."""


class DecidedScheduler(Scheduler):
    """kvconform's scheduler with the engine's decisions (see the module docstring).

    Example: ``DecidedScheduler(engine, layout, ServingMode()).step_as(StepDecisions((
    ScheduledDecision("r0", 0, 8),)), 64)`` admits ``r0`` with 8 tokens whatever the
    budget rule would give, and fails if ``r0``'s hit is not 0. With
    ``mode.async_scheduling`` use :func:`decided_scheduler` (the same overrides on
    :class:`AsyncScheduler`)."""

    def __init__(self, engine: KVCacheEngine, layout: KVCacheLayout, mode: ServingMode) -> None:
        super().__init__(engine, layout, mode, on_scheduled=self._check_scheduled)
        self._decisions = StepDecisions()
        self._victims: list[str] = []

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
            return 0
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

    Example: ``r1`` (8 tokens in flight, blocks 3-4) is aborted: the reference frees
    blocks 3-4 at once (2 more free blocks, as vLLM's ``finish_requests``), and the
    next step's processing skips ``r1``."""

    def _defers_abort(self, state: RequestState) -> bool:
        """Never: released at once (see the class docstring)."""
        return False

    def preempt(self, request_id: str) -> None:
        """A trace's ``Preempt`` of a running request, at once also with tokens in flight
        (stale output, as the engine's own preemptions)."""
        if request_id in self.running:
            self._preempt(request_id)


def decided_scheduler(
    engine: KVCacheEngine, layout: KVCacheLayout, mode: ServingMode
) -> DecidedScheduler:
    """The decided scheduler for ``mode`` (asynchronous or not)."""
    cls = DecidedAsyncScheduler if mode.async_scheduling else DecidedScheduler
    return cls(engine, layout, mode)


@dataclass(frozen=True)
class View:
    """Per live request its block ids and computed tokens, and the free block count."""

    block_ids: dict[str, tuple[tuple[int, ...], ...]]
    num_computed_tokens: dict[str, int]
    num_free_blocks: int


def reference_view(scheduler: DecidedScheduler) -> View:
    """The reference side's :class:`View`."""
    engine = scheduler.engine
    blocks = {rid: tuple(map(tuple, engine.get_block_ids(rid))) for rid in scheduler.requests}
    computed = {rid: s.num_computed_tokens for rid, s in scheduler.requests.items()}
    return View(blocks, computed, engine.num_free_blocks())


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


#: ``make_harness(layout, num_draft_tokens=, admission_gate=, accepted=)``: the engine side.
HarnessFactory = Callable[..., Any]


def run_decided(trace: Trace, make_harness: HarnessFactory) -> int:
    """Run ``trace`` on the engine's scheduler and on :class:`DecidedScheduler` over the
    reference; raises :class:`DecisionMismatch` at the first disagreement, returns the
    number of steps run. ``trace.mode`` gives drafts and the admission gate."""
    mode = ServingMode(
        async_scheduling=trace.mode.async_scheduling,
        admission_gate=trace.mode.admission_gate,
        num_draft_tokens=trace.mode.num_draft_tokens,
    )
    harness = make_harness(
        trace.layout,
        num_draft_tokens=mode.num_draft_tokens,
        admission_gate=mode.admission_gate,
        accepted=Drafts.accepted_drafts,
        asynchronous=mode.async_scheduling,
    )
    # the reference bounds unprocessed tokens as the engine does (vLLM: batches in
    # flight x the budget cap; the layout's default is max_model_len)
    layout = replace(trace.layout, max_in_flight_tokens=harness.max_in_flight_tokens)
    ref = decided_scheduler(make_reference(layout), layout, mode)
    for index, op in enumerate(trace.operations):
        _apply(harness, ref, op, index)
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
        mine, theirs = harness.reset_prefix_cache(), ref.engine.reset_prefix_cache()
        if mine != theirs:
            raise DecisionMismatch(
                f"{where}: reset_prefix_cache returned {mine} on the engine, {theirs} on "
                "the reference"
            )
    elif isinstance(op, Step):
        decisions = harness.step(op.token_budget)
        ref.step_as(decisions, op.token_budget)
        where = f"{where}, step {ref.num_steps} ({decisions.describe()})"
    compare_views(harness.view(), reference_view(ref), where)


__all__ = [
    "DecidedAsyncScheduler",
    "DecidedScheduler",
    "DecisionMismatch",
    "decided_scheduler",
    "View",
    "compare_views",
    "reference_view",
    "run_decided",
]
