"""What an engine's own scheduler decided in one step: the scheduler level's common ground.

The scheduler level (:mod:`properties.engines.vllm_scheduler` drives vLLM's ``Scheduler``,
:mod:`properties.runner.decided` replays its decisions on the reference) compares two
cache managers driven by two schedulers *on the same decisions*. The decisions are what
a scheduler chooses, never the arguments it passes to its cache manager (those are what
the level checks):

* ``scheduled``: the requests that run in the step, in scheduling order, each with its
  computed tokens when it was scheduled (``start``; for a request admitted in the step:
  its prefix-cache hit), the tokens it computes (drafts included) and its drafts;
* ``preempted``: the requests preempted to make room, in order.

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


@dataclass(frozen=True)
class StepDecisions:
    """One step's decisions (see the module docstring)."""

    scheduled: tuple[ScheduledDecision, ...] = ()
    preempted: tuple[str, ...] = ()
    #: draft tokens each running request carried into the step (the drafter's last
    #: proposal): what a request the engine preempted instead of scheduling tried to run
    proposed_drafts: tuple[tuple[str, int], ...] = ()

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
        return text


__all__ = ["ScheduledDecision", "StepDecisions"]
