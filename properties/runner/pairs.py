"""Which combinations of features a run reached: serving modes, production settings,
group types and pool pressure, counted in pairs (swarm-testing reach).

A *feature* is one thing an example can switch on: a serving mode (``async``,
``admission-gate``, ``drafts``, ``external-hits``, ``async-loads``, ``load-failures``), a
production setting (``eagle-drop``, ``lookahead-hashes``, ``retention=sparse``,
``retention=interval``, ``admission-cap``, ``partial-hits``), ``pool-pressure`` (the pool
holds fewer than two requests of ``max_model_len``), or a group type (``full``,
``sliding_window``, ``chunked_local``, ``mamba``). A *pair* is two features of which at
least one is not a group type (mode x mode, mode x group type). Every example adds one to
each pair of features it has; :func:`pair_table` then lists every pair as reached,
excluded (by the model, or by what the engine declares) or missed.

Worked example: a gemma3-like layout (full + sliding window) run with asynchronous
scheduling and the admission gate on a pool of 3 requests has the features ``async``,
``admission-gate``, ``full`` and ``sliding_window``: it reaches the pairs
``async x admission-gate``, ``async x full``, ``async x sliding_window``,
``admission-gate x full`` and ``admission-gate x sliding_window``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import combinations
from typing import TYPE_CHECKING

from properties.core.modes import ServingMode
from reference.layout import KVCacheLayout, draft_token_limit

if TYPE_CHECKING:
    from properties.engines.under_test import EngineUnderTest

#: The features that are not group types, in the order tables list them.
MODE_FEATURES: tuple[str, ...] = (
    "async",
    "admission-gate",
    "drafts",
    "external-hits",
    "async-loads",
    "load-failures",
    "eagle-drop",
    "lookahead-hashes",
    "retention=sparse",
    "retention=interval",
    "admission-cap",
    "pool-pressure",
    "partial-hits",
)
GROUP_TYPES: tuple[str, ...] = ("full", "sliding_window", "chunked_local", "mamba")

#: What an engine must declare for a feature: a production setting (``setting:NAME``),
#: the serving-mode calls (``serving_modes``) or a spec type (``spec:TYPE``).
NEEDS: Mapping[str, tuple[str, ...]] = {
    "async": ("serving_modes",),
    "admission-gate": ("serving_modes",),
    "drafts": ("serving_modes",),
    "external-hits": ("serving_modes", "setting:external"),
    "async-loads": ("serving_modes", "setting:external"),
    "load-failures": ("serving_modes", "setting:external"),
    "eagle-drop": ("setting:eagle",),
    "lookahead-hashes": ("setting:eagle",),
    "retention=sparse": ("setting:retention",),
    "retention=interval": ("setting:retention",),
    "admission-cap": ("setting:admission_cap",),
    "pool-pressure": (),
    "partial-hits": ("setting:partial_hits",),
    **{kind: (f"spec:{kind}",) for kind in GROUP_TYPES},
    # group types outside the pair table, drawn where their production setting is declared
    "rswa": ("setting:rswa",),
    "circular_buffer": ("setting:circular_buffer",),
}

#: What an engine must declare for a pair beyond its two features' needs: drafts on a
#: Mamba group need its speculative blocks (the ``mamba_modes`` production setting), and
#: partial hits have a Mamba group.
PAIR_NEEDS: Mapping[frozenset[str], tuple[str, ...]] = {
    frozenset({"drafts", "mamba"}): ("setting:mamba_modes",),
    frozenset({"drafts", "partial-hits"}): ("setting:mamba_modes",),
}

#: Pairs the model of kvconform leaves out, with the reason (``docs`` of each mode).
MODEL_EXCLUSIONS: Mapping[frozenset[str], str] = {
    frozenset({"drafts", "async"}): "drafts with asynchronous scheduling are not modelled",
    frozenset({"external-hits", "mamba"}): "loaded Mamba states are not modelled",
    frozenset({"async-loads", "mamba"}): "loaded Mamba states are not modelled",
    frozenset({"load-failures", "mamba"}): "loaded Mamba states are not modelled",
    frozenset({"eagle-drop", "chunked_local"}): "vLLM runs EAGLE without chunked groups",
    frozenset({"lookahead-hashes", "chunked_local"}): "vLLM runs EAGLE without chunked groups",
    frozenset({"eagle-drop", "lookahead-hashes"}): "lookahead hashes turn the EAGLE drop off",
    frozenset({"retention=sparse", "retention=interval"}): "a layout has one retention interval",
    frozenset({"partial-hits", "chunked_local"}): (
        "partial hits need every group but full attention and Mamba at the hash block "
        "size; a chunked-local group's is the scheduler block size"
    ),
    frozenset({"partial-hits", "eagle-drop"}): "partial hits are drawn without EAGLE",
    frozenset({"partial-hits", "lookahead-hashes"}): "partial hits are drawn without EAGLE",
    frozenset({"partial-hits", "external-hits"}): "loaded Mamba states are not modelled",
    frozenset({"partial-hits", "async-loads"}): "loaded Mamba states are not modelled",
    frozenset({"partial-hits", "load-failures"}): "loaded Mamba states are not modelled",
}


def features(layout: KVCacheLayout, mode: ServingMode | None) -> frozenset[str]:
    """The features of one example (see the module docstring).

    Example: a full + Mamba layout, ``ServingMode(async_scheduling=True)``, retention
    interval 0, a pool of 40 blocks where one request needs 8 ->
    ``{"async", "retention=sparse", "full", "mamba"}``.
    """
    out = {spec.type_name for spec in layout.specs}
    r = layout.prefix_cache_retention_interval
    if r is not None:
        out.add("retention=sparse" if r == 0 else "retention=interval")
    if layout.drop_eagle_group_ids:
        out.add("eagle-drop")
    if layout.num_hash_lookahead_tokens:
        out.add("lookahead-hashes")
    if layout.max_in_flight_tokens is not None:
        out.add("admission-cap")
    if layout.num_blocks - 1 < 2 * layout.blocks_per_request():
        out.add("pool-pressure")
    if layout.partial_hits_enabled:
        out.add("partial-hits")
    if mode is not None:
        # what a Mamba layout does not model is not run: no connector, drafts only up to
        # its speculative blocks
        has_mamba = "mamba" in out
        limit = draft_token_limit(layout)
        for name, on in (
            ("async", mode.async_scheduling),
            ("admission-gate", mode.admission_gate),
            ("drafts", mode.num_draft_tokens > 0 and limit != 0),
            ("external-hits", mode.external_hits and not has_mamba),
            ("async-loads", mode.async_loads and not has_mamba),
            ("load-failures", mode.load_failures and not has_mamba),
        ):
            if on:
                out.add(name)
    return frozenset(out)


def all_pairs() -> list[tuple[str, str]]:
    """Every pair, in table order: mode x mode, then mode x group type."""
    modes = list(combinations(MODE_FEATURES, 2))
    return modes + [(m, g) for m in MODE_FEATURES for g in GROUP_TYPES]


def count_pairs(counts: dict[tuple[str, str], int], example: Iterable[str]) -> None:
    """Add one example's features to ``counts`` (pair -> examples)."""
    present = set(example)
    for a, b in all_pairs():
        if a in present and b in present:
            counts[(a, b)] = counts.get((a, b), 0) + 1


