"""The suite's power and speed: time and steps to catch each mutant, reference throughput,
and the checked steps per CPU second of each engine and property.

For every mutant engine of ``properties/mutants/`` the stateful machine runs
under a Hypothesis profile with the shrink phase disabled, so the figures are the
cost of *detection*: the wall time and the number of machine steps (rule
applications, ``machine_for(...).stats.steps``) up to and including the first
failing step, and the property that fired. A mutant that survives the whole run
is a gap in the suite (``caught`` is False).

The reference then runs a fixed number of examples (the profile's
``max_examples``) at each level; its row gives steps per second and examples per
second: the suite's throughput.

Worked example of a row: ``swa_off_by_one  universal  window_liveness  0.21 s
37 steps  2 examples`` means the second generated example failed at the machine's
37th step overall, 0.21 s after the run began.

Last, the suite's own speed (:func:`suite_speed`): each engine (``--engines``, the
reference and vLLM unless told) runs every property of ``kvconform check`` at the
exact level on a fixed number of the profile's examples (:data:`SPEED_EXAMPLES`; the ci
profile is derandomized, so the same examples at every commit and on every engine
that draws the same layouts), in this process, and its row gives the checked steps
(the property's steps: machine steps, or trace operations for determinism) per CPU
second of the process (``time.process_time``: the suite's checks, the lockstep
reference and the engine together, a loaded machine's waiting left out). A change to
the suite's hot paths shows as more steps per CPU second on the same steps. Example:
``reference  invariants  25 examples  1830 steps  4.10 CPU s  446 steps/CPU s``.

Usage: ``kvconform bench suite [--profile ci] [--engines reference vllm]``, or
``print(format_suite(bench_suite("ci")))``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hypothesis import Phase, Verbosity, settings
from hypothesis.stateful import run_state_machine_as_test

from properties.engines.under_test import EngineUnderTest, resolve_engine
from properties.runner.config import CheckConfig
from properties.runner.machine import machine_for
from properties.runner.profiles import load_profile
from properties.tools.bench.table import aligned
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

REFERENCE = "reference"
#: Examples a detection run uses; ``None`` keeps the profile's (``ci``: 60). The
#: derandomized stream is the same for every machine, so which mutants it catches
#: depends on this number and on the strategies, not on the engine.
DETECTION_EXAMPLES: int | None = None


@dataclass(frozen=True)
class SuiteRow:
    """One run: a mutant (or the reference) at one level.

    ``steps`` and ``seconds`` count up to the first failure for a caught mutant, the
    whole run otherwise; ``check`` names the property that fired first (``None``
    when nothing failed).
    """

    name: str
    level: str
    caught: bool
    check: str | None
    seconds: float
    steps: int
    examples: int
    description: str = ""

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    @property
    def examples_per_second(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class SpeedRow:
    """One engine running one property for :func:`suite_speed`. ``status``: ``ok``,
    ``FAILED (check)`` (the figures still count what ran) or why nothing ran (``not
    installed: ...``, ``error: ...``; then the figures are 0)."""

    engine: str
    prop: str
    level: str
    status: str
    examples: int = 0
    steps: int = 0
    cpu_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def steps_per_cpu_second(self) -> float:
        return self.steps / self.cpu_seconds if self.cpu_seconds > 0 else 0.0


@dataclass
class _FirstFailure:
    steps: int
    seconds: float
    examples: int
    check: str


def failure_name(exc: BaseException) -> str:
    """The property a failure reports (``PropertyViolation.name``), else its type name."""
    group = getattr(exc, "exceptions", None)  # an ExceptionGroup (several distinct bugs)
    if isinstance(group, (list, tuple)) and group:
        return failure_name(group[0])
    return getattr(exc, "name", None) or type(exc).__name__


def detection_settings(
    profile: str = "ci", max_examples: int | None = DETECTION_EXAMPLES
) -> settings:
    """Profile ``profile`` without the shrink phase (and quiet): detection only.

    ``max_examples`` replaces the profile's (``None`` keeps it)."""
    base = load_profile(profile)
    return settings(
        base,
        phases=(Phase.explicit, Phase.generate),
        verbosity=Verbosity.quiet,
        max_examples=max_examples or base.max_examples,
    )


