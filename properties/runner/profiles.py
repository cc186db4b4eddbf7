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

from hypothesis import HealthCheck, Phase, settings

from properties.core.constants import PROFILES
from reference.errors import KVConformError

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


def load_profile(name: str) -> settings:
    """Load and return profile ``name`` (one of :data:`PROFILES`)."""
    if name not in PROFILES:
        raise KVConformError(f"--profile must be one of {', '.join(PROFILES)}, got {name!r}")
    settings.load_profile(name)
    return settings.get_profile(name)
