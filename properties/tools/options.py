"""The range of every numeric option of the ``kvconform`` command, checked in one place.

:data:`NUMERIC_OPTIONS` maps an option's ``argparse`` destination to its flag and its
range; :func:`check_numbers` checks every one a command was given (finite, within its
range) before the command runs, and raises a usage error (exit 2) with one line naming
the flag. ``--call-timeout`` is checked where the configuration is built
(:class:`properties.runner.config.CheckConfig`), ``KVCONFORM_EXEC_TIMEOUT`` where it is
read (:func:`properties.engines.exec_engine.call_timeout_from_env`).

Worked example: ``--minutes nan`` gives ``--minutes must be a finite number, got nan``;
``--max-examples -5`` gives ``--max-examples must be >= 1, got -5``; ``--workers 100000``
gives ``--workers must be <= 1024, got 100000``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from reference.errors import KVConformError


@dataclass(frozen=True)
class NumberRange:
    """``flag`` takes a number in ``[low, high]`` (``(low, high]`` when not
    ``low_inclusive``)."""

    flag: str
    low: float
    high: float
    low_inclusive: bool = True

    def check(self, value: float) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise KVConformError(f"{self.flag} must be a finite number, got {value}")
        if value < self.low or (value == self.low and not self.low_inclusive):
            relation = ">=" if self.low_inclusive else ">"
            raise KVConformError(f"{self.flag} must be {relation} {_text(self.low)}, got {value}")
        if value > self.high:
            raise KVConformError(f"{self.flag} must be <= {_text(self.high)}, got {value}")


def _text(bound: float) -> str:
    """``1`` for 1 and 1.0, ``0.5`` for 0.5: a bound as the user would type it."""
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


DAY_S = 86_400.0

#: ``argparse`` destination -> its range (options a command lacks are not checked).
NUMERIC_OPTIONS: dict[str, NumberRange] = {
    "max_examples": NumberRange("--max-examples", 1, 10_000_000),
    "tier_examples": NumberRange("--tier-examples", 1, 10_000_000),
    "seed": NumberRange("--seed", 0, 2**63 - 1),
    "workers": NumberRange("--workers", 1, 1024),
    "shrink_seconds": NumberRange("--shrink-seconds", 0, DAY_S),
    "minutes": NumberRange("--minutes", 0, 366 * 24 * 60, low_inclusive=False),
    "progress_seconds": NumberRange("--progress-seconds", 0, DAY_S, low_inclusive=False),
    "per_mode": NumberRange("--per-mode", 1, 10_000),
    "examples": NumberRange("--examples", 1, 1_000_000),
    "repeat": NumberRange("--repeat", 1, 10_000),
    "hotspots": NumberRange("--hotspots", 0, 10_000),
    "scale": NumberRange("--scale", 1, 10_000),
    "threads": NumberRange("--threads", 1, 1024),
}


def check_numbers(args: argparse.Namespace) -> None:
    """Check every numeric option ``args`` holds (see the module docstring)."""
    for dest, allowed in NUMERIC_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is not None:
            allowed.check(value)


def selected_tiers(
    value: str | None, profile: str, max_examples: int | None = None
) -> tuple[str, ...] | None:
    """``--tiers`` (``--kv-tiers`` under pytest): None (the profile's), ``()`` for
    ``none``, else the tiers named, checked against the profile's (a usage error names an
    unknown one). A run bounded by ``--max-examples`` runs the small tier only unless
    ``--tiers`` names more. Example: ``selected_tiers("medium", "ci") == ("medium",)``."""
    from properties.runner.profiles import tier_examples

    if value is None:
        return () if max_examples is not None else None
    names = () if value.strip() == "none" else tuple(t.strip() for t in value.split(","))
    tier_examples(profile, names)  # raises on an unknown tier
    return names


def tier_counts(
    profile: str, tiers: tuple[str, ...] | None, examples_per_tier: int | None
) -> dict[str, int]:
    """The examples of each large tier a run takes: the profile's counts of the tiers
    ``tiers`` names (None: all of them), each replaced by ``examples_per_tier`` when
    set (``--tier-examples``). Example: profile ci, tiers ``("medium",)``, 20 per tier ->
    ``{"medium": 20}``."""
    from properties.runner.profiles import tier_examples

    counts = tier_examples(profile, tiers)
    if examples_per_tier is None:
        return counts
    return {tier: examples_per_tier for tier in counts}
