"""Serve any Python engine factory behind the exec protocol: the server side of
``docs/exec-protocol.md``.

``python -m properties.engines.serve TARGET`` reads requests from stdin and answers on
stdout; ``TARGET`` is a built-in engine name (``reference``...) or ``module:factory``.
Anything the engine prints goes to stderr (stdout carries protocol messages only).
Each call maps to the engine method of the same name; arguments and results are
converted as the protocol states (hits as ``{"num_tokens", "block_ids"}``, tables as
lists of lists, ref counts as ``[block, count]`` pairs, cached blocks as
``[block, group, num_tokens]``). An exception in the engine becomes an
``engine_error`` answer naming its type; :class:`UnsupportedLayoutError` from the factory
becomes ``unsupported_layout``.

What does not travel: a factory's ``layout_strategy`` and ``known_divergences`` are
Python objects; the client sees only ``spec_types`` and ``production_settings`` (sent in
``hello``) and ``unsupported_layout`` answers. An engine offering
:class:`properties.core.engine.SupportsServingModes` is announced with the
``serving_modes`` capability: ``set_in_flight``, ``cache_blocks`` and the serving-mode
keywords of ``allocate_slots`` then reach it.

Worked example: ``kvconform check --engine "exec:python -m properties.engines.serve
reference" --level exact`` runs the reference in a child process and compares it call by
call with the in-process reference: every result, the free queue order included,
travels through the protocol.
"""

from __future__ import annotations

import json
import operator
import os
import sys
import traceback
from typing import Any, BinaryIO

from properties.core.allocation import Allocation, allocate
from properties.core.coverage_probe import start_measuring, stop_measuring
from properties.core.declarations import read_declaration
from properties.core.engine import (
    CachedBlock,
    CacheHit,
    EngineFactory,
    ExposesCachedBlocks,
    ExposesFreeQueue,
    ExposesRefCounts,
    KVCacheEngine,
    PoolUsage,
    ReportsAllocationEstimate,
    ReportsPools,
    RequestInput,
    SupportsServingModes,
    UnsupportedLayoutError,
    load_engine_factory,
)
from properties.core.modes import EXTERNAL_KEYWORDS, production_settings
from properties.core.trace import layout_from_json

PROTOCOL_VERSION = 1


class ProtocolViolation(Exception):
    """The client's message is wrong (answered as ``protocol_error``)."""


