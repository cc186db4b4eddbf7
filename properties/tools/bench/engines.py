"""Bench: scheduler-step speed of real KV cache managers against the reference.

Two recorded traces (seeded, built in code, cached as JSON under ``.kvconform/bench/``)
replay through :class:`properties.runner.scheduler.Scheduler` on each engine, with no checks and
no lockstep: only the engine's speed. Every ``Step`` operation is timed with
``time.perf_counter``; ``Arrive`` operations (which build and hash the request) are not.

The traces (``scale=1``):

* ``decode-heavy``: 256 requests, each a 2048-token prompt of random token ids (no
  sharing) and 24..40 output tokens, on the ``gemma3`` preset (5 sliding groups with
  w = 1024 + 1 full group, block size 16, ``max_model_len`` 4096, blocks for about 32
  concurrent requests, see :func:`pool_blocks`); steps with a token budget of 8192.
* ``prefix-heavy``: 256 requests, each one of 4 shared 1024-token system prompts plus a
  random 64..256-token suffix and 12..20 output tokens, on the ``gpt-oss`` preset (a
  sliding group with w = 128 + a full group, block size 16, ``max_model_len`` 2048);
  budget 4096.

Requests arrive 1..4 at a time between steps; the trace ends with as many ``Step``
operations as the reference needs to finish every request (found by replaying on the
reference while the trace is built). ``scale=k`` divides request counts, prompt lengths,
windows, budgets and the concurrency target by ``k`` (each at least 1) for quick tests.

Per engine and trace a row gives: steps, busy steps (steps that scheduled something), hit
tokens and preemptions summed over the replay (the same on every engine that matches the
reference), mean / p50 / p99 milliseconds per step, total step seconds, and the ratio of
its total to the baseline's (the first engine, normally the reference). Example::

    print(format_engine_bench(bench_engines(("reference", "vllm"))))
"""

from __future__ import annotations

import gc
import hashlib
import math
import random
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from properties.core.allocation import Allocation, allocate
from properties.core.constants import DEFAULT_BENCH_DIR
from properties.core.engine import (
    BUILTIN_ENGINES,
    BuildsAsDeployed,
    CommitsSteps,
    EngineError,
    FreesInBatch,
    HasSelfChecks,
    KVCacheEngine,
    PlansSteps,
    load_engine_factory,
)
from properties.core.proxy import EngineProxy
from properties.core.trace import (
    Arrive,
    Operation,
    Step,
    Trace,
    TraceFormatError,
    load_trace,
    write_trace,
)
from properties.engines.reference import make_engine as make_reference_engine
from properties.engines.under_test import resolve_engine
from properties.generate.presets import (
    FULL,
    MAMBA,
    ModelPreset,
    chunked,
    get_preset,
    sliding,
)
from properties.runner.scheduler import Scheduler, StepRecord
from properties.tools.bench.call_profile import CallShare, CallTime, call_shares, call_times
from properties.tools.bench.hotspots import FunctionSplit, FunctionTime, Hotspot, hotspots
from properties.tools.bench.table import aligned
from reference.errors import KVConformError
from reference.layout import KVCacheLayout
from reference.specs import cdiv

#: Token ids are drawn from ``[0, VOCAB_SIZE)``.
VOCAB_SIZE = 32_000
#: Longest run of Step operations a drain may take before the recipe is declared broken.
MAX_DRAIN_STEPS = 100_000


class BenchError(KVConformError):
    """A bench recipe or argument is invalid."""


# ---------------------------------------------------------------------------
# Trace recipes


