"""The engine call running now, readable by a parent process after this one died.

A property's worker process (:mod:`properties.tools.parallel`) installs a shared buffer
with :func:`install`; the engine boundary marks each call with :func:`entered` and
:func:`left`. When the worker ends without a verdict (an in-process engine called
``os._exit(0)``, segfaulted, or was killed) the parent reads the buffer and names the
call it was in. Without a buffer installed both marks cost one attribute test.

Worked example::

    buffer = multiprocessing.get_context("fork").Array("c", CALL_BYTES, lock=False)
    install(buffer); entered("engine: new_step()")
    read(buffer)   # -> "engine: new_step()"; after left(): ""
"""

from __future__ import annotations

from typing import Any

#: Bytes kept of a call's description.
CALL_BYTES = 512


class _Sink:
    buffer: Any = None  # a ctypes char array shared with the parent, or None


def install(buffer: Any) -> None:
    """Record calls into ``buffer`` (a shared ``c_char`` array of :data:`CALL_BYTES`)."""
    _Sink.buffer = buffer


def entered(what: str) -> None:
    """A call described by ``what`` starts."""
    if _Sink.buffer is not None:
        _Sink.buffer.value = what.encode("utf-8", "replace")[: CALL_BYTES - 1]


def left() -> None:
    """The call returned (or raised)."""
    if _Sink.buffer is not None:
        _Sink.buffer.value = b""


def read(buffer: Any) -> str:
    """The call recorded in ``buffer`` ("" when none was running)."""
    return bytes(buffer.value).decode("utf-8", "replace")
