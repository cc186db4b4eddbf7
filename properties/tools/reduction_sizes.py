"""Trace sizes before and after the reducer, for every in-project mutant.

``python -m properties.tools.reduction_sizes [--seconds 20] [--mutants NAME ...]`` runs
each mutant of :mod:`properties.mutants` as ``kvconform check --profile ci`` draws its
property (detection only, no Hypothesis shrinking: the trace as first found), reduces that
trace with :func:`properties.runner.reduce.reduce_trace` (same failing check) and prints one
line per mutant as it is measured, then a table: operations, requests, tokens and
blocks before and after, the reduction's time and whether it finished (then no single
operation of the reduced trace can be removed).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hypothesis.stateful import run_state_machine_as_test

from properties.runner.check import config_for, settings_for
from properties.runner.config import CheckConfig
from properties.runner.machine import machine_for
from properties.runner.reduce import TraceSize, reduce_trace
from properties.runner.run import engine_of
from properties.tools.bench.suite import detection_settings


@dataclass(frozen=True)
class SizeRow:
    """One mutant's trace before and after reduction (``before`` None: the ci stream
    did not fail at an operation: it escaped, or failed building the engine)."""

    name: str
    check: str | None
    before: TraceSize | None
    after: TraceSize | None
    seconds: float
    finished: bool

    def line(self) -> str:
        if self.before is None or self.after is None:
            return f"{self.name:<32} no failing operation in the ci stream: nothing to reduce"
        b, a = self.before, self.after
        return (
            f"{self.name:<32} {self.check:<24} ops {b.operations:>3} -> {a.operations:<3} "
            f"requests {b.requests:>2} -> {a.requests:<2} tokens {b.tokens:>4} -> {a.tokens:<4} "
            f"blocks {b.blocks:>5} -> {a.blocks:<5} {self.seconds:5.1f}s"
            f"{'' if self.finished else ' (budget hit)'}"
        )


def mutants() -> list[tuple[str, str, str, str, Callable]]:
    """``(name, engine, level, property, factory)`` of every in-project mutant."""
    from properties.mutants.optimized_mutants import OPTIMIZED_MUTANT_INFO
    from properties.mutants.reference_mutants import MUTANT_INFO

    out = [(n, i.target, i.level, i.prop, i.factory) for n, i in MUTANT_INFO.items()]
    for n, i in OPTIMIZED_MUTANT_INFO.items():
        engine = f"properties.mutants.optimized_mutants:{i.factory.__name__}"
        out.append((n, engine, i.level, i.prop, i.factory))
    return out


def measure(
    name: str, engine: str, level: str, prop: str, factory: Callable, seconds: float
) -> SizeRow:
    """The first failing trace of the mutant's ci stream, reduced."""
    config = config_for(prop, CheckConfig(engine=engine, level=level))
    under_test = engine_of(config, factory)
    machine = machine_for(config, under_test, name=f"{prop.capitalize()}Machine")
    with contextlib.suppress(Exception):  # the failure is what we want
        run_state_machine_as_test(machine, settings=settings_for(prop, detection_settings("ci")))
    stats = machine.stats
    if stats.first_trace is None or stats.first_failure is None:
        return SizeRow(name, None, None, None, 0.0, False)
    check = stats.first_failure[3]
    start = time.perf_counter()
    reduced, finished = reduce_trace(stats.first_trace, check, config, under_test, seconds)
    if reduced is stats.first_trace:  # reduce_trace's answer for a trace that passes
        return SizeRow(f"{name} (first trace passes on replay)", check, None, None, 0.0, False)
    return SizeRow(
        name,
        check,
        TraceSize.of(stats.first_trace),
        TraceSize.of(reduced),
        time.perf_counter() - start,
        finished,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="budget per reduction")
    parser.add_argument("--mutants", nargs="*", default=None, help="only these mutants")
    args = parser.parse_args(argv)
    rows = []
    for name, engine, level, prop, factory in mutants():
        if args.mutants and name not in args.mutants:
            continue
        rows.append(measure(name, engine, level, prop, factory, args.seconds))
        print(rows[-1].line(), flush=True)
    caught = [r for r in rows if r.before is not None and r.after is not None]
    if caught:
        ops_before = sum(r.before.operations for r in caught)
        ops_after = sum(r.after.operations for r in caught)
        print(
            f"total: {len(caught)} mutants caught, operations {ops_before} -> {ops_after}, "
            f"{sum(r.finished for r in caught)} reductions finished within "
            f"{args.seconds:g} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
