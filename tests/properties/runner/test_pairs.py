"""Pair reach (swarm testing): the features of an example, the pairs it adds, and the
table's verdicts (hand-computed)."""

from __future__ import annotations

import dataclasses

from properties.core.modes import ServingMode
from properties.runner.pairs import (
    Declared,
    all_pairs,
    count_pairs,
    features,
    pair_status,
    pair_table,
)
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec

EVERYTHING = Declared(frozenset({"eagle", "retention", "admission_cap", "external"}), True, None)


def _gemma(num_blocks: int) -> KVCacheLayout:
    return KVCacheLayout(
        groups=(
            KVCacheGroup(("full",), FullAttentionSpec(block_size=4)),
            KVCacheGroup(("swa",), SlidingWindowSpec(block_size=4, sliding_window=8)),
        ),
        num_blocks=num_blocks,
        max_model_len=32,
    )


def test_features_of_an_example() -> None:
    # one request of 32 tokens pins 8 full blocks and (vLLM's max_memory_usage of the
    # window group) 9 sliding-window blocks: 17; pressure below 2 * 17 = 34 usable blocks
    roomy = _gemma(num_blocks=64)
    assert roomy.blocks_per_request() == 17
    mode = ServingMode(async_scheduling=True, admission_gate=True)
    assert features(roomy, mode) == {"async", "admission-gate", "full", "sliding_window"}
    tight = dataclasses.replace(roomy, num_blocks=32, prefix_cache_retention_interval=0)
    assert features(tight, None) == {
        "full",
        "sliding_window",
        "pool-pressure",
        "retention=sparse",
    }


def test_external_hits_do_not_count_with_mamba() -> None:
    layout = KVCacheLayout(
        groups=(
            KVCacheGroup(("full",), FullAttentionSpec(block_size=4)),
            KVCacheGroup(("m",), MambaSpec(block_size=4)),
        ),
        num_blocks=200,
        max_model_len=32,
    )
    mode = ServingMode(external_hits=True, async_loads=True)
    assert features(layout, mode) == {"full", "mamba"}


def test_drafts_do_not_count_with_mamba() -> None:
    # the scheduler proposes no drafts with a Mamba group (no speculative Mamba blocks)
    mamba = KVCacheLayout(
        groups=(
            KVCacheGroup(("full",), FullAttentionSpec(block_size=4)),
            KVCacheGroup(("m",), MambaSpec(block_size=4)),
        ),
        num_blocks=200,
        max_model_len=32,
    )
    full = dataclasses.replace(mamba, groups=mamba.groups[:1])
    mode = ServingMode(admission_gate=True, num_draft_tokens=3)
    assert features(mamba, mode) == {"admission-gate", "full", "mamba"}
    assert features(full, mode) == {"admission-gate", "drafts", "full"}


def test_count_pairs_counts_each_pair_of_features_once_per_example() -> None:
    counts: dict[tuple[str, str], int] = {}
    count_pairs(counts, {"async", "admission-gate", "full", "sliding_window"})
    count_pairs(counts, {"async", "full"})
    assert counts == {
        ("async", "admission-gate"): 1,
        ("async", "full"): 2,
        ("async", "sliding_window"): 1,
        ("admission-gate", "full"): 1,
        ("admission-gate", "sliding_window"): 1,
    }  # group type x group type is not a pair


def test_pair_verdicts() -> None:
    counts = {("async", "full"): 3}
    assert pair_status(("async", "full"), counts, EVERYTHING) == "reached 3"
    assert pair_status(("async", "drafts"), counts, EVERYTHING) == (
        "excluded: drafts with asynchronous scheduling are not modelled"
    )
    assert pair_status(("async", "mamba"), counts, EVERYTHING) == "MISSED"
    plain = Declared(frozenset(), False, ("full", "sliding_window"))
    assert pair_status(("async", "full"), {}, plain) == "excluded: no serving-mode calls"
    assert pair_status(("pool-pressure", "mamba"), {}, plain) == "excluded: no mamba groups"
    assert pair_status(("pool-pressure", "full"), {}, plain) == "MISSED"


def test_table_for_an_engine_without_serving_modes() -> None:
    # supports only pool-pressure x {full, sliding_window}: both reached
    plain = Declared(frozenset(), False, ("full", "sliding_window"))
    counts = {("pool-pressure", "full"): 2, ("pool-pressure", "sliding_window"): 1}
    lines = pair_table(counts, plain)
    total = len(all_pairs())
    assert lines[0] == f"pairs reached: 2 of 2 the engine supports ({total - 2} excluded)"
    assert not any(line.startswith("  missed") for line in lines)
    # the exclusions in two lines at most (issue 42: 14 lines for an engine of 1 pair)
    excluded = [line for line in lines if line.startswith("  excluded")]
    assert len(excluded) <= 2
    declared = next(x for x in excluded if x.startswith("  excluded by the engine's"))
    assert "no serving-mode calls: " in declared


def test_missed_pairs_are_grouped_by_their_first_feature() -> None:
    only_full = Declared(frozenset(), True, ("full",))
    lines = pair_table({}, only_full)
    assert "  missed: async x {admission-gate, pool-pressure, full}" in lines
    assert "  missed: drafts x {pool-pressure, full}" in lines


def test_pairs_a_known_divergence_removes_are_excluded_by_it() -> None:
    """``KnownDivergence.features``: one feature removes every pair it is in, two remove
    that pair only; a pair the model already excludes keeps the model's reason."""
    declared = dataclasses.replace(
        EVERYTHING,
        removed={
            frozenset({"lookahead-hashes"}): "no-lookahead",
            frozenset({"async", "mamba"}): "mamba-leak",
        },
    )
    why = "excluded: known divergence "
    assert pair_status(("async", "lookahead-hashes"), {}, declared) == why + "no-lookahead"
    assert pair_status(("lookahead-hashes", "full"), {}, declared) == why + "no-lookahead"
    assert pair_status(("async", "mamba"), {}, declared) == why + "mamba-leak"
    assert pair_status(("admission-gate", "mamba"), {}, declared) == "MISSED"
    assert pair_status(("async", "mamba"), {("async", "mamba"): 3}, declared) == "reached 3"
    assert pair_status(("eagle-drop", "lookahead-hashes"), {}, declared) == (
        "excluded: lookahead hashes turn the EAGLE drop off"
    )
    assert declared.removed_by(("full", "async")) is None


def test_declared_of_an_engine_reads_its_declarations() -> None:
    from properties.core.engine import KnownDivergence
    from properties.engines.under_test import EngineUnderTest

    divergence = KnownDivergence(
        "no-async", "leaks under async", "findings/x.md", lambda layout: False, ("async",)
    )
    silent = KnownDivergence("other", "a layout quirk", "findings/y.md", lambda layout: False)
    engine = EngineUnderTest(
        "pkg:make",
        lambda layout: None,
        spec_types=("full", "sliding_window"),
        known_divergences=(divergence, silent),
        production_settings=frozenset({"retention"}),
    )
    declared = Declared.of(engine, False)
    assert declared == Declared(
        frozenset({"retention"}),
        False,
        ("full", "sliding_window"),
        {frozenset({"async"}): "no-async"},
    )
    assert declared.removed_by(("async", "full")) == "no-async"
    assert declared.supports("mamba") is not None
