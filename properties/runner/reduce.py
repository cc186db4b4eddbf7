"""The trace reducer: delta debugging after Hypothesis, keeping the same failing check.

Hypothesis shrinks the choices that generated a trace; what it returns can still hold
operations that play no part in the failure (a run of ``reset_prefix_cache``, a request
nobody reads), and its shrinking is bounded in time. :func:`reduce_trace` works on the
trace itself, replaying candidates with :func:`properties.runner.machine.replay_trace`
and keeping a candidate only when it fails with the **same check** (one bug, one name):

1. whole requests (every operation naming one request id);
2. operations, by delta debugging: chunks of half the trace, then quarters, ... then
   single operations, until no single operation can be removed;
3. prompt and output lengths of each arrival (shortest candidate first);
4. the layout's size: fewer blocks, then fewer groups.

The passes repeat until none changes the trace (or the time budget runs out); the
passes on sizes stop at :data:`RESERVE` of the budget, the rest is kept for the
operations. A reduction that finishes ends on a sweep of single-operation removals that
removes nothing: the trace holds no operation whose removal keeps the failure, which
:func:`is_one_minimal` checks. The operations after the failing
one are dropped (a replay stops at the failure).

Worked example: a trace ``arrive r0, reset, reset, step(8), reset, arrive r1, step(8)``
whose engine fails ``hit_soundness`` when ``r1`` hits ``r0``'s blocks reduces to
``arrive r0, step(8), arrive r1, step(8)``, with both prompts cut to the shortest
lengths that still give the bad hit.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from properties.core.engine import CallTimeoutError
from properties.core.trace import Arrive, Operation, Trace, validate_references
from properties.runner.config import CheckConfig
from properties.runner.run import engine_of, replay_trace

#: Default time budget of one reduction, seconds.
DEFAULT_REDUCE_SECONDS = 30.0
#: The share of the budget the passes on requests, lengths and the layout may use; the
#: rest is kept for removing operations (the one guarantee a reduced trace gives).
RESERVE = 0.7


def failure_name(exc: BaseException) -> str:
    """The name a failure is reported under: the check's (``PropertyViolation.name``), or
    the error's type for an engine that broke the protocol."""
    return getattr(exc, "name", type(exc).__name__)


@dataclass(frozen=True)
class TraceSize:
    """How big a trace is: operations, requests, prompt and output tokens, blocks."""

    operations: int
    requests: int
    tokens: int
    blocks: int

    @classmethod
    def of(cls, trace: Trace) -> TraceSize:
        arrivals = [op for op in trace.operations if isinstance(op, Arrive)]
        return cls(
            len(trace.operations),
            len(arrivals),
            sum(len(a.prompt) + len(a.output) for a in arrivals),
            trace.layout.num_blocks,
        )

    def __str__(self) -> str:
        return (
            f"{self.operations} ops, {self.requests} requests, {self.tokens} tokens, "
            f"{self.blocks} blocks"
        )


class _Oracle:
    """Replays candidates; remembers the last trace that failed with ``check``."""

    def __init__(
        self,
        trace: Trace,
        check: str,
        config: CheckConfig,
        factory: Callable | None,
        deadline: float,
    ) -> None:
        self.check = check
        self.config = config
        self.engine = engine_of(config, factory)
        self.deadline = deadline
        self.best = trace
        self.replays = 0

    def out_of_time(self) -> bool:
        return time.perf_counter() > self.deadline

    def failing(self, candidate: Trace) -> Trace | None:
        """``candidate`` as replayed (operations up to the failing one, the calls seen and
        the failure) when it fails with the same check, else None."""
        try:
            validate_references(candidate.operations)
        except Exception:  # noqa: BLE001 - an invalid candidate is not a failure
            return None
        self.replays += 1
        try:
            run, exc = replay_trace(candidate, self.config, self.engine)
        except Exception:  # noqa: BLE001 - a layout the engine refuses, a failing build
            return None
        if exc is None or run is None or failure_name(exc) != self.check:
            return None  # a build that fails is not a smaller trace of this failure
        return dataclasses.replace(run.to_trace(exc), seed=candidate.seed)

    def accept(self, candidate: Trace) -> bool:
        if self.out_of_time():
            return False
        found = self.failing(candidate)
        if found is None:
            return False
        self.best = found
        return True


def reduce_trace(
    trace: Trace,
    check: str,
    config: CheckConfig,
    factory: Callable | None = None,
    seconds: float = DEFAULT_REDUCE_SECONDS,
) -> tuple[Trace, bool]:
    """The smallest trace found that fails with ``check`` (see the module docstring),
    and whether the reduction finished within ``seconds`` (then no single operation can
    be removed). A trace that does not fail with ``check`` on replay comes back as is."""
    started = time.perf_counter()
    oracle = _Oracle(trace, check, config, factory, started + seconds)
    first = oracle.failing(trace)
    if first is None:
        return trace, False
    oracle.best = first
    # the passes on sizes stop at RESERVE of the budget: the rest is for the operations
    full_deadline = oracle.deadline
    sizes_deadline = started + RESERVE * seconds
    while not oracle.out_of_time():
        before = oracle.best
        changed = _remove_operations(oracle)
        oracle.deadline = min(full_deadline, sizes_deadline)
        _remove_requests(oracle)
        _shorten_arrivals(oracle)
        _shrink_layout(oracle)
        oracle.deadline = full_deadline
        if oracle.best != before:
            continue
        if not changed and not oracle.out_of_time():  # a complete sweep removed nothing
            return oracle.best, True
    # out of time: the last operations sweep may have been cut short
    return oracle.best, False


