"""What one check run is asked to do: :class:`CheckConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from properties.checks.registry import validate_disabled
from properties.core.constants import DEFAULT_FAILURE_DIR, DEFAULT_LEVEL, LEVELS
from reference.errors import KVConformError


@dataclass(frozen=True)
class CheckConfig:
    """Engine (built-in name or ``module:factory``), level, layouts and switches.

    ``attention`` adds the attention check to every scheduled step; ``disabled`` names
    invariants to skip (``properties.checks.registry.INVARIANTS``); ``max_len`` bounds the
    ``max_model_len`` of generated layouts. ``production`` draws the deployed settings
    on top (retention interval, EAGLE, lookahead hashes, and a
    :class:`properties.core.modes.ServingMode` for engines that support it).
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

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise KVConformError(f"--level must be one of {', '.join(LEVELS)}, got {self.level!r}")
        try:
            validate_disabled(self.disabled)
        except ValueError as exc:
            raise KVConformError(str(exc)) from exc
