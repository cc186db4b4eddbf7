"""The suite's power and speed: time and steps to catch each mutant, reference throughput.

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

Usage: ``kvconform bench suite [--profile ci]``, or
``print(format_suite(bench_suite("ci")))``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hypothesis import Phase, Verbosity, settings
from hypothesis.stateful import run_state_machine_as_test

from properties.runner.config import CheckConfig
from properties.runner.machine import machine_for
from properties.runner.profiles import load_profile

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
    factory: Callable | None,
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
    machine = machine_for(config, factory, name=f"{property_name.capitalize()}Machine")
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


def bench_suite(
    profile: str = "ci",
    levels: Sequence[str] = ("universal", "exact"),
    mutants: Sequence[str] | None = None,
    max_examples: int | None = DETECTION_EXAMPLES,
) -> list[SuiteRow]:
    """Every mutant (or those named) at each of ``levels``, then the reference at each,
    all under :func:`detection_settings` (``profile``, ``max_examples``).

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
                rows.append(
                    run_machine(
                        config, info.factory, hyp, name, info.description, property_name=info.prop
                    )
                )
        for level in levels:
            config = CheckConfig(engine=REFERENCE, level=level, failure_dir=tmp)
            rows.append(run_machine(config, None, hyp, REFERENCE, "the reference (throughput)"))
    return rows


def format_suite(rows: Sequence[SuiteRow]) -> str:
    """A plain-text table: mutants (caught by what, after how long), then throughput."""
    lines = [
        f"{'mutant':<26} {'level':<9} {'caught by':<24} {'time s':>7} {'steps':>6} {'examples':>8}"
    ]
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
    return "\n".join(lines)