def _with_operations(trace: Trace, operations: Sequence[Operation]) -> Trace:
    return dataclasses.replace(trace, operations=tuple(operations), observed=(), failure=None)


def _remove_operations(oracle: _Oracle) -> bool:
    """Delta debugging over the operations; ends with a sweep of single removals that
    removes nothing. Returns whether anything was removed."""
    changed = False
    chunk = max(1, len(oracle.best.operations) // 2)
    while not oracle.out_of_time():
        removed = False
        i = 0
        while i < len(oracle.best.operations) and not oracle.out_of_time():
            ops = oracle.best.operations
            candidate = _with_operations(oracle.best, ops[:i] + ops[i + chunk :])
            if candidate.operations and oracle.accept(candidate):
                removed = changed = True
            else:
                i += chunk
        if chunk == 1 and not removed:
            return changed
        chunk = max(1, chunk // 2)
    return changed


def _remove_requests(oracle: _Oracle) -> None:
    """Every operation of one request at a time (its arrival, abort and preemption)."""
    ids = [op.request_id for op in oracle.best.operations if isinstance(op, Arrive)]
    for rid in ids:
        if oracle.out_of_time():
            return
        kept = [op for op in oracle.best.operations if getattr(op, "request_id", None) != rid]
        if kept and len(kept) < len(oracle.best.operations):
            oracle.accept(_with_operations(oracle.best, kept))


def _shorter(length: int, lowest: int) -> list[int]:
    """Candidate lengths below ``length``, shortest first: ``_shorter(16, 1)`` is
    ``[1, 4, 8, 12, 15]``."""
    out = {lowest, length // 4, length // 2, 3 * length // 4, length - 1}
    return sorted(n for n in out if lowest <= n < length)


def _shorten_arrivals(oracle: _Oracle) -> None:
    """Each arrival's prompt, then its output, cut to the shortest length that keeps
    the failure (among a few candidates: the loop of passes refines it)."""
    index = 0
    while index < len(oracle.best.operations) and not oracle.out_of_time():
        op = oracle.best.operations[index]
        if isinstance(op, Arrive):
            for field, lowest in (("prompt", 1), ("output", 0)):
                tokens = getattr(op, field)
                for n in _shorter(len(tokens), lowest):
                    shorter = dataclasses.replace(op, **{field: tokens[:n]})
                    ops = list(oracle.best.operations)
                    ops[index] = shorter
                    if oracle.accept(_with_operations(oracle.best, ops)):
                        op = shorter
                        break
        index += 1


def _shrink_layout(oracle: _Oracle) -> None:
    """Fewer blocks (a few candidates, fewest first), then one group fewer."""
    layout = oracle.best.layout
    for n in _shorter(layout.num_blocks, 2):
        try:
            smaller = dataclasses.replace(layout, num_blocks=n)
        except Exception:  # noqa: BLE001 - a layout the rules refuse
            continue
        if oracle.accept(dataclasses.replace(oracle.best, layout=smaller)):
            break
    layout = oracle.best.layout
    for gid in range(len(layout.groups) - 1, -1, -1):
        if len(layout.groups) < 2 or oracle.out_of_time():
            return
        groups = layout.groups[:gid] + layout.groups[gid + 1 :]
        try:
            fewer = dataclasses.replace(layout, groups=groups)
        except Exception:  # noqa: BLE001
            continue
        if oracle.accept(dataclasses.replace(oracle.best, layout=fewer)):
            layout = oracle.best.layout


def is_one_minimal(
    trace: Trace, check: str, config: CheckConfig, factory: Callable | None = None
) -> int | None:
    """The index of an operation whose removal keeps the failure ``check``, or None when
    there is none (the trace is 1-minimal)."""
    oracle = _Oracle(trace, check, config, factory, float("inf"))
    for i in range(len(trace.operations)):
        ops = trace.operations[:i] + trace.operations[i + 1 :]
        if ops and oracle.failing(_with_operations(trace, ops)) is not None:
            return i
    return None


def reduce_failure(
    candidates: Sequence[Trace | None],
    check: str,
    config: CheckConfig,
    factory: Callable | None,
    seconds: float,
) -> tuple[Trace | None, str | None]:
    """The reduced trace of a property's failure: the first of ``candidates`` (the
    Hypothesis-shrunk trace, then the trace as first found) that fails with ``check``
    again, reduced; and a one-line note of what the reduction did. A timed-out call is
    not reduced (every replay would cost the deadline again)."""
    for trace in candidates:
        if trace is None or not trace.failure:
            continue
        if trace.failure.get("property") == CallTimeoutError.__name__:
            return trace, None
        before = TraceSize.of(trace)
        reduced, finished = reduce_trace(trace, check, config, factory, seconds)
        if reduced is trace:
            continue
        note = f"trace reduced from {before} to {TraceSize.of(reduced)}"
        if not finished:
            note += f" (reduction stopped after {seconds:g} s: it may not be minimal)"
        return reduced, note
    first = next((t for t in candidates if t is not None), None)
    return first, None
