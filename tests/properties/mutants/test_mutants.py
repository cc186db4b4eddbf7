"""The suite's power: the stateful machine, run with the ``ci`` profile, must catch every
mutant engine of :mod:`properties.mutants.reference_mutants` at the level its catalogue names, and
must pass on the reference.

Detection, not shrinking, is asserted: the shrink phase is off (the first failing
example ends the run), which keeps each mutant to a few seconds. The ``ci`` profile
is derandomized: every machine sees the same fixed stream of examples, so which
mutants it catches changes when the strategies change.

Every mutant is a hard requirement: a mutant that escapes is a gap in the suite.
"""

from __future__ import annotations

import pytest

from properties.core.engine import load_engine_factory
from properties.engines.under_test import resolve_engine
from properties.mutants.optimized_mutants import OPTIMIZED_MUTANT_INFO, OPTIMIZED_MUTANTS
from properties.mutants.reference_mutants import MUTANT_INFO, MUTANTS, MutantInfo
from properties.runner.check import config_for, failed_check, run_property
from properties.runner.config import CheckConfig
from properties.runner.profiles import tier_examples
from properties.runner.reach import load_reach_corpus, replay_reach
from properties.tools.bench.suite import DETECTION_EXAMPLES, detection_settings, run_machine

#: Mutant -> why the ci detection run misses it: a gap in the suite's reach, not in
#: the mutant. Each is caught by its hand-written trace (the test named), and the
#: detection test is a strict xfail: it fails as soon as the ci stream catches the
#: mutant, so this list cannot go stale.
CI_ESCAPES: dict[str, str] = {
    "mamba_negative_estimate": (
        "needs a decode whose drafts are all rejected, then a step of fewer tokens, "
        "crossing a block boundary downward on a speculative Mamba group; the ci "
        "production stream draws ~55 such draft steps, none crossing (the offline tier "
        "met it before mode 'none' was drawn; vLLM's run meets it: its known divergence) "
        "(tests/properties/mutants/test_mamba_mutants.py::"
        "test_the_findings_trace_catches_the_negative_estimate)"
    ),
    "mamba_eagle_look_past": (
        "needs EAGLE with the drop (no lookahead hashes) on a flagged Mamba group and a "
        "resend past a cached state; the ci production stream draws two such layouts, "
        "with few calls (tests/properties/mutants/test_mamba_mutants.py::"
        "test_a_resend_under_eagle_catches_a_mamba_lookup_looking_past)"
    ),
    "delay_cache_ignored": (
        "needs a request that reads blocks of an asynchronous load which never completed "
        "(a failed load, or a same-step hit); the attention stream's 74 examples draw "
        "none (tests/properties/runner/test_serving_modes.py::"
        "test_delay_cache_ignored_is_caught_after_a_failed_load, "
        "test_delay_cache_ignored_is_caught_exactly)"
    ),
    "mamba_checkpoint_unkeyed": (
        "needs a prefill checkpoint block on a Mamba group without partial hits whose key "
        "the exact level meets; since partial hits, three Mamba layouts in four of the "
        "production stream are partial and the ci stream meets none (the reach corpus case "
        "mamba-checkpoint-keyed-for-a-sibling catches it: "
        "test_the_reach_corpus_catches_what_the_stream_misses)"
    ),
    "mamba_none_without_draft_slots": (
        "needs mode 'none' with speculative blocks and a decode that allocates its draft "
        "slots; since partial hits the ci stream draws no such step (the reach corpus "
        "case mamba-none-draft-slots catches it: "
        "test_the_reach_corpus_catches_what_the_stream_misses)"
    ),
}

#: Mutants of CI_ESCAPES that ``kvconform check`` still catches before it draws: the
#: reach corpus case that meets each (:mod:`properties.runner.reach`).
CAUGHT_BY_THE_CORPUS: dict[str, str] = {
    "mamba_checkpoint_unkeyed": "mamba-checkpoint-keyed-for-a-sibling",
    "mamba_none_without_draft_slots": "mamba-none-draft-slots",
}


def run_like_check(
    info: MutantInfo | None, level: str, failure_dir: str, property_name: str = "invariants"
):
    """The mutant's property (``invariants`` or ``production``) exactly as ``kvconform
    check --profile ci`` draws it (same machine name, so the same derandomized
    examples), shrinking off."""
    engine = "reference" if info is None else info.target
    under_test = resolve_engine(engine, isolation="none")
    config = CheckConfig(engine=engine, level=level, failure_dir=failure_dir)
    prop = property_name if info is None else info.prop
    return run_machine(
        config,
        under_test,
        detection_settings("ci", DETECTION_EXAMPLES),
        engine,
        property_name=prop,
    )


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(reason=CI_ESCAPES[n], strict=True))
        if n in CI_ESCAPES
        else n
        for n in MUTANT_INFO
    ],
)
def test_mutant_is_caught(name: str, tmp_path) -> None:
    info = MUTANT_INFO[name]
    if info.tier is not None:
        # a bug of a path only a large tier's examples take: caught there as ``kvconform
        # check --profile ci`` runs that tier (its ci example count)
        assert_caught_at_tier(info, str(tmp_path), tier_examples("ci")[info.tier])
        return
    row = run_like_check(info, info.level, str(tmp_path))
    assert row.caught, f"{name} escaped the ci profile at level {info.level}: {row}"
    assert row.check in info.caught_by, (
        f"{name} failed for another reason than {sorted(info.caught_by)}: {row.check}"
    )


