"""What one check run is asked to do: :class:`CheckConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from properties.checks.registry import validate_disabled
from properties.core.constants import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_FAILURE_DIR,
    DEFAULT_ISOLATION,
    DEFAULT_LEVEL,
    ISOLATION_MODES,
    LEVELS,
    MAX_CALL_TIMEOUT_S,
)
from properties.engines.under_test import EngineUnderTest, resolve_engine
from properties.generate.presets import PRESETS
from properties.generate.strategies import SMALL, TIER_NAMES
from reference.errors import KVConformError


@dataclass(frozen=True)
class CheckConfig:
    """Engine (built-in name or ``module:factory``), level, layouts and switches.

    ``attention`` adds the attention check to every scheduled step; ``disabled`` names
    invariants to skip (``properties.checks.registry.INVARIANTS``); ``max_len`` bounds the
    ``max_model_len`` of generated layouts. ``production`` draws the deployed settings
    on top (retention interval, EAGLE, lookahead hashes, and a
    :class:`properties.core.modes.ServingMode` for engines that support it);
    ``call_timeout`` is the deadline of one engine call in seconds (0: none) and
    ``isolation`` where the engine runs (:data:`properties.core.constants.ISOLATION_MODES`).
    Example: ``CheckConfig("vllm", "exact")``.
    """

    engine: str = "reference"
    level: str = DEFAULT_LEVEL
    preset: str | None = None
    attention: bool = False
    disabled: frozenset[str] = frozenset()
    max_len: int = 128
    failure_dir: str = DEFAULT_FAILURE_DIR
    production: bool = False
    call_timeout: float = DEFAULT_CALL_TIMEOUT_S
    isolation: str = DEFAULT_ISOLATION
    #: the scale tier (:data:`properties.generate.strategies.TIERS`): ``small`` runs the
    #: stateful machine (then the profile's medium, offline and production examples), a larger
    #: one only that tier's examples
    tier: str = SMALL
    #: replay the reach corpus before drawing (:mod:`properties.runner.reach`)
    reach_corpus: bool = True

    def __post_init__(self) -> None:
        timeout = self.call_timeout
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 <= timeout <= MAX_CALL_TIMEOUT_S  # nan and inf too
        ):
            raise KVConformError(
                f"--call-timeout must be a number of seconds >= 0 and <= "
                f"{MAX_CALL_TIMEOUT_S:g} (0: no deadline), got {timeout!r}"
            )
        if self.preset is not None and self.preset not in PRESETS:
            raise KVConformError(
                f"--preset must be one of {', '.join(PRESETS)}, got {self.preset!r}"
            )
        if self.isolation not in ISOLATION_MODES:
            raise KVConformError(
                f"--isolation must be one of {', '.join(ISOLATION_MODES)}, got {self.isolation!r}"
            )
        if self.tier not in TIER_NAMES:
            raise KVConformError(
                f"--tier must be one of {', '.join(TIER_NAMES)}, got {self.tier!r}"
            )
        if self.level not in LEVELS:
            raise KVConformError(f"--level must be one of {', '.join(LEVELS)}, got {self.level!r}")
        try:
            validate_disabled(self.disabled)
        except ValueError as exc:
            raise KVConformError(str(exc)) from exc

    def replay_options(self) -> str:
        """The options a replay of this run's failure needs to reproduce it, beyond the
        engine and level: skipped invariants (a skipped check would fire first and name
        another failure), a call timeout and an isolation other than the defaults. The
        attention property replays with ``--attention``, which skips the invariants itself.
        Example: ``CheckConfig(disabled=frozenset({"hit_bounds"}),
        call_timeout=1).replay_options() == "--skip-checks hit_bounds --call-timeout 1"``."""
        parts = []
        if self.disabled and not self.attention:
            parts.append("--skip-checks " + " ".join(sorted(self.disabled)))
        if self.call_timeout != DEFAULT_CALL_TIMEOUT_S:
            parts.append(f"--call-timeout {self.call_timeout:g}")
        if self.isolation != DEFAULT_ISOLATION:
            parts.append(f"--isolation {self.isolation}")
        return " ".join(parts)

    def resolve_engine(self) -> EngineUnderTest:
        """The engine under test ``engine`` names, loaded, checked and isolated as
        ``isolation`` and ``call_timeout`` ask
        (:func:`properties.engines.under_test.resolve_engine`); callers resolve it once
        and pass it on. Example:
        ``CheckConfig("vllm").resolve_engine().known_divergences``."""
        return resolve_engine(self.engine, isolation=self.isolation, call_timeout=self.call_timeout)