def _arg(args: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in args:
        raise ProtocolViolation(f"missing argument {name!r}")
    value = args[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolViolation(f"argument {name!r} has the wrong type: {value!r}")
    return value


def _optional(args: dict, name: str, kind: type, default: Any) -> Any:
    """Argument ``name`` when the message has it, else ``default``."""
    return _arg(args, name, kind) if name in args else default


def _tokens(args: dict, name: str) -> tuple[int, ...]:
    value = _arg(args, name, list)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ProtocolViolation(f"argument {name!r} must be a list of integers")
    return tuple(value)


def _table(block_ids) -> list[list[int]]:
    return [[int(b) for b in group] for group in block_ids]


def _plain(value: Any) -> Any:
    """An engine's answer as JSON data, unconverted: tuples become lists and integer
    types (numpy's too) ints, nothing else changes, so the client sees a float, a
    string or a None exactly where the engine gave one and reports it
    (:mod:`properties.checks.answers`). Example: ``((1, 2.0), None)`` -> ``[[1, 2.0], None]``.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"returned {value!r} ({type(value).__name__}), not JSON data") from None


class EngineServer:
    """The state of one server: the factory, the current engine and its last hits."""

    def __init__(self, factory: EngineFactory, name: str) -> None:
        self.factory = factory
        self.name = name
        self.engine: KVCacheEngine | None = None
        # the hit objects get_computed_blocks returned, handed back on allocate_slots
        self.hits: dict[str, CacheHit] = {}

    def _engine(self) -> KVCacheEngine:
        if self.engine is None:
            raise ProtocolViolation('no engine yet: send "create" first')
        return self.engine

    def hello(self, args: dict) -> dict:
        version = args.get("protocol")
        if version != PROTOCOL_VERSION:
            raise ProtocolViolation(
                f"this server speaks protocol {PROTOCOL_VERSION}, the client asked for {version!r}"
            )
        result: dict[str, Any] = {"protocol": PROTOCOL_VERSION, "name": self.name}
        spec_types = read_declaration(self.factory, "spec_types", "factory attribute")
        if spec_types is not None:
            result["spec_types"] = list(spec_types)
        settings = production_settings(self.factory)
        if settings:
            result["production_settings"] = sorted(settings)
        return result

    def create(self, args: dict) -> dict:
        layout = layout_from_json(_arg(args, "layout", dict))
        self.engine = None
        self.hits.clear()
        engine = self.factory(layout)
        if engine is None:  # a factory that forgot its return: named, not "no engine yet"
            raise ProtocolViolation(
                f"the factory {self.name} returned None instead of an engine for the layout"
            )
        self.engine = engine
        capabilities = [
            name
            for name, proto in (
                ("ref_counts", ExposesRefCounts),
                ("free_queue", ExposesFreeQueue),
                ("cached_blocks", ExposesCachedBlocks),
                ("serving_modes", SupportsServingModes),
                ("allocation_estimate", ReportsAllocationEstimate),
                ("pools", ReportsPools),
            )
            if isinstance(engine, proto)
        ]
        return {
            "capabilities": capabilities,
            "separate_group_pools": bool(getattr(engine, "separate_group_pools", False)),
            "lookahead_on_prefill_chunks": bool(
                getattr(engine, "lookahead_on_prefill_chunks", True)
            ),
        }

    def dispatch(self, call: str, args: dict) -> Any:
        if call == "hello":
            return self.hello(args)
        if call == "create":
            return self.create(args)
        if call == "shutdown":
            return None
        engine = self._engine()
        if call == "add_request":
            engine.add_request(
                RequestInput(
                    _arg(args, "request_id", str),
                    _tokens(args, "prompt_token_ids"),
                    args.get("cache_salt"),
                    args.get("lora_name"),
                )
            )
            return None
        if call == "append_output_tokens":
            engine.append_output_tokens(_arg(args, "request_id", str), _tokens(args, "token_ids"))
            return None
        if call == "set_num_computed_tokens":
            engine.set_num_computed_tokens(
                _arg(args, "request_id", str), _arg(args, "num_computed_tokens", int)
            )
            return None
        if call == "new_step":
            engine.new_step()
            return None
        if call == "get_computed_blocks":
            request_id = _arg(args, "request_id", str)
            hit = engine.get_computed_blocks(request_id)
            if not isinstance(hit, CacheHit):
                raise TypeError(f"returned {hit!r}, not a CacheHit")
            self.hits[request_id] = hit
            return {"num_tokens": _plain(hit.num_tokens), "block_ids": _plain(hit.block_ids)}
        if call == "allocate_slots":
            return _plain(allocate(engine, self._allocation(engine, args)))
        if call == "free":
            engine.free(_arg(args, "request_id", str))
            return None
        if call == "remove_request":
            request_id = _arg(args, "request_id", str)
            engine.remove_request(request_id)
            self.hits.pop(request_id, None)
            return None
        if call == "reset_prefix_cache":
            return _plain(engine.reset_prefix_cache())
        if call == "get_block_ids":
            return _plain(engine.get_block_ids(_arg(args, "request_id", str)))
        if call == "num_free_blocks":
            return _plain(engine.num_free_blocks())
        if call == "set_in_flight" and isinstance(engine, SupportsServingModes):
            engine.set_in_flight(
                _arg(args, "request_id", str),
                _arg(args, "num_in_flight_tokens", int),
                _arg(args, "num_pending_tokens", int),
            )
            return None
        if call == "cache_blocks" and isinstance(engine, SupportsServingModes):
            engine.cache_blocks(_arg(args, "request_id", str), _arg(args, "num_tokens", int))
            return None
        if call == "ref_counts" and isinstance(engine, ExposesRefCounts):
            counts = engine.ref_counts()
            if not hasattr(counts, "items"):
                raise TypeError(f"returned {counts!r}, not a mapping block id -> count")
            return [[_plain(b), _plain(c)] for b, c in counts.items()]
        if call == "last_allocation_estimate" and isinstance(engine, ReportsAllocationEstimate):
            return _plain(engine.last_allocation_estimate())
        if call == "pool_usage" and isinstance(engine, ReportsPools):
            pools = engine.pool_usage()
            if not isinstance(pools, (list, tuple)) or not all(
                isinstance(p, PoolUsage) for p in pools
            ):
                raise TypeError(f"returned {pools!r}, not a list of PoolUsage")
            return [
                {
                    "name": p.name,
                    "group_ids": _plain(list(p.group_ids)),
                    "num_blocks": _plain(p.num_blocks),
                    "num_free": _plain(p.num_free),
                }
                for p in pools
            ]
        if call == "free_queue" and isinstance(engine, ExposesFreeQueue):
            return _plain(engine.free_queue())
        if call == "cached_blocks" and isinstance(engine, ExposesCachedBlocks):
            blocks = engine.cached_blocks()
            if not isinstance(blocks, (list, tuple)) or not all(
                isinstance(c, CachedBlock) for c in blocks
            ):
                raise TypeError(f"returned {blocks!r}, not a list of CachedBlock")
            return [_plain([c.block_id, c.group_id, c.num_tokens]) for c in blocks]
        raise ProtocolViolation(f"unknown call {call!r}")

    def _allocation(self, engine: KVCacheEngine, args: dict) -> Allocation:
        """The :class:`Allocation` of an ``allocate_slots`` message. Its serving-mode
        keywords (sent only when not at their default) are accepted only for an engine
        announced with ``serving_modes``, the external-hit ones only when the factory
        declares the ``external`` production setting."""
        request_id = _arg(args, "request_id", str)
        allocation = Allocation(
            request_id,
            _arg(args, "num_new_tokens", int),
            _arg(args, "num_new_computed_tokens", int),
            self._hit(request_id, args.get("hit")),
            _arg(args, "num_lookahead_tokens", int),
            _optional(args, "full_sequence_must_fit", bool, False),
            _optional(args, "num_external_computed_tokens", int, 0),
            _optional(args, "delay_cache_blocks", bool, False),
        )
        keywords = allocation.keywords()
        if keywords and not isinstance(engine, SupportsServingModes):
            raise ProtocolViolation(
                f"allocate_slots argument {sorted(keywords)[0]!r} needs the serving_modes "
                "capability, which this engine does not announce"
            )
        external = [k for k in EXTERNAL_KEYWORDS if k in keywords]
        if external and "external" not in production_settings(self.factory):
            raise ProtocolViolation(
                f"allocate_slots argument {external[0]!r} needs the 'external' production "
                "setting, which this engine does not declare"
            )
        return allocation

    def _hit(self, request_id: str, data: Any) -> CacheHit | None:
        """The engine's own hit object when ``data`` is the hit it returned last."""
        if data is None:
            return None
        if not isinstance(data, dict) or "num_tokens" not in data or "block_ids" not in data:
            raise ProtocolViolation("argument 'hit' must be null or {num_tokens, block_ids}")
        hit = CacheHit(
            tuple(tuple(int(b) for b in row) for row in data["block_ids"]),
            int(data["num_tokens"]),
        )
        kept = self.hits.pop(request_id, None)
        if (
            kept is not None
            and kept.num_tokens == hit.num_tokens
            and _table(kept.block_ids) == _table(hit.block_ids)
        ):
            return kept
        return hit


def answer(message: Any, server: EngineServer) -> dict:
    """The response to one parsed request (a ``result`` or an ``error`` object)."""
    message_id = message.get("id") if isinstance(message, dict) else None
    try:
        if not isinstance(message, dict):
            raise ProtocolViolation("a message must be a JSON object")
        call, args = message.get("call"), message.get("args", {})
        if not isinstance(call, str):
            raise ProtocolViolation('a message needs a string "call"')
        if not isinstance(args, dict):
            raise ProtocolViolation('"args" must be an object')
        result = server.dispatch(call, args)
        json.dumps(result)  # not JSON data: an engine error, answered as one
        return {"id": message_id, "result": result}
    except ProtocolViolation as exc:
        kind, text = "protocol_error", str(exc)
    except UnsupportedLayoutError as exc:
        kind, text = "unsupported_layout", str(exc)
    except Exception as exc:  # noqa: BLE001 - every engine failure is answered
        traceback.print_exc(file=sys.stderr)
        kind, text = "engine_error", f"{type(exc).__name__}: {exc}"
    return {"id": message_id, "error": {"kind": kind, "message": text}}


def serve(factory: EngineFactory, name: str, requests: BinaryIO, responses: BinaryIO) -> int:
    """Answer every request line of ``requests`` on ``responses`` until EOF or shutdown."""
    server = EngineServer(factory, name)
    for raw in iter(requests.readline, b""):
        if not raw.strip():
            continue
        try:
            message = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            message = None
            reply = {
                "id": None,
                "error": {"kind": "protocol_error", "message": f"invalid JSON: {exc}"},
            }
        else:
            reply = answer(message, server)
        responses.write(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
        responses.flush()
        if isinstance(message, dict) and message.get("call") == "shutdown":
            break
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m properties.engines.serve ENGINE``: the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print(
            "usage: python -m properties.engines.serve ENGINE\n"
            "  ENGINE: a built-in engine name or module:factory; serves it on stdin/stdout "
            "(docs/exec-protocol.md)",
            file=sys.stderr,
        )
        return 2
    # stdout carries protocol messages only: keep it for them, send the rest to stderr
    responses = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    try:
        factory = load_engine_factory(argv[0])
    except Exception as exc:  # noqa: BLE001 - reported to the client at hello
        print(f"properties.engines.serve: {exc}", file=sys.stderr)
        return 2
    start_measuring()  # when --engine-coverage asks for it (properties.core.coverage_probe)
    try:
        return serve(factory, argv[0], sys.stdin.buffer, responses)
    finally:
        stop_measuring()


if __name__ == "__main__":
    sys.exit(main())