@pytest.mark.parametrize("name", sorted(CAUGHT_BY_THE_CORPUS))
def test_the_reach_corpus_catches_what_the_stream_misses(name: str, tmp_path) -> None:
    """``kvconform check`` replays the reach corpus before it draws: the mutant fails
    there, on its case, with a check its catalogue names."""
    info = MUTANT_INFO[name]
    config = CheckConfig(engine=info.target, level=info.level, failure_dir=str(tmp_path))
    engine = resolve_engine(info.target, isolation="none")
    result = run_property(info.prop, config, detection_settings("ci", 1), None, engine, 0)
    assert not result.passed and result.first is not None and result.examples == 0
    assert result.first.case is not None  # a case, maybe an earlier one than ours
    assert result.check in info.caught_by, result.failure
    # the case written for it catches it on its own
    case = next(c for c in load_reach_corpus() if c.name == CAUGHT_BY_THE_CORPUS[name])
    alone = replay_reach(info.prop, config_for(info.prop, config), engine, [case])
    assert alone.failed is case and failed_check(alone.error) in info.caught_by


@pytest.mark.parametrize("prop", ["invariants", "production"])
@pytest.mark.parametrize("level", ["universal", "exact"])
def test_reference_passes(level: str, prop: str, tmp_path) -> None:
    row = run_like_check(None, level, str(tmp_path), prop)
    assert not row.caught, row
    assert row.examples > 0 and row.steps > 0


def test_catalogue_entries_load_as_engines() -> None:
    assert len(MUTANTS) >= 12
    for name, target in MUTANTS.items():
        assert target == f"properties.mutants.reference_mutants:make_{name}"
        assert load_engine_factory(target) is MUTANT_INFO[name].factory
        assert MUTANT_INFO[name].level in ("universal", "exact")
        assert MUTANT_INFO[name].description


# -- the optimized engine's mutants ------------------------------------------------------


#: Examples of a mutant's large tier: what CI's optimized gate runs per large tier
#: (``kvconform check --engine optimized --tier-examples 20``).
TIER_DETECTION_EXAMPLES = 20


@pytest.mark.parametrize("name", list(OPTIMIZED_MUTANT_INFO))
def test_optimized_mutant_is_caught(name: str, tmp_path) -> None:
    """Each optimized mutant fails its property exactly as ``kvconform check --engine
    <mutant> --level exact --profile ci`` runs it (shrinking off); a mutant of a path only
    many requests at once take is caught by its large tier (``--tier-examples 20``), after
    the small tier's machine missed it."""
    info = OPTIMIZED_MUTANT_INFO[name]
    assert_caught_at_tier(info, str(tmp_path), TIER_DETECTION_EXAMPLES)


def assert_caught_at_tier(info: MutantInfo, failure_dir: str, tier_count: int) -> None:
    """``info``'s mutant fails its property as ``kvconform check`` runs it (shrinking
    off), the small tier first, then its large tier (``info.tier``, ``tier_count``
    examples) when it names one, which must be where it is caught."""
    config = CheckConfig(engine=info.target, level=info.level, failure_dir=failure_dir)
    engine = resolve_engine(info.factory)
    tiers = None if info.tier is None else {info.tier: tier_count}
    result = run_property(
        info.prop, config, detection_settings("ci", None), None, engine, tiers=tiers
    )
    name = info.name
    assert result.failure is not None, f"{name} escaped the ci profile ({info.prop})"
    assert any(c in result.failure for c in info.caught_by), (
        f"{name} failed for another reason than {sorted(info.caught_by)}: {result.failure}"
    )
    if info.tier is not None:
        assert result.failure.startswith(f"[{info.tier} tier]"), result.failure


def test_optimized_engine_passes(tmp_path) -> None:
    """The unmutated optimized engine passes both properties the mutants fail."""
    config = CheckConfig(engine="optimized", level="exact", failure_dir=str(tmp_path))
    for prop in ("invariants", "attention"):
        result = run_property(prop, config, detection_settings("ci", 40), None)
        assert result.failure is None, result.failure
        assert result.examples > 0 and result.steps > 0


def test_optimized_catalogue_loads_as_engines() -> None:
    assert len(OPTIMIZED_MUTANTS) >= 5
    for name, target in OPTIMIZED_MUTANTS.items():
        assert target == f"properties.mutants.optimized_mutants:make_{name}"
        assert load_engine_factory(target) is OPTIMIZED_MUTANT_INFO[name].factory
