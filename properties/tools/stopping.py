"""SIGINT, SIGTERM and SIGHUP stop a ``kvconform`` command cleanly, whatever it runs.

:func:`stop_on_signals` makes the first SIGINT, SIGTERM or SIGHUP (a closed terminal, a
dropped SSH session, a CI runner cancelling the job) raise :class:`Stopped` (a
``KeyboardInterrupt`` carrying the signal) in the main thread; later ones are ignored
while the command winds down (its workers and engine children are ended, a summary is
printed, what was found is kept). Engine children run in their own session
(:mod:`properties.engines.exec_engine`), so a terminal's Ctrl-C or hang-up reaches only
kvconform, which then ends them with their process groups; property workers ignore
SIGINT and SIGHUP and are ended by their parent (:mod:`properties.tools.parallel`).

A signal that arrives while Python runs a garbage-collection callback or a finalizer
(``__del__``, a weakref callback) cannot stop anything there: Python prints "Exception
ignored" and drops the exception. The handler sees it (:func:`_in_swallowing_frame`) and
delivers the signal again a moment later, outside that code. Where the frames do not
show it (a weakref callback of any other name, a C-level finalizer calling Python), the
dropped :class:`Stopped` reaches ``sys.unraisablehook``, which re-arms the handler and
delivers the signal again the same way: the stop is never lost.

Exit code of a stopped command (:func:`stopped_exit_code`): the failure found so far
when there is one (1 a property failed, 3 the engine broke the protocol, ...), else 129
for SIGHUP, 130 for SIGINT and 143 for SIGTERM. Worked example:
``stopped_exit_code(Stopped(SIGTERM), [None, "property"])`` is 1;
``stopped_exit_code(Stopped(SIGHUP), [])`` is 129.
"""

from __future__ import annotations

import gc
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import FrameType

from properties.core.outcome import Outcome, combined_exit_code

#: The signals that stop a command.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Seconds before a signal that landed in a garbage-collection callback or a finalizer is
#: delivered again.
REDELIVER_S = 0.02
_OUTCOMES = {
    signal.SIGTERM: Outcome.TERMINATED,
    signal.SIGHUP: Outcome.HANGUP,
    signal.SIGINT: Outcome.INTERRUPTED,
}


class Stopped(KeyboardInterrupt):
    """A stop signal arrived; ``signum`` says which; ``results`` what finished before."""

    def __init__(self, signum: int, results: list | None = None) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.results = results or []
        #: first failures found before the stop (properties.runner.check.FirstFailure)
        self.found: list = []

    @property
    def outcome(self) -> Outcome:
        return _OUTCOMES.get(self.signum, Outcome.INTERRUPTED)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def stopped_exit_code(stop: KeyboardInterrupt, kinds: Iterable[str | None]) -> int:
    """The exit code of a command stopped by ``stop`` after results of ``kinds``."""
    code = combined_exit_code(kinds)
    if code:
        return code
    return stop.outcome.exit_code if isinstance(stop, Stopped) else Outcome.INTERRUPTED.exit_code


def _in_swallowing_frame(frame: FrameType | None) -> bool:
    """``frame`` (or a caller of it) is a garbage-collection callback or a finalizer,
    where Python drops an exception instead of propagating it."""
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        code = frame.f_code
        if code in callbacks or code.co_name == "__del__":
            return True
        if code.co_name == "__call__" and code.co_filename.endswith("weakref.py"):
            return True  # a weakref.finalize callback
        frame = frame.f_back
    return False


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """The first SIGINT/SIGTERM/SIGHUP raises :class:`Stopped` here; the handlers are
    restored afterwards. Outside the main thread it does nothing (Python delivers
    signals there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    main = threading.main_thread().ident

    def redeliver(signum: int) -> None:
        # to the main thread itself: a blocking call there (a sleep, a wait on a
        # worker) is interrupted, as by the first delivery; raised in the timer's
        # thread, the signal would wait for the main thread's next bytecode
        timer = threading.Timer(REDELIVER_S, signal.pthread_kill, (main, signum))
        timer.daemon = True
        timer.start()

    def handler(signum, frame) -> None:
        if fired:
            return  # winding down already
        if _in_swallowing_frame(frame):  # raised here, the stop would be dropped
            redeliver(signum)
            return
        fired.append(signum)
        raise Stopped(signum)

    previous_hook = sys.unraisablehook

    def unraisable(info) -> None:
        """Python dropped our Stopped (a finalizer the frames did not show): again."""
        if isinstance(info.exc_value, Stopped) and info.exc_value.signum in fired:
            fired.remove(info.exc_value.signum)
            redeliver(info.exc_value.signum)
            return
        previous_hook(info)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        for s, h in previous.items():
            signal.signal(s, h)