@dataclass(frozen=True)
class TraceRecipe:
    """How one bench trace is built (all lengths in tokens, ranges inclusive).

    A prompt is ``system_prompt_len`` tokens of one of ``num_system_prompts`` shared system
    prompts (none when 0) followed by a random suffix of ``suffix_len`` tokens. Example:
    ``num_system_prompts=4, system_prompt_len=1024, suffix_len=(64, 256)`` gives prompts of
    1088..1280 tokens whose first 1024 tokens are one of 4 sequences.
    """

    name: str
    preset: str
    seed: int
    num_requests: int
    num_system_prompts: int
    system_prompt_len: int
    suffix_len: tuple[int, int]
    output_len: tuple[int, int]
    token_budget: int
    max_model_len: int
    concurrency: int
    arrivals_per_step: tuple[int, int] = (1, 4)
    block_size: int = 16
    scale_windows: int = 1

    def __post_init__(self) -> None:
        for field_name in ("num_requests", "token_budget", "max_model_len", "concurrency"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise BenchError(f"TraceRecipe.{field_name} must be an integer >= 1, got {value!r}")
        for field_name in ("suffix_len", "output_len", "arrivals_per_step"):
            lo, hi = getattr(self, field_name)
            if not 0 <= lo <= hi:
                raise BenchError(
                    f"TraceRecipe.{field_name} must be a range (lo, hi) with 0 <= lo <= hi, "
                    f"got {(lo, hi)!r}"
                )
        if self.system_prompt_len + self.suffix_len[0] < 1:
            raise BenchError(
                f"TraceRecipe {self.name!r}: prompts must hold at least 1 token, got "
                f"system_prompt_len {self.system_prompt_len} + suffix_len {self.suffix_len}"
            )
        longest = self.system_prompt_len + self.suffix_len[1] + self.output_len[1]
        if longest > self.max_model_len:
            raise BenchError(
                f"TraceRecipe {self.name!r}: longest request ({longest} tokens) exceeds "
                f"max_model_len {self.max_model_len}"
            )

    def scaled(self, scale: int) -> TraceRecipe:
        """Counts, prompt lengths, budget, windows and ``max_model_len`` divided by ``scale``
        (each at least 1 where it was; ``max_model_len`` still fits the longest request);
        output lengths stay, so that tiny traces still decode for several steps.

        Example: ``decode-heavy`` at scale 32 has 8 requests of 64-token prompts and 24..40
        output tokens, budget 256, window 1024 // 32 = 32, ``max_model_len`` 128.
        """
        if not isinstance(scale, int) or scale < 1:
            raise BenchError(f"scale must be an integer >= 1, got {scale!r}")
        if scale == 1:
            return self

        def down(n: int) -> int:
            return max(1, n // scale) if n > 0 else 0

        system_prompt_len = down(self.system_prompt_len)
        suffix_len = (down(self.suffix_len[0]), down(self.suffix_len[1]))
        longest = system_prompt_len + suffix_len[1] + self.output_len[1]
        return replace(
            self,
            num_requests=down(self.num_requests),
            system_prompt_len=system_prompt_len,
            suffix_len=suffix_len,
            token_budget=down(self.token_budget),
            max_model_len=max(self.block_size, down(self.max_model_len), longest),
            concurrency=max(2, down(self.concurrency)),
            scale_windows=self.scale_windows * scale,
        )

    def digest(self) -> str:
        """8 hex digits of the recipe; names its cache file, so a changed recipe rebuilds."""
        return hashlib.sha256(repr(self).encode("utf-8")).hexdigest()[:8]


DECODE_HEAVY = TraceRecipe(
    name="decode-heavy",
    preset="gemma3",
    seed=1,
    num_requests=256,
    num_system_prompts=0,
    system_prompt_len=0,
    suffix_len=(2048, 2048),
    output_len=(24, 40),
    token_budget=8192,
    max_model_len=4096,
    concurrency=32,
)

PREFIX_HEAVY = TraceRecipe(
    name="prefix-heavy",
    preset="gpt-oss",
    seed=2,
    num_requests=256,
    num_system_prompts=4,
    system_prompt_len=1024,
    suffix_len=(64, 256),
    output_len=(12, 20),
    token_budget=4096,
    max_model_len=2048,
    concurrency=32,
)

#: The recorded traces, in bench order.
RECIPES: tuple[TraceRecipe, ...] = (DECODE_HEAVY, PREFIX_HEAVY)

HYBRID_6 = TraceRecipe(
    name="hybrid-6",
    preset="hybrid6",
    seed=3,
    num_requests=128,
    num_system_prompts=2,
    system_prompt_len=2048,
    suffix_len=(512, 2048),
    output_len=(24, 40),
    token_budget=8192,
    max_model_len=8192,
    concurrency=32,
)


def sweep_recipe(num_requests: int, context: int) -> TraceRecipe:
    """``num_requests`` prompts of ``context`` tokens arriving at once and prefilled in
    one step (the budget and the pool hold them all), then 16 decode steps with every
    request running: the decode steps measure the cost per request-step at that
    concurrency.
    Example: ``sweep_recipe(64, 2048)`` is the trace ``sweep-64x2k``."""
    return TraceRecipe(
        name=f"sweep-{num_requests}x{context // 1024}k",
        preset="gpt-oss",
        seed=4,
        num_requests=num_requests,
        num_system_prompts=0,
        system_prompt_len=0,
        suffix_len=(context, context),
        output_len=(16, 16),
        token_budget=num_requests * context,
        max_model_len=context + 16,
        concurrency=num_requests,
        arrivals_per_step=(num_requests, num_requests),
    )


#: The scale sweep: concurrency 64..4096 at 2k context, and context 2k..128k at 64 requests.
SWEEP_RECIPES: tuple[TraceRecipe, ...] = tuple(
    sweep_recipe(n, c)
    for n, c in ((64, 2048), (256, 2048), (1024, 2048), (4096, 2048), (64, 32768), (64, 131072))
)

#: Every bench trace, in bench order (``kvconform bench engines`` runs them all).
ALL_RECIPES: tuple[TraceRecipe, ...] = (*RECIPES, HYBRID_6, *SWEEP_RECIPES)


def pool_blocks(recipe: TraceRecipe) -> int:
    """Pool size (null block included) for ``recipe.concurrency`` requests of the longest kind.

    A decoding request of ``T = longest prompt + longest output`` tokens holds
    ``cdiv(T, bs)`` blocks in a full group and ``min(cdiv(T, bs), cdiv(w - 1, bs) + 1)`` in
    a sliding group of window ``w`` (the steady state); right after its prefill every group
    holds ``cdiv(P, bs)`` blocks for a prompt of ``P`` tokens (the peak, until the next step
    frees the blocks out of the window). The pool is ``1 + concurrency * steady +
    prefills * (peak - steady)`` with ``prefills = cdiv(budget, P)`` prompts per step.

    Worked example, ``decode-heavy`` (gemma3, 5 sliding w=1024 + 1 full, bs 16, P=2048,
    T=2088): steady = 5 * 65 + 131 = 456, peak = 6 * 128 = 768, prefills = 4, so
    ``1 + 32 * 456 + 4 * 312 = 15841`` blocks.
    """
    layout = _layout(recipe, num_blocks=2)
    prompt = recipe.system_prompt_len + recipe.suffix_len[1]
    total = prompt + recipe.output_len[1]
    steady = 0
    peak = 0
    for group in layout.groups:
        spec = group.spec
        bs = spec.block_size
        window = getattr(spec, "sliding_window", None)
        held = cdiv(total, bs)
        if window is not None:
            held = min(held, cdiv(window - 1, bs) + 1)
        steady += held
        peak += cdiv(prompt, bs)
    prefills = cdiv(recipe.token_budget, prompt)
    return 1 + recipe.concurrency * steady + prefills * max(0, peak - steady)


#: A 6-group hybrid for the bench only (not a model family, so not in the presets the
#: strategies draw from): full attention, two sliding windows, chunked local and two
#: Mamba groups (the two Mamba layers form one bucket of 2 -> 2 groups of 1).
HYBRID6 = ModelPreset(
    name="hybrid6",
    description="bench: full + sliding 1024 + sliding 4096 + chunked 2048 + 2 Mamba",
    pattern=(FULL, sliding(1024), sliding(4096), chunked(2048), MAMBA, MAMBA),
    num_kv_heads=8,
    head_size=128,
    mamba_shapes=((16, 64),),
    expected_num_groups=6,
)
BENCH_PRESETS: dict[str, ModelPreset] = {HYBRID6.name: HYBRID6}


def _layout(recipe: TraceRecipe, num_blocks: int) -> KVCacheLayout:
    preset = BENCH_PRESETS.get(recipe.preset) or get_preset(recipe.preset)
    return preset.layout(
        num_blocks=num_blocks,
        max_model_len=recipe.max_model_len,
        block_size=recipe.block_size,
        scale_windows=recipe.scale_windows,
    )


def recipe_layout(recipe: TraceRecipe) -> KVCacheLayout:
    """The recipe's preset layout with :func:`pool_blocks` blocks."""
    return _layout(recipe, pool_blocks(recipe))


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB_SIZE) for _ in range(n))


