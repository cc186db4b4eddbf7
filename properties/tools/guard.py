"""An engine in kvconform's own process cannot end it with a false verdict.

An adapter run in process (``--isolation none``, or ``auto`` for an engine kvconform does
not know that has no call timeout) shares the process with the verdict: if it calls
``os._exit(0)`` the command would end with exit 0 and no verdict. :func:`needs_guard`
says when that can happen; ``check`` then runs each property in a forked worker
(:func:`properties.tools.parallel.run_tasks`) and ``replay`` runs in one forked child
(:func:`run_guarded`). A child that ends without sending its verdict is an engine error
(exit 3) naming the engine call it was in (:mod:`properties.core.current_call`).

Worked example: ``run_guarded(lambda: 0, on_error)`` returns 0; a ``fn`` whose engine
calls ``os._exit(0)`` inside ``new_step()`` returns 3 after printing ``ENGINE ERROR
(...): the engine ended the process (exit code 0) during broken: new_step(), before any
verdict``.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import sys
from collections.abc import Callable

from properties.core import current_call
from properties.core.engine import BUILTIN_ENGINES
from properties.core.outcome import Outcome


def needs_guard(config) -> bool:
    """Whether ``config``'s engine runs in this process and is not a built-in engine."""
    from properties.engines.isolation import wants_isolation

    if config.engine.startswith("exec:") or config.engine in BUILTIN_ENGINES:
        return False
    return not wants_isolation(config.engine, config.isolation, config.call_timeout)


def run_guarded(fn: Callable[[], int], on_error: Callable[[BaseException], int]) -> int:
    """``fn()`` (a command's work, printing as it goes, returning its exit code) in a
    forked child; ``on_error`` turns an exception of ``fn`` into the exit code. The exit
    code is the one the child sent; a child that sent none is an engine error."""
    from properties.tools.parallel import STOP_GRACE_S, died_result

    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    buffer = ctx.Array("c", current_call.CALL_BYTES, lock=False)
    sys.stdout.flush()
    sys.stderr.flush()
    proc = ctx.Process(target=_child, args=(fn, on_error, writer, buffer))
    proc.start()
    writer.close()
    try:
        proc.join()
    except KeyboardInterrupt:
        proc.terminate()
        proc.join(timeout=STOP_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
        raise
    try:
        if reader.poll():
            return int(reader.recv())
    except EOFError:
        pass  # the child ended without sending its verdict
    call = current_call.read(buffer)
    result = died_result("replay", proc.exitcode, call, 0.0, process="the process")
    print(f"{Outcome.from_kind(result.kind).title}: {result.failure}", flush=True)
    return Outcome.from_kind(result.kind).exit_code


def _child(fn, on_error, writer, buffer) -> None:
    from properties.core.forked import settle_forked_child
    from properties.tools.parallel import _end_worker

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _end_worker)
    settle_forked_child()
    current_call.install(buffer)
    try:
        code = fn()
    except BaseException as exc:  # noqa: BLE001 - every error becomes a code
        code = on_error(exc)
    sys.stdout.flush()
    sys.stderr.flush()
    writer.send(code)
