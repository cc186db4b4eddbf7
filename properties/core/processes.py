"""Every process a run starts ends with the run, however the run ends.

Three mechanisms, one per way a process could outlive kvconform:

* **Process groups.** An engine child (``exec:``, or an adapter served in a child
  process) starts in its own session, so its process group holds it and everything it
  forks (a helper, a server). :func:`kill_group` ends the whole group: at ``close``, on
  an engine error, on every signal. Example: an engine that forks ``sleep 1000`` leaves
  nothing behind once its group is killed.
* **A watchdog** for ``kill -9`` of kvconform itself (no handler can run then): a tiny
  process (:data:`_WATCHDOG_SOURCE`, started once per process that starts engines,
  :func:`watch_group`) holds the read end of a pipe whose write end only kvconform
  holds; it learns each engine group's id, and when the pipe closes (kvconform is gone,
  however it ended) it kills every group still registered. :func:`unwatch_group`
  removes a group that ended normally.
* **Parent-death signals** for property workers (:func:`die_with_parent`): on Linux a
  worker asks the kernel for SIGTERM when its parent dies, and its SIGTERM handler ends
  its own engines. :func:`reap_descendants` ends, at the end of a command, any process
  still alive below kvconform (what an in-process adapter forked and left running).

All of it is best effort where the platform lacks a piece (no ``prctl`` outside Linux):
the process groups and the watchdog work on every POSIX system.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _prctl(option: int, value: int) -> bool:
    """``prctl(option, value)`` on Linux; False where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(signum: int = signal.SIGTERM) -> bool:
    """Ask for ``signum`` when this process's parent dies (Linux); True if set. A
    parent that already died before the call is caught too (its child is reparented)."""
    parent = os.getppid()
    done = _prctl(_PR_SET_PDEATHSIG, int(signum))
    if done and os.getppid() != parent:  # the parent died before the request took hold
        os.kill(os.getpid(), signum)
    return done


def kill_group(pgid: int, signum: int = signal.SIGKILL) -> None:
    """Send ``signum`` to every process of group ``pgid``; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _children_of() -> dict[int, list[int]]:
    """Parent pid -> child pids, from ``/proc`` (empty where there is no ``/proc``)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return children
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def descendants(pid: int | None = None) -> list[int]:
    """Every live process below ``pid`` (default: this one), children first."""
    root = os.getpid() if pid is None else pid
    tree = _children_of()
    out: list[int] = []
    todo = list(tree.get(root, ()))
    while todo:
        child = todo.pop(0)
        out.append(child)
        todo.extend(tree.get(child, ()))
    return out


def reap_descendants(keep: frozenset[int] = frozenset()) -> list[int]:
    """Kill every process still alive below this one (but ``keep``) and collect the
    children among them; returns the pids killed."""
    killed = [pid for pid in descendants() if pid not in keep]
    for pid in killed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for pid in killed:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)
    return killed


#: The watchdog's program: registered groups on its stdin (``+PGID`` / ``-PGID``), each
#: killed when the stdin closes (kvconform ended, however it ended).
_WATCHDOG_SOURCE = """
import os, signal, sys
groups = set()
for line in sys.stdin:
    line = line.strip()
    if line[:1] == "+":
        groups.add(int(line[1:]))
    elif line[:1] == "-":
        groups.discard(int(line[1:]))
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""


class _Watchdog:
    """The watchdog of this process (started on first use; one per process)."""

    lock = threading.Lock()
    proc: subprocess.Popen | None = None
    owner: int | None = None


def _watchdog() -> subprocess.Popen | None:
    with _Watchdog.lock:
        if _Watchdog.owner != os.getpid():  # a forked child starts its own
            _Watchdog.proc, _Watchdog.owner = None, os.getpid()
        if _Watchdog.proc is None or _Watchdog.proc.poll() is not None:
            try:
                _Watchdog.proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _WATCHDOG_SOURCE],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,  # no terminal signal ends it before its work
                )
            except OSError:
                _Watchdog.proc = None
        return _Watchdog.proc


def _tell(line: str) -> None:
    proc = _watchdog()
    if proc is None or proc.stdin is None:
        return
    with contextlib.suppress(OSError, ValueError):
        proc.stdin.write(f"{line}\n".encode())
        proc.stdin.flush()


def watch_group(pgid: int) -> None:
    """Have the watchdog kill group ``pgid`` if this process ends before it does."""
    _tell(f"+{pgid}")


def unwatch_group(pgid: int) -> None:
    """Group ``pgid`` ended normally: the watchdog forgets it."""
    if _Watchdog.proc is not None and _Watchdog.owner == os.getpid():
        _tell(f"-{pgid}")


def watchdog_pid() -> int | None:
    """The pid of this process's watchdog, if one is running."""
    proc = _Watchdog.proc
    if proc is None or _Watchdog.owner != os.getpid() or proc.poll() is not None:
        return None
    return proc.pid


def start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker now, with SIGHUP ignored (an ignored
    signal stays ignored across ``exec``). It already ignores SIGINT and SIGTERM, but a
    closed terminal sends SIGHUP to the whole foreground process group: a tracker killed
    by it makes every worker relaunch it and print tracebacks of the semaphores it forgot,
    while kvconform itself stops cleanly on the same signal."""
    if not hasattr(signal, "SIGHUP"):
        return
    from multiprocessing import resource_tracker

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGHUP, previous)