@dataclass(frozen=True)
class Declared:
    """What the engine under test declares: its production settings, whether it takes
    the serving-mode calls, its spec types (None: all), and the features its known
    divergences remove from every draw: a set of one or two features -> the divergence's
    name (``KnownDivergence.features``)."""

    settings: frozenset[str]
    serving_modes: bool
    spec_types: tuple[str, ...] | None
    removed: Mapping[frozenset[str], str] = field(default_factory=dict)

    @classmethod
    def of(cls, engine: EngineUnderTest, serving_modes: bool) -> Declared:
        """What ``engine`` declares (``serving_modes``: whether the built engine takes the
        serving-mode calls). Example: an engine with production settings ``{"retention"}``,
        spec types ``("full",)`` and a known divergence on ``("async",)`` gives
        ``Declared(frozenset({"retention"}), serving_modes, ("full",),
        {frozenset({"async"}): name})``."""
        return cls(
            frozenset(engine.production_settings),
            serving_modes,
            tuple(engine.spec_types),
            {frozenset(d.features): d.name for d in engine.known_divergences if d.features},
        )

    def removed_by(self, pair: tuple[str, str]) -> str | None:
        """The known divergence that removes every layout of ``pair`` (one of its features,
        or both together), else None. Example: with ``removed = {frozenset({"a"}): "d"}``
        the pairs ``("a", "full")`` and ``("async", "a")`` are removed by ``d``."""
        for key in (frozenset(pair), frozenset(pair[:1]), frozenset(pair[1:])):
            if key in self.removed:
                return self.removed[key]
        return None

    def supports(self, feature: str) -> str | None:
        """None when the engine can be driven with ``feature``, else why not."""
        return self.meets(NEEDS[feature])

    def supports_pair(self, pair: tuple[str, str]) -> str | None:
        """None when the engine can be driven with both features of ``pair`` together
        (each one's needs, then :data:`PAIR_NEEDS`), else why not. Example: an engine
        declaring only ``retention`` cannot run drafts on a Mamba group: "no
        'mamba_modes' production setting"."""
        return (
            self.supports(pair[0])
            or self.supports(pair[1])
            or self.meets(PAIR_NEEDS.get(frozenset(pair), ()))
        )

    def meets(self, needs: Iterable[str]) -> str | None:
        """None when the engine declares every one of ``needs`` (``serving_modes``,
        ``setting:NAME``, ``spec:TYPE``), else why not."""
        for need in needs:
            kind, _, name = need.partition(":")
            if kind == "serving_modes" and not self.serving_modes:
                return "no serving-mode calls"
            if kind == "setting" and name not in self.settings:
                return f"no '{name}' production setting"
            if kind == "spec" and self.spec_types is not None and name not in self.spec_types:
                return f"no {name} groups"
        return None


