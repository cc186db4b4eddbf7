"""A failure a person can act on: the rule it broke, where, and what differed.

:func:`explain_failure` turns a failing trace into a few lines: the check's name with its
spec label, the rule's one-line statement and its ``docs/spec.md`` section; the operation
that failed (its index, the operation, the scheduler step it belongs to, the request it
names); then the check's message (diffs, never dumps: :mod:`properties.core.diff`).
:func:`format_summary` is the text summary at the end of ``kvconform check``.

Worked example (a ``pool_accounting`` failure at the second operation)::

    [pool_accounting] I1: free + in use == num_blocks - 1 (docs/spec.md §11, Pool accounting)
      at operation 1 (operations 0-1): Step(token_budget=8), scheduler step 1
      0 free + 1 in use != 2 blocks (null block excluded)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from properties.checks.registry import CHECKS
from properties.core.trace import Step, Trace

#: The ``docs/spec.md`` subsection (of §11) that defines each label, by its letter; the
#: checks that compare with something else than an invariant are defined together.
_SECTION_BY_LETTER = {
    "I": "Pool accounting",
    "X": "Pool accounting",
    "A": "Allocation",
    "W": "Windows",
    "H": "Prefix hits",
    "C": "Caching",
    "F": "Free and reset",
    "R": "Free and reset",
    "P": "Answers, reference, attention",
    "T": "Answers, reference, attention",
    "S": "Separate pools",
}
_SECTION_BY_CHECK = {"exact_match": "Answers, reference, attention"}


def spec_section(check: str) -> str | None:
    """Where ``docs/spec.md`` defines the rule of ``check``. Example:
    ``spec_section("hit_soundness")`` is ``'docs/spec.md §11, Prefix hits'``."""
    info = CHECKS.get(check)
    if info is None:
        return None
    section = _SECTION_BY_CHECK.get(check) or _SECTION_BY_LETTER.get(info.label[:1])
    return f"docs/spec.md §11, {section}" if section else None


def rule_line(check: str) -> str:
    """The check's name, label, one-line rule and section; for a name that is not a
    check (an engine error's type), the name alone. Example: ``rule_line("hit_bounds")``
    is ``'[hit_bounds] H1: 0 <= hit <= num_tokens - 1, aligned (docs/spec.md §11,
    Prefix hits)'``."""
    info = CHECKS.get(check)
    if info is None:
        return (
            f"[{check}] the engine broke the protocol (P1, docs/spec.md §11, Answers, "
            "reference, attention)"
        )
    return f"[{check}] {info.label}: {info.guards} ({spec_section(check)})"


def failing_operation(trace: Trace) -> tuple[int, int] | None:
    """``(index, scheduler step)`` of the trace's last operation (a replay stops at the
    failing one): the step counts the ``Step`` operations up to and including it."""
    if not trace.operations:
        return None
    index = len(trace.operations) - 1
    steps = sum(1 for op in trace.operations if isinstance(op, Step))
    return index, steps


def where_line(trace: Trace) -> str:
    """Where the failure happened. Example: ``'at operation 3 (operations 0-3): Step(...),
    scheduler step 2'``; a failure before any operation: ``'at the engine's
    construction (no operation ran)'``."""
    found = failing_operation(trace)
    if found is None:
        return "at the engine's construction (no operation ran)"
    index, step = found
    op = trace.operations[index]
    request = getattr(op, "request_id", None)
    return (
        f"at operation {index} (operations 0-{len(trace.operations) - 1}): {_short_op(op)}, "
        f"scheduler step {step}" + (f", request {request!r}" if request else "")
    )


def _short_op(op: object) -> str:
    text = repr(op)
    return text if len(text) <= 160 else text[:150] + " ...)"


def explain_failure(trace: Trace, max_lines: int = 24) -> str:
    """The failure of ``trace`` in at most ``max_lines`` lines (module docstring)."""
    failure = trace.failure or {}
    check = str(failure.get("property", "?"))
    message = str(failure.get("message", ""))
    prefix = f"[{check}] "
    if message.startswith(prefix):
        message = message[len(prefix) :]
    lines = [rule_line(check), f"  {where_line(trace)}"]
    body = message.splitlines() or [""]
    lines += [f"  {line}" for line in body]
    if len(lines) > max_lines:
        lines = lines[: max_lines - 1] + [f"  ... ({len(lines) - max_lines + 1} more lines)"]
    return "\n".join(lines)


def format_summary(
    results: Sequence[object],
    engine: str,
    level: str,
    reports: dict[str, Path | str] | None = None,
    tiers: dict[str, tuple[int, int]] | None = None,
    wall_seconds: float | None = None,
    options: str = "",
) -> str:
    """The closing summary of ``kvconform check``: the properties that ran (by name),
    their examples and steps (per tier when tiers exist: ``{tier: (examples, steps)}``),
    the run's wall time and the result; the gates (rows that are not properties: pair
    reach, engine coverage, xfails, rule coverage) by name; for each failed row its
    trace, HTML report (``reports``: property -> page, or the line saying why none was
    written) and replay command. Example (one passing property, 2.5 s from start to
    end)::

        summary: 1 properties (invariants), 20 examples, 310 steps, 2.5s wall: PASSED
    """
    from properties.core.constants import PROPERTIES
    from properties.runner.check import replay_command

    props = [r for r in results if getattr(r, "name", None) in PROPERTIES]
    gates = [r for r in results if getattr(r, "name", None) not in PROPERTIES]
    examples = sum(getattr(r, "examples", 0) for r in props)
    steps = sum(getattr(r, "steps", 0) for r in props)
    seconds = (
        wall_seconds if wall_seconds is not None else sum(getattr(r, "seconds", 0.0) for r in props)
    )
    failed = [r for r in results if not getattr(r, "passed", True)]
    result = "PASSED" if not failed else f"FAILED ({', '.join(r.name for r in failed)})"
    names = ", ".join(r.name for r in props) or "none"
    gate_text = f", gates ({', '.join(r.name for r in gates)})" if gates else ""
    lines = [
        f"summary: {len(props)} properties ({names}){gate_text}, {examples} examples, "
        f"{steps} steps, {seconds:.1f}s{' wall' if wall_seconds is not None else ''}: {result}"
    ]
    if tiers:
        per_tier = ", ".join(f"{t} {e} examples/{n} steps" for t, (e, n) in tiers.items())
        lines.append(f"  per tier: {per_tier}")
    for r in failed:
        path = getattr(r, "trace_path", None)
        if path is None:
            continue
        lines.append(f"  {r.name}:")
        lines.append(f"    trace: {path}")
        report = (reports or {}).get(r.name)
        if report is not None:
            lines.append(f"    report: {report}" if isinstance(report, Path) else f"    {report}")
        command = replay_command(path, engine, level, r.name == "attention", options)
        lines.append(f"    replay: {command}")
    return "\n".join(lines)
