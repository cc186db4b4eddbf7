"""Scale tiers (issue 18): the bounds of each tier of generated examples
(:class:`ScaleTier`), the tiers by name (:data:`TIERS`) and :func:`tier`.

Example: ``TIERS["medium"].max_requests == 64``; ``tier("huge")`` raises a
``ValueError`` naming the known tiers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from properties.generate.presets import PRESETS

#: Every window and chunk size of the model presets, unscaled (gemma3's 1024,
#: gpt-oss's 128, llama4-scout's 8192 chunks, ...): the production tier's windows.
PRESET_WINDOWS: tuple[int, ...] = tuple(sorted({w for p in PRESETS.values() for w in p.windows}))


#: The trace shapes of a large tier (:attr:`ScaleTier.workload`).
ONLINE, OFFLINE_WORKLOAD = WORKLOADS = ("online", "offline")


@dataclass(frozen=True)
class ScaleTier:
    """The bounds of one scale tier of generated examples.

    ``max_len`` bounds ``max_model_len`` (and so the prompts); the pool holds
    ``min_blocks..max_blocks`` blocks; at most ``max_requests`` requests arrive (in bulk:
    :func:`bulk_arrivals`); a trace has at most ``max_steps`` operations after its first
    bulk arrival; a step's token budget is one of ``token_budgets``; group block sizes
    come from ``block_sizes`` and windows and chunks from ``window_sizes`` (``None``:
    the small tier's own draws). The small tier is run by the stateful machine with
    today's strategies, unchanged: its entry records those bounds
    (``CheckConfig.max_len``, ``layouts()``'s pools, ``operations()``'s 8 requests).
    ``workload`` is the shape of a trace (:func:`tier_operations`): ``"online"``
    (arrivals, aborts, preemptions and resets between steps) or ``"offline"``
    (:func:`offline_operations`: one batch at once, then steps only).
    Example: ``TIERS["medium"].max_requests == 64``.
    """

    name: str
    max_len: int
    min_blocks: int
    max_blocks: int | None
    max_requests: int
    max_steps: int
    token_budgets: tuple[int, ...] | None = None
    block_sizes: tuple[int, ...] | None = None
    window_sizes: tuple[int, ...] | None = None
    workload: str = ONLINE

    def __post_init__(self) -> None:
        if self.max_len < 1 or self.min_blocks < 2 or self.max_requests < 1:
            raise ValueError(f"ScaleTier {self.name!r}: bounds must be positive, got {self!r}")
        if self.workload not in WORKLOADS:
            raise ValueError(
                f"ScaleTier {self.name!r}: workload must be one of {', '.join(WORKLOADS)}, "
                f"got {self.workload!r}"
            )
        if self.max_blocks is not None and self.max_blocks < self.min_blocks:
            raise ValueError(f"ScaleTier {self.name!r}: max_blocks < min_blocks")


#: The tier names, smallest first (``offline`` is at the medium scale). (The first three
#: are written as one string from the time Hypothesis mixed the source's short literals
#: into its derandomized streams; :mod:`properties.runner.profiles` now pins that pool to
#: an empty one, so a new literal moves no stream.)
SMALL, MEDIUM, PRODUCTION = tuple("small medium production".split())  # noqa: SIM905


OFFLINE = "offline"


TIER_NAMES: tuple[str, ...] = (SMALL, MEDIUM, OFFLINE, PRODUCTION)


_MEDIUM_TIER = ScaleTier(
    MEDIUM,
    max_len=2**13,  # 8192
    min_blocks=256,
    max_blocks=4096,
    max_requests=64,
    max_steps=24,
    token_budgets=(2**9, 2**11, 2**13),  # 512, 2048, 8192
    block_sizes=(4, 8, 16, 32),
)


TIERS: dict[str, ScaleTier] = {
    SMALL: ScaleTier(
        SMALL, max_len=128, min_blocks=5, max_blocks=None, max_requests=8, max_steps=40
    ),
    MEDIUM: _MEDIUM_TIER,
    # an offline batch (a list of prompts handed to the engine at once) at the medium
    # scale: up to 128 requests prefilled in waves or, with a budget that holds the whole
    # batch, in one step, then decoding in lock step (the engine's many-item paths), with
    # steps for outputs of up to OFFLINE_OUTPUT tokens
    OFFLINE: dataclasses.replace(
        _MEDIUM_TIER,
        name=OFFLINE,
        max_requests=128,
        max_steps=96,
        token_budgets=(2**11, 2**13, 2**15),  # 2048, 8192, 32768
        workload=OFFLINE_WORKLOAD,
    ),
    PRODUCTION: ScaleTier(
        PRODUCTION,
        max_len=2**17,  # 131072
        min_blocks=10**4,
        max_blocks=10**5,
        max_requests=4096,
        max_steps=24,
        token_budgets=(2**13, 2**14, 2**15),  # 8192, 16384, 32768
        block_sizes=(16, 32, 64),
        window_sizes=PRESET_WINDOWS,
    ),
}


#: The tiers run after the small one, in order.
LARGE_TIERS: tuple[str, ...] = (MEDIUM, OFFLINE, PRODUCTION)


def tier(name: str) -> ScaleTier:
    """The tier called ``name``; a clear error for an unknown one."""
    if name not in TIERS:
        raise ValueError(f"unknown scale tier {name!r}; known: {', '.join(TIERS)}")
    return TIERS[name]
