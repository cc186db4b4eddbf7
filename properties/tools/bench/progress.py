"""Progress of the benches: a line per row as soon as it is measured, before the table.

Examples: ``engine_line`` prints ``  bench: prefix-heavy on reference: ok, 212 steps,
1.93 s``; ``suite_line`` prints ``  bench: salt_ignored (universal): caught by
hit_soundness after 0.41 s``.
"""

from __future__ import annotations


def engine_line(row) -> None:
    """One :class:`properties.tools.bench.engines.EngineBenchRow`, as measured."""
    if row.ok:
        print(
            f"  bench: {row.trace} on {row.engine}: ok, {row.steps} steps, {row.total_s:.2f} s",
            flush=True,
        )
    else:
        print(f"  bench: {row.trace} on {row.engine}: {row.status}", flush=True)


def suite_line(row) -> None:
    """One :class:`properties.tools.bench.suite.SuiteRow` (or ``SpeedRow``), as
    measured."""
    if hasattr(row, "cpu_seconds"):  # the suite's speed on one engine and property
        print(
            f"  bench: suite speed of {row.engine} ({row.prop}, {row.level}): {row.status}, "
            f"{row.steps} steps in {row.cpu_seconds:.2f} CPU s",
            flush=True,
        )
        return
    what = f"caught by {row.check}" if row.caught else "not caught"
    if row.name == "reference":
        what = f"FAILED ({row.check})" if row.caught else "passed"
    print(
        f"  bench: {row.name} ({row.level}): {what} after {row.seconds:.2f} s, "
        f"{row.steps} steps, {row.examples} examples",
        flush=True,
    )
