"""A deadline on one call of an engine that runs in this process.

``with call_deadline(seconds, what): ...`` marks a call as running with a limit of
``seconds`` of its own time: wall time less the time the machine made it wait for a CPU
(:mod:`properties.core.charged_time`; a loaded CI machine does not fail a correct
engine), capped at :data:`properties.core.charged_time.WALL_CAP` times the limit in wall
time. A ``SIGALRM`` interval timer, started at the first deadline and then left running,
ticks every :data:`TICK_S` seconds; a tick that finds the running call past its
deadline raises :class:`DeadlinePassed` inside it, which
:class:`call_deadline` turns into a :class:`properties.core.engine.CallTimeoutError`
naming the call. Entering and leaving a call only stores two values (a timer per call
cost about 10 us, a tenth of a step of the reference); a timeout fires between
``seconds`` and ``seconds + TICK_S`` after the call began. ``DeadlinePassed`` derives
from ``BaseException`` so an engine's ``except Exception`` cannot swallow it, and the
next tick raises it again if something does.

Time the interpreter spends collecting garbage during the call is not charged to it: a
full collection of a long campaign's heap (a gigabyte of Hypothesis's data, seconds on a
busy machine) is kvconform's cost, not the engine's, and a tick that lands inside a
collection waits for the next one (an exception raised there would be lost anyway).

What it can interrupt: Python code (a ``while True``), ``time.sleep`` and other calls
that wait in the kernel, and C code that checks for signals (the regular expression
engine does: ``re.match(r'(a+)+$', 'a' * 40 + 'b')`` stops at the deadline). What it
cannot: C code that holds the GIL and never checks for signals (for example
``sum(itertools.repeat(1, 10**12))``); such engines need a child process
(``--isolation process``, :mod:`properties.engines.isolation`), whose deadline kills
the child. It works only in the main thread (Python delivers signals there); anywhere
else the call runs without a deadline. It owns ``SIGALRM``: do not combine it with
another user of that signal (pytest-timeout's signal method).

Worked example::

    with call_deadline(2.0, "allocate_slots('r0', num_new_tokens=8)"):
        engine.allocate_slots("r0", 8)   # raises CallTimeoutError 2 to 2.1 s later
"""

from __future__ import annotations

import atexit
import gc
import signal
import threading
import time

from properties.core.charged_time import (
    WALL_CAP,
    overrun_text,
    run_queue_seconds,
)
from properties.core.engine import CallTimeoutError

#: Seconds between two ticks of the timer that enforces deadlines.
TICK_S = 0.1


class DeadlinePassed(BaseException):
    """Raised inside an engine call at its deadline (never seen outside this module)."""


class _Running:
    """The call running now: its description, start and limit (``what`` None: none)."""

    what: str | None = None
    started: float = 0.0
    seconds: float = 0.0
    ticking: bool = False
    #: when the collection running now began (None: none), and the seconds the call's
    #: finished collections took, which are not charged to it
    collecting_since: float | None = None
    collected_seconds: float = 0.0
    #: the main thread's run-queue seconds at the call's first tick (None: not read yet)
    waited_base: float | None = None
    #: run-queue seconds of the call when it was stopped, for the message
    waited: float = 0.0


#: The schedstat file of the thread reading it: ticks run in the main thread, the one
#: calls run in (a path fixed at import would name the parent's thread in a forked worker).
_SCHEDSTAT = "/proc/thread-self/schedstat"


def _now() -> float:
    """The clock deadlines read (a test replaces it and :func:`_run_queue`)."""
    return time.monotonic()


def _run_queue() -> float | None:
    """The main thread's run-queue seconds (:mod:`properties.core.charged_time`)."""
    return run_queue_seconds(_SCHEDSTAT)


def charged_seconds(now: float) -> float:
    """The seconds the running call is charged now: wall time since it began, less the
    collections it sat through and the time its thread waited for a CPU since its first
    tick (:mod:`properties.core.charged_time`; the wait before that first tick, at most
    :data:`TICK_S`, is charged)."""
    charged = now - _Running.started - _Running.collected_seconds
    waited = _run_queue()
    if waited is None:
        return charged
    if _Running.waited_base is None:
        _Running.waited_base = waited
    _Running.waited = waited - _Running.waited_base
    return charged - _Running.waited


def _on_tick(signum, frame) -> None:
    if _Running.what is None or _Running.collecting_since is not None:
        return
    now = _now()
    charged = charged_seconds(now)
    if charged >= _Running.seconds or now - _Running.started >= WALL_CAP * _Running.seconds:
        raise DeadlinePassed()


def _on_collection(phase: str, info: dict) -> None:
    """``gc.callbacks`` entry: time each collection that runs during a call."""
    if phase == "start":
        _Running.collecting_since = _now() if _Running.what is not None else None
    elif _Running.collecting_since is not None:
        _Running.collected_seconds += _now() - _Running.collecting_since
        _Running.collecting_since = None


_HAS_TIMER = hasattr(signal, "setitimer")


def deadline_available() -> bool:
    """True where :func:`call_deadline` can interrupt a call (main thread, SIGALRM)."""
    return _HAS_TIMER and threading.current_thread() is threading.main_thread()


def _start_ticking() -> None:
    if signal.getsignal(signal.SIGALRM) is not _on_tick:
        signal.signal(signal.SIGALRM, _on_tick)
    signal.setitimer(signal.ITIMER_REAL, TICK_S, TICK_S)
    _Running.ticking = True
    if _on_collection not in gc.callbacks:
        gc.callbacks.insert(0, _on_collection)  # (first: every other callback is timed)
    atexit.register(stop_ticking)  # at shutdown the default action would kill the process


def stop_ticking() -> None:
    """Stop the timer (at exit; deadlines start it again when needed)."""
    if _Running.ticking:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _Running.ticking = False


class call_deadline:  # noqa: N801 - used as a function: ``with call_deadline(...)``
    """Run the body under a deadline of ``seconds`` (0 or less: no deadline)."""

    __slots__ = ("seconds", "what", "armed")

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds = seconds
        self.what = what
        self.armed = False

    def __enter__(self) -> None:
        if self.seconds > 0 and deadline_available():
            if not _Running.ticking:
                _start_ticking()
            _Running.started = _now()
            _Running.seconds = self.seconds
            _Running.collected_seconds = 0.0
            _Running.waited_base = None
            _Running.waited = 0.0
            _Running.what = self.what
            self.armed = True

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.armed:
            return
        _Running.what = None
        self.armed = False
        if exc_type is DeadlinePassed:
            raise CallTimeoutError(timeout_message(self.what, self.seconds)) from None


def timeout_message(what: str, seconds: float) -> str:
    """The one line of a call stopped at its deadline: the call, the limit, the wall
    time and the load (:func:`properties.core.charged_time.overrun_text`)."""
    wall = _now() - _Running.started
    return (
        f"{what} did not return within {overrun_text(seconds, wall, _Running.waited)} "
        "(--call-timeout; an engine that holds the GIL in C code needs --isolation process)"
    )
