"""Engines in any language: a child process speaking the exec protocol (``exec:COMMAND``).

The protocol (``docs/exec-protocol.md``, version 1) is line-delimited JSON over the
child's stdin and stdout: one request per engine call, one response, errors as
messages, a ``hello`` handshake first, then ``create`` with a layout to build an
engine (replacing the previous one). Three layers, each usable on its own:

* :class:`ExecProcess`: the child and the wire. ``call(name, args)`` sends one request
  and waits for its response until a deadline; a hung child is killed and reported,
  a crashed child is reported with its exit status, a bad line is reported as a
  protocol violation, each as an :class:`properties.core.engine.EngineError` that
  names the call and shows the tail of the child's stderr.
* :class:`ExecEngine`: the engine protocol (:class:`properties.core.engine.KVCacheEngine`)
  over an :class:`ExecProcess`, with the optional capabilities the engine announced
  (``serving_modes``: :class:`properties.core.engine.SupportsServingModes`, the calls of
  the serving modes and the keywords of ``allocate_slots``).
* :class:`ExecEngineFactory`: ``factory(layout) -> ExecEngine``; one child per factory,
  reused from engine to engine (``create`` replaces the engine), restarted after a
  failure. ``exec:COMMAND`` on the command line resolves to :func:`factory_from_command`.
  Its ``production_settings`` are the ones ``hello`` declared
  (:data:`properties.core.modes.PRODUCTION_SETTINGS`), none when it declared none.

Worked example: ``ExecProcess(["./rust-block-manager"]).start()`` returns the
``hello`` result ``{"protocol": 1, "name": "rust-block-manager", ...}``; then
``call("create", {"layout": layout_to_json(layout)})`` builds an engine and
``call("num_free_blocks", {})`` returns ``num_blocks - 1`` for a fresh pool.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import shlex
import signal
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from properties.core.allocation import Allocation, TakesAllocations
from properties.core.charged_time import ChildClock
from properties.core.constants import MAX_CALL_TIMEOUT_S
from properties.core.declarations import check_spec_types
from properties.core.engine import (
    BlockIds,
    CachedBlock,
    CacheHit,
    CallTimeoutError,
    EngineError,
    EngineLoadError,
    PoolUsage,
    RequestInput,
    UnsupportedLayoutError,
)
from properties.core.modes import EXTERNAL_KEYWORDS, check_production_settings
from properties.core.processes import kill_group, unwatch_group, watch_group
from properties.core.trace import layout_to_json
from reference.errors import KVConformError
from reference.layout import KVCacheLayout

#: The protocol version this client speaks (``hello``'s ``protocol``).
PROTOCOL_VERSION = 1
#: Seconds a call may take unless ``KVCONFORM_EXEC_TIMEOUT`` says otherwise.
DEFAULT_CALL_TIMEOUT_S = 60.0
#: The first message also covers the child's start-up (imports, JIT, ...).
MIN_STARTUP_TIMEOUT_S = 120.0
#: Environment variable giving the per-call timeout in seconds.
TIMEOUT_ENV = "KVCONFORM_EXEC_TIMEOUT"
#: Seconds a closing child gets to exit after its stdin is closed.
EXIT_GRACE_S = 5.0
#: The longest answer line the client reads (a production-tier table of 10^5 blocks is a
#: few megabytes); past it the engine broke the protocol.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
#: The optional calls an engine may announce in ``create``'s ``capabilities``
#: (``serving_modes``: ``set_in_flight``, ``cache_blocks`` and the keywords of
#: ``allocate_slots``; the external-hit keywords also need the ``external`` setting).
CAPABILITIES = (
    "ref_counts",
    "free_queue",
    "cached_blocks",
    "serving_modes",
    "allocation_estimate",
    "pools",
)

_STDERR_TAIL_BYTES = 4000
_STDERR_TAIL_LINES = 20


class ExecTimeoutError(CallTimeoutError):
    """The child did not answer a call in time (it has been killed)."""


class ExecCrashError(EngineError):
    """The child exited (or closed its stdout) while a call was pending."""


class ExecProtocolError(EngineError):
    """The child answered with something that is not a protocol response."""


def call_timeout_from_env() -> float:
    """The per-call timeout: ``$KVCONFORM_EXEC_TIMEOUT`` seconds, else 60. A value that
    is not a finite number of seconds in (0, :data:`MAX_CALL_TIMEOUT_S`] is a usage error
    (``KVConformError``, exit 2), not the engine's: ``abc``, ``nan``, ``inf``, ``-1``."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_CALL_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value) and value <= MAX_CALL_TIMEOUT_S):
        raise KVConformError(
            f"{TIMEOUT_ENV} must be a number of seconds in (0, {MAX_CALL_TIMEOUT_S:g}], got {raw!r}"
        )
    return value


