"""The time a deadline charges an engine: wall time less the time the machine made it wait.

A correct engine on a loaded machine (a CI runner with other jobs, two CPU-bound
processes beside the check) takes longer in wall time without doing more work: its
thread is ready to run and waits in the kernel's run queue for a CPU. Deadlines must
measure the engine, not the machine, so the time an engine is charged for a call is

    charged = wall time of the call - time its thread waited for a CPU

(Linux reports the second figure per thread in ``/proc/<pid>/task/<tid>/schedstat``:
its second field, nanoseconds spent runnable but not running). A hang is still caught
at the limit: a thread that sleeps, blocks on a lock or waits for I/O is not waiting
for a CPU, so its whole wall time is charged, and a thread spinning in a loop is
charged every second it runs. Garbage collection of kvconform's own heap is not charged
either (:mod:`properties.core.deadline`).

Where the figure is unavailable (no ``/proc``, another system) the charge is the wall
time, as before. :data:`WALL_CAP` bounds the wall time of any call whatever its charge,
so even an engine starved for hours ends.

Worked example: a call that ran 9.0 s wall while its thread waited 6.5 s for a CPU is
charged 2.5 s; under a 5 s limit it passes. A call that slept 5.1 s is charged 5.1 s and
fails, whatever the load.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

#: A call's wall time is capped at this many times its limit, whatever its charge.
WALL_CAP = 30.0


def schedstat_path(pid: int | None = None, tid: int | None = None) -> str:
    """The schedstat file of thread ``tid`` of process ``pid`` (default: this process's
    main thread)."""
    pid = os.getpid() if pid is None else pid
    tid = (threading.main_thread().native_id or pid) if tid is None and pid == os.getpid() else tid
    return f"/proc/{pid}/task/{tid or pid}/schedstat"


def run_queue_seconds(path: str) -> float | None:
    """Seconds the thread of ``path`` (:func:`schedstat_path`) has spent waiting for a
    CPU since it started; None where the kernel does not say."""
    try:
        with open(path, "rb") as handle:
            fields = handle.read(200).split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def load_text() -> str:
    """The machine's load, for a deadline's message: ``load average 7.9 on 2 cores``."""
    try:
        one_minute = os.getloadavg()[0]
    except OSError:
        return f"{os.cpu_count() or '?'} cores"
    return f"load average {one_minute:.1f} on {os.cpu_count() or '?'} cores"


def overrun_text(limit: float, wall: float, waited: float) -> str:
    """What a missed deadline says about time and load: ``5 s of its own time (9.2 s
    wall, 4.2 s of it waiting for a CPU; load average 7.9 on 2 cores)``."""
    return (
        f"{limit:g} s of its own time ({wall:.1f} s wall, {waited:.1f} s of it waiting for "
        f"a CPU; {load_text()})"
    )


#: How stale the run-queue figure a child's call starts from may be, in seconds: reading
#: it at every call would cost a file read per protocol round trip; a figure up to this
#: old credits the call with at most this much wait that came before it.
SAMPLE_EVERY_S = 0.5


class ChildClock:
    """Charged time of the calls to one child process (its main thread): :meth:`start`
    at each call, :meth:`remaining` when its wall time may be up."""

    __slots__ = ("path", "now", "read", "_sampled_at", "_sample", "started", "limit", "base")
    __slots__ += ("waited",)

    def __init__(
        self,
        pid: int,
        now: Callable[[], float] = time.monotonic,
        read: Callable[[str], float | None] = run_queue_seconds,
    ) -> None:
        """``now`` and ``read`` (the clock and the run-queue reader) are parameters so a
        test can drive the clock by hand."""
        self.path = schedstat_path(pid, pid)
        self.now = now
        self.read = read
        self._sampled_at = float("-inf")
        self._sample: float | None = None
        self.started = 0.0
        self.limit = 0.0
        self.base: float | None = None
        self.waited = 0.0

    def start(self, limit: float) -> None:
        """A call begins, allowed ``limit`` seconds of the child's own time."""
        now = self.now()
        if now - self._sampled_at >= SAMPLE_EVERY_S:
            self._sample, self._sampled_at = self.read(self.path), now
        self.started, self.limit, self.base, self.waited = now, limit, self._sample, 0.0

    def remaining(self) -> float:
        """Wall seconds the call may still wait: its limit less what it was charged so
        far; 0 or less once its deadline has passed (or the wall cap)."""
        now = self.now()
        wall = now - self.started
        if wall < self.limit:
            return self.limit - wall
        if wall >= WALL_CAP * self.limit:
            return 0.0
        waited = self.read(self.path)
        if waited is not None and self.base is not None:
            self.waited = waited - self.base
        return self.limit - (wall - self.waited)

    def overrun(self) -> str:
        """The time and load part of a missed deadline's message (:func:`overrun_text`)."""
        return overrun_text(self.limit, self.now() - self.started, self.waited)