def run_machine(
    config: CheckConfig,
    engine: EngineUnderTest,
    hyp_settings: settings,
    name: str,
    description: str = "",
    property_name: str = "invariants",
) -> SuiteRow:
    """Run the stateful machine once; record the first failure (if any) as it happens.

    ``property_name`` is ``invariants`` or ``production``: the machine is built and named
    exactly as ``kvconform check`` builds that property's (same derandomized examples).
    """
    from properties.runner.check import config_for, settings_for

    config = config_for(property_name, config)
    hyp_settings = settings_for(property_name, hyp_settings)
    # as kvconform check
    machine = machine_for(config, engine, name=f"{property_name.capitalize()}Machine")
    started = time.perf_counter()
    try:
        run_state_machine_as_test(machine, settings=hyp_settings)
    except Exception as exc:  # noqa: BLE001 - any failure is a detection
        first = machine.stats.first_failure
        if first is not None:
            step, examples, when, check = first
            return SuiteRow(
                name, config.level, True, check, when - started, step, examples, description
            )
        return SuiteRow(
            name,
            config.level,
            True,
            failure_name(exc),
            time.perf_counter() - started,
            machine.stats.steps,
            machine.stats.examples,
            description,
        )
    elapsed = time.perf_counter() - started
    return SuiteRow(
        name,
        config.level,
        False,
        None,
        elapsed,
        machine.stats.steps,
        machine.stats.examples,
        description,
    )


#: Examples each engine runs per property in :func:`suite_speed` (the attention
#: property a third of them, as ``kvconform check`` runs it)
SPEED_EXAMPLES = 25
#: The level :func:`suite_speed` checks at
SPEED_LEVEL = "exact"


def suite_speed(
    engines: Sequence[str] = (REFERENCE, "vllm"),
    profile: str = "ci",
    examples: int = SPEED_EXAMPLES,
    properties: Sequence[str] | None = None,
    level: str = SPEED_LEVEL,
    on_row: Callable[[SpeedRow], None] | None = None,
) -> list[SpeedRow]:
    """Checked steps per CPU second of each engine and property (module docstring):
    every property of ``kvconform check`` (or those named) at ``level`` on ``examples``
    of the profile's examples with no shrinking, the engine in this process. An engine
    that is not installed gets one row saying so."""
    from properties.core.constants import PROPERTIES
    from properties.core.engine import EngineError
    from properties.runner.check import run_property

    wanted = PROPERTIES if properties is None else tuple(properties)
    hyp = detection_settings(profile, examples)
    rows: list[SpeedRow] = []

    def add(row: SpeedRow) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    with tempfile.TemporaryDirectory(prefix="kvconform-bench-") as tmp:
        for name in engines:
            config = CheckConfig(engine=name, level=level, failure_dir=tmp, isolation="none")
            try:
                engine = config.resolve_engine()
                engine.factory(_PROBE_LAYOUT)  # (an engine that is not installed fails here)
            except (EngineError, ImportError) as exc:
                add(SpeedRow(name, "-", level, _why_not(exc)))
                continue
            for prop in wanted:
                cpu, wall = time.process_time(), time.perf_counter()
                result = run_property(prop, config, hyp, None, engine, shrink_seconds=0)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                status = "ok" if result.passed else f"FAILED ({result.check or result.kind})"
                add(SpeedRow(name, prop, level, status, result.examples, result.steps, cpu, wall))
    return rows


#: a layout any engine builds: building one tells whether the engine is installed
_PROBE_LAYOUT = KVCacheLayout(
    (KVCacheGroup(("layer",), FullAttentionSpec(block_size=16)),),
    num_blocks=16,
    max_model_len=64,
)