def describe_call(call: str, args: Mapping[str, Any]) -> str:
    """``allocate_slots('r3', num_new_tokens=8, ...)``: a call as reports show it (long
    lists shortened, ``request_id`` first and unnamed, the hit and layout left out)."""
    parts = []
    if "request_id" in args:
        parts.append(repr(args["request_id"]))
    for key, value in args.items():
        if key in ("request_id", "layout", "hit"):
            continue
        shown = (
            f"[{len(value)} items]" if isinstance(value, list) and len(value) > 8 else repr(value)
        )
        parts.append(f"{key}={shown}")
    return f"{call}({', '.join(parts)})"


class CallText:
    """A call's description (:func:`describe_call`), built only when a message shows it:
    a call that succeeds, nearly every call, never formats its arguments. Example:
    ``f"{CallText('free', {'request_id': 'r3'})} timed out"`` -> ``"free('r3') timed
    out"``."""

    __slots__ = ("call", "args")

    def __init__(self, call: str, args: Mapping[str, Any]) -> None:
        self.call = call
        self.args = args

    def __str__(self) -> str:
        return describe_call(self.call, self.args)


#: what a message names a call by: its text, or a :class:`CallText` formatted on demand
Described = str | CallText


def _exit_description(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


class ExecProcess:
    """One child process speaking the exec protocol (see the module docstring).

    ``argv`` is the command; ``timeout`` the seconds each call may take (default:
    :func:`call_timeout_from_env`); ``label`` names the engine in messages (default: the
    command). Not thread-safe: one call at a time, as the protocol requires.
    """

    def __init__(
        self,
        argv: Sequence[str],
        timeout: float | None = None,
        label: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        if not argv:
            raise EngineError("exec engine: empty command")
        self.argv = list(argv)
        self.timeout = call_timeout_from_env() if timeout is None else float(timeout)
        if not self.timeout > 0:
            raise EngineError(f"exec engine: the call timeout must be > 0, got {timeout!r}")
        self.label = label or shlex.join(self.argv)
        self._env = dict(env) if env is not None else None
        self._cwd = cwd
        self._proc: subprocess.Popen | None = None
        self._stderr = None
        self._buffer = bytearray()
        self._next_id = 0
        self._broken: str | None = None
        self._finalizer = None
        self._clock = ChildClock(0)  # the child's, once started
        #: one selector per pipe for the child's life (readable stdout, writable stdin):
        #: a call then waits with one ``select``, building nothing
        self._readable: selectors.BaseSelector | None = None
        self._writable: selectors.BaseSelector | None = None
        self.hello: dict[str, Any] = {}
        #: Incremented at each ``create``: engines built earlier are retired.
        self.generation = 0

    # -- life cycle -------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Spawn the child and shake hands; returns the ``hello`` result."""
        if self._proc is not None:
            raise EngineError(f"exec engine {self.label!r}: already started")
        # kept open for the child's life; closed by close()
        self._stderr = tempfile.TemporaryFile(prefix="kvconform-exec-stderr-")  # noqa: SIM115
        try:
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env=self._env,
                cwd=self._cwd,
                bufsize=0,
                start_new_session=True,  # a terminal's Ctrl-C reaches only kvconform
            )
        except OSError as exc:
            self._stderr.close()
            self._stderr = None
            raise EngineLoadError(
                f"exec engine {self.label!r}: cannot start {self.argv[0]!r}: {exc}"
            ) from None
        self._clock = ChildClock(self._proc.pid)
        os.set_blocking(self._proc.stdin.fileno(), False)
        os.set_blocking(self._proc.stdout.fileno(), False)
        self._readable = selectors.DefaultSelector()
        self._readable.register(self._proc.stdout.fileno(), selectors.EVENT_READ)
        self._writable = selectors.DefaultSelector()
        self._writable.register(self._proc.stdin.fileno(), selectors.EVENT_WRITE)
        self._finalizer = weakref.finalize(self, _stop, self._proc)
        _LIVE.add(self._proc)
        watch_group(self._proc.pid)  # its group dies with kvconform, even on kill -9
        hello = self.call(
            "hello",
            {"protocol": PROTOCOL_VERSION, "client": "kvconform"},
            timeout=max(self.timeout, MIN_STARTUP_TIMEOUT_S),
        )
        if not isinstance(hello, dict):
            self._fail(ExecProtocolError, f"hello answered {hello!r}, not an object")
        version = hello.get("protocol")
        if version != PROTOCOL_VERSION:
            self.close()
            raise ExecProtocolError(
                f"exec engine {self.label!r} speaks protocol version {version!r}; "
                f"kvconform speaks version {PROTOCOL_VERSION} (docs/exec-protocol.md)"
            )
        if isinstance(hello.get("name"), str) and hello["name"]:
            self.label = hello["name"]
        self.hello = hello
        return hello

    @property
    def alive(self) -> bool:
        """Started, not closed, and no failure seen (a failed child is never reused)."""
        return self._proc is not None and self._broken is None and self._proc.poll() is None

    def close(self) -> None:
        """Close the child's stdin, give it :data:`EXIT_GRACE_S` to exit, then kill it."""
        proc = self._proc
        if proc is None:
            return
        if self._broken is None:
            self._broken = "closed"
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout=EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _end_group(proc)  # what the engine forked (a helper, a server) ends with it
        proc.stdout.close()
        for selector in (self._readable, self._writable):
            if selector is not None:
                selector.close()
        self._readable = self._writable = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        if self._finalizer is not None:
            self._finalizer.detach()

    # -- calls ------------------------------------------------------------------------
    def call(
        self,
        call: str,
        args: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Send ``call`` and return its ``result``; an ``error`` answer raises
        :class:`EngineError` (:class:`UnsupportedLayoutError` for ``unsupported_layout``)."""
        args = dict(args or {})
        what = CallText(call, args)
        if self._proc is None:
            raise EngineError(f"exec engine {self.label!r}: {what} before start()")
        if self._broken is not None:
            raise EngineError(
                f"exec engine {self.label!r}: {what} on a child that is gone ({self._broken})"
            )
        if call == "create":
            self._clear_stderr()
            self.generation += 1  # earlier engines retire, even if this create fails
        self._next_id += 1
        message_id = self._next_id
        line = json.dumps({"id": message_id, "call": call, "args": args}, separators=(",", ":"))
        self._clock.start(self.timeout if timeout is None else timeout)
        self._write(line.encode() + b"\n", what)
        raw = self._read_line(what)
        try:
            response = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            self._fail(
                ExecProtocolError, f"{what} answered a line that is not JSON ({exc}): {_clip(raw)}"
            )
        if not isinstance(response, dict):
            self._fail(ExecProtocolError, f"{what} answered {_clip(raw)}, not a JSON object")
        if response.get("id") != message_id:
            self._fail(
                ExecProtocolError,
                f"{what} (message id {message_id}) answered with id {response.get('id')!r}: "
                f"{_clip(raw)}",
            )
        if "error" in response:
            error = response["error"]
            kind = error.get("kind") if isinstance(error, dict) else None
            message = error.get("message") if isinstance(error, dict) else error
            if kind == "unsupported_layout":
                raise UnsupportedLayoutError(f"exec engine {self.label!r}: {message}")
            raise EngineError(
                self._with_stderr(
                    f"exec engine {self.label!r}: {what} failed: {kind or 'error'}: {message}",
                    quiet_if_empty=True,
                )
            )
        if "result" not in response:
            self._fail(ExecProtocolError, f"{what} answered without result or error: {_clip(raw)}")
        return response["result"]

    # -- the wire ---------------------------------------------------------------------
    def _write(self, data: bytes, what: Described) -> None:
        """Write ``data`` to the child's stdin, waiting for room only when the pipe is
        full (a request line nearly always fits at once)."""
        fd = self._proc.stdin.fileno()
        view = memoryview(data)
        while view:
            try:
                written = os.write(fd, view)
            except BlockingIOError:
                written = 0
            except (BrokenPipeError, ConnectionResetError):
                self._crashed(what)
            view = view[written:]
            if view:
                self._wait(self._writable, what, "did not read its request")

    def _read_line(self, what: Described) -> bytes:
        """The next line of the child's stdout (each byte read and searched once: an
        answer of many megabytes costs its size, not its square)."""
        fd = self._proc.stdout.fileno()
        buffer = self._buffer
        scanned = 0
        while (end := buffer.find(b"\n", scanned)) < 0:
            if len(buffer) > MAX_ANSWER_BYTES:  # never read an endless line whole
                self._buffer = bytearray()
                self._fail(
                    ExecProtocolError,
                    f"{what} answered a line of more than {MAX_ANSWER_BYTES} bytes "
                    f"(the protocol's limit): {_clip(bytes(buffer[:300]))}",
                )
            scanned = len(buffer)
            self._wait(self._readable, what, "got no answer")
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                continue
            if not chunk:
                self._crashed(what)
            buffer += chunk
        line = bytes(buffer[:end])
        del buffer[: end + 1]
        return line

    def _wait(self, selector: selectors.BaseSelector | None, what: Described, how: str) -> None:
        """Until ``selector``'s pipe is ready; once the call has been charged its limit
        (the child's own time: :class:`properties.core.charged_time.ChildClock`), it
        timed out."""
        assert selector is not None  # (started: the call checked)
        while True:
            remaining = self._clock.remaining()
            if remaining <= 0:
                self._timed_out(what, how)
            if selector.select(remaining):
                return

    # -- failures ---------------------------------------------------------------------
    def _clear_stderr(self) -> None:
        if self._stderr is not None:
            self._stderr.seek(0)
            self._stderr.truncate()

    def stderr_tail(self) -> str:
        """The last lines the child wrote to stderr (since the last ``create``)."""
        if self._stderr is None:
            return ""
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - _STDERR_TAIL_BYTES))
        text = self._stderr.read().decode(errors="replace")
        lines = text.splitlines()[-_STDERR_TAIL_LINES:]
        return "\n".join(lines)

    def _with_stderr(self, message: str, quiet_if_empty: bool = False) -> str:
        tail = self.stderr_tail()
        if not tail.strip():
            return (
                message if quiet_if_empty else f"{message}\n  (the engine wrote nothing to stderr)"
            )
        body = "\n".join(f"    {line}" for line in tail.splitlines())
        return f"{message}\n  stderr of the engine (last lines):\n{body}"

    def _fail(self, error: type[EngineError], message: str) -> NoReturn:
        """The child broke the protocol: kill it and raise ``error`` naming the call."""
        self._broken = message
        _kill_quietly(self._proc)
        raise error(self._with_stderr(f"exec engine {self.label!r}: {message}"))

    def _timed_out(self, what: Described, how: str) -> NoReturn:
        self._broken = f"{what} timed out"
        overrun = self._clock.overrun()
        _kill_quietly(self._proc)
        raise ExecTimeoutError(
            self._with_stderr(
                f"exec engine {self.label!r}: {what} {how} within {overrun} "
                f"(the engine was killed; {TIMEOUT_ENV} sets the limit)"
            )
        )

    def _crashed(self, what: Described) -> NoReturn:
        try:
            code = self._proc.wait(timeout=EXIT_GRACE_S)
            how = _exit_description(code)
        except subprocess.TimeoutExpired:
            _kill_quietly(self._proc)
            how = "closed its stdout (killed)"
        self._broken = f"{how} during {what}"
        raise ExecCrashError(self._with_stderr(f"exec engine {self.label!r} {how} during {what}"))


def _stop(proc: subprocess.Popen) -> None:
    """At garbage collection or exit: close the child's stdin (it exits), then kill it
    if it has not exited within a second; its process group ends with it."""
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        _kill_quietly(proc)
    _end_group(proc)


def _end_group(proc: subprocess.Popen) -> None:
    """Kill the child's process group (it runs in its own session: the group is the
    child and whatever it forked) and tell the watchdog it is gone."""
    kill_group(proc.pid)
    unwatch_group(proc.pid)


#: Every engine child this process started and has not seen end (weakly held).
_LIVE: weakref.WeakSet[subprocess.Popen] = weakref.WeakSet()


def kill_engine_children() -> None:
    """Kill every engine child still running, at once (a stopped command: its children
    live in their own session, so nothing else ends them)."""
    for proc in list(_LIVE):
        kill_group(proc.pid)  # the child and everything it forked
    for proc in list(_LIVE):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)
        unwatch_group(proc.pid)


def _kill_quietly(proc: subprocess.Popen | None) -> None:
    """Kill the child and its process group at once (a broken or hung engine)."""
    if proc is None:
        return
    kill_group(proc.pid)
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        proc.wait(timeout=EXIT_GRACE_S)
    unwatch_group(proc.pid)


def _clip(raw: bytes | str, limit: int = 300) -> str:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


# ---------------------------------------------------------------------------
# The engine protocol over a child


def _int(value: Any, what: Described, process: ExecProcess) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        process._fail(ExecProtocolError, f"{what} returned {value!r}, not an integer")
    return value


def _table(value: Any, what: Described, process: ExecProcess) -> BlockIds:
    if not isinstance(value, list) or not all(isinstance(row, list) for row in value):
        process._fail(ExecProtocolError, f"{what} returned {_clip(json.dumps(value))}, not a table")
    table = tuple(map(tuple, value))
    if all(type(b) is int for row in table for b in row):  # (JSON integers: the common case)
        return table
    return tuple(tuple(_int(b, what, process) for b in row) for row in value)  # names the bad one


class ExecEngine(TakesAllocations):
    """:class:`properties.core.engine.KVCacheEngine` served by a child process.

    Built by :class:`ExecEngineFactory`. Calls made after the factory built a newer
    engine on the same child raise :class:`EngineError` (one engine per child)."""

    def __init__(
        self,
        process: ExecProcess,
        layout: KVCacheLayout,
        created: Any,
        production_settings: frozenset[str] = frozenset(),
    ) -> None:
        self.process = process
        self.layout = layout
        self.generation = process.generation
        self.name = process.label
        created = created if isinstance(created, dict) else {}
        self.separate_group_pools = bool(created.get("separate_group_pools", False))
        self.lookahead_on_prefill_chunks = bool(created.get("lookahead_on_prefill_chunks", True))
        #: what ``hello`` declared: the external-hit keywords need ``external``
        self.production_settings = production_settings

    def _call(self, call: str, args: dict[str, Any] | None = None) -> Any:
        if self.process.generation != self.generation:
            raise EngineError(
                f"exec engine {self.name!r}: {describe_call(call, args or {})} on an engine "
                "that a newer create replaced (a child serves one engine at a time)"
            )
        return self.process.call(call, args)

    def add_request(self, request: RequestInput) -> None:
        self._call(
            "add_request",
            {
                "request_id": request.request_id,
                "prompt_token_ids": list(request.prompt_token_ids),
                "cache_salt": request.cache_salt,
                "lora_name": request.lora_name,
            },
        )

    def append_output_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._call(
            "append_output_tokens",
            {"request_id": request_id, "token_ids": [int(t) for t in token_ids]},
        )

    def set_num_computed_tokens(self, request_id: str, num_computed_tokens: int) -> None:
        self._call(
            "set_num_computed_tokens",
            {"request_id": request_id, "num_computed_tokens": int(num_computed_tokens)},
        )

    def new_step(self) -> None:
        self._call("new_step")

    def get_computed_blocks(self, request_id: str) -> CacheHit:
        args = {"request_id": request_id}
        what = CallText("get_computed_blocks", args)
        result = self._call("get_computed_blocks", args)
        if not isinstance(result, dict) or "num_tokens" not in result or "block_ids" not in result:
            self.process._fail(
                ExecProtocolError, f"{what} returned {_clip(json.dumps(result))}, not a hit"
            )
        return CacheHit(
            _table(result["block_ids"], what, self.process),
            _int(result["num_tokens"], what, self.process),
        )

    def allocate(self, allocation: Allocation) -> BlockIds | None:
        """``allocate_slots`` over the protocol: the serving-mode keywords only when not
        at their default, so an engine is sent exactly the arguments it was built for
        (they need the ``serving_modes`` capability, the external-hit ones also the
        ``external`` production setting)."""
        keywords = allocation.keywords()
        if keywords:
            self._check_keywords(allocation, keywords)
        hit = allocation.hit
        args = {
            "request_id": allocation.request_id,
            "num_new_tokens": int(allocation.num_new_tokens),
            "num_new_computed_tokens": int(allocation.num_new_computed_tokens),
            "hit": None
            if hit is None
            else {
                "num_tokens": int(hit.num_tokens),
                "block_ids": [[int(b) for b in row] for row in hit.block_ids],
            },
            "num_lookahead_tokens": int(allocation.num_lookahead_tokens),
            **keywords,
        }
        result = self._call("allocate_slots", args)
        if result is None:
            return None
        return _table(result, CallText("allocate_slots", args), self.process)

    def _check_keywords(self, allocation: Allocation, keywords: dict[str, Any]) -> None:
        raise EngineError(
            f"exec engine {self.name!r}: {allocation.describe()} with serving-mode keywords, "
            "but the engine did not announce the serving_modes capability in create"
        )

    def free(self, request_id: str) -> None:
        self._call("free", {"request_id": request_id})

    def remove_request(self, request_id: str) -> None:
        self._call("remove_request", {"request_id": request_id})

    def reset_prefix_cache(self) -> bool:
        result = self._call("reset_prefix_cache")
        if not isinstance(result, bool):
            self.process._fail(
                ExecProtocolError, f"reset_prefix_cache() returned {result!r}, not a boolean"
            )
        return result

    def get_block_ids(self, request_id: str) -> BlockIds:
        args = {"request_id": request_id}
        return _table(
            self._call("get_block_ids", args), CallText("get_block_ids", args), self.process
        )

    def num_free_blocks(self) -> int:
        return _int(self._call("num_free_blocks"), "num_free_blocks()", self.process)


class _RefCounts:
    def ref_counts(self) -> dict[int, int]:
        result = self._call("ref_counts")
        if not isinstance(result, list) or not all(
            isinstance(p, list) and len(p) == 2 for p in result
        ):
            self.process._fail(
                ExecProtocolError,
                f"ref_counts() returned {_clip(json.dumps(result))}, not [block, count] pairs",
            )
        return {
            _int(b, "ref_counts()", self.process): _int(c, "ref_counts()", self.process)
            for b, c in result
        }


class _FreeQueue:
    def free_queue(self) -> list[int]:
        result = self._call("free_queue")
        if not isinstance(result, list):
            self.process._fail(
                ExecProtocolError, f"free_queue() returned {_clip(json.dumps(result))}, not a list"
            )
        return [_int(b, "free_queue()", self.process) for b in result]


class _CachedBlocks:
    def cached_blocks(self) -> list[CachedBlock]:
        result = self._call("cached_blocks")
        if not isinstance(result, list) or not all(
            isinstance(t, list) and len(t) == 3 for t in result
        ):
            self.process._fail(
                ExecProtocolError,
                f"cached_blocks() returned {_clip(json.dumps(result))}, not "
                "[block, group, num_tokens] triples",
            )
        return [
            CachedBlock(*(_int(v, "cached_blocks()", self.process) for v in triple))
            for triple in result
        ]


class _ServingModes:
    """:class:`properties.core.engine.SupportsServingModes` over the protocol: the
    ``serving_modes`` capability."""

    def set_in_flight(
        self, request_id: str, num_in_flight_tokens: int, num_pending_tokens: int
    ) -> None:
        self._call(
            "set_in_flight",
            {
                "request_id": request_id,
                "num_in_flight_tokens": int(num_in_flight_tokens),
                "num_pending_tokens": int(num_pending_tokens),
            },
        )

    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        self._call("cache_blocks", {"request_id": request_id, "num_tokens": int(num_tokens)})

    def _check_keywords(self, allocation: Allocation, keywords: dict[str, Any]) -> None:
        external = [k for k in keywords if k in EXTERNAL_KEYWORDS]
        if external and "external" not in self.production_settings:
            raise EngineError(
                f"exec engine {self.name!r}: allocate_slots({allocation.request_id!r}) with "
                f"{', '.join(external)}, but the engine did not declare the 'external' "
                "production setting in hello (docs/exec-protocol.md)"
            )


class _AllocationEstimate:
    """:class:`properties.core.engine.ReportsAllocationEstimate` over the protocol: the
    ``allocation_estimate`` capability (the answer is ``null`` or an integer)."""

    def last_allocation_estimate(self) -> int | None:
        result = self._call("last_allocation_estimate")
        if result is None:
            return None
        return _int(result, "last_allocation_estimate()", self.process)


class _Pools:
    """:class:`properties.core.engine.ReportsPools` over the protocol: the ``pools``
    capability; the answer is a list of ``{"name", "group_ids", "num_blocks", "num_free"}``
    objects (the boundary then checks that they partition the groups)."""

    def pool_usage(self) -> list[PoolUsage]:
        result = self._call("pool_usage")
        keys = {"name", "group_ids", "num_blocks", "num_free"}
        if not isinstance(result, list) or not all(
            isinstance(p, dict) and set(p) == keys and isinstance(p["group_ids"], list)
            for p in result
        ):
            self.process._fail(
                ExecProtocolError,
                f"pool_usage() returned {_clip(json.dumps(result))}, not a list of "
                "{name, group_ids, num_blocks, num_free} objects",
            )
        what = "pool_usage()"
        return [
            PoolUsage(
                p["name"],
                tuple(_int(g, what, self.process) for g in p["group_ids"]),
                _int(p["num_blocks"], what, self.process),
                _int(p["num_free"], what, self.process),
            )
            for p in result
        ]


_MIXINS = {
    "allocation_estimate": _AllocationEstimate,
    "ref_counts": _RefCounts,
    "free_queue": _FreeQueue,
    "cached_blocks": _CachedBlocks,
    "serving_modes": _ServingModes,
    "pools": _Pools,
}
_CLASSES: dict[frozenset[str], type] = {}


def engine_class(capabilities: frozenset[str]) -> type:
    """:class:`ExecEngine` with the methods of the announced capabilities, so that the
    checks' ``isinstance(engine, ExposesRefCounts)`` tests (and the machine's
    ``isinstance(engine, SupportsServingModes)``) see exactly those."""
    if capabilities not in _CLASSES:
        bases = tuple(_MIXINS[c] for c in CAPABILITIES if c in capabilities) + (ExecEngine,)
        name = "ExecEngine" + "".join(c.title().replace("_", "") for c in sorted(capabilities))
        _CLASSES[capabilities] = type(name, bases, {})
    return _CLASSES[capabilities]


class ExecEngineFactory:
    """``factory(layout) -> ExecEngine`` over one child, restarted when it has failed.

    ``spec_types`` (from ``hello``) is the tuple of spec types the engine supports, or
    None for all; the layout strategies draw only those (see ``docs/exec-protocol.md``).
    ``production_settings`` (from ``hello``) are the production layout settings it
    declares (:func:`properties.core.modes.production_settings` reads them), none by
    default.
    """

    def __init__(self, argv: Sequence[str], timeout: float | None = None) -> None:
        self.argv = list(argv)
        self.timeout = call_timeout_from_env() if timeout is None else timeout
        self.process: ExecProcess | None = None
        self._hello: dict[str, Any] | None = None

    def _live_process(self) -> ExecProcess:
        if self.process is None or not self.process.alive:
            process = ExecProcess(self.argv, self.timeout)
            self._hello = process.start()
            self.process = process
        return self.process

    @property
    def hello(self) -> dict[str, Any]:
        if self._hello is None:
            self._live_process()
        return self._hello

    @property
    def spec_types(self) -> tuple[str, ...] | None:
        """``hello``'s ``spec_types`` (None: all), checked when the engine is loaded
        (:func:`properties.core.declarations.check_spec_types`)."""
        kinds = self.hello.get("spec_types")
        where = f"exec engine {shlex.join(self.argv)!r}: hello's spec_types"
        return None if kinds is None else check_spec_types(kinds, where)

    @property
    def production_settings(self) -> frozenset[str]:
        """``hello``'s ``production_settings`` (none by default), checked the same way
        (:func:`properties.core.modes.check_production_settings`)."""
        where = f"exec engine {shlex.join(self.argv)!r}: hello's production_settings"
        return check_production_settings(self.hello.get("production_settings"), where)

    def __call__(self, layout: KVCacheLayout) -> ExecEngine:
        process = self._live_process()
        # building an engine may import the engine's own modules: the start-up allowance
        created = process.call(
            "create",
            {"layout": layout_to_json(layout)},
            timeout=max(self.timeout, MIN_STARTUP_TIMEOUT_S),
        )
        capabilities = created.get("capabilities", []) if isinstance(created, dict) else []
        unknown = [c for c in capabilities if c not in CAPABILITIES]
        if not isinstance(capabilities, list) or unknown:
            process._fail(
                ExecProtocolError,
                f"create announced capabilities {capabilities!r}; known: {', '.join(CAPABILITIES)}",
            )
        return engine_class(frozenset(capabilities))(
            process, layout, created, self.production_settings
        )

    def close(self) -> None:
        if self.process is not None:
            self.process.close()


_FACTORIES: dict[tuple[str, float], ExecEngineFactory] = {}


def factory_from_command(command: str) -> ExecEngineFactory:
    """The factory of ``exec:COMMAND`` (``command`` without the prefix), one per command
    in a process. ``python`` as the first word is the running interpreter."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise EngineLoadError(f"--engine exec:{command}: cannot split the command: {exc}") from None
    if not argv:
        raise EngineLoadError("--engine exec: needs a command after 'exec:'")
    if argv[0] == "python":
        argv[0] = sys.executable
    key = (command, call_timeout_from_env())
    if key not in _FACTORIES:
        _FACTORIES[key] = ExecEngineFactory(argv, key[1])
    return _FACTORIES[key]
