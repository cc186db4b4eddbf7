"""What an engine's own scheduler decided in one step: the scheduler level's common ground.

The scheduler level (:mod:`properties.engines.vllm_scheduler` drives vLLM's ``Scheduler``,
:mod:`properties.runner.decided` replays its decisions on the reference) compares two
cache managers driven by two schedulers *on the same decisions*. The decisions are what
a scheduler chooses, never the arguments it passes to its cache manager (those are what
the level checks):

* ``scheduled``: the requests that run in the step, in scheduling order, each with its
  computed tokens when it was scheduled (``start``; for a request admitted in the step:
  its prefix-cache hit), the tokens it computes (drafts included) and its drafts;
* ``preempted``: the requests preempted to make room, in order;
* ``connector_events`` (with a KV connector): the admission phase's connector events in
  order (:class:`ConnectorEvent`): an asynchronous load completed, and every admission's
  allocation with the blocks and external tokens the connector was told.

Worked example: a step that runs ``r0``'s decode at position 9 with 2 drafts and admits
``r1`` (8 prompt tokens, a 4-token hit), preempting ``r2``, is
``StepDecisions((ScheduledDecision("r0", 9, 3, 2), ScheduledDecision("r1", 4, 4)),
preempted=("r2",))``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledDecision:
    """One request's share of a step: ``num_tokens`` from ``start``, ``num_drafts`` of
    them draft tokens, ``num_accepted`` of those accepted."""

    request_id: str
    start: int
    num_tokens: int
    num_drafts: int = 0
    #: drafts the step accepts (the model's verdict, the same on both sides)
    num_accepted: int = 0


#: :attr:`ConnectorEvent.kind` of an asynchronous load the scheduler completes (cached, or
#: freed when it failed) before it handles the request again
PROMOTE = "promote"
#: :attr:`ConnectorEvent.kind` of an admission's allocation (``update_state_after_alloc``)
ALLOCATED = "allocated"


@dataclass(frozen=True)
class ConnectorEvent:
    """One event of a step's admission phase with a KV connector: ``PROMOTE`` (the load
    of ``request_id`` is completed) or ``ALLOCATED`` (it was allocated; the connector
    was told ``block_ids`` and ``external_tokens``, loaded asynchronously or not).

    Example: ``ConnectorEvent(ALLOCATED, "r1", 8, True, ((1, 2, 3),))``: ``r1`` starts an
    asynchronous load of 8 tokens into blocks 1-3."""

    kind: str
    request_id: str
    external_tokens: int = 0
    asynchronous: bool = False
    block_ids: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class StepDecisions:
    """One step's decisions (see the module docstring)."""

    scheduled: tuple[ScheduledDecision, ...] = ()
    preempted: tuple[str, ...] = ()
    #: draft tokens each running request carried into the step (the drafter's last
    #: proposal): what a request the engine preempted instead of scheduling tried to run
    proposed_drafts: tuple[tuple[str, int], ...] = ()
    #: the admission phase's KV connector events, in order (none without a connector)
    connector_events: tuple[ConnectorEvent, ...] = ()
    #: running requests whose allocation failed with no victim taken for them (the
    #: engine stopped instead: a victim with tokens in flight under deferred frees, a
    #: connector's pending frees), neither scheduled nor preempted, in order
    failed_allocations: tuple[str, ...] = ()
    #: requests the engine ended with an error when this step's output (asynchronous:
    #: the previous step's) was processed, in order: a grammar rejected a sampled token
    #: (a request that ran) or failed to compile (a waiting one)
    grammar_errors: tuple[str, ...] = ()
    #: the requests the engine reported ended with this step's output processing (since
    #: its previous report), sorted; None when it reports none (no output processed, or
    #: not asked to)
    finished_reported: tuple[str, ...] | None = None

    def of(self, request_id: str) -> ScheduledDecision | None:
        """The decision for ``request_id`` (None: not scheduled in this step)."""
        for item in self.scheduled:
            if item.request_id == request_id:
                return item
        return None

    def describe(self) -> str:
        """One line, e.g. ``r0+3(2 drafts)@9 r1+4@4; preempted r2``."""
        parts = [
            f"{d.request_id}+{d.num_tokens}"
            + (f"({d.num_drafts} drafts)" if d.num_drafts else "")
            + f"@{d.start}"
            for d in self.scheduled
        ]
        text = " ".join(parts) or "nothing scheduled"
        if self.preempted:
            text += "; preempted " + ", ".join(self.preempted)
        for e in self.connector_events:
            if e.kind == PROMOTE:
                text += f"; {e.request_id}'s load completed"
            elif e.external_tokens:
                how = "asynchronously" if e.asynchronous else "synchronously"
                text += f"; {e.request_id} loads {e.external_tokens} tokens {how}"
        return text


@dataclass(frozen=True)
class Accounting:
    """A scheduler's request accounting between steps, as vLLM's engine core reads it
    (``get_request_counts``, ``has_finished_requests``): running requests; waiting ones
    (loading from a KV connector included); and whether a request ended (finished or
    aborted) since the last step was scheduled, or ended and is still kept by a
    connector (a save or a load not reported yet).

    Example: ``r0`` running, ``r1`` waiting for its asynchronous load, ``r2`` aborted
    since the last step: ``Accounting(1, 1, True)``."""

    num_running: int
    num_waiting: int
    has_finished: bool


__all__ = [
    "ALLOCATED",
    "PROMOTE",
    "Accounting",
    "ConnectorEvent",
    "ScheduledDecision",
    "StepDecisions",
]
