"""``kvconform check --engine vllm-scheduler``: the scheduler level for vLLM.

vLLM's own ``Scheduler`` (:mod:`properties.engines.vllm_scheduler`) runs generated
traces while :class:`properties.runner.decided.DecidedScheduler` replays its decisions
on the reference (:mod:`properties.runner.decided`: the checks). Run it with vLLM's
interpreter::

    .engines/vllm/bin/python -m properties.tools.cli check --engine vllm-scheduler \\
        --level exact --profile ci --engine-coverage

Examples per profile: :data:`EXAMPLES` (derandomized on ``ci``; ``--seed N`` draws
another stream), an equal share for each mode of :func:`_modes` (a serving mode and
vLLM's scheduler options, :class:`LevelMode`: synchronous, 2 drafts, the admission
gate, asynchronous scheduling, four KV connector modes, then priority scheduling, LoRA
limits, pauses, dynamic drafts, long-prefill caps, images, connectors that save, under
asynchronous scheduling and with block-level load failures, grammars). Each example
is a trace of the small tier's strategies (``layouts``: 1-3 groups of the kinds in
:data:`KINDS`; ``operations``: up to 30; in a connector mode, no Mamba group and
:func:`reload_tail` at the end); layouts where one of vLLM's known divergences of its
manager applies (``properties.engines.vllm.KNOWN_DIVERGENCES``, ``findings/vllm/``) are
not drawn, as at the manager level. The first disagreement stops the run: its trace is saved under
``.kvconform/failures/`` with the failure, and its replay command printed
(``--replay FILE`` runs one trace again); exit 1. ``--engine-coverage`` measures
``vllm.v1.core.sched.scheduler`` (no value) or the modules named; exit 0 when every
example agreed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from properties.core.images import with_images
from properties.core.modes import ServingMode
from properties.core.scheduler_options import SchedulerOptions
from properties.core.trace import (
    Abort,
    Arrive,
    Operation,
    ResetPrefixCache,
    Step,
    Trace,
    load_trace,
    save_trace,
)
from reference.layout import KVCacheLayout

#: examples per profile
EXAMPLES: dict[str, int] = {"dev": 64, "ci": 1250, "nightly": 5000, "gpu": 1250}

#: spec kinds the level draws (every kind kvconform models)
KINDS: tuple[str, ...] = ("full", "sliding_window", "chunked_local", "mamba")

#: the engine name the CLI resolves to this level
ENGINE = "vllm-scheduler"


@dataclass(frozen=True)
class LevelMode:
    """One mode of the level: the serving mode, the engine scheduler's options
    (:class:`properties.core.scheduler_options.SchedulerOptions`) and whether the drawn
    requests get LoRA adapters (:func:`with_loras`)."""

    mode: ServingMode
    options: SchedulerOptions = SchedulerOptions()
    loras: bool = False
    #: the drawn prompts get images (:func:`properties.core.images.with_images`)
    images: bool = False

    def describe(self) -> str:
        extras = [name for name in ("loras", "images") if getattr(self, name)]
        return " / ".join([self.mode.describe(), self.options.describe(), *extras])


def _modes() -> tuple[LevelMode, ...]:
    """The modes drawn: synchronous, 2 drafts, the admission gate, asynchronous scheduling
    (vLLM's preemptions of requests with tokens in flight and its immediate aborts
    replayed on the reference: :class:`properties.runner.decided.DecidedAsyncScheduler`),
    a KV connector (:mod:`properties.engines.vllm_connector`) loading synchronously,
    asynchronously with failing loads, asynchronously under the admission gate, and
    asynchronously with failing loads and 2 drafts; then vLLM's scheduler options
    (:class:`SchedulerOptions`): priority scheduling with a LoRA limit of 1 over three
    adapters, priority with asynchronous scheduling and pauses, a long-prefill threshold
    (adaptive) with a prefill cadence of 3 and at most 2 running requests, chunked
    prefill off with 2 drafts, and pauses with asynchronous, failing loads."""
    return (
        LevelMode(ServingMode()),
        LevelMode(ServingMode(num_draft_tokens=2)),
        LevelMode(ServingMode(admission_gate=True)),
        LevelMode(ServingMode(async_scheduling=True)),
        LevelMode(ServingMode(external_hits=True)),
        LevelMode(ServingMode(external_hits=True, async_loads=True, load_failures=True)),
        LevelMode(ServingMode(admission_gate=True, external_hits=True, async_loads=True)),
        LevelMode(
            ServingMode(
                num_draft_tokens=2, external_hits=True, async_loads=True, load_failures=True
            )
        ),
        LevelMode(ServingMode(), SchedulerOptions(policy="priority")),
        LevelMode(
            ServingMode(async_scheduling=True),
            SchedulerOptions(max_loras=1, reset_running=True),
            loras=True,
        ),
        LevelMode(
            ServingMode(async_scheduling=True), SchedulerOptions(policy="priority", pauses=True)
        ),
        LevelMode(
            ServingMode(num_draft_tokens=3), SchedulerOptions(dynamic_drafts=True, metrics=True)
        ),
        LevelMode(
            ServingMode(admission_gate=True),
            SchedulerOptions(
                long_prefill_token_threshold=8,
                adaptive_long_prefill=True,
                prefill_schedule_interval=3,
                max_num_seqs=2,
            ),
        ),
        LevelMode(
            ServingMode(num_draft_tokens=2),
            SchedulerOptions(chunked_prefill=False, reset_running=True),
        ),
        LevelMode(
            ServingMode(external_hits=True, async_loads=True, load_failures=True),
            SchedulerOptions(pauses=True),
        ),
        LevelMode(
            ServingMode(),
            SchedulerOptions(encoder_budget=10, v1_model_runner=True, report_finished=True),
            images=True,
        ),
        LevelMode(
            ServingMode(async_scheduling=True, admission_gate=True),
            SchedulerOptions(encoder_budget=8, unchunked_images=True, policy="priority"),
            images=True,
        ),
        LevelMode(
            ServingMode(external_hits=True, async_loads=True),
            SchedulerOptions(encoder_budget=16, remote_images=True),
            images=True,
        ),
        LevelMode(
            ServingMode(external_hits=True),
            SchedulerOptions(delayed_frees=True, reset_connector=True, stats=False),
        ),
        LevelMode(
            ServingMode(async_scheduling=True, external_hits=True),
            SchedulerOptions(delayed_frees=True, report_finished=True),
        ),
        LevelMode(
            ServingMode(num_draft_tokens=2),
            SchedulerOptions(structured_output=True, report_finished=True, stats=False),
        ),
        LevelMode(
            ServingMode(async_scheduling=True),
            SchedulerOptions(structured_output=True, policy="priority"),
        ),
        LevelMode(ServingMode(external_hits=True), SchedulerOptions(invalid_blocks=True)),
        LevelMode(
            ServingMode(external_hits=True, async_loads=True, load_failures=True),
            SchedulerOptions(invalid_blocks=True, fail_on_load_errors=True),
        ),
        LevelMode(
            ServingMode(
                async_scheduling=True, external_hits=True, async_loads=True, load_failures=True
            )
        ),
    )


#: the LoRA adapters :func:`with_loras` hands out (and no adapter)
LORAS: tuple[str | None, ...] = (None, "lora-a", "lora-b", "lora-c")


def with_loras(ops: tuple[Operation, ...]) -> tuple[Operation, ...]:
    """The trace's requests with LoRA adapters: request ``rN`` gets ``LORAS[N % 4]`` (its
    number read from the id), so that a LoRA limit of 1 or 2 binds. Example: ``r5``
    (``lora-a``)."""

    def adapter(request_id: str) -> str | None:
        digits = "".join(c for c in request_id if c.isdigit()) or "0"
        return LORAS[int(digits) % len(LORAS)]

    return tuple(
        replace(op, lora_name=adapter(op.request_id)) if isinstance(op, Arrive) else op
        for op in ops
    )


def modes_described(*descriptions: str) -> tuple[LevelMode, ...]:
    """The modes of :func:`_modes` whose :meth:`LevelMode.describe` is one of
    ``descriptions`` (a test runs the ci draws of those modes alone: each mode's
    derandomized draws do not depend on the others)."""
    found = tuple(m for m in _modes() if m.describe() in descriptions)
    if len(found) != len(descriptions):
        known = [m.describe() for m in _modes()]
        raise KeyError(f"no level mode described {descriptions}; known: {known}")
    return found


def reload_tail(
    layout: KVCacheLayout, ops: tuple[Operation, ...], abort: bool = False
) -> tuple[Operation, ...]:
    """The end of a connector mode's trace, so that it loads from the host tier: steps
    with a budget for every request until all have ended (one per output token of the
    longest, twice over for preemptions; their blocks go to the tier), a
    ``ResetPrefixCache``, the longest request back as
    :func:`properties.generate.strategies.reload_ops` (its head computed on the device,
    the rest loaded) or whole, and the same steps again; with ``abort``, the last
    request back is aborted after the first of them (while it runs, or while its
    asynchronous load waits). Example: ``r0`` (12 prompt tokens, 2 outputs) alone,
    alignment 4 -> 8 steps, the reset, ``r1`` (the first 4 tokens), ``r2`` (all 14 and
    3 more), 8 steps."""
    from properties.generate.strategies import reload_ops

    arrivals = [op for op in ops if isinstance(op, Arrive)]
    drain = (Step(2 * layout.max_model_len),) * (2 * max(len(a.output) for a in arrivals) + 4)
    old = max(arrivals, key=lambda a: len(a.prompt) + len(a.output))
    again = replace(old, request_id=f"r{len(arrivals)}", output=())
    back = reload_ops(layout, old, len(arrivals)) or (again,)
    cut = (drain[0], Abort(back[-1].request_id)) if abort else ()
    return drain + (ResetPrefixCache(),) + back + cut + drain


def _harness_factory(mutant: str | None) -> Callable:
    from properties.engines.vllm_scheduler import make_harness

    if mutant is None:
        return make_harness
    from properties.mutants.vllm_scheduler_mutants import mutant_class

    def factory(layout: KVCacheLayout, **kw: Any) -> Any:
        cls = mutant_class(mutant, kw.get("asynchronous", False))
        return make_harness(layout, scheduler_class=cls, **kw)

    return factory


def run_one(
    trace: Trace, mutant: str | None = None, options: SchedulerOptions | None = None
) -> int:
    """Run one trace (raises ``DecisionMismatch``); returns the steps run. ``options``
    default to those a saved failure recorded (:func:`trace_options`)."""
    from properties.runner.decided import run_decided

    if options is None:
        options = trace_options(trace)
    return run_decided(trace, _harness_factory(mutant), options)


def trace_options(trace: Trace) -> SchedulerOptions:
    """The scheduler options a trace saved by this level records (in its failure, key
    ``"options"``), the defaults for any other trace."""
    failure = trace.failure or {}
    return SchedulerOptions.from_json(failure.get("options"), "failure.options")


def search(
    examples: int,
    seed: int | None = None,
    mutant: str | None = None,
    kinds: tuple[str, ...] = KINDS,
    modes: tuple[LevelMode, ...] | None = None,
) -> tuple[int, int, Trace | None, str | None]:
    """Draw up to ``examples`` traces, an equal share per mode of ``modes`` (default
    :func:`_modes`); returns ``(examples run, steps, failing trace, message)`` (no
    shrinking: the first failing trace as drawn stops the search; its failure records
    the mode's options)."""
    from hypothesis import HealthCheck, Phase, assume, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    from properties.engines.vllm import KNOWN_DIVERGENCES
    from properties.generate.strategies import layouts, operations
    from properties.runner.decided import DecisionMismatch
    from reference.specs import MambaSpec

    state: dict = {"n": 0, "steps": 0, "trace": None, "msg": None}

    def traces(level: LevelMode) -> st.SearchStrategy[Trace]:
        mode = level.mode

        @st.composite
        def draw_trace(draw) -> Trace:
            layout = draw(layouts(kinds=kinds, max_groups=3))
            # vLLM's known divergences of the manager (findings/vllm/) are not drawn
            assume(not any(d.applies(layout) for d in KNOWN_DIVERGENCES))
            # drafts and connectors are not modelled with a Mamba group
            assume(
                not (
                    (mode.num_draft_tokens or mode.external_hits)
                    and any(isinstance(s, MambaSpec) for s in layout.specs)
                )
            )
            ops = draw(operations(layout, max_ops=30))
            if mode.external_hits:
                ops = ops + reload_tail(layout, ops, draw(st.booleans()))
            if level.loras:
                ops = with_loras(ops)
            if level.images:
                ops = tuple(
                    replace(op, prompt=with_images(op.prompt)) if isinstance(op, Arrive) else op
                    for op in ops
                )
            return Trace(layout=layout, operations=ops, mode=mode)

        return draw_trace()

    def check(options: SchedulerOptions) -> Callable[[Trace], None]:
        def body(trace: Trace) -> None:
            if state["trace"] is not None:
                return
            state["n"] += 1
            try:
                state["steps"] += run_one(trace, mutant, options)
            except DecisionMismatch as exc:
                # the options go with the trace (trace_options reads them back)
                failure = {"options": options.to_json()}
                state["trace"], state["msg"] = replace(trace, failure=failure), str(exc)

        return body

    if modes is None:
        modes = _modes()
    for i, level in enumerate(modes):  # each mode its share of the examples
        if state["trace"] is not None:
            break  # the first failing trace stops the search
        share = examples // len(modes) + (i < examples % len(modes))
        run = settings(
            max_examples=share,
            deadline=None,
            database=None,
            derandomize=seed is None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.reuse, Phase.generate],
        )(given(traces(level))(check(level.options)))
        if seed is not None:
            run = hseed(seed + i)(run)
        run()
    return state["n"], state["steps"], state["trace"], state["msg"]


