"""Per-check control: ``--skip-checks NAME...`` and ``--xfails-file FILE``.

* A *skipped* check does not run (it must be an invariant: the checks that are not,
  ``answers``, ``exact_match``, ``attention``, ``determinism``, are chosen with
  ``--level`` and ``--only``).
* An *xfails file* lists checks the engine is known to break, one a line, each with its
  reason after ``#``; blank lines and lines starting with ``#`` are comments::

      hit_bounds        # our lookup may hit a whole prompt (issue 12)
      exact_match       # we evict in LRU order, not vLLM's

  The rule is strict, as array-api-tests' ``--xfails-file``: a listed check that fails
  is XFAIL (the run passes); a listed check that ran and never failed is XPASS, and the
  run fails (the file is out of date). A property that fails on a listed invariant is
  run again without it (and without the listed invariants found before), so that a
  known failure hides none of the other checks; a check that cannot be turned off
  (``exact_match``, ``attention``, ``determinism``) leaves its property XFAIL.

Unknown names, a line without a reason, a name listed twice or both skipped and
expected to fail are usage errors (exit 2), one line each.

Worked example: an xfails file with ``hit_bounds  # whole-prompt hits`` on an engine
whose lookups hit whole prompts: the invariants property fails on ``hit_bounds`` (XFAIL),
runs again without it and passes; the run exits 0. On the reference ``hit_bounds``
runs and never fails: XPASS, exit 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from properties.checks.registry import CHECKS, INVARIANTS
from reference.errors import KVConformError

#: The properties that run the invariants (a listed invariant can be turned off there).
INVARIANT_PROPERTIES = ("invariants", "production")


@dataclass(frozen=True)
class CheckSelection:
    """Checks to skip, and checks expected to fail with their reasons (name -> reason).

    Example: ``CheckSelection(skip=frozenset({"idle_pool_free"}), xfail=(("hit_bounds",
    "whole-prompt hits"),))``."""

    skip: frozenset[str] = frozenset()
    xfail: tuple[tuple[str, str], ...] = ()
    source: str | None = None

    @property
    def xfail_reasons(self) -> dict[str, str]:
        return dict(self.xfail)

    def __bool__(self) -> bool:
        return bool(self.skip or self.xfail)


#: The largest xfails file read (a few hundred lines of check names and reasons).
MAX_XFAILS_BYTES = 1024 * 1024


def parse_xfails(text: str, source: str = "xfails file") -> tuple[tuple[str, str], ...]:
    """The ``(check, reason)`` pairs of an xfails file's text (see the module docstring).

    Example: ``parse_xfails("hit_bounds  # whole prompts\\n") == (("hit_bounds",
    "whole prompts"),)``."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, _, reason = (part.strip() for part in line.partition("#"))
        where = f"{source}:{number}"
        if not reason:
            raise KVConformError(f"{where}: {name!r} needs a reason after '#'")
        if " " in name or "\t" in name:
            raise KVConformError(f"{where}: one check name per line, got {name!r}")
        _require_known(name, where)
        if name in seen:
            raise KVConformError(f"{where}: {name!r} is listed twice")
        seen.add(name)
        out.append((name, reason))
    return tuple(out)


def _require_known(name: str, where: str) -> None:
    if name not in CHECKS:
        raise KVConformError(f"{where}: unknown check {name!r}; known: {', '.join(CHECKS)}")


def load_selection(skip: Iterable[str] | None, xfails_file: str | None) -> CheckSelection:
    """The selection the options ask for; every name checked (a usage error otherwise)."""
    skipped = frozenset(skip or ())
    for name in sorted(skipped):
        _require_known(name, "--skip-checks")
        if name not in INVARIANTS:
            raise KVConformError(
                f"--skip-checks: {name!r} is not an invariant and cannot be skipped "
                "(use --level universal for exact_match, --only for the properties)"
            )
    xfail: tuple[tuple[str, str], ...] = ()
    if xfails_file is not None:
        from properties.core.json_input import read_text

        text = read_text(xfails_file, "--xfails-file", MAX_XFAILS_BYTES)
        xfail = parse_xfails(text, xfails_file)
    both = sorted(skipped & {name for name, _ in xfail})
    if both:
        raise KVConformError(f"checks both skipped and expected to fail: {', '.join(both)}")
    return CheckSelection(skipped, xfail, xfails_file)


def with_skips(config, selection: CheckSelection):
    """``config`` (a :class:`properties.runner.config.CheckConfig`) with the skipped
    checks disabled."""
    return replace(config, disabled=config.disabled | selection.skip) if selection.skip else config


#: Invariants that only the serving modes (or one production setting) can trigger: the
#: event they run on never happens without it. Check -> (what it needs, why).
DECLARATION_ONLY_CHECKS: dict[str, tuple[str, str]] = {
    "external_hit_bounds": ("external", "external hits need the 'external' setting"),
    "external_load_exclusive": ("external", "external hits need the 'external' setting"),
    "host_hit_content": ("external", "external hits need the 'external' setting"),
    "in_flight_reads_held": ("serving_modes", "asynchronous steps need the serving calls"),
    "committed_blocks_verified": ("serving_modes", "cache_blocks is a serving call"),
}