def _arrivals(recipe: TraceRecipe, rng: random.Random) -> list[Arrive]:
    systems = [_tokens(rng, recipe.system_prompt_len) for _ in range(recipe.num_system_prompts)]
    out = []
    for i in range(recipe.num_requests):
        prefix = systems[rng.randrange(len(systems))] if systems else ()
        suffix = _tokens(rng, rng.randint(*recipe.suffix_len))
        output = _tokens(rng, rng.randint(*recipe.output_len))
        out.append(Arrive(f"{recipe.name}-{i}", prefix + suffix, output))
    return out


def build_trace(recipe: TraceRecipe) -> Trace:
    """The recipe's trace: arrivals in groups of ``arrivals_per_step`` with one ``Step`` after
    each group, then ``Step``s until the reference has finished every request.

    Deterministic: the same recipe gives an equal trace (one ``random.Random(seed)``).
    """
    layout = recipe_layout(recipe)
    rng = random.Random(recipe.seed)
    arrivals = _arrivals(recipe, rng)
    scheduler = Scheduler(make_reference_engine(layout), layout)
    operations: list[Operation] = []

    def emit(op: Operation) -> None:
        operations.append(op)
        scheduler.apply(op)

    i = 0
    while i < len(arrivals):
        k = rng.randint(*recipe.arrivals_per_step)
        for op in arrivals[i : i + k]:
            emit(op)
        i += k
        emit(Step(recipe.token_budget))
    for _ in range(MAX_DRAIN_STEPS):
        if scheduler.is_idle():
            break
        emit(Step(recipe.token_budget))
    else:
        raise BenchError(
            f"trace {recipe.name!r}: requests still pending after {MAX_DRAIN_STEPS} drain steps"
        )
    return Trace(layout=layout, operations=tuple(operations), seed=recipe.seed)


