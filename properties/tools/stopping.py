"""SIGINT and SIGTERM stop a ``kvconform`` command cleanly, whatever it is running.

:func:`stop_on_signals` makes the first SIGINT or SIGTERM raise :class:`Stopped` (a
``KeyboardInterrupt`` carrying the signal) in the main thread; later ones are ignored
while the command winds down (its workers and engine children are ended, a summary is
printed, what was found is kept). Engine children run in their own session
(:mod:`properties.engines.exec_engine`), so a terminal's Ctrl-C reaches only
kvconform, which then ends them; property workers ignore SIGINT and are ended by their
parent (:mod:`properties.tools.parallel`).

Exit code of a stopped command (:func:`stopped_exit_code`): the failure found so far
when there is one (1 a property failed, 3 the engine broke the protocol, ...), else 130
for SIGINT and 143 for SIGTERM. Worked example: ``stopped_exit_code(Stopped(SIGTERM),
[None, "property"])`` is 1; ``stopped_exit_code(Stopped(SIGTERM), [])`` is 143.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from properties.core.outcome import Outcome, combined_exit_code

#: The signals that stop a command.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
        return Outcome.TERMINATED if self.signum == signal.SIGTERM else Outcome.INTERRUPTED

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def stopped_exit_code(stop: KeyboardInterrupt, kinds: Iterable[str | None]) -> int:
    """The exit code of a command stopped by ``stop`` after results of ``kinds``."""
    code = combined_exit_code(kinds)
    if code:
        return code
    return stop.outcome.exit_code if isinstance(stop, Stopped) else Outcome.INTERRUPTED.exit_code


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """The first SIGINT/SIGTERM raises :class:`Stopped` here; the handlers are restored
    afterwards. Outside the main thread it does nothing (Python delivers signals there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum, frame) -> None:
        if fired:
            return  # winding down already
        fired.append(signum)
        raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