def cmd_check(args: argparse.Namespace) -> int:
    """The ``check`` command for ``--engine vllm-scheduler`` (see the module docstring)."""
    from properties.core.coverage_probe import start_measuring, stop_measuring
    from properties.engines.vllm_scheduler import COVERAGE_MODULES
    from properties.tools.engine_coverage import cli_session

    def factory() -> None:  # what --engine-coverage reads: the default modules
        return None

    factory.coverage_modules = COVERAGE_MODULES  # type: ignore[attr-defined]
    examples = EXAMPLES.get(args.profile, EXAMPLES["ci"])
    print(
        f"kvconform check: engine={ENGINE} level={args.level} profile={args.profile} "
        f"examples={examples} seed={args.seed if args.seed is not None else 'derandomized'}",
        flush=True,
    )
    if args.level != "exact":
        print(f"kvconform check: --engine {ENGINE} runs at --level exact only", file=sys.stderr)
        return 2
    from properties.core.engine import EngineError
    from properties.engines.vllm import _import_vllm

    try:
        _import_vllm()
    except EngineError as exc:  # vLLM missing: a configuration error, one line
        print(f"kvconform check: {exc}", file=sys.stderr)
        return 2
    start = time.monotonic()
    with cli_session(args, factory) as finish:
        start_measuring()
        n, steps, trace, message = search(examples, args.seed)
        stop_measuring()
        regression = finish()
    took = time.monotonic() - start
    if trace is not None:
        failed = Trace(
            layout=trace.layout,
            operations=trace.operations,
            mode=trace.mode,
            failure={
                "property": "scheduler",
                "message": message,
                "engine": ENGINE,
                "level": "exact",
                "options": (trace.failure or {}).get("options"),
            },
        )
        path = save_trace(failed)
        print(f"scheduler level: FAILED after {n} examples: {message}")
        print(f"  trace: {path}")
        replay = ".engines/vllm/bin/python -m properties.tools.scheduler_level --replay"
        print(f"  replay: {replay} {path}")
        return 1
    print(f"scheduler level: {n} examples, {steps} steps, {took:.1f}s: passed")
    return 4 if regression else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m properties.tools.scheduler_level --replay FILE [--mutant NAME]``."""
    parser = argparse.ArgumentParser(prog="kvconform-scheduler-level")
    parser.add_argument("--replay", required=True, metavar="FILE")
    parser.add_argument("--mutant", default=None)
    args = parser.parse_args(argv)
    from properties.runner.decided import DecisionMismatch

    trace = load_trace(args.replay)
    try:
        steps = run_one(trace, args.mutant)
    except DecisionMismatch as exc:
        print(f"scheduler level: FAILED: {exc}")
        return 1
    print(f"scheduler level: {steps} steps: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