@dataclass(frozen=True)
class EngineChecks:
    """The invariants for one engine, as every report states them: ``runnable`` (they run
    and can fire), ``idle`` (they run but the engine's declarations never give them an
    event: check -> why), ``lost`` (its capabilities turn them off) and the
    ``capabilities`` themselves."""

    runnable: tuple[str, ...]
    idle: dict[str, str]
    lost: tuple[str, ...]
    capabilities: frozenset[str]


def engine_checks(engine, config) -> EngineChecks:
    """The one statement of which invariants an engine is checked by (the CLI's
    ``checks:`` line, its reports and the pytest route read it). Example: an engine
    without the serving calls has ``in_flight_reads_held`` idle, not runnable."""
    from properties.runner.run import active_checks_for

    active, capabilities = active_checks_for(engine, config)
    lost = tuple(n for n in INVARIANTS if n not in active and n not in config.disabled)
    declared = set(engine.production_settings) | (set(capabilities) & {"serving_modes"})
    if "serving_modes" not in declared:
        declared.discard("external")  # external hits travel through the serving calls
    idle = {
        n: why
        for n, (needs, why) in DECLARATION_ONLY_CHECKS.items()
        if n in active and needs not in declared
    }
    runnable = tuple(n for n in active if n not in idle)
    return EngineChecks(runnable, idle, lost, frozenset(capabilities))


def checks_ran(prop: str, active: Sequence[str], level: str) -> list[str]:
    """The checks property ``prop`` runs, given the invariants ``active`` for the engine
    (after skips). Example: ``checks_ran("determinism", [...], "universal") ==
    ["answers", "determinism"]``."""
    lockstep = ["exact_match"] if level == "exact" else []
    if prop in INVARIANT_PROPERTIES:
        return ["answers", *active, *lockstep]
    if prop == "attention":
        return ["answers", "attention", *lockstep]
    return ["answers", "determinism"]


@dataclass(frozen=True)
class XfailOutcome:
    """What became of one listed check: ``xfail`` (it failed, as expected), ``xpass``
    (it ran and never failed: the run fails) or ``not run`` (no property ran it)."""

    check: str
    reason: str
    status: str
    prop: str | None = None
    failure: str | None = None


def run_selected(
    run: Callable[[object, list[str]], list],
    config,
    wanted: list[str],
    selection: CheckSelection,
    on_xfail: Callable[[object, str], None] | None = None,
) -> tuple[list, list[XfailOutcome]]:
    """Run ``wanted`` with ``run(config, names) -> [PropertyResult]`` under
    ``selection``: a property that fails on a listed check is XFAIL (its result gets
    ``xfailed``, its failure cleared) and, when the check is an invariant, runs again
    without it. Returns the results and one outcome per listed check (``xpass`` needs
    ``ran`` to be filled in by :func:`xfail_outcomes`)."""
    config = with_skips(config, selection)
    reasons = selection.xfail_reasons
    results = run(config, wanted)
    failed_on: dict[str, object] = {}
    for i, result in enumerate(results):
        xfailed: list[str] = []
        disabled = config.disabled
        while result.failure is not None and result.kind == "property" and result.check in reasons:
            check = result.check
            xfailed.append(check)
            failed_on.setdefault(check, result)
            if on_xfail is not None:
                on_xfail(result, reasons[check])
            if check not in INVARIANTS or result.name not in INVARIANT_PROPERTIES:
                result = replace(result, failure=None, kind=None, trace_path=None, note=None)
                break
            disabled = disabled | {check}
            result = run(replace(config, disabled=disabled), [result.name])[0]
        if xfailed:
            result = replace(result, xfailed=tuple(xfailed))
        results[i] = result
    return results, [
        XfailOutcome(
            name,
            reason,
            "xfail" if name in failed_on else "unknown",
            failed_on[name].name if name in failed_on else None,
            failed_on[name].failure if name in failed_on else None,
        )
        for name, reason in selection.xfail
    ]


def xfail_outcomes(outcomes: list[XfailOutcome], ran: Iterable[str]) -> list[XfailOutcome]:
    """Settle the ``unknown`` outcomes: ``xpass`` for a check that ran (in ``ran``),
    ``not run`` for one that did not."""
    ran = set(ran)
    return [
        o if o.status != "unknown" else replace(o, status="xpass" if o.check in ran else "not run")
        for o in outcomes
    ]


def xpass_failure(outcomes: list[XfailOutcome], source: str | None) -> str | None:
    """The failure text of the XPASS checks (strict: the run fails), or None."""
    xpassed = [o for o in outcomes if o.status == "xpass"]
    if not xpassed:
        return None
    return (
        f"XPASS (strict): {', '.join(o.check for o in xpassed)} listed in "
        f"{source or 'the xfails file'} as expected to fail, but ran and never failed; "
        "remove them from the file"
    )