def _why_not(exc: BaseException) -> str:
    """A short reason an engine could not be built: not installed (an import failed
    somewhere in its causes) or the error's first line."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ImportError):
            return f"not installed ({seen})"
        seen = seen.__cause__
    return f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"


def bench_suite(
    profile: str = "ci",
    levels: Sequence[str] = ("universal", "exact"),
    mutants: Sequence[str] | None = None,
    max_examples: int | None = DETECTION_EXAMPLES,
    on_row: Callable[[SuiteRow | SpeedRow], None] | None = None,
    engines: Sequence[str] = (REFERENCE, "vllm"),
    speed_examples: int = SPEED_EXAMPLES,
) -> list[SuiteRow | SpeedRow]:
    """Every mutant (or those named) at each of ``levels``, then the reference at each,
    all under :func:`detection_settings` (``profile``, ``max_examples``), then the
    suite's speed on ``engines`` (:func:`suite_speed`, ``speed_examples`` per property;
    no engine: none); ``on_row`` hears of each row as soon as it is measured
    (progress).

    The mutants are those of ``properties/mutants/`` (reference and optimized), each run
    under the property its catalogue names (``invariants``, ``attention`` or
    ``production``), as the mutant tests run them.
    """
    from properties.mutants.optimized_mutants import OPTIMIZED_MUTANT_INFO
    from properties.mutants.reference_mutants import MUTANT_INFO

    catalogue = {**MUTANT_INFO, **OPTIMIZED_MUTANT_INFO}
    names = list(catalogue) if mutants is None else list(mutants)
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        from reference.errors import KVConformError

        raise KVConformError(
            f"bench_suite(mutants=...): unknown mutants {unknown}; known: {', '.join(catalogue)}"
        )
    hyp = detection_settings(profile, max_examples)
    rows: list[SuiteRow] = []
    with tempfile.TemporaryDirectory(prefix="kvconform-bench-") as tmp:
        for name in names:
            info = catalogue[name]
            # each mutant under the property its catalogue names; an optimized mutant at
            # its own level only (it claims the exact level)
            for level in levels if name in MUTANT_INFO else (info.level,):
                config = CheckConfig(engine=info.target, level=level, failure_dir=tmp)
                engine = resolve_engine(info.factory)
                rows.append(
                    run_machine(
                        config, engine, hyp, name, info.description, property_name=info.prop
                    )
                )
                if on_row is not None:
                    on_row(rows[-1])
        for level in levels:
            config = CheckConfig(engine=REFERENCE, level=level, failure_dir=tmp)
            engine = config.resolve_engine()
            rows.append(run_machine(config, engine, hyp, REFERENCE, "the reference (throughput)"))
            if on_row is not None:
                on_row(rows[-1])
    if engines:
        rows.extend(suite_speed(engines, profile, speed_examples, on_row=on_row))
    return rows


def format_suite(rows: Sequence[SuiteRow | SpeedRow]) -> str:
    """A plain-text table: mutants (caught by what, after how long), then throughput, then
    the suite's speed per engine and property (:func:`format_speed`)."""
    speed = [r for r in rows if isinstance(r, SpeedRow)]
    rows = [r for r in rows if isinstance(r, SuiteRow)]
    header = f"{'mutant':<26} {'level':<9} {'caught by':<24} {'time s':>7} {'steps':>6}"
    lines = [f"{header} {'examples':>8}"] if rows else []
    mutant_rows = [r for r in rows if r.name != REFERENCE]
    for r in mutant_rows:
        caught = r.check if r.caught else "NOT CAUGHT"
        lines.append(
            f"{r.name:<26} {r.level:<9} {caught:<24} {r.seconds:>7.2f} {r.steps:>6} {r.examples:>8}"
        )
    if mutant_rows:
        by_name: dict[str, bool] = {}
        for r in mutant_rows:
            by_name[r.name] = by_name.get(r.name, False) or r.caught
        caught = sum(by_name.values())
        lines.append(f"caught at some level: {caught}/{len(by_name)} mutants")
    for r in rows:
        if r.name != REFERENCE:
            continue
        status = f"FAILED ({r.check})" if r.caught else "passed"
        lines.append(
            f"reference {r.level:<9} {status}: {r.examples} examples, {r.steps} steps in "
            f"{r.seconds:.2f} s = {r.steps_per_second:.0f} steps/s, "
            f"{r.examples_per_second:.1f} examples/s"
        )
    if speed:
        lines += ["", format_speed(speed)] if lines else [format_speed(speed)]
    return "\n".join(lines)


def format_speed(rows: Sequence[SpeedRow]) -> str:
    """The suite's speed (:func:`suite_speed`) as a table, each engine's total last.
    Example row: ``reference  invariants  exact  ok  25  1830  4.10  446``."""
    header = ["engine", "property", "level", "status", "examples", "steps", "CPU s", "steps/CPU s"]
    body: list[list[str]] = []
    for engine in dict.fromkeys(r.engine for r in rows):
        mine = [r for r in rows if r.engine == engine]
        for r in mine:
            body.append(
                [
                    r.engine,
                    r.prop,
                    r.level,
                    r.status,
                    str(r.examples),
                    str(r.steps),
                    f"{r.cpu_seconds:.2f}",
                    f"{r.steps_per_cpu_second:.0f}",
                ]
            )
        ran = [r for r in mine if r.examples]
        if len(ran) > 1:
            steps = sum(r.steps for r in ran)
            cpu = sum(r.cpu_seconds for r in ran)
            body.append(
                [
                    engine,
                    "all",
                    ran[0].level,
                    "",
                    str(sum(r.examples for r in ran)),
                    str(steps),
                    f"{cpu:.2f}",
                    f"{steps / cpu:.0f}" if cpu > 0 else "-",
                ]
            )
    title = "suite speed: checked steps per CPU second (this process: checks and engine)"
    return "\n".join([title, aligned([header, *body], left={0, 1, 2, 3})])
