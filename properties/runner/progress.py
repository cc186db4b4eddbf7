"""What a run tells a person while it runs: progress lines and kvconform's own shrink note.

* :class:`Ticker`: while a property runs, its examples, steps, elapsed time and failures
  so far; on a terminal one line updated in place (about once a second), otherwise one
  line every :data:`LINE_SECONDS` seconds; nothing when the environment variable
  ``KVCONFORM_PROGRESS`` is ``quiet`` (``kvconform check -q``). ``KVCONFORM_PROGRESS=lines``
  forces plain lines (several worker processes share one terminal).
* :func:`set_sink`: the counts go to a function instead (``kvconform fuzz`` workers
  send them to the parent, whose counters then move every second).
* :func:`honest_shrink_reporter`: Hypothesis' warning when its shrink phase hits the
  time bound asks the user to report a Hypothesis bug; kvconform bounds shrinking on
  purpose (``--shrink-seconds``), so the warning is replaced by one line saying so.

Worked example: ``Ticker("invariants", lambda: (12, 340, 0))`` started at ``t0`` prints,
off a terminal after 2 s, ``  invariants: 12 examples, 340 steps, 2s, 0 failures``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: Off a terminal, one progress line per this many seconds (the first after
#: :data:`FIRST_SECONDS`: a run shows progress within its first five seconds).
LINE_SECONDS = 5.0
FIRST_SECONDS = 2.0
#: On a terminal, the updating line is redrawn this often.
TTY_SECONDS = 1.0
#: The environment variable that sets the progress style: ``quiet``, ``lines`` or unset.
PROGRESS_ENV = "KVCONFORM_PROGRESS"

#: Where a :class:`Ticker` sends its counts instead of printing them (a fuzz worker sends
#: them to its parent), every :data:`SINK_SECONDS`; None: print.
_SINK: Callable[[int, int, int], None] | None = None
SINK_SECONDS = 1.0

#: The start of Hypothesis' warning when shrinking stops on its time bound.
HYPOTHESIS_SLOW_SHRINK = "WARNING: Hypothesis has spent more than"


def shrink_stopped_line(seconds: float | None) -> str:
    """kvconform's line for a shrink phase that hit its bound. Example:
    ``shrink_stopped_line(30)`` is ``'kvconform: shrinking stopped after 30 s
    (--shrink-seconds); the smallest failing trace found so far is kept'``."""
    bound = "its time bound" if seconds is None else f"{seconds:g} s"
    return (
        f"kvconform: shrinking stopped after {bound} (--shrink-seconds); the smallest "
        "failing trace found so far is kept"
    )


@contextmanager
def honest_shrink_reporter(seconds: float | None) -> Iterator[None]:
    """Within the block, Hypothesis' slow-shrink warning becomes
    :func:`shrink_stopped_line`, on a line of its own; every other Hypothesis report (the
    falsifying example, a state machine's "Steps leading up to this error", its notes) is
    dropped: kvconform reports a failure itself, as a saved trace with its replay command
    and page, and Hypothesis' text would describe its internals, not the engine."""
    from hypothesis.reporting import current_reporter, with_reporter

    outer = current_reporter()

    def reporter(text: object) -> None:
        if isinstance(text, str) and text.startswith(HYPOTHESIS_SLOW_SHRINK):
            sys.stdout.flush()
            outer("\n" + shrink_stopped_line(seconds))

    with with_reporter(reporter):
        yield


def set_sink(sink: Callable[[int, int, int], None] | None) -> None:
    """Send every :class:`Ticker`'s ``(examples, steps, failures)`` to ``sink`` about once a
    second instead of printing them (None: print again)."""
    global _SINK
    _SINK = sink


def configure_progress(quiet: bool, workers: int) -> None:
    """Set the progress style for this process and the workers it starts: ``quiet``
    (``-q``), plain ``lines`` when several workers share the output, else automatic."""
    if quiet:
        os.environ[PROGRESS_ENV] = "quiet"
    elif workers > 1:
        os.environ[PROGRESS_ENV] = "lines"


def progress_style(stream=None) -> str:
    """``quiet``, ``lines`` or ``tty`` (see the module docstring)."""
    wanted = os.environ.get(PROGRESS_ENV, "")
    if wanted in ("quiet", "lines"):
        return wanted
    stream = stream if stream is not None else sys.stdout
    return "tty" if getattr(stream, "isatty", lambda: False)() else "lines"


def progress_text(name: str, examples: int, steps: int, seconds: float, failures: int) -> str:
    """One progress line. Example: ``progress_text("attention", 3, 90, 12.4, 1)`` is
    ``'  attention: 3 examples, 90 steps, 12s, 1 failure'``."""
    return (
        f"  {name}: {examples} examples, {steps} steps, {seconds:.0f}s, "
        f"{failures} failure{'' if failures == 1 else 's'}"
    )


class Ticker:
    """Prints a property's progress from a background thread until stopped (module
    docstring). ``counts()`` returns ``(examples, steps, failures)``."""

    def __init__(
        self,
        name: str,
        counts: Callable[[], tuple[int, int, int]],
        stream=None,
        style: str | None = None,
    ) -> None:
        self.name = name
        self.counts = counts
        self.stream = stream if stream is not None else sys.stdout
        self.style = style or progress_style(self.stream)
        self.start = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drawn = False

    def _line(self) -> str:
        examples, steps, failures = self.counts()
        return progress_text(self.name, examples, steps, time.perf_counter() - self.start, failures)

    def _loop(self) -> None:
        sink = _SINK
        if sink is not None:
            while not self._stop.wait(SINK_SECONDS):
                sink(*self.counts())
            return
        period = TTY_SECONDS if self.style == "tty" else LINE_SECONDS
        wait = min(period, FIRST_SECONDS)
        while not self._stop.wait(wait):
            wait = period
            try:
                if self.style == "tty":
                    self.stream.write("\r\x1b[2K" + self._line())
                    self._drawn = True
                else:
                    self.stream.write(self._line() + "\n")
                self.stream.flush()
            except (OSError, ValueError):  # the stream went away
                return

    def __enter__(self) -> Ticker:
        if self.style != "quiet" or _SINK is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._drawn:  # clear the updating line: the result line replaces it
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
