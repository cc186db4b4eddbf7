"""Replayable traces: a layout plus engine-independent user events, saved as JSON.

A trace records *what users did*, never what an engine did with it: requests
arrive with a prompt and the output they will decode, scheduler steps run with a
token budget, requests are aborted or preempted, the prefix cache is reset. The
deterministic scheduler (:mod:`properties.runner.scheduler`) turns these events into
manager calls in the same way for every engine, so one trace replays on any
engine. The JSON format is described in ``docs/trace-format.md``.

Worked example: the two operations ``Arrive("r0", prompt=(1, 2, 3), output=(4,))``
and ``Step(token_budget=8)`` become, in JSON,
``{"op": "arrive", "request_id": "r0", "prompt": [1, 2, 3], "output": [4],
"cache_salt": null, "lora_name": null}`` and
``{"op": "step", "token_budget": 8, "num_lookahead_tokens": 0}``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from properties.core.constants import DEFAULT_FAILURE_DIR
from properties.core.json_input import InputError, read_json
from properties.core.modes import ServingMode
from properties.core.output_files import OutputWriteError, write_text_atomic
from reference.errors import KVConformError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

#: The value of the top-level ``"format"`` field of every trace file.
TRACE_FORMAT = "kvconform-trace/1"
_FORMAT_PREFIX = "kvconform-trace/"

#: Limits checked when a trace is loaded (:func:`check_limits`): a trace beyond them is a
#: load error, never a hang or a failure at operation 0.
MAX_TRACE_BYTES = 64 * 1024 * 1024
MAX_NUM_BLOCKS = 100_000
MAX_MODEL_LEN = 131_072
MAX_GROUPS = 32
MAX_OPERATIONS = 100_000
MAX_TOKEN_ID = 2**31 - 1


class TraceFormatError(KVConformError):
    """A trace, operation or layout cannot be built, written or read."""


# ---------------------------------------------------------------------------
# Operations


def _check_request_id(owner: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise TraceFormatError(f"{owner}.request_id must be a non-empty string, got {value!r}")


def _check_tokens(owner: str, field: str, value: object, min_len: int) -> None:
    if not isinstance(value, tuple):
        raise TraceFormatError(f"{owner}.{field} must be a tuple of token ids, got {value!r}")
    if len(value) < min_len:
        raise TraceFormatError(f"{owner}.{field} must hold at least {min_len} token(s), got ()")
    for token in value:
        if not _is_int(token) or token < 0:
            raise TraceFormatError(
                f"{owner}.{field} must hold integers >= 0, got {token!r} in {value!r}"
            )


def _check_optional_str(owner: str, field: str, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise TraceFormatError(f"{owner}.{field} must be a string or None, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Arrive:
    """A request arrives. ``output`` is fixed in advance: the tokens it will decode.

    The request finishes once every output token has been generated; an empty
    ``output`` finishes right after prefill. Example: ``Arrive("r0", (1, 2), (3,))``
    prefills 2 tokens, decodes token 3, then finishes.
    """

    request_id: str
    prompt: tuple[int, ...]
    output: tuple[int, ...] = ()
    cache_salt: str | None = None
    lora_name: str | None = None

    def __post_init__(self) -> None:
        _check_request_id("Arrive", self.request_id)
        _check_tokens("Arrive", "prompt", self.prompt, min_len=1)
        _check_tokens("Arrive", "output", self.output, min_len=0)
        _check_optional_str("Arrive", "cache_salt", self.cache_salt)
        _check_optional_str("Arrive", "lora_name", self.lora_name)


@dataclass(frozen=True)
class Step:
    """One scheduler step computing at most ``token_budget`` tokens over all requests.

    ``num_lookahead_tokens`` extra slots per decoding request (speculative
    decoding). Example: ``Step(4)`` on a fresh 10-token prompt prefills tokens 0..3.
    """

    token_budget: int
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.token_budget) or self.token_budget < 1:
            raise TraceFormatError(
                f"Step.token_budget must be an integer >= 1, got {self.token_budget!r}"
            )
        if not _is_int(self.num_lookahead_tokens) or self.num_lookahead_tokens < 0:
            raise TraceFormatError(
                f"Step.num_lookahead_tokens must be an integer >= 0, "
                f"got {self.num_lookahead_tokens!r}"
            )


@dataclass(frozen=True)
class Abort:
    """The user cancels the request: its blocks are freed and it is forgotten."""

    request_id: str

    def __post_init__(self) -> None:
        _check_request_id("Abort", self.request_id)


@dataclass(frozen=True)
class Preempt:
    """The request is freed and goes back to waiting; it later recomputes from 0."""

    request_id: str

    def __post_init__(self) -> None:
        _check_request_id("Preempt", self.request_id)


@dataclass(frozen=True)
class ResetPrefixCache:
    """Drop every cached prefix (fails, changing nothing, while blocks are in use)."""


Operation = Arrive | Step | Abort | Preempt | ResetPrefixCache

_OP_NAMES: dict[type, str] = {
    Arrive: "arrive",
    Step: "step",
    Abort: "abort",
    Preempt: "preempt",
    ResetPrefixCache: "reset_prefix_cache",
}
_OP_TYPES: dict[str, type] = {name: cls for cls, name in _OP_NAMES.items()}


def validate_references(operations: Iterable[Operation]) -> None:
    """Every ``Arrive`` id is new; ``Abort``/``Preempt`` name an earlier, not yet
    aborted arrival.

    Examples: ``(Abort("r0"), Arrive("r0", (1,)))`` fails (operation 0 names ``r0``
    before any arrival introduced it); ``(Arrive("r0", (1,)), Abort("r0"),
    Preempt("r0"))`` fails (operation 2 names an aborted request). Naming a request
    that already *finished* is allowed: whether it finished depends on scheduling.
    """
    arrived: set[str] = set()
    aborted: set[str] = set()
    for index, op in enumerate(operations):
        if isinstance(op, Arrive):
            if op.request_id in arrived:
                raise TraceFormatError(
                    f"operations[{index}] (arrive) reuses request_id {op.request_id!r}"
                )
            arrived.add(op.request_id)
        elif isinstance(op, (Abort, Preempt)):
            name = _OP_NAMES[type(op)]
            if op.request_id not in arrived:
                raise TraceFormatError(
                    f"operations[{index}] ({name}) names request_id "
                    f"{op.request_id!r}, which no earlier arrive introduced"
                )
            if op.request_id in aborted:
                raise TraceFormatError(
                    f"operations[{index}] ({name}) names request_id "
                    f"{op.request_id!r}, which an earlier abort removed"
                )
            if isinstance(op, Abort):
                aborted.add(op.request_id)


# ---------------------------------------------------------------------------
# Trace


def _json_native(value: Any, where: str) -> Any:
    """``value`` with tuples turned into lists; raises for anything JSON cannot hold."""
    if value is None or isinstance(value, (bool, str, float)) or _is_int(value):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_native(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise TraceFormatError(f"{where} keys must be strings, got {key!r}")
            out[key] = _json_native(v, f"{where}.{key}")
        return out
    raise TraceFormatError(
        f"{where} must be JSON data (None, bool, int, float, str, "
        f"list, dict), got {type(value).__name__} {value!r}"
    )


@dataclass(frozen=True)
class Trace:
    """A replayable run: the layout, the operations, and optionally what was seen.

    ``observed`` holds one record per operation (the calls made and results seen,
    free-form JSON dicts); ``failure`` is ``{"property", "message", "engine",
    "level"}`` when the run failed. Both are normalised to JSON data on
    construction (tuples become lists) so that a saved and reloaded trace compares
    equal to the original.
    """

    layout: KVCacheLayout
    operations: tuple[Operation, ...]
    seed: int | None = None
    observed: tuple[dict, ...] = ()
    failure: dict | None = None
    mode: ServingMode = ServingMode()
    #: what the engine under test showed after each operation, recorded by the run that
    #: saved the failure (:mod:`properties.runner.engine_view`); JSON data, or None
    engine_view: dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVCacheLayout):
            raise TraceFormatError(f"Trace.layout must be a KVCacheLayout, got {self.layout!r}")
        if not isinstance(self.operations, tuple):
            raise TraceFormatError(
                f"Trace.operations must be a tuple, got {type(self.operations).__name__}"
            )
        for index, op in enumerate(self.operations):
            if type(op) not in _OP_NAMES:
                raise TraceFormatError(
                    f"Trace.operations[{index}] must be an Operation, got {op!r}"
                )
        if not isinstance(self.mode, ServingMode):
            raise TraceFormatError(f"Trace.mode must be a ServingMode, got {self.mode!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise TraceFormatError(f"Trace.seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.observed, tuple):
            raise TraceFormatError(
                f"Trace.observed must be a tuple of dicts, got {type(self.observed).__name__}"
            )
        observed = []
        for index, record in enumerate(self.observed):
            if not isinstance(record, Mapping):
                raise TraceFormatError(f"Trace.observed[{index}] must be a dict, got {record!r}")
            observed.append(_json_native(record, f"Trace.observed[{index}]"))
        # Normalising a frozen field in __post_init__ needs object.__setattr__.
        object.__setattr__(self, "observed", tuple(observed))
        if self.failure is not None:
            if not isinstance(self.failure, Mapping):
                raise TraceFormatError(
                    f"Trace.failure must be a dict or None, got {self.failure!r}"
                )
            object.__setattr__(self, "failure", _json_native(self.failure, "Trace.failure"))
        if self.engine_view is not None:
            if not isinstance(self.engine_view, Mapping):
                raise TraceFormatError(
                    "Trace.engine_view must be a dict or None, got "
                    f"{type(self.engine_view).__name__}"
                )
            view = _json_native(self.engine_view, "Trace.engine_view")
            object.__setattr__(self, "engine_view", view)


# ---------------------------------------------------------------------------
# Layout <-> JSON

_SPEC_TYPES: dict[str, type[KVCacheSpec]] = {
    "full": FullAttentionSpec,
    "sliding_window": SlidingWindowSpec,
    "chunked_local": ChunkedLocalAttentionSpec,
    "mamba": MambaSpec,
}
_SPEC_NAMES: dict[type[KVCacheSpec], str] = {cls: name for name, cls in _SPEC_TYPES.items()}


def _to_tuples(value: Any) -> Any:
    """JSON lists back to tuples, recursively: ``[[4, 8]]`` -> ``((4, 8),)``."""
    if isinstance(value, list):
        return tuple(_to_tuples(v) for v in value)
    return value


def _fields_to_json(obj: Any, tag: str, name: str) -> dict:
    """A dataclass as ``{tag: name, <every field>}`` (so new fields travel too); the
    shared form of specs and operations. Example: ``_fields_to_json(Step(8, 0), "op",
    "step")`` -> ``{"op": "step", "token_budget": 8, "num_lookahead_tokens": 0}``."""
    out: dict[str, Any] = {tag: name}
    for f in dataclasses.fields(obj):
        out[f.name] = _json_native(getattr(obj, f.name), f"{name}.{f.name}")
    return out


def _fields_from_json(data: Any, where: str, tag: str, types: Mapping[str, type], kind: str) -> Any:
    """Inverse of :func:`_fields_to_json`: the class ``types[data[tag]]`` built from the
    other fields (JSON lists back to tuples). A value that is not an object, an unknown
    ``tag`` (``kind`` names what it tags), an unknown field or one the class refuses
    raises TraceFormatError at ``where``. Example: ``{"op": "evict"}`` at
    ``operations[1]`` -> ``operations[1].op: unknown operation 'evict'; known: ...``."""
    if not isinstance(data, Mapping):
        raise TraceFormatError(f"{where} must be an object, got {data!r}")
    name = data.get(tag)
    cls = types.get(name) if isinstance(name, str) else None
    if cls is None:
        raise TraceFormatError(f"{where}.{tag}: unknown {kind} {name!r}; known: {', '.join(types)}")
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key == tag:
            continue
        if key not in known:
            raise TraceFormatError(
                f"{where}.{key}: unknown field of {name} (value {value!r}); "
                f"known: {', '.join(sorted(known))}"
            )
        kwargs[key] = _to_tuples(value)
    try:
        return cls(**kwargs)
    except KVConformError as exc:
        raise TraceFormatError(f"{where}: {exc}") from exc
    except TypeError as exc:
        raise TraceFormatError(f"{where}: cannot build {cls.__name__}: {exc}") from exc


def spec_to_json(spec: KVCacheSpec) -> dict:
    """``{"type": "sliding_window", "block_size": 4, ..., "sliding_window": 3}``.

    Every dataclass field of the spec is written, so new fields travel too.
    """
    name = _SPEC_NAMES.get(type(spec))
    if name is None:
        raise TraceFormatError(
            f"spec type {type(spec).__name__} has no trace name; known: "
            f"{', '.join(c.__name__ for c in _SPEC_NAMES)}"
        )
    return _fields_to_json(spec, "type", name)


def spec_from_json(data: Any, where: str = "spec") -> KVCacheSpec:
    """Inverse of :func:`spec_to_json`; unknown types and fields raise TraceFormatError."""
    return _fields_from_json(data, where, "type", _SPEC_TYPES, "KV cache spec type")


def layout_to_json(layout: KVCacheLayout) -> dict:
    """Every field of the layout, groups in order, each with its spec."""
    return {
        "name": layout.name,
        "num_blocks": layout.num_blocks,
        "max_model_len": layout.max_model_len,
        "enable_caching": layout.enable_caching,
        "max_in_flight_tokens": layout.max_in_flight_tokens,
        "prefix_cache_retention_interval": layout.prefix_cache_retention_interval,
        "use_eagle": layout.use_eagle,
        "num_hash_lookahead_tokens": layout.num_hash_lookahead_tokens,
        "groups": [
            {
                "layer_names": list(g.layer_names),
                "spec": spec_to_json(g.spec),
                "is_eagle_group": g.is_eagle_group,
            }
            for g in layout.groups
        ],
    }


def _require(data: Mapping, key: str, where: str) -> Any:
    if key not in data:
        raise TraceFormatError(f"{where}.{key} is missing")
    return data[key]


def _require_int(data: Mapping, key: str, where: str, optional: bool = False) -> int | None:
    value = data.get(key) if optional else _require(data, key, where)
    if value is None and optional:
        return None
    if not _is_int(value):
        raise TraceFormatError(f"{where}.{key} must be an integer, got {value!r}")
    return value


def layout_from_json(data: Any, where: str = "layout") -> KVCacheLayout:
    """Inverse of :func:`layout_to_json`; errors name the field (``layout.groups[1].spec``)."""
    if not isinstance(data, Mapping):
        raise TraceFormatError(f"{where} must be an object, got {data!r}")
    groups_data = _require(data, "groups", where)
    if not isinstance(groups_data, list):
        raise TraceFormatError(f"{where}.groups must be a list, got {groups_data!r}")
    groups = []
    for index, g in enumerate(groups_data):
        gwhere = f"{where}.groups[{index}]"
        if not isinstance(g, Mapping):
            raise TraceFormatError(f"{gwhere} must be an object, got {g!r}")
        names = _require(g, "layer_names", gwhere)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise TraceFormatError(f"{gwhere}.layer_names must be a list of strings, got {names!r}")
        spec = spec_from_json(_require(g, "spec", gwhere), f"{gwhere}.spec")
        eagle_group = g.get("is_eagle_group", False)
        if not isinstance(eagle_group, bool):
            raise TraceFormatError(
                f"{gwhere}.is_eagle_group must be a boolean, got {eagle_group!r}"
            )
        groups.append(KVCacheGroup(tuple(names), spec, eagle_group))
    enable_caching = data.get("enable_caching", True)
    if not isinstance(enable_caching, bool):
        raise TraceFormatError(f"{where}.enable_caching must be a boolean, got {enable_caching!r}")
    use_eagle = data.get("use_eagle", False)
    if not isinstance(use_eagle, bool):
        raise TraceFormatError(f"{where}.use_eagle must be a boolean, got {use_eagle!r}")
    name = data.get("name", "")
    if not isinstance(name, str):
        raise TraceFormatError(f"{where}.name must be a string, got {name!r}")
    try:
        return KVCacheLayout(
            groups=tuple(groups),
            num_blocks=_require_int(data, "num_blocks", where),
            max_model_len=_require_int(data, "max_model_len", where),
            enable_caching=enable_caching,
            max_in_flight_tokens=_require_int(data, "max_in_flight_tokens", where, optional=True),
            prefix_cache_retention_interval=_require_int(
                data, "prefix_cache_retention_interval", where, optional=True
            ),
            use_eagle=use_eagle,
            num_hash_lookahead_tokens=_require_int(
                data, "num_hash_lookahead_tokens", where, optional=True
            )
            or 0,
            name=name,
        )
    except KVConformError as exc:
        if isinstance(exc, TraceFormatError):
            raise
        raise TraceFormatError(f"{where}: {exc}") from exc


# ---------------------------------------------------------------------------
# Operations <-> JSON


def operation_to_json(op: Operation) -> dict:
    """``{"op": "<name>", <fields>}``; token tuples become lists."""
    name = _OP_NAMES.get(type(op))
    if name is None:
        raise TraceFormatError(f"not an Operation: {op!r}")
    return _fields_to_json(op, "op", name)


def operation_from_json(data: Any, where: str = "operation") -> Operation:
    """Inverse of :func:`operation_to_json`; unknown ops and fields raise TraceFormatError."""
    return _fields_from_json(data, where, "op", _OP_TYPES, "operation")


# ---------------------------------------------------------------------------
# Trace <-> JSON


def mode_from_json(data: Any, where: str = "mode") -> ServingMode:
    """A :class:`ServingMode` from ``{"async_scheduling": bool, "admission_gate": bool}``
    (missing fields: their defaults; unknown fields are an error)."""
    if not isinstance(data, Mapping):
        raise TraceFormatError(f"{where} must be an object, got {data!r}")
    known = {f.name for f in dataclasses.fields(ServingMode)}
    for key in data:
        if key not in known:
            raise TraceFormatError(f"{where}.{key}: unknown field of ServingMode")
    try:
        return ServingMode(**dict(data))
    except KVConformError as exc:
        raise TraceFormatError(f"{where}: {exc}") from exc


def trace_to_json(trace: Trace) -> dict:
    """The whole trace as JSON data, tagged ``"format": "kvconform-trace/1"``."""
    return {
        "format": TRACE_FORMAT,
        "seed": trace.seed,
        "layout": layout_to_json(trace.layout),
        "mode": dataclasses.asdict(trace.mode),
        "operations": [operation_to_json(op) for op in trace.operations],
        "observed": [dict(r) for r in trace.observed],
        "failure": trace.failure,
        **({"engine_view": trace.engine_view} if trace.engine_view is not None else {}),
    }


def _check_format(data: Mapping, where: str) -> None:
    tag = data.get("format")
    if tag == TRACE_FORMAT:
        return
    if isinstance(tag, str) and tag.startswith(_FORMAT_PREFIX):
        raise TraceFormatError(
            f"{where}.format: unsupported trace version {tag!r}; this kvconform reads "
            f"{TRACE_FORMAT!r}"
        )
    raise TraceFormatError(
        f"{where}.format: not a kvconform trace (expected {TRACE_FORMAT!r}, got {tag!r})"
    )


def check_limits(layout: KVCacheLayout, operations: tuple[Operation, ...], where: str) -> None:
    """The size and range limits of a loaded trace (``MAX_*`` of this module): the pool,
    ``max_model_len``, groups, operations, token ids, and every request's prompt plus
    output within ``max_model_len``.

    Example: ``Arrive("r0", prompt=(1,) * 10, output=(2,) * 10)`` under
    ``max_model_len = 16`` fails: the request would reach 20 tokens.
    """
    bounds = (
        ("layout.num_blocks", layout.num_blocks, MAX_NUM_BLOCKS),
        ("layout.max_model_len", layout.max_model_len, MAX_MODEL_LEN),
        ("layout.groups", len(layout.groups), MAX_GROUPS),
        ("operations", len(operations), MAX_OPERATIONS),
    )
    for name, value, most in bounds:
        if value > most:
            raise TraceFormatError(f"{where}.{name} is {value}, more than the limit {most}")
    for index, op in enumerate(operations):
        if isinstance(op, Arrive):
            length = len(op.prompt) + len(op.output)
            if length > layout.max_model_len:
                raise TraceFormatError(
                    f"{where}.operations[{index}] (arrive {op.request_id!r}): prompt "
                    f"{len(op.prompt)} + output {len(op.output)} tokens exceed max_model_len "
                    f"{layout.max_model_len}"
                )
            big = max(op.prompt + op.output)
            if big > MAX_TOKEN_ID:
                raise TraceFormatError(
                    f"{where}.operations[{index}] (arrive {op.request_id!r}): token id {big} "
                    f"is above the limit {MAX_TOKEN_ID}"
                )
        elif isinstance(op, Step) and op.num_lookahead_tokens > layout.max_model_len:
            raise TraceFormatError(
                f"{where}.operations[{index}] (step): num_lookahead_tokens "
                f"{op.num_lookahead_tokens} exceeds max_model_len {layout.max_model_len}"
            )


def trace_from_json(data: Any, where: str = "trace") -> Trace:
    """Inverse of :func:`trace_to_json`. Also checks request references
    (:func:`validate_references`) and the limits (:func:`check_limits`)."""
    if not isinstance(data, Mapping):
        raise TraceFormatError(f"{where} must be a JSON object, got {type(data).__name__}")
    _check_format(data, where)
    layout_data = _require(data, "layout", where)
    if isinstance(layout_data, Mapping):  # before building: a huge pool must not be built
        for key, most in (("num_blocks", MAX_NUM_BLOCKS), ("max_model_len", MAX_MODEL_LEN)):
            value = layout_data.get(key)
            if _is_int(value) and value > most:
                raise TraceFormatError(
                    f"{where}.layout.{key} is {value}, more than the limit {most}"
                )
    layout = layout_from_json(layout_data, f"{where}.layout")
    mode = mode_from_json(data.get("mode", {}), f"{where}.mode")
    ops_data = _require(data, "operations", where)
    if not isinstance(ops_data, list):
        raise TraceFormatError(f"{where}.operations must be a list, got {ops_data!r}")
    if len(ops_data) > MAX_OPERATIONS:
        raise TraceFormatError(
            f"{where}.operations holds {len(ops_data)} operations, more than the limit "
            f"{MAX_OPERATIONS}"
        )
    operations = tuple(
        operation_from_json(op, f"{where}.operations[{i}]") for i, op in enumerate(ops_data)
    )
    try:
        validate_references(operations)
    except TraceFormatError as exc:
        raise TraceFormatError(f"{where}: {exc}") from exc
    check_limits(layout, operations, where)
    seed = _require_int(data, "seed", where, optional=True)
    observed = data.get("observed", [])
    if not isinstance(observed, list):
        raise TraceFormatError(f"{where}.observed must be a list, got {observed!r}")
    failure = data.get("failure")
    try:
        return Trace(
            layout=layout,
            mode=mode,
            operations=operations,
            seed=seed,
            observed=tuple(observed),
            failure=failure,
            engine_view=data.get("engine_view"),
        )
    except TraceFormatError as exc:
        raise TraceFormatError(f"{where}: {exc}") from exc


def trace_to_text(trace: Trace, compact: bool = False) -> str:
    """Canonical JSON text: sorted keys and a trailing newline; 2-space indent, or no
    white space at all with ``compact`` (bench traces with 2k-token prompts)."""
    data = trace_to_json(trace)
    if compact:
        return json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n"
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def write_trace(trace: Trace, path: str | Path, compact: bool = False) -> Path:
    """Write ``trace`` to ``path`` atomically (a temporary file, then a rename), creating
    the parent directory. The one writer of trace files; returns ``path``."""
    try:
        return write_text_atomic(path, trace_to_text(trace, compact), "the trace file")
    except OutputWriteError as exc:
        raise OSError(str(exc)) from None


def save_trace(trace: Trace, directory: str | Path = DEFAULT_FAILURE_DIR) -> Path:
    """Write ``<directory>/<UTC time>-<8 hex of the content's sha256>.json``, once.

    Example name: ``20250101T120000Z-1a2b3c4d.json``. The digest leaves the seed and the
    engine view out, so the same failure found again (by another seed of a fuzz campaign,
    or a second run) is not written again: the path already there is returned. The
    directory is created.
    Returns the path of the trace.
    """
    digest = hashlib.sha256(
        trace_to_text(dataclasses.replace(trace, seed=None, engine_view=None)).encode("utf-8")
    ).hexdigest()[:8]
    directory = Path(directory)
    if directory.is_dir():
        existing = sorted(directory.glob(f"*-{digest}.json"))
        if existing:
            return existing[0]
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return write_trace(trace, directory / f"{stamp}-{digest}.json")


def load_trace(path: str | Path) -> Trace:
    """Read a trace file; errors name the path (and the field, for format errors)."""
    path = Path(path)
    try:
        data = read_json(path, "trace file", MAX_TRACE_BYTES)
    except InputError as exc:
        raise TraceFormatError(str(exc)) from None
    try:
        return trace_from_json(data)
    except TraceFormatError as exc:
        raise TraceFormatError(f"trace file {str(path)!r}: {exc}") from exc
