"""A deadline on one call of an engine that runs in this process.

:func:`call_deadline` arms ``SIGALRM`` (``setitimer``) for ``seconds``; if the call is
still running then, a :class:`DeadlinePassed` is raised inside it and turned into a
:class:`properties.core.engine.CallTimeoutError` naming the call. ``DeadlinePassed``
derives from ``BaseException``, so an engine's ``except Exception`` cannot swallow it,
and the timer re-fires every :data:`REFIRE_S` seconds until the call gives up.

What it can interrupt: Python code (a ``while True``), ``time.sleep`` and other calls
that wait in the kernel, and C code that checks for signals (the regular expression
engine does: ``re.match(r'(a+)+$', 'a' * 40 + 'b')`` stops at the deadline). What it
cannot: C code that holds the GIL and never checks for signals (for example
``sum(itertools.repeat(1, 10**12))``); such engines need a child process
(``--isolation process``, :mod:`properties.engines.isolation`), whose deadline kills
the child. It works only in the main thread (Python delivers signals there); anywhere
else the call runs without a deadline.

Worked example::

    with call_deadline(2.0, "allocate_slots('r0', num_new_tokens=8)"):
        engine.allocate_slots("r0", 8)   # raises CallTimeoutError after 2 s
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from properties.core.engine import CallTimeoutError

#: After the deadline, the alarm fires again every so often until the call returns.
REFIRE_S = 0.25


class DeadlinePassed(BaseException):
    """Raised inside an engine call at its deadline (never seen outside this module)."""


def _on_alarm(signum, frame) -> None:
    raise DeadlinePassed()


def deadline_available() -> bool:
    """True where :func:`call_deadline` can interrupt a call (main thread, SIGALRM)."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextmanager
def call_deadline(seconds: float, what: str) -> Iterator[None]:
    """Run the body under a deadline of ``seconds`` (0 or less: no deadline)."""
    if seconds <= 0 or not deadline_available():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, REFIRE_S)
    try:
        yield
    except DeadlinePassed:
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise CallTimeoutError(
            f"{what} did not return within {seconds:g} s (--call-timeout; an engine that "
            "holds the GIL in C code needs --isolation process)"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