def pair_status(
    pair: tuple[str, str], counts: Mapping[tuple[str, str], int], declared: Declared
) -> str:
    """``"reached N"``, ``"excluded: why"`` or ``"MISSED"`` for one pair."""
    n = counts.get(pair, 0)
    if n:
        return f"reached {n}"
    why = MODEL_EXCLUSIONS.get(frozenset(pair))
    if why is None:
        why = declared.supports_pair(pair)
    if why is None and (divergence := declared.removed_by(pair)) is not None:
        why = f"known divergence {divergence}"
    return f"excluded: {why}" if why else "MISSED"


def pair_table(counts: Mapping[tuple[str, str], int], declared: Declared) -> list[str]:
    """The lines ``kvconform check`` prints: a summary line, then the missed pairs (one
    line per first feature: ``missed: drafts x {mamba, pool-pressure}``), then the
    excluded pairs, one line for the model's exclusions and one for the engine's
    declarations, each counted by reason. Reached pairs are counted, not listed (their
    counts go in the JSON result). Example: ``excluded by the engine's declarations: 70
    pairs (no serving-mode calls: 70)``."""
    statuses = {pair: pair_status(pair, counts, declared) for pair in all_pairs()}
    reached = [p for p, s in statuses.items() if s.startswith("reached")]
    missed = [p for p, s in statuses.items() if s == "MISSED"]
    excluded: dict[str, list[tuple[str, str]]] = {}
    for p, s in statuses.items():
        if s.startswith("excluded"):
            excluded.setdefault(s.removeprefix("excluded: "), []).append(p)
    supported = len(reached) + len(missed)
    lines = [
        f"pairs reached: {len(reached)} of {supported} the engine supports "
        f"({sum(len(v) for v in excluded.values())} excluded)"
    ]
    by_first: dict[str, list[str]] = {}
    for a, b in missed:
        by_first.setdefault(a, []).append(b)
    for a, others in by_first.items():
        lines.append(f"  missed: {a} x {{{', '.join(others)}}}")
    model_reasons = set(MODEL_EXCLUSIONS.values())
    for label, of_model in (("the model", True), ("the engine's declarations", False)):
        reasons = {w: p for w, p in excluded.items() if (w in model_reasons) == of_model}
        if reasons:  # one line per source, reasons counted: never a wall of lines
            counted = "; ".join(f"{why}: {len(p)}" for why, p in sorted(reasons.items()))
            total = sum(len(p) for p in reasons.values())
            lines.append(f"  excluded by {label}: {total} pairs ({counted})")
    return lines
