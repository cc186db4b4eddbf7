"""Where an engine's time goes, function by function: ``kvconform bench engines --hotspots N``.

``--calls`` splits a row's time by protocol call; this goes one level down. One extra
replay of the trace runs under :mod:`cProfile`, switched on only while a protocol call
is inside the engine (the scheduler and the bench's own bookkeeping are not profiled),
and each operation's profile is added to the decode steps' totals or the prefill
steps' as the decode and prefill columns split them (:class:`FunctionSplit`). A row then
lists its ``N`` functions with the most self time per decode step and per prefilled
request (:class:`Hotspot`), with their cumulative time and calls per step or request.

The profiler's own cost inflates every function call by a similar amount, so read the
figures against each other (which functions hold the time), not against the row's
timings: the timed replays run without it. Under ``--cpu`` the profile, too, counts the
thread's CPU time, so a busy machine does not charge the time another process holds the
core to whichever function it interrupted (each profiled call then costs more). An
``exec:`` engine runs in its own process: its profile shows the pipe, not the engine.

Example: decode-heavy on the optimized engine lists, per decode step,
``optimized/control/batched_decode.py:266(apply_decode_item)`` with 3.16 calls and
``{method 'item' of 'numpy.ndarray' objects}`` with 122: the few requests that reach a
block boundary hold the step, in scalar reads of the arrays.
"""

from __future__ import annotations

import cProfile
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from properties.tools.bench.table import aligned

#: where a function's file is shown from, the deepest first: the installed packages
#: (``vllm/v1/core/...``), the standard library, the project's root (``optimized/...``;
#: a virtual environment inside the project is deeper, so its packages keep their names)
_ROOTS: tuple[str, ...] = tuple(
    sorted(
        {
            str(Path(p).resolve()) + "/"
            for p in (
                Path(__file__).resolve().parents[3],
                *(sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")),
            )
        },
        key=len,
        reverse=True,
    )
)


class FunctionTime(NamedTuple):
    """One function's totals over some steps: self seconds (in its own body), cumulative
    seconds (with what it called) and calls. Example: ``FunctionTime("a.py:3(f)", 0.002,
    0.005, 40)``."""

    function: str
    self_seconds: float
    cumulative_seconds: float
    calls: int


class Hotspot(NamedTuple):
    """One function's share of a bench row: microseconds of self and cumulative time and
    calls, per decode step or per prefilled request."""

    function: str
    self_us: float
    cumulative_us: float
    calls: float


def function_label(code: object) -> str:
    """A profiled function's name: ``path:line(qualified name)`` with the path shown from
    the project's root or from the installed packages, or cProfile's own text for a
    built-in. Example: ``optimized/control/block_pool.py:410(BlockPool.get_new_blocks)``;
    ``{method 'take' of 'numpy.ndarray' objects}``."""
    if isinstance(code, str):
        return code if code.startswith("{") else "{" + code.strip("<>") + "}"
    filename = getattr(code, "co_filename", "?")
    for root in _ROOTS:
        if filename.startswith(root):
            filename = filename[len(root) :]
            break
    name = getattr(code, "co_qualname", getattr(code, "co_name", "?"))
    return f"{filename}:{getattr(code, 'co_firstlineno', 0)}({name})"


class FunctionSplit:
    """cProfile around the engine's calls (:meth:`enable` / :meth:`disable`, made by the
    timing wrapper), one fresh profile per operation; :meth:`op_ended` adds it to the
    decode steps' totals (``True``), the prefill steps' (``False``) or drops it (``None``:
    an idle step, an arrival, any other operation). Example: a decode step calling
    ``free`` once adds one call of each function ``free`` ran to the decode totals."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.totals: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
        #: cProfile's clock: its own wall clock for ``time.perf_counter`` (the cheapest),
        #: else ``clock`` (``time.thread_time`` under ``--cpu``: the time another process
        #: takes the core from the engine is not charged to the function it interrupted,
        #: at about half a microsecond per profiled call)
        self._clock = None if clock is time.perf_counter else clock
        self._profile = self._new_profile()

    def enable(self) -> None:
        self._profile.enable()

    def disable(self) -> None:
        self._profile.disable()

    def op_ended(self, decode: bool | None) -> None:
        if decode is not None:
            into = self.totals[decode]
            for entry in self._profile.getstats():
                label = function_label(entry.code)
                if label in _SWITCHING_OFF:
                    continue  # the profiler switching itself off
                sums = into.setdefault(label, [0.0, 0.0, 0])
                sums[0] += entry.inlinetime
                sums[1] += entry.totaltime
                sums[2] += entry.callcount
        self._profile = self._new_profile()

    def _new_profile(self) -> cProfile.Profile:
        return cProfile.Profile() if self._clock is None else cProfile.Profile(self._clock)

    def function_times(self, decode: bool) -> tuple[FunctionTime, ...]:
        """The totals of one kind of step, most self time first (ties by name)."""
        return tuple(
            sorted(
                (FunctionTime(f, s, c, int(n)) for f, (s, c, n) in self.totals[decode].items()),
                key=lambda t: (-t.self_seconds, t.function),
            )
        )


#: the calls that stop the profiler, with which every profile ends (not the engine's)
_SWITCHING_OFF = frozenset(
    (
        function_label("<method 'disable' of '_lsprof.Profiler' objects>"),
        function_label(FunctionSplit.disable.__code__),
    )
)


def hotspots(times: Sequence[FunctionTime], units: int, top: int) -> tuple[Hotspot, ...]:
    """The first ``top`` of ``times`` (most self time first) per unit (a decode step or a
    prefilled request; none when ``units`` is 0). Example: 2 ms of self time over 100
    decode steps -> ``self_us`` 20."""
    if units <= 0:
        return ()
    return tuple(
        Hotspot(
            t.function,
            1e6 * t.self_seconds / units,
            1e6 * t.cumulative_seconds / units,
            t.calls / units,
        )
        for t in times[:top]
    )


class _HotspotRow(Protocol):
    trace: str
    engine: str
    decode_hotspots: tuple[Hotspot, ...] | None
    prefill_hotspots: tuple[Hotspot, ...] | None


def format_hotspots(rows: Sequence[_HotspotRow]) -> str:
    """One aligned line per row, step kind and function (rows with no profile skipped):
    trace, engine, ``decode`` (per step) or ``prefill`` (per request), self us, cumulative
    us, calls, function. Empty when no row has a profile."""
    header = ("trace", "engine", "per", "self us", "cum us", "calls", "function")
    table = [header]
    for row in rows:
        for kind, spots in (("decode", row.decode_hotspots), ("prefill", row.prefill_hotspots)):
            for spot in spots or ():
                table.append(
                    (
                        row.trace,
                        row.engine,
                        kind,
                        f"{spot.self_us:.1f}",
                        f"{spot.cumulative_us:.1f}",
                        f"{spot.calls:.2f}",
                        spot.function,
                    )
                )
    if len(table) == 1:
        return ""
    return aligned(table, left={0, 1, 2, 6})
