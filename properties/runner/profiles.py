"""Hypothesis profiles of kvconform, registered and loaded explicitly.

``dev`` (quick local runs), ``pr`` (a pull request's gate: derandomized like ``ci``, a
minute on two cores, saying what it leaves to ``ci``: :func:`profile_note`), ``ci`` (CI:
bounded and derandomized, so a CI run is reproducible; the gate), ``nightly`` (long
campaigns), ``gpu`` (GPU CI: few, heavier examples). ``pr``, ``ci`` and ``gpu`` skip
Hypothesis' target phase: with a few hundred examples the hill-climbing on
``hypothesis.target`` scores (pool pressure, hit length, churn) spends half of them on
variants of one example; campaigns keep it. ``CI=true`` makes Hypothesis load its own
``ci`` profile unless one is loaded explicitly; :func:`load_profile` always loads ours.
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings
from hypothesis.configuration import storage_directory
from hypothesis.database import DirectoryBasedExampleDatabase

from properties.core.constants import PROFILES
from properties.generate.strategies import MEDIUM, OFFLINE, PRODUCTION
from reference.errors import KVConformError


def _pin_local_constants() -> None:
    """Make a derandomized stream independent of the source code and the modules a
    process has loaded.

    Hypothesis (6.1xx) mixes into its generation constants it reads from the source of
    every *local* module loaded (files under the working directory). The examples a
    derandomized profile draws would then depend on what the process imported, where
    kvconform is installed, and every literal anyone adds to kvconform: ``kvconform
    check`` from a checkout, from an installed wheel, pytest (the test modules too) and
    an engine's own package would each get another stream, and any edit of the suite
    (a new constant in a docstring-free helper) would silently move which mutants the
    ci profile catches. The pool is pinned to an empty one: a profile's stream depends
    on the strategies and the machine's name only. A no-op on a Hypothesis without that
    pool."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:  # pragma: no cover - another Hypothesis layout
        return
    if not hasattr(providers, "_get_local_constants"):  # pragma: no cover
        return
    empty = Constants()
    providers._get_local_constants = lambda: empty


_pin_local_constants()

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
#: Every phase but ``target`` (see the module docstring).
_NO_TARGET = (Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink)

settings.register_profile(
    "dev",
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=_SUPPRESS,
    print_blob=True,
)


def _register_gate(name: str, max_examples: int, stateful_step_count: int) -> None:
    """A gate's profile: derandomized (the same examples on every run), no database, no
    target phase."""
    settings.register_profile(
        name,
        max_examples=max_examples,
        stateful_step_count=stateful_step_count,
        deadline=None,
        derandomize=True,
        database=None,
        phases=_NO_TARGET,
        suppress_health_check=_SUPPRESS,
        print_blob=True,
    )


_register_gate("pr", max_examples=40, stateful_step_count=30)
_register_gate("ci", max_examples=200, stateful_step_count=40)
settings.register_profile(
    "nightly",
    max_examples=5000,
    stateful_step_count=80,
    deadline=None,
    # a campaign draws fresh examples and keeps them, CI=true or not (there Hypothesis'
    # own defaults are derandomized with no database, which HypoFuzz refuses to fuzz)
    derandomize=False,
    database=DirectoryBasedExampleDatabase(
        storage_directory("examples", intent_to_write=False).path
    ),
    suppress_health_check=_SUPPRESS,
    print_blob=True,
)
_register_gate("gpu", max_examples=30, stateful_step_count=40)


#: Examples of the large scale tiers a property runs after its small ones, per profile
#: (:mod:`properties.runner.tiers`). Under a derandomized profile the first example of a
#: tier is its simplest one (one request), so ``ci`` runs 2 production examples to get
#: one of thousands of requests; such an example costs 30-200 s (2 loaded cores).
TIER_EXAMPLES: dict[str, dict[str, int]] = {
    "dev": {MEDIUM: 2, OFFLINE: 2, PRODUCTION: 1},
    "pr": {MEDIUM: 1, OFFLINE: 1, PRODUCTION: 0},
    "ci": {MEDIUM: 5, OFFLINE: 4, PRODUCTION: 2},
    "nightly": {MEDIUM: 200, OFFLINE: 100, PRODUCTION: 40},
    "gpu": {MEDIUM: 5, OFFLINE: 4, PRODUCTION: 2},
}


def tier_examples(name: str, only: tuple[str, ...] | None = None) -> dict[str, int]:
    """The large tiers' example counts of profile ``name``, only the tiers ``only`` names
    when given (``--tiers``). Example: ``tier_examples("ci") == {"medium": 5,
    "production": 2}``; ``tier_examples("ci", ("medium",)) == {"medium": 5}``."""
    if name not in TIER_EXAMPLES:
        raise KVConformError(f"--profile must be one of {', '.join(PROFILES)}, got {name!r}")
    counts = dict(TIER_EXAMPLES[name])
    if only is not None:
        unknown = sorted(set(only) - set(counts))
        if unknown:
            raise KVConformError(
                f"--tiers names unknown tiers {unknown}; the large tiers are "
                f"{', '.join(counts)} (or none)"
            )
        counts = {tier: n for tier, n in counts.items() if tier in only}
    return counts


def profile_note(name: str) -> str | None:
    """What a reduced profile leaves out, against ``ci`` (the gate), as ``check`` prints
    it at the start; None for the others. Example: ``profile_note("pr")`` starts with
    ``"profile pr (a pull request's quick gate; ci stays the gate): 40 examples per
    property (ci 200)"``."""
    if name != "pr":
        return None
    mine, gate = settings.get_profile(name), settings.get_profile("ci")
    tiers = ", ".join(
        f"{tier} {TIER_EXAMPLES[name][tier]} (ci {n})"
        if TIER_EXAMPLES[name][tier]
        else f"{tier} skipped (ci {n})"
        for tier, n in TIER_EXAMPLES["ci"].items()
    )
    return (
        f"profile {name} (a pull request's quick gate; ci stays the gate): "
        f"{mine.max_examples} examples per property (ci {gate.max_examples}), "
        f"{mine.stateful_step_count} steps per example (ci {gate.stateful_step_count}); "
        f"large tiers: {tiers}"
    )


def get_profile(name: str) -> settings:
    """Profile ``name`` (one of :data:`PROFILES`), without loading it globally: a run passes
    its settings explicitly, so a pytest session's other Hypothesis tests keep theirs."""
    if name not in PROFILES:
        raise KVConformError(f"--profile must be one of {', '.join(PROFILES)}, got {name!r}")
    return settings.get_profile(name)


def load_profile(name: str) -> settings:
    """Load and return profile ``name`` (one of :data:`PROFILES`)."""
    if name not in PROFILES:
        raise KVConformError(f"--profile must be one of {', '.join(PROFILES)}, got {name!r}")
    settings.load_profile(name)
    return settings.get_profile(name)
