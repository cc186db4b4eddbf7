"""What the engine under test showed after each operation of a failing trace, recorded
when the trace is saved, so that a page of the failure is drawn from the file alone.

A trace travels (bug reports, CI artifacts) and is untrusted data
(``docs/threat-model.md``): ``kvconform report`` must never load or start the engine a
file names. So the engine's side of the report is recorded here, by the run that found
the failure, with the engine the user chose on the command line: the trace is replayed
once on that engine (its checks on, stopping at the failure) and a snapshot taken after
every operation (:func:`snapshot`). The reference's side needs no recording: the
reference is kvconform's own specification, and the report replays it.

A snapshot, as JSON data: ``tables`` (request id -> one list of block ids per group, for
the requests holding blocks), ``free`` (the free count), ``queue`` (the head of the free
queue, front first, or None), ``cached`` (cached block ids, at most
:data:`CACHED_SHOWN`, with ``cached_count``), ``ref_counts`` (block id -> references,
for the blocks that have any, or None) and ``pools`` (pool name -> free count, for
engines with separate pools, or None): every per-block field the engine exposes.

Bounds: no view is recorded for a trace of more than :data:`MAX_VIEW_OPERATIONS`
operations, nor for a failure that was a missed deadline (replaying a hung engine would
wait out every deadline again; its view says why instead); a view larger than
:data:`MAX_VIEW_BYTES` keeps its last snapshots only (the earlier ones become ``None``).

Worked example: a two-operation trace (an arrival and a step) of one full-attention
group whose step allocated block 1 for ``r0`` records ``{"engine": "reference",
"steps": [{"tables": {}, "free": 15, ...}, {"tables": {"r0": [[1]]}, "free": 14,
...}], "failure": None}``.
"""

from __future__ import annotations

import json
from typing import Any

from properties.core.engine import CallTimeoutError
from properties.core.trace import Trace
from properties.engines.under_test import EngineUnderTest
from properties.runner.config import CheckConfig
from properties.runner.run import TraceRun
from reference.errors import KVConformError

#: The most operations of a trace whose engine view is recorded (a shrunk trace has a
#: few dozen; an unshrunk large-tier trace thousands).
MAX_VIEW_OPERATIONS = 400
#: The most bytes of JSON an engine view may take in a trace file.
MAX_VIEW_BYTES = 4 * 1024 * 1024
#: Free-queue entries kept per snapshot.
QUEUE_HEAD = 16
#: Cached blocks kept per snapshot.
CACHED_SHOWN = 64
#: The engine's last calls kept at the failing operation.
LAST_CALLS = 4
#: The exception names of a missed deadline (``failure["property"]`` of a trace).
TIMEOUT_ERRORS = frozenset({"CallTimeoutError", "ExecTimeoutError"})


def snapshot(run: TraceRun) -> dict[str, Any]:
    """The engine's state now, as the checks read it (see the module docstring); a read
    the engine cannot answer is shown as its error, never raised."""
    state = run.lockstep.checker.state
    tables: dict[str, Any] = {}
    for rid, tracked in sorted(run.lockstep.checker.requests.items()):
        if not tracked.holds_blocks:
            continue
        try:
            tables[rid] = [[int(b) for b in g] for g in run.lockstep.engine.get_block_ids(rid)]
        except Exception as exc:  # noqa: BLE001 - an engine that cannot answer is shown so
            tables[rid] = f"cannot read: {exc}"
    out: dict[str, Any] = {"tables": tables}
    out["free"] = _read(lambda: int(state.num_free()))
    out["queue"] = (
        _read(lambda: [int(b) for b in state.free_queue()[:QUEUE_HEAD]])
        if state.has_free_queue
        else None
    )
    out["cached"] = None
    if state.has_cached:
        cached = _read(
            lambda: sorted((int(c.group_id), int(c.block_id)) for c in state.cached_blocks())
        )
        if isinstance(cached, list):
            out["cached"] = [b for _g, b in cached][:CACHED_SHOWN]
            out["cached_count"] = len(cached)
    out["ref_counts"] = (
        _read(lambda: {str(int(b)): int(n) for b, n in sorted(state.ref_counts().items()) if n})
        if state.has_ref_counts
        else None
    )
    out["pools"] = (
        _read(lambda: {p.name: int(p.num_free) for p in state.pools()}) if state.has_pools else None
    )
    return out


def _read(fn) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - shown, not raised
        return f"cannot read: {exc}"


def walk(trace: Trace, config: CheckConfig, engine: EngineUnderTest) -> tuple[list, str | None]:
    """Snapshots after every operation of ``trace`` on ``engine``, and the failure text
    (None when it passes). The run stops at the first failure, whose snapshot is the
    last one and carries the engine's last calls (``calls``)."""
    snaps: list[dict] = []
    try:
        run = TraceRun(config, trace.layout, engine, trace.mode)
    except (AssertionError, KVConformError) as exc:
        return snaps, f"{type(exc).__name__}: {exc}"
    for op in trace.operations:
        try:
            run.apply(op)
        except (AssertionError, KVConformError) as exc:
            snaps.append(snapshot(run))
            # the calls that led to the failure (a lookup's hit is in no table yet)
            snaps[-1]["calls"] = [json.dumps(c)[:400] for c in run.lockstep.log[-LAST_CALLS:]]
            return snaps, f"{type(exc).__name__}: {exc}"
        snaps.append(snapshot(run))
    return snaps, None


def record_engine_view(trace: Trace, config: CheckConfig, engine: EngineUnderTest) -> dict:
    """The engine view of ``trace`` (see the module docstring): ``{"engine", "steps",
    "failure"}``, or ``{"engine", "omitted"}`` saying why none was recorded."""
    name = config.engine
    failure = trace.failure or {}
    if failure.get("property") in TIMEOUT_ERRORS:
        return {"engine": name, "omitted": "the engine missed a deadline; it is not replayed"}
    if len(trace.operations) > MAX_VIEW_OPERATIONS:
        return {
            "engine": name,
            "omitted": f"the trace has {len(trace.operations)} operations; the engine's side "
            f"is recorded for at most {MAX_VIEW_OPERATIONS}",
        }
    try:
        steps, replay_failure = walk(trace, config, engine)
    except CallTimeoutError as exc:  # (raised outside an operation: the factory)
        return {"engine": name, "omitted": f"the replay missed a deadline: {exc}"}
    return {"engine": name, "steps": _within_budget(steps), "failure": replay_failure}


def _within_budget(steps: list) -> list:
    """``steps`` with its earliest snapshots replaced by None until the JSON fits
    :data:`MAX_VIEW_BYTES` (the failing operation's is kept whatever its size)."""
    sizes = [len(json.dumps(s)) for s in steps]
    total = sum(sizes)
    out = list(steps)
    for i in range(len(out) - 1):
        if total <= MAX_VIEW_BYTES:
            break
        total -= sizes[i]
        out[i] = None
    return out
