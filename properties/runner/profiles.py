"""Hypothesis profiles of kvconform, registered and loaded explicitly.

``dev`` (quick local runs), ``ci`` (CI: bounded and derandomized, so a CI run is
reproducible), ``nightly`` (long campaigns), ``gpu`` (GPU CI: few, heavier
examples). ``ci`` and ``gpu`` skip Hypothesis' target phase: with a few hundred examples
the hill-climbing on ``hypothesis.target`` scores (pool pressure, hit length, churn)
spends half of them on variants of one example; campaigns keep it. ``CI=true`` makes
Hypothesis load its own ``ci`` profile unless one is
loaded explicitly; :func:`load_profile` always loads ours.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, Phase, settings

from properties.core.constants import PROFILES
from properties.generate.strategies import MEDIUM, PRODUCTION
from reference.errors import KVConformError


def _pin_local_constants() -> None:
    """Make a derandomized stream independent of the modules a process has loaded.

    Hypothesis (6.1xx) mixes into its generation constants it reads from the source of
    every *local* module loaded (files under the working directory). The examples a
    derandomized profile draws then depend on what the process imported and where
    kvconform is installed: ``kvconform check`` from a checkout, from an installed wheel
    (no local module of ours), pytest (the test modules too) and an engine's own package
    (its constants change with every edit) would each get another stream, so an engine
    and the reference, or a mutant test and the command it reproduces, would not see
    the same examples. The pool is pinned to the constants of kvconform's own source
    (``reference/``, ``optimized/``, ``properties/``, read once from the installed
    files, whatever is imported): a profile's stream then depends on the kvconform
    version and the machine's name only. A no-op on a Hypothesis without that pool."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants, _constants_from_source
    except ImportError:  # pragma: no cover - another Hypothesis layout
        return
    if not hasattr(providers, "_get_local_constants"):  # pragma: no cover
        return
    root = Path(__file__).resolve().parents[2]
    pool: list[Constants] = []

    def kvconform_constants() -> Constants:
        if not pool:
            constants = Constants()
            for package in ("reference", "optimized", "properties"):
                for path in sorted((root / package).rglob("*.py")):
                    try:
                        constants |= _constants_from_source(path.read_bytes(), limit=True)
                    except (OSError, SyntaxError, ValueError, RecursionError):
                        continue  # pragma: no cover - an unreadable file adds nothing
            pool.append(constants)
        return pool[0]

    providers._get_local_constants = kvconform_constants


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
settings.register_profile(
    "ci",
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    phases=_NO_TARGET,
    suppress_health_check=_SUPPRESS,
    print_blob=True,
)
settings.register_profile(
    "nightly",
    max_examples=5000,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=_SUPPRESS,
    print_blob=True,
)
settings.register_profile(
    "gpu",
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    phases=_NO_TARGET,
    suppress_health_check=_SUPPRESS,
    print_blob=True,
)


#: Examples of the large scale tiers a property runs after its small ones, per profile
#: (:mod:`properties.runner.tiers`). Under a derandomized profile the first example of a
#: tier is its simplest one (one request), so ``ci`` runs 2 production examples to get
#: one of thousands of requests; such an example costs 30-200 s (2 loaded cores).
TIER_EXAMPLES: dict[str, dict[str, int]] = {
    "dev": {MEDIUM: 2, PRODUCTION: 1},
    "ci": {MEDIUM: 5, PRODUCTION: 2},
    "nightly": {MEDIUM: 200, PRODUCTION: 40},
    "gpu": {MEDIUM: 5, PRODUCTION: 2},
}


def tier_examples(name: str) -> dict[str, int]:
    """The large tiers' example counts of profile ``name``. Example:
    ``tier_examples("ci") == {"medium": 5, "production": 2}``."""
    if name not in TIER_EXAMPLES:
        raise KVConformError(f"--profile must be one of {', '.join(PROFILES)}, got {name!r}")
    return dict(TIER_EXAMPLES[name])


def load_profile(name: str) -> settings:
    """Load and return profile ``name`` (one of :data:`PROFILES`)."""
    if name not in PROFILES:
        raise KVConformError(f"--profile must be one of {', '.join(PROFILES)}, got {name!r}")
    settings.load_profile(name)
    return settings.get_profile(name)
