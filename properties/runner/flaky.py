"""A failure that did not repeat: reported as the failure it was, never as Hypothesis'.

Hypothesis replays a failing example to shrink it; when the replay passes (an ``exec:``
engine that sends garbage after N calls over its whole life, exits or segfaults, an
adapter that leaks until ``MemoryError``) it raises one of its ``Flaky`` errors
(``FlakyFailure``, ``FlakyStrategyDefinition``, ...), which says nothing about the
engine. :func:`not_reproduced` turns such an error back into the first failure the run
recorded (its trace holds the call, the message with the engine's stderr tail, and the
operations), with a note that it did not reproduce.

Worked example: a run whose first failure was ``EngineError("engine: new_step() ...
exited with code 1; stderr: boom")`` and that ended in ``FlakyFailure`` gives
``Unrepeated("engine", "EngineError: engine: new_step() ...", trace, NOTE)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis.errors import Flaky

from properties.core.outcome import Outcome
from properties.core.trace import Trace

#: The note a result carries when its failure did not repeat.
NOTE = (
    "the failure did not reproduce when Hypothesis replayed it (it depends on more than "
    "this trace: the engine's state over its lifetime, memory, time); this is the first "
    "failure recorded, and its trace is saved as it ran"
)


@dataclass(frozen=True)
class Unrepeated:
    """The first failure of a run whose replay passed: its kind, text and trace."""

    kind: str
    failure: str
    trace: Trace
    note: str = NOTE


def is_flaky(exc: BaseException) -> bool:
    """Whether ``exc`` (or the first of a group) is one of Hypothesis' Flaky errors."""
    if isinstance(exc, Flaky):
        return True
    inner = getattr(exc, "exceptions", None)
    return bool(inner) and is_flaky(inner[0])


def not_reproduced(exc: BaseException, first: Trace | None) -> Unrepeated | None:
    """The first recorded failure, when ``exc`` is Hypothesis saying it did not repeat
    and a failing trace was recorded; else None (classify ``exc`` as usual)."""
    if not is_flaky(exc) or first is None or not first.failure:
        return None
    info = first.failure
    kind = Outcome.from_kind(info.get("kind")).kind
    return Unrepeated(kind, f"{info.get('property')}: {info.get('message')}", first)