def _cache_path(recipe: TraceRecipe, directory: Path) -> Path:
    return directory / f"{recipe.name}-{recipe.digest()}.json"


def recorded_traces(
    scale: int = 1,
    directory: str | Path | None = DEFAULT_BENCH_DIR,
    recipes: Sequence[TraceRecipe] = RECIPES,
) -> dict[str, Trace]:
    """``{"decode-heavy": Trace, "prefix-heavy": Trace}`` (see the module docstring).

    With a ``directory``, each trace is read from ``<directory>/<name>-<recipe digest>.json``
    when that file exists and is written there otherwise (first use); ``None`` always
    builds in memory. An unreadable cache file is rebuilt and overwritten.
    """
    out: dict[str, Trace] = {}
    for base in recipes:
        recipe = base.scaled(scale)
        if directory is None:
            out[recipe.name] = build_trace(recipe)
            continue
        path = _cache_path(recipe, Path(directory))
        trace = None
        if path.exists():
            try:
                trace = load_trace(path)
            except TraceFormatError:
                trace = None
        if trace is None:
            trace = build_trace(recipe)
            write_trace(trace, path, compact=True)
        out[recipe.name] = trace
    return out


# ---------------------------------------------------------------------------
# Timing


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile: the ``ceil(p / 100 * n)``-th smallest value (1-based).

    Examples: ``percentile([4, 1, 3, 2], 50) == 2``; of ``1..100``, p50 is 50 and p99 is
    99; of a single value, every percentile is that value.
    """
    if not values:
        raise BenchError("percentile of an empty list")
    if not 0 < p <= 100:
        raise BenchError(f"percentile p must be in (0, 100], got {p!r}")
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class Replay:
    """What one replay measured: seconds per Step, and sanity counters.

    Steps are split by what they schedule: a **decode step** schedules only requests past
    their prompt (``decode_seconds``, ``decode_items`` request-steps in all); every other
    busy step holds a prefill chunk, and its time counts towards the prefills
    (``prefill_seconds``, ``prefills`` = prompts whose last chunk it scheduled). Both
    count the engine's time only (:class:`TimedEngine`); ``step_seconds`` is wall time.
    """

    step_seconds: tuple[float, ...]
    busy_steps: int
    hit_tokens: int
    preemptions: int
    finished: int
    decode_seconds: tuple[float, ...] = ()
    decode_items: int = 0
    prefill_seconds: float = 0.0
    prefills: int = 0
    max_running: int = 0
    #: with ``calls``: the engine's time per protocol call, summed over the decode steps
    #: and over the prefill steps (:class:`CallTime`, most expensive first)
    decode_calls: tuple[CallTime, ...] = ()
    prefill_calls: tuple[CallTime, ...] = ()
    #: with ``functions``: the engine's time per function (cProfile), summed over the
    #: decode steps and over the prefill steps (:class:`FunctionTime`, most self time first)
    decode_functions: tuple[FunctionTime, ...] = ()
    prefill_functions: tuple[FunctionTime, ...] = ()


class TimedEngine(EngineProxy):
    """Forwards every protocol call to ``engine`` and adds the time spent inside it to
    ``seconds``: the engine's own cost, without the scheduler's bookkeeping around it.
    Built by :func:`timed`, it offers the engine's batched calls (timed too)."""

    def __init__(
        self, engine: KVCacheEngine, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        super().__init__(engine)
        self.engine = engine
        self.seconds = 0.0
        #: per protocol call, seconds and calls (None: not kept; :func:`replay_timed`'s
        #: ``calls``)
        self.call_seconds: dict[str, float] | None = None
        self.call_counts: dict[str, int] = {}
        #: cProfile switched on inside every call (None: not profiled; :func:`replay_timed`'s
        #: ``functions``)
        self.profiler: FunctionSplit | None = None
        #: wall time (``time.perf_counter``) or the thread's CPU time (``time.thread_time``:
        #: steadier on a busy machine, :data:`CPU_CLOCK`)
        self.clock = clock

    def _timed(self, name: str, fn, *args):
        """``fn(*args)``, its time added to :attr:`seconds` (and to protocol call
        ``name``'s when :attr:`call_seconds` is kept)."""
        profiler = self.profiler
        start = self.clock()
        if profiler is not None:  # (inside the clock reads: the profile holds the call only)
            profiler.enable()
        try:
            return fn(*args)
        finally:
            if profiler is not None:
                profiler.disable()
            elapsed = self.clock() - start
            self.seconds += elapsed
            if self.call_seconds is not None:
                self.call_seconds[name] = self.call_seconds.get(name, 0.0) + elapsed
                self.call_counts[name] = self.call_counts.get(name, 0) + 1

    def add_request(self, request):
        return self._timed("add_request", self.engine.add_request, request)

    def append_output_tokens(self, request_id, token_ids):
        return self._timed(
            "append_output_tokens", self.engine.append_output_tokens, request_id, token_ids
        )

    def set_num_computed_tokens(self, request_id, num_computed_tokens):
        return self._timed(
            "set_num_computed_tokens",
            self.engine.set_num_computed_tokens,
            request_id,
            num_computed_tokens,
        )

    def new_step(self):
        return self._timed("new_step", self.engine.new_step)

    def get_computed_blocks(self, request_id):
        return self._timed("get_computed_blocks", self.engine.get_computed_blocks, request_id)

    def allocate(self, allocation: Allocation):
        return self._timed("allocate", allocate, self.engine, allocation)

    def free(self, request_id):
        return self._timed("free", self.engine.free, request_id)

    def remove_request(self, request_id):
        return self._timed("remove_request", self.engine.remove_request, request_id)

    def reset_prefix_cache(self):
        return self._timed("reset_prefix_cache", self.engine.reset_prefix_cache)

    def get_block_ids(self, request_id):
        return self._timed("get_block_ids", self.engine.get_block_ids, request_id)

    def num_free_blocks(self):
        return self._timed("num_free_blocks", self.engine.num_free_blocks)


class _TimedPlans:
    def schedule_step(self, items):
        return self._timed("schedule_step", self.engine.schedule_step, items)


class _TimedCommits:
    def commit_step(self, updates):
        return self._timed("commit_step", self.engine.commit_step, updates)


class _TimedFrees:
    def free_requests(self, request_ids):
        return self._timed("free_requests", self.engine.free_requests, request_ids)

    def remove_requests(self, request_ids):
        return self._timed("remove_requests", self.engine.remove_requests, request_ids)


#: only the batched calls are passed on: the scheduler then makes the same calls as on
#: the bare engine
TimedEngine.CAPABILITIES = (
    (PlansSteps, _TimedPlans),
    (CommitsSteps, _TimedCommits),
    (FreesInBatch, _TimedFrees),
)


#: The clock of ``bench engines --cpu``: CPU time of the calling thread, which other
#: processes on a busy machine do not inflate (the engine's calls run on this thread).
CPU_CLOCK: Callable[[], float] = time.thread_time


def timed(engine: KVCacheEngine, clock: Callable[[], float] = time.perf_counter) -> TimedEngine:
    """The timing wrapper exposing exactly the engine's batched capabilities, so the
    scheduler makes the same calls as on the bare engine; every call is timed the same way
    for every engine (batched calls replace per-request calls, nothing goes untimed)."""
    return TimedEngine.around(engine, clock)


def replay_timed(
    engine: KVCacheEngine,
    trace: Trace,
    clock: Callable[[], float] = time.perf_counter,
    calls: bool = False,
    functions: bool = False,
) -> Replay:
    """Apply ``trace`` to a fresh scheduler over ``engine``, timing every ``Step`` (wall
    time in ``step_seconds``; the split into decode and prefill counts the time spent
    inside the engine's calls only, see :class:`TimedEngine`). ``calls``: also that time
    per protocol call (``decode_calls``, ``prefill_calls``). ``functions``: also the
    engine's time per function under cProfile (``decode_functions``,
    ``prefill_functions``; the profiler slows every call, so timings are for a
    separate replay)."""
    engine = timed(engine, clock)
    split = _CallSplit(engine) if calls else None
    profile = engine.profiler = FunctionSplit(clock) if functions else None
    scheduler = Scheduler(engine, trace.layout)
    seconds: list[float] = []
    decode_seconds: list[float] = []
    busy = hits = preempted = decode_items = prefills = max_running = 0
    prefill_seconds = 0.0
    prompt_len: dict[str, int] = {}
    clock = time.perf_counter
    for op in trace.operations:
        kind: bool | None = None  # the step's kind for ``split``: decode, prefill, neither
        if isinstance(op, Step):
            start = clock()
            inside = engine.seconds
            record: StepRecord = scheduler.step(op.token_budget, op.num_lookahead_tokens)
            seconds.append(clock() - start)
            elapsed = engine.seconds - inside
            if record.scheduled:
                busy += 1
                in_prefill = [s for s in record.scheduled if s.start < prompt_len[s.request_id]]
                if in_prefill:
                    prefill_seconds += elapsed
                    prefills += sum(
                        1 for s in in_prefill if s.start + s.num_tokens >= prompt_len[s.request_id]
                    )
                else:
                    decode_seconds.append(elapsed)
                    decode_items += len(record.scheduled)
                kind = not in_prefill
            max_running = max(max_running, len(scheduler.running))
            hits += sum(s.hit_tokens for s in record.scheduled)
            preempted += len(record.preempted)
        else:
            if isinstance(op, Arrive):
                prompt_len[op.request_id] = len(op.prompt)
            scheduler.apply(op)
        if split is not None:
            split.op_ended(kind)
        if profile is not None:
            profile.op_ended(kind)
    return Replay(
        tuple(seconds),
        busy,
        hits,
        preempted,
        len(scheduler.finished),
        tuple(decode_seconds),
        decode_items,
        prefill_seconds,
        prefills,
        max_running,
        *(split.totals() if split is not None else ((), ())),
        *(
            (profile.function_times(True), profile.function_times(False))
            if profile is not None
            else ((), ())
        ),
    )


class _CallSplit:
    """:func:`replay_timed`'s per-call time, split by step kind: the engine records each
    operation's calls into fresh maps, which are then added to the decode steps' totals (a
    decode step), the prefill steps' (a busy step with a prefill chunk) or neither (an
    idle step, an arrival or any other operation, as the decode and prefill columns count
    them)."""

    def __init__(self, engine: TimedEngine) -> None:
        self.engine = engine
        self.sums: dict[bool, tuple[dict[str, float], dict[str, int]]] = {
            True: ({}, {}),
            False: ({}, {}),
        }
        self._record_afresh()

    def _record_afresh(self) -> None:
        self.engine.call_seconds, self.engine.call_counts = {}, {}

    def op_ended(self, decode: bool | None) -> None:
        if decode is not None:
            into_seconds, into_counts = self.sums[decode]
            counts = self.engine.call_counts
            for name, seconds in (self.engine.call_seconds or {}).items():
                into_seconds[name] = into_seconds.get(name, 0.0) + seconds
                into_counts[name] = into_counts.get(name, 0) + counts[name]
        self._record_afresh()

    def totals(self) -> tuple[tuple[CallTime, ...], tuple[CallTime, ...]]:
        return call_times(*self.sums[True]), call_times(*self.sums[False])


def engine_alone(engine: KVCacheEngine) -> KVCacheEngine:
    """``engine`` (fresh: no request yet) with its adapter's own checks off
    (:class:`HasSelfChecks`) and built as deployed where the adapter had chosen another
    configuration to observe it (:class:`BuildsAsDeployed`), so that the bench times and
    weighs the engine as it runs in production, not the adapter. Example: the vLLM
    adapter's per-step audit of every cached hash against the KV events stops, and vLLM's
    manager is rebuilt with the events off, as ``vllm serve`` runs it."""
    if isinstance(engine, HasSelfChecks):
        engine.disable_self_checks()
    if isinstance(engine, BuildsAsDeployed):
        engine.build_as_deployed()
    return engine


def control_plane_bytes_per_request(make: Callable[[], KVCacheEngine], trace: Trace) -> float:
    """Peak memory allocated while the engine is built by ``make`` and ``trace`` replays on
    it (``tracemalloc``: Python objects and numpy buffers; torch tensors are not traced),
    divided by the most requests running at once. The engine is built inside the trace, so
    its block pool's per-block state (vLLM's ``KVCacheBlock`` objects, the optimized
    engine's arrays) counts; the scheduler's objects count the same for every engine.
    Example: 3 MiB peak over a replay with at most 32 running requests -> 96 KiB/request.
    Slow: run apart from the timed replays."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        replay = replay_timed(make(), trace)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return (peak - base) / max(1, replay.max_running)


@dataclass(frozen=True)
class EngineBenchRow:
    """One engine on one trace. ``status`` is ``"ok"`` or why nothing was measured (then
    every measured field is None). ``ratio`` = ``total_s / baseline total_s``."""

    trace: str
    engine: str
    status: str
    steps: int | None = None
    busy_steps: int | None = None
    hit_tokens: int | None = None
    preemptions: int | None = None
    finished: int | None = None
    mean_ms: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    total_s: float | None = None
    ratio: float | None = None
    decode_ms: float | None = None
    decode_us_per_req: float | None = None
    prefill_ms_per_req: float | None = None
    kib_per_req: float | None = None
    decode_speedup: float | None = None
    prefill_speedup: float | None = None
    #: with ``calls``: where the decode and prefill time went, per protocol call
    calls: tuple[CallShare, ...] | None = None
    #: with ``hotspots``: the functions holding the most self time per decode step and
    #: per prefilled request (:mod:`.hotspots`)
    decode_hotspots: tuple[Hotspot, ...] | None = None
    prefill_hotspots: tuple[Hotspot, ...] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _not_installed(name: str, exc: BaseException) -> str:
    if name in BUILTIN_ENGINES:
        return f"not installed: run ci/engines/{name}"
    return f"not installed: {exc}"


def _caused_by_import(exc: BaseException) -> bool:
    seen = exc
    while seen is not None:
        if isinstance(seen, ImportError):
            return True
        seen = seen.__cause__
    return False


def _measure(
    name: str,
    trace_name: str,
    trace: Trace,
    repeat: int,
    memory: bool = False,
    clock: Callable[[], float] = time.perf_counter,
    calls: bool = False,
    top_functions: int = 0,
) -> EngineBenchRow:
    """The fastest of ``repeat`` replays (by total step time); errors become the status.
    ``calls``: the row also splits its time by protocol call (:mod:`.call_profile`).
    ``top_functions``: one more replay, under cProfile, gives the row's hotspots
    (:mod:`.hotspots`)."""
    try:
        factory = resolve_engine(name, isolation="none")
    except EngineError as exc:
        status = _not_installed(name, exc) if _caused_by_import(exc) else f"error: {exc}"
        return EngineBenchRow(trace_name, name, status)
    best: Replay | None = None
    profiled: Replay | None = None
    for i in range(repeat + (1 if top_functions else 0)):
        try:
            engine = engine_alone(factory(trace.layout))
        except (EngineError, ImportError) as exc:
            status = _not_installed(name, exc) if _caused_by_import(exc) else f"error: {exc}"
            return EngineBenchRow(trace_name, name, status)
        # the objects alive before the replay (the traces, the modules of engines benched
        # earlier) are frozen: a collection during the replay then walks the replay's
        # objects only, so a row does not pay for what earlier rows left in memory
        gc.collect()
        gc.freeze()
        try:
            # (the last replay of a row with hotspots is the profiled one, timed apart)
            result = replay_timed(engine, trace, clock, calls, functions=i == repeat)
        except KVConformError as exc:
            return EngineBenchRow(trace_name, name, f"error: {exc}")
        finally:
            gc.unfreeze()
        if i == repeat:
            profiled = result
        elif best is None or sum(result.step_seconds) < sum(best.step_seconds):
            best = result
    assert best is not None
    total = sum(best.step_seconds)
    steps = len(best.step_seconds)
    kib = None
    if memory:
        kib = control_plane_bytes_per_request(lambda: engine_alone(factory(trace.layout)), trace)
        kib /= 1024
    decode_total = sum(best.decode_seconds)
    return EngineBenchRow(
        decode_ms=1000 * decode_total / len(best.decode_seconds) if best.decode_seconds else None,
        decode_us_per_req=1e6 * decode_total / best.decode_items if best.decode_items else None,
        prefill_ms_per_req=1000 * best.prefill_seconds / best.prefills if best.prefills else None,
        kib_per_req=kib,
        calls=call_shares(
            best.decode_calls, len(best.decode_seconds), best.prefill_calls, best.prefills
        )
        if calls
        else None,
        decode_hotspots=None
        if profiled is None
        else hotspots(profiled.decode_functions, len(profiled.decode_seconds), top_functions),
        prefill_hotspots=None
        if profiled is None
        else hotspots(profiled.prefill_functions, profiled.prefills, top_functions),
        trace=trace_name,
        engine=name,
        status="ok",
        steps=steps,
        busy_steps=best.busy_steps,
        hit_tokens=best.hit_tokens,
        preemptions=best.preemptions,
        finished=best.finished,
        mean_ms=1000 * total / steps if steps else 0.0,
        p50_ms=1000 * percentile(best.step_seconds, 50) if steps else 0.0,
        p99_ms=1000 * percentile(best.step_seconds, 99) if steps else 0.0,
        total_s=total,
    )


def with_ratios(rows: Sequence[EngineBenchRow]) -> list[EngineBenchRow]:
    """Each ok row's ``ratio`` = its ``total_s`` / the first ok row's ``total_s`` of the same
    trace. Example: reference 2.0 s, vllm 3.0 s -> ratios 1.0 and 1.5."""
    baseline: dict[str, float] = {}
    out = []
    for row in rows:
        if not row.ok or row.total_s is None:
            out.append(row)
            continue
        base = baseline.setdefault(row.trace, row.total_s)
        ratio = row.total_s / base if base > 0 else math.inf
        out.append(replace(row, ratio=ratio))
    return out


def with_speedups(rows: Sequence[EngineBenchRow], baseline: str = "vllm") -> list[EngineBenchRow]:
    """Each ok row's speedup over the ``baseline`` engine's row of the same trace:
    ``decode_speedup = baseline decode_ms / decode_ms`` and ``prefill_speedup`` likewise
    (None where either side is missing). Example: vllm 2.0 ms, optimized 0.1 ms -> 20.0."""
    base = {r.trace: r for r in rows if r.ok and r.engine == baseline}

    def speedup(theirs: float | None, mine: float | None) -> float | None:
        if theirs is None or mine is None or mine <= 0:
            return None
        return theirs / mine

    out = []
    for row in rows:
        ref = base.get(row.trace)
        if not row.ok or ref is None:
            out.append(row)
            continue
        out.append(
            replace(
                row,
                decode_speedup=speedup(ref.decode_ms, row.decode_ms),
                prefill_speedup=speedup(ref.prefill_ms_per_req, row.prefill_ms_per_req),
            )
        )
    return out


def check_engine_names(engines: Sequence[str]) -> None:
    """A name that is no engine is a usage error (``EngineLoadError``, exit 2), not a
    row's status; an engine whose module is missing gets "not installed" rows."""
    for name in engines:
        if name in BUILTIN_ENGINES:
            continue
        try:
            load_engine_factory(name)
        except EngineError as exc:
            if not _caused_by_import(exc):  # a module that cannot be imported: a row
                raise


def bench_engines(
    engines: Sequence[str] = ("reference", "vllm"),
    traces: dict[str, Trace] | None = None,
    repeat: int = 1,
    memory: bool = False,
    on_row: Callable[[EngineBenchRow], None] | None = None,
    cpu: bool = False,
    calls: bool = False,
    top_functions: int = 0,
) -> list[EngineBenchRow]:
    """One row per trace and engine, in that order; ``traces`` defaults to
    :func:`recorded_traces`. The first engine is the baseline of the ratios. ``cpu``: the
    engine's calls are timed in the thread's CPU time (:data:`CPU_CLOCK`) instead of wall
    time, so the decode and prefill columns hold CPU milliseconds.
    ``on_row`` hears of each row as soon as it is measured (progress). ``calls``: each
    row also says where its time went, per protocol call (``EngineBenchRow.calls``).
    ``top_functions``: each row also lists that many functions holding the most self time
    per decode step and per prefilled request, from one more replay under cProfile
    (``EngineBenchRow.decode_hotspots``, ``prefill_hotspots``; 0: none)."""
    if not engines:
        raise BenchError("engines must name at least one engine, got ()")
    if not isinstance(repeat, int) or repeat < 1:
        raise BenchError(f"repeat must be an integer >= 1, got {repeat!r}")
    if not isinstance(top_functions, int) or top_functions < 0:
        raise BenchError(f"hotspots must be an integer >= 0, got {top_functions!r}")
    check_engine_names(engines)
    if traces is None:
        traces = recorded_traces()
    rows = []
    for trace_name, trace in traces.items():
        for name in engines:
            clock = CPU_CLOCK if cpu else time.perf_counter
            rows.append(
                _measure(name, trace_name, trace, repeat, memory, clock, calls, top_functions)
            )
            if on_row is not None:
                on_row(rows[-1])
    return with_speedups(with_ratios(rows))


_SANITY_FIELDS = ("steps", "busy_steps", "hit_tokens", "preemptions", "finished")


def engine_mismatches(rows: Sequence[EngineBenchRow]) -> list[str]:
    """One warning per trace and counter where an ok engine differs from the trace's first ok
    row, and one per engine that failed on a trace (an error, not a missing install).
    Example: ``"WARNING: prefix-heavy: vllm hit_tokens 1024 != reference 2048"``;
    ``kvconform bench engines`` exits 1 when there is any."""
    first: dict[str, EngineBenchRow] = {}
    warnings = []
    for row in rows:
        if row.status.startswith("error"):
            warnings.append(f"WARNING: {row.trace}: {row.engine} {row.status}")
        if not row.ok:
            continue
        base = first.setdefault(row.trace, row)
        for field_name in _SANITY_FIELDS:
            mine, theirs = getattr(row, field_name), getattr(base, field_name)
            if mine != theirs:
                warnings.append(
                    f"WARNING: {row.trace}: {row.engine} {field_name} {mine} != "
                    f"{base.engine} {theirs}"
                )
    return warnings


def _cell(value: object, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_engine_bench(rows: Sequence[EngineBenchRow]) -> str:
    """An aligned table (one line per row, a ``note`` column holding any non-ok status),
    followed by :func:`engine_mismatches` warnings."""
    header = (
        "trace",
        "engine",
        "steps",
        "busy",
        "hit tok",
        "preempt",
        "mean ms",
        "p50 ms",
        "p99 ms",
        "total s",
        "ratio",
        "dec ms",
        "us/req-step",
        "prefill ms/req",
        "KiB/req",
        "x vllm dec",
        "x vllm pre",
        "note",
    )
    table = [header]
    for r in rows:
        table.append(
            (
                r.trace,
                r.engine,
                _cell(r.steps),
                _cell(r.busy_steps),
                _cell(r.hit_tokens),
                _cell(r.preemptions),
                _cell(r.mean_ms),
                _cell(r.p50_ms),
                _cell(r.p99_ms),
                _cell(r.total_s),
                _cell(r.ratio, 2),
                _cell(r.decode_ms),
                _cell(r.decode_us_per_req, 1),
                _cell(r.prefill_ms_per_req),
                _cell(r.kib_per_req, 1),
                _cell(r.decode_speedup, 1),
                _cell(r.prefill_speedup, 1),
                "" if r.ok else r.status,
            )
        )
    return "\n".join([aligned(table, left={0, 1, len(header) - 1}), *engine_mismatches(rows)])
