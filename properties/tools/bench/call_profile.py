"""Where an engine's time goes, per protocol call: ``kvconform bench engines --calls``.

:func:`properties.tools.bench.engines.replay_timed` with ``calls`` sums the time spent in
each protocol call (``schedule_step``, ``free``, ``allocate``, ``get_computed_blocks``,
...) over the decode steps and over the prefill steps, as the decode and prefill columns
split them (:class:`CallTime`). A row then reads each call per decode step and per
prefilled request (:class:`CallShare`), so the figures add up to the row's ``dec ms`` and
``prefill ms/req``; :func:`format_call_profile` prints them. The same wrapper times every
engine, so two engines' profiles compare call by call.

Example: decode-heavy, optimized: ``schedule_step 90 us/step (1.00 calls), free 14 us/step
(0.46 calls), ...`` against vLLM's ``allocate 610 us/step (27 calls), free 71 us/step, ...``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from properties.tools.bench.table import aligned


class CallTime(NamedTuple):
    """The time an engine spent in one protocol call over some steps, and how many calls
    it took. Example: ``CallTime("free", 0.0013, 46)``."""

    name: str
    seconds: float
    count: int


def call_times(seconds: dict[str, float], counts: dict[str, int]) -> tuple[CallTime, ...]:
    """The calls as :class:`CallTime`, most expensive first (ties by name). Example:
    ``({"a": 1.0, "b": 2.0}, {"a": 3, "b": 1})`` -> ``(b 2.0 s 1 call, a 1.0 s 3 calls)``."""
    return tuple(
        sorted(
            (CallTime(name, seconds[name], counts[name]) for name in seconds),
            key=lambda c: (-c.seconds, c.name),
        )
    )


class CallShare(NamedTuple):
    """One protocol call's share of a bench row: microseconds and calls per decode step,
    and per prefilled request (0 where the call never ran in such steps)."""

    name: str
    decode_us_per_step: float
    decode_calls_per_step: float
    prefill_us_per_req: float
    prefill_calls_per_req: float


def call_shares(
    decode: Sequence[CallTime],
    decode_steps: int,
    prefill: Sequence[CallTime],
    prefills: int,
) -> tuple[CallShare, ...]:
    """Each call's :class:`CallShare`: the decode steps' totals divided by ``decode_steps``,
    the prefill steps' by ``prefills`` (a count of 0 gives 0), the calls in order of their
    decode cost, then their prefill cost. Example: ``free`` 2 ms over 4 calls in 100
    decode steps -> 20 us and 0.04 calls per step."""
    per_decode = {c.name: c for c in decode}
    per_prefill = {c.name: c for c in prefill}

    def per(total: float, steps: int) -> float:
        return total / steps if steps else 0.0

    shares = []
    for name in {**per_decode, **per_prefill}:
        d = per_decode.get(name, CallTime(name, 0.0, 0))
        p = per_prefill.get(name, CallTime(name, 0.0, 0))
        shares.append(
            CallShare(
                name,
                per(1e6 * d.seconds, decode_steps),
                per(d.count, decode_steps),
                per(1e6 * p.seconds, prefills),
                per(p.count, prefills),
            )
        )
    shares.sort(key=lambda s: (-s.decode_us_per_step, -s.prefill_us_per_req, s.name))
    return tuple(shares)


class _ProfiledRow(Protocol):
    trace: str
    engine: str
    calls: tuple[CallShare, ...] | None


def format_call_profile(rows: Sequence[_ProfiledRow]) -> str:
    """One aligned line per row and call (rows with no profile skipped): trace, engine,
    call, us and calls per decode step, us and calls per prefilled request. Empty when no
    row has a profile."""
    header = ("trace", "engine", "call", "dec us/step", "calls/step", "prefill us/req", "calls/req")
    table = [header]
    for row in rows:
        for share in row.calls or ():
            table.append(
                (
                    row.trace,
                    row.engine,
                    share.name,
                    f"{share.decode_us_per_step:.1f}",
                    f"{share.decode_calls_per_step:.2f}",
                    f"{share.prefill_us_per_req:.1f}",
                    f"{share.prefill_calls_per_req:.2f}",
                )
            )
    if len(table) == 1:
        return ""
    return aligned(table, left={0, 1, 2})
