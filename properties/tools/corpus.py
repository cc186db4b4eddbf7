"""The conformance corpus: traces with their expected results, replayed without Hypothesis.

``kvconform corpus export DIR`` draws traces deterministically (fixed seeds, no example
database) from the strategies, mode by mode (:data:`MODES`: every spec type alone,
hybrids, caching off, and every model preset), runs each on the reference with every
invariant on, and writes, per trace, the reference's answer to every call the exact
level compares (hits, new block ids, block tables, free counts, free-queue order). The
format is ``docs/corpus-format.md`` (``kvconform-corpus/1``).

``kvconform corpus run DIR --engine ... --level universal|exact`` replays every case
through the deterministic scheduler: ``universal`` runs the invariants the corpus names,
``exact`` also compares each call with the recorded answer (:class:`RecordedEngine`
stands where the reference stands in :class:`properties.checks.lockstep.LockstepEngine`),
so the corpus alone says what is right. A mismatch names the case, the operation, the
expected call and both values, e.g.::

    FAIL 003-full (cases/003-full.json): operation 5 Step(token_budget=7, ...), expected
    call 12 allocate_slots: [exact_match] new blocks of allocate_slots('r1', ...): the
    corpus gives [[5]], rust-block-manager gives [[6]]
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from properties.checks.registry import INVARIANTS, PropertyViolation
from properties.core.allocation import Allocation, TakesAllocations, allocate
from properties.core.engine import (
    BlockIds,
    CacheHit,
    EngineError,
    KnownDivergenceMet,
    RequestInput,
    UnsupportedLayoutError,
)
from properties.core.json_input import InputError, read_json
from properties.core.output_files import OutputPathError, check_output_dir, write_text_atomic
from properties.core.proxy import EngineProxy
from properties.core.trace import (
    TRACE_FORMAT,
    Abort,
    Arrive,
    Preempt,
    ResetPrefixCache,
    Step,
    Trace,
    trace_from_json,
    trace_to_json,
)
from properties.engines.under_test import EngineUnderTest, resolve_engine
from properties.runner.config import CheckConfig
from properties.runner.run import TraceRun, excused_config, failure_kind
from reference.errors import KVConformError

#: The value of ``"format"`` in a corpus manifest and in each case file.
CORPUS_FORMAT = "kvconform-corpus/1"
_FORMAT_PREFIX = "kvconform-corpus/"
MANIFEST = "manifest.json"

#: The spec types an engine may support alone, each with modes of its own in the corpus.
_KINDS: tuple[str, ...] = ("full", "sliding_window", "chunked_local", "mamba")

#: Mode name -> what its layouts are: ``kind:K`` (generated layouts of spec type K only;
#: ``kind:K+L``: of these two types, both present or not), ``pressure:K`` (type K in a
#: pool of 5 to 12 blocks, where requests wait, are preempted and evict hits),
#: ``no-caching:K`` (type K, prefix caching off), ``hybrid`` (any mix), ``no-caching``
#: (any mix, prefix caching off), ``preset:NAME``. Every engine kind gets cases it can
#: run: of the default 88, a full-attention-only engine runs 12 (``kind``, ``pressure``
#: and ``no-caching`` of ``full``; 4 of 52 before these modes), a full + sliding-window
#: one (SGLang, LMDeploy) 47, a Mamba-only one 13, full + Mamba 33.
MODES: tuple[str, ...] = (
    *(f"kind:{k}" for k in _KINDS),
    "kind:full+sliding_window",
    *(f"pressure:{k}" for k in _KINDS),
    *(f"no-caching:{k}" for k in _KINDS),
    "hybrid",
    "no-caching",
    "preset:mistral-7b",
    "preset:gpt-oss",
    "preset:gemma2",
    "preset:gemma3",
    "preset:llama4-scout",
    "preset:qwen3-next",
    "preset:jamba",
)


class CorpusError(KVConformError):
    """A corpus directory or case file that cannot be read (names the file and field)."""


class CorpusMismatch(AssertionError):
    """The engine made a call sequence the corpus has no record of (it diverged)."""


# ---------------------------------------------------------------------------
# Recording and replaying the reference's answers


def _table(block_ids) -> list[list[int]]:
    return [[int(b) for b in row] for row in block_ids]


def _call_args(call: str, args: tuple) -> dict[str, Any]:
    """The arguments a corpus entry keeps to identify a call (not the whole prompt)."""
    if call == "add_request":
        return {"request_id": args[0].request_id}
    if call == "append_output_tokens":
        return {"request_id": args[0], "token_ids": [int(t) for t in args[1]]}
    if call == "set_num_computed_tokens":
        return {"request_id": args[0], "num_computed_tokens": int(args[1])}
    if call == "allocate_slots":
        request_id, n, n_hit, hit, lookahead = args
        return {
            "request_id": request_id,
            "num_new_tokens": int(n),
            "num_new_computed_tokens": int(n_hit),
            "with_hit": hit is not None,
            "num_lookahead_tokens": int(lookahead),
        }
    if call in ("get_computed_blocks", "free", "remove_request"):
        return {"request_id": args[0]}
    return {}


def _result_json(call: str, result: Any) -> Any:
    if call == "get_computed_blocks":
        return {"num_tokens": int(result.num_tokens), "block_ids": _table(result.block_ids)}
    if call == "allocate_slots":
        return None if result is None else _table(result)
    if call == "reset_prefix_cache":
        return bool(result)
    return None


def _default_mode(allocation: Allocation) -> None:
    """A corpus entry keeps the five protocol arguments of an allocation: the corpus
    covers the default serving mode only."""
    if allocation.keywords():
        raise CorpusError(
            f"{allocation.describe()}: the corpus records the default serving mode only"
        )


class RecordingEngine(EngineProxy):
    """Wraps the reference; records every call the lockstep engine makes to it.

    ``expected`` ends up as the corpus entries: one per state-changing call,
    ``{"call", "args", "result", "after"}`` where ``after`` holds the answers to the
    queries made before the next state-changing call (``num_free_blocks``,
    ``free_queue``, ``block_ids`` per request)."""

    name = "reference"

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.expected: list[dict[str, Any]] = []

    def _mutate(self, call: str, *args):
        return self._recorded(call, args, getattr(self.inner, call)(*args))

    def _recorded(self, call: str, args: tuple, result: Any) -> Any:
        self.expected.append(
            {"call": call, "args": _call_args(call, args), "result": _result_json(call, result)}
        )
        return result

    def _after(self) -> dict[str, Any]:
        if not self.expected:
            raise CorpusError("the reference was queried before any call")
        return self.expected[-1].setdefault("after", {})

    def add_request(self, request: RequestInput) -> None:
        self._mutate("add_request", request)

    def append_output_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._mutate("append_output_tokens", request_id, token_ids)

    def set_num_computed_tokens(self, request_id: str, num_computed_tokens: int) -> None:
        self._mutate("set_num_computed_tokens", request_id, num_computed_tokens)

    def new_step(self) -> None:
        self._mutate("new_step")

    def get_computed_blocks(self, request_id: str) -> CacheHit:
        return self._mutate("get_computed_blocks", request_id)

    def allocate(self, allocation: Allocation) -> BlockIds | None:
        _default_mode(allocation)
        result = allocate(self.inner, allocation)
        return self._recorded("allocate_slots", allocation.positional(), result)

    def free(self, request_id: str) -> None:
        self._mutate("free", request_id)

    def remove_request(self, request_id: str) -> None:
        self._mutate("remove_request", request_id)

    def reset_prefix_cache(self) -> bool:
        return self._mutate("reset_prefix_cache")

    def get_block_ids(self, request_id: str) -> BlockIds:
        result = self.inner.get_block_ids(request_id)
        self._after().setdefault("block_ids", {})[request_id] = _table(result)
        return result

    def num_free_blocks(self) -> int:
        result = self.inner.num_free_blocks()
        self._after()["num_free_blocks"] = int(result)
        return result

    def free_queue(self) -> list[int]:
        result = self.inner.free_queue()
        self._after()["free_queue"] = [int(b) for b in result]
        return result


class RecordedEngine(TakesAllocations):
    """The recorded answers of the reference, served in order (exact level of ``run``).

    A state-changing call must be the next entry (same call, same identifying
    arguments). Queries are answered from the state the consumed entries recorded: a
    request's table is the one recorded after its own latest allocation (only its own
    calls change it), the free count and free queue are those recorded after the latest
    allocation or free (no other call changes the pool). So the answers do not depend
    on when the lockstep engine asks (per call, or after a batch of allocations for an
    engine with ``schedule_step``). Anything else raises :class:`CorpusMismatch`."""

    name = "the corpus"

    def __init__(self, expected: Sequence[dict[str, Any]]) -> None:
        self.expected = list(expected)
        self.cursor = 0  # entries consumed
        self.tables: dict[str, list[list[int]]] = {}
        self.pool: dict[str, Any] = {}

    def _next(self, call: str, *args) -> Any:
        wanted = _call_args(call, args)
        if self.cursor >= len(self.expected):
            raise CorpusMismatch(
                f"the engine's run goes on with {call}({wanted}) after the last of the "
                f"corpus's {len(self.expected)} expected calls"
            )
        entry = self.expected[self.cursor]
        if entry["call"] != call or entry.get("args", {}) != wanted:
            raise CorpusMismatch(
                f"expected call {self.cursor} is {entry['call']}({entry.get('args', {})}), "
                f"the run makes {call}({wanted})"
            )
        self.cursor += 1
        after = entry.get("after", {})
        if call == "free":
            self.tables.pop(wanted["request_id"], None)
        self.tables.update(after.get("block_ids", {}))
        self.pool.update({k: after[k] for k in ("num_free_blocks", "free_queue") if k in after})
        return entry.get("result")

    def _query(self, what: str, value: Any) -> Any:
        if value is None:
            raise CorpusMismatch(
                f"the corpus has no {what} at expected call {self.cursor - 1} "
                f"({self.expected[self.cursor - 1]['call'] if self.cursor else 'none'})"
            )
        return value

    @property
    def current(self) -> str:
        """The last expected call consumed, as reports name it."""
        if not self.cursor:
            return "before the first expected call"
        return f"expected call {self.cursor - 1} {self.expected[self.cursor - 1]['call']}"

    def add_request(self, request: RequestInput) -> None:
        self._next("add_request", request)

    def append_output_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._next("append_output_tokens", request_id, token_ids)

    def set_num_computed_tokens(self, request_id: str, num_computed_tokens: int) -> None:
        self._next("set_num_computed_tokens", request_id, num_computed_tokens)

    def new_step(self) -> None:
        self._next("new_step")

    def get_computed_blocks(self, request_id: str) -> CacheHit:
        result = self._next("get_computed_blocks", request_id)
        return CacheHit(tuple(tuple(row) for row in result["block_ids"]), result["num_tokens"])

    def allocate(self, allocation: Allocation) -> BlockIds | None:
        _default_mode(allocation)
        result = self._next("allocate_slots", *allocation.positional())
        return None if result is None else tuple(tuple(row) for row in result)

    def free(self, request_id: str) -> None:
        self._next("free", request_id)

    def remove_request(self, request_id: str) -> None:
        self._next("remove_request", request_id)

    def reset_prefix_cache(self) -> bool:
        return bool(self._next("reset_prefix_cache"))

    def get_block_ids(self, request_id: str) -> BlockIds:
        table = self._query(f"block table of {request_id!r}", self.tables.get(request_id))
        return tuple(tuple(row) for row in table)

    def num_free_blocks(self) -> int:
        return self._query("free block count", self.pool.get("num_free_blocks"))

    def free_queue(self) -> list[int]:
        return list(self._query("free queue", self.pool.get("free_queue")))


# ---------------------------------------------------------------------------
# Export


def mode_strategy(mode: str, max_len: int):
    """The layouts of ``mode`` (one of :data:`MODES`)."""
    from properties.generate import strategies as kvst

    kind, _, name = mode.partition(":")
    kinds = tuple(name.split("+")) if name else tuple(_KINDS)
    if kind == "kind":
        return kvst.layouts(kinds=kinds, max_len=max_len)
    if kind == "pressure":
        return kvst.layouts(kinds=kinds, max_len=max_len, max_groups=2, max_blocks=12)
    if kind == "hybrid":
        return kvst.layouts(max_len=max_len)
    if kind == "no-caching":
        return kvst.layouts(kinds=kinds, max_len=max_len, enable_caching=False)
    if kind == "preset":
        return kvst.preset_layouts(names=[name], max_len=max_len)
    raise ValueError(f"unknown corpus mode {mode!r}; known: {', '.join(MODES)}")


def draw_traces(mode: str, count: int, max_ops: int = 40, max_len: int = 64) -> list[Trace]:
    """``count`` traces of ``mode``, the same every time: Hypothesis generation from a
    seed derived from the mode's name, no example database, traces of at least 6
    operations with at least 2 requests kept in the order drawn, each extended by
    :func:`with_resends`."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    from properties.generate import strategies as kvst

    drawn: list[Trace] = []

    @hseed(zlib.crc32(mode.encode()))
    @settings(
        max_examples=6 * count,
        database=None,
        phases=(Phase.generate,),
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(kvst.traces(mode_strategy(mode, max_len), max_ops=max_ops))
    def collect(trace: Trace) -> None:
        arrivals = sum(isinstance(op, Arrive) for op in trace.operations)
        if len(drawn) < count and len(trace.operations) >= 6 and arrivals >= 2:
            drawn.append(trace)

    collect()
    if len(drawn) < count:
        raise CorpusError(f"mode {mode}: drew only {len(drawn)} usable traces of {count}")
    return [with_resends(trace) for trace in drawn]


#: Steps appended after the resent requests (each with a budget of ``max_model_len``).
RESEND_STEPS = 6


def with_resends(trace: Trace, count: int = 2) -> Trace:
    """``trace`` followed by its first ``count`` requests sent again (same prompt, output,
    salt and LoRA, new ids) and :data:`RESEND_STEPS` steps, so that every case exercises
    prefix hits (a retry, or the same system prompt again). Example: a trace whose
    arrivals are ``r0, r1, r2`` gets ``r3`` (= r0) and ``r4`` (= r1) at its end."""
    arrivals = [op for op in trace.operations if isinstance(op, Arrive)]
    extra: list = [
        Arrive(f"r{len(arrivals) + i}", op.prompt, op.output, op.cache_salt, op.lora_name)
        for i, op in enumerate(arrivals[:count])
    ]
    extra += [Step(trace.layout.max_model_len)] * RESEND_STEPS
    return dataclasses.replace(trace, operations=trace.operations + tuple(extra))


def record_case(trace: Trace) -> list[dict[str, Any]]:
    """Run ``trace`` on the reference (every invariant on) and return its expected calls."""
    from properties.engines.reference import make_engine

    recorder = RecordingEngine(make_engine(trace.layout))
    run = TraceRun(
        CheckConfig(engine="reference", level="exact"),
        trace.layout,
        resolve_engine("reference"),
        mode=trace.mode,
        expected=recorder,
    )
    for op in trace.operations:
        run.apply(op)
    return recorder.expected


def _coverage(trace: Trace, expected: list[dict[str, Any]]) -> dict[str, int]:
    counts = {
        "operations": len(trace.operations),
        "preempt_ops": sum(isinstance(op, Preempt) for op in trace.operations),
        "abort_ops": sum(isinstance(op, Abort) for op in trace.operations),
        "reset_ops": sum(isinstance(op, ResetPrefixCache) for op in trace.operations),
        "lookahead_steps": sum(
            isinstance(op, Step) and op.num_lookahead_tokens > 0 for op in trace.operations
        ),
        "salted_or_lora": sum(
            isinstance(op, Arrive) and (op.cache_salt is not None or op.lora_name is not None)
            for op in trace.operations
        ),
        "calls": len(expected),
        "hits": sum(
            e["call"] == "get_computed_blocks" and e["result"]["num_tokens"] > 0 for e in expected
        ),
        "refused_allocations": sum(
            e["call"] == "allocate_slots" and e["result"] is None for e in expected
        ),
    }
    return counts


def export_corpus(directory: str | Path, per_mode: int = 4, modes: Sequence[str] = MODES) -> dict:
    """Write the corpus to ``directory`` (created; existing case files are replaced) and
    return its manifest."""
    if per_mode < 1:
        raise CorpusError(f"--per-mode must be >= 1, got {per_mode}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise CorpusError(f"unknown corpus modes {unknown}; known: {', '.join(MODES)}")
    root = _corpus_root(directory)

    try:
        check_output_dir(root, "corpus export")
    except OutputPathError as exc:
        raise CorpusError(str(exc)) from None
    cases_dir = root / "cases"
    cases_dir.mkdir(parents=True, exist_ok=True)
    for old in cases_dir.glob("*.json"):
        old.unlink()
    cases = []
    coverage: dict[str, int] = {}
    spec_types_seen: set[str] = set()
    index = 0
    for mode in modes:
        for trace in draw_traces(mode, per_mode):
            expected = record_case(trace)
            name = f"{index:03d}-{mode.replace(':', '-')}"
            index += 1
            path = cases_dir / f"{name}.json"
            case = {
                "format": CORPUS_FORMAT,
                "name": name,
                "mode": mode,
                "trace": trace_to_json(trace),
                "expected": expected,
            }
            write_text_atomic(path, json.dumps(case, separators=(",", ":")) + "\n", "corpus case")
            counts = _coverage(trace, expected)
            for key, value in counts.items():
                coverage[key] = coverage.get(key, 0) + value
            spec_types_seen.update(s.type_name for s in trace.layout.specs)
            cases.append(
                {
                    "name": name,
                    "file": f"cases/{name}.json",
                    "mode": mode,
                    "spec_types": sorted({s.type_name for s in trace.layout.specs}),
                    "operations": counts["operations"],
                    "calls": counts["calls"],
                }
            )
    manifest = {
        "format": CORPUS_FORMAT,
        "trace_format": TRACE_FORMAT,
        "kvconform_version": _version(),
        "modes": list(modes),
        "universal_checks": list(INVARIANTS),
        "spec_types": sorted(spec_types_seen),
        "coverage": coverage,
        "cases": cases,
    }
    write_text_atomic(root / MANIFEST, json.dumps(manifest, indent=1) + "\n", "corpus manifest")
    return manifest


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvconform")
    except PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------------
# Run


#: The largest corpus file (manifest or case) kvconform reads.
MAX_CORPUS_FILE_BYTES = 64 * 1024 * 1024


def _read_json(path: Path, what: str) -> Any:
    try:
        return read_json(path, what, MAX_CORPUS_FILE_BYTES)
    except InputError as exc:
        raise CorpusError(str(exc)) from None


def _corpus_root(directory: str | Path) -> Path:
    """The corpus directory; a path that is not a directory is a usage error."""
    root = Path(directory)
    try:
        if root.exists() and not root.is_dir():
            raise CorpusError(f"{root} is a file, not a corpus directory")
    except OSError as exc:  # a symbolic link loop, a name too long
        raise CorpusError(f"{root}: {exc.strerror or exc}") from None
    return root


def _case_path(root: Path, name: str, index: int) -> Path:
    """Case ``index`` of the manifest, a file inside the corpus: a manifest naming a path
    outside it (``../../etc/passwd``, an absolute path, a link out) is refused."""
    try:
        inside = (root / name).resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError) as exc:  # a symbolic link loop (RuntimeError in 3.11)
        raise CorpusError(f"{root / MANIFEST}: cases[{index}] ({name!r}): {exc}") from None
    if not inside:
        raise CorpusError(
            f"{root / MANIFEST}: cases[{index}] names {name!r}, outside the corpus directory"
        )
    return root / name


def _check_format(data: Any, path: Path) -> None:
    fmt = data.get("format") if isinstance(data, dict) else None
    if fmt == CORPUS_FORMAT:
        return
    if isinstance(fmt, str) and fmt.startswith(_FORMAT_PREFIX):
        raise CorpusError(
            f"{path}: unsupported corpus version {fmt!r} (this kvconform reads {CORPUS_FORMAT})"
        )
    raise CorpusError(f"{path}: not a kvconform corpus file (format {fmt!r})")


def load_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    manifest = _read_json(path, "corpus manifest")
    _check_format(manifest, path)
    if not isinstance(manifest.get("cases"), list):
        raise CorpusError(f"{path}: 'cases' must be a list")
    return manifest


@dataclass
class CaseResult:
    name: str
    file: str
    status: str  # "pass", "fail", "skip"
    message: str = ""
    #: a failure's kind (properties.runner.run.failure_kind): "property" or "engine"
    kind: str = ""


@dataclass
class CorpusReport:
    results: list[CaseResult] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def passed(self) -> bool:
        return self.count("fail") == 0 and self.count("pass") > 0


def run_case(path: Path, level: str, engine: EngineUnderTest, checks: Sequence[str]) -> CaseResult:
    """Replay one case file; pass, fail (with the message) or skip (with the reason)."""
    data = _read_json(path, "corpus case")
    _check_format(data, path)
    name = data.get("name", path.stem)
    try:
        trace = trace_from_json(data.get("trace"), f"{path}: trace")
    except KVConformError as exc:
        raise CorpusError(str(exc)) from None
    kinds = engine.spec_types
    unsupported = sorted({s.type_name for s in trace.layout.specs} - set(kinds))
    if unsupported:
        return CaseResult(name, str(path), "skip", f"spec types {unsupported} not supported")
    for divergence in engine.known_divergences:
        if not divergence.checks and divergence.applies_to(trace.layout, trace.mode):
            return CaseResult(
                name,
                str(path),
                "skip",
                f"known divergence {divergence.name} ({divergence.finding})",
            )
    expected = RecordedEngine(data.get("expected", [])) if level == "exact" else None
    disabled = frozenset(set(INVARIANTS) - set(checks))
    config = CheckConfig(engine=engine.name, level=level, disabled=disabled)
    config = excused_config(config, engine, trace.layout)
    try:
        run = TraceRun(config, trace.layout, engine, mode=trace.mode, expected=expected)
    except UnsupportedLayoutError as exc:
        return CaseResult(name, str(path), "skip", f"unsupported layout: {exc}")
    op_index = -1
    try:
        for op in trace.operations:
            op_index += 1
            run.apply(op)
        if expected is not None and expected.cursor != len(expected.expected):
            raise CorpusMismatch(
                f"the run ended after {expected.cursor} of the corpus's "
                f"{len(expected.expected)} expected calls"
            )
    except KnownDivergenceMet as met:  # met at run time: skipped as a layout would be
        return CaseResult(name, str(path), "skip", f"known divergence met: {met}")
    except (PropertyViolation, CorpusMismatch, EngineError, KVConformError, AssertionError) as exc:
        where = f"operation {op_index} {trace.operations[op_index]!r}" if op_index >= 0 else "start"
        if expected is not None:
            where += f", {expected.current}"
        kind = "engine error" if isinstance(exc, EngineError) else type(exc).__name__
        return CaseResult(name, str(path), "fail", f"{where}: {kind}: {exc}", failure_kind(exc))
    return CaseResult(name, str(path), "pass")


def run_corpus(
    directory: str | Path,
    engine: str,
    level: str = "universal",
    on_result: Callable[[CaseResult], None] | None = None,
) -> CorpusReport:
    """Replay every case of the corpus in ``directory`` on ``engine`` at ``level``."""
    root = _corpus_root(directory)
    manifest = load_manifest(root)
    checks = manifest.get("universal_checks", list(INVARIANTS))
    unknown = sorted(set(checks) - set(INVARIANTS))
    if unknown:
        raise CorpusError(
            f"{root / MANIFEST}: universal_checks names checks this kvconform does not have: "
            f"{unknown}"
        )
    # the corpus runs the engine in this process, as it always has (no isolation)
    under_test = resolve_engine(engine, isolation="none")
    report = CorpusReport()
    for index, entry in enumerate(manifest["cases"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            raise CorpusError(f"{root / MANIFEST}: cases[{index}] needs a 'file'")
        path = _case_path(root, entry["file"], index)
        result = run_case(path, level, under_test, checks)
        report.results.append(result)
        if on_result is not None:
            on_result(result)
    return report
