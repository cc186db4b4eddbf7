"""The Aphrodite adapter's declarations, without Aphrodite (importing the adapter imports
no engine): which layouts and modes each known divergence applies to (hand-built layouts),
and that its features name pairs of the pair table."""

from __future__ import annotations

import dataclasses

from properties.core.modes import SYNC, ServingMode
from properties.engines.aphrodite import KNOWN_DIVERGENCES, make_engine
from properties.engines.under_test import EngineUnderTest
from properties.runner.pairs import GROUP_TYPES, MODE_FEATURES
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

BY_NAME = {d.name: d for d in KNOWN_DIVERGENCES}
FULL = FullAttentionSpec(block_size=4)
WINDOW = SlidingWindowSpec(block_size=4, sliding_window=8)
MAMBA = MambaSpec(block_size=4, shapes=((4, 8),))


def layout(*specs, **settings) -> KVCacheLayout:
    groups = tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))
    return KVCacheLayout(groups=groups, num_blocks=32, max_model_len=64, **settings)


def applying(value: KVCacheLayout, mode: ServingMode | None = None) -> set[str]:
    return {d.name for d in KNOWN_DIVERGENCES if d.applies_to(value, mode)}


def test_each_divergence_applies_where_documented() -> None:
    eagle = dict(use_eagle=True)
    assert applying(layout(FULL)) == set()
    assert applying(layout(FULL, WINDOW)) == set()
    assert applying(layout(FULL, **eagle)) == set()  # one group: the unitary coordinator
    assert applying(layout(FULL, **eagle, num_hash_lookahead_tokens=1)) == {
        "aphrodite-no-lookahead-hashes"
    }
    assert applying(layout(FULL, WINDOW, **eagle)) == {"aphrodite-eagle-hybrid-bounded-margin"}
    assert applying(layout(WINDOW, prefix_cache_retention_interval=0, **eagle)) == {
        "aphrodite-eagle-sparse-retention-no-hit"
    }
    assert applying(layout(WINDOW, prefix_cache_retention_interval=0)) == set()
    assert applying(layout(WINDOW, **eagle)) == set()  # dense retention
    chunked = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=6)
    assert applying(layout(chunked)) == {"aphrodite-chunked-hit-in-previous-chunk"}
    aligned = dataclasses.replace(chunked, attention_chunk_size=8)
    assert applying(layout(aligned)) == set()


def test_the_mamba_leak_is_a_divergence_of_asynchronous_scheduling() -> None:
    """Mamba layouts are drawn; their asynchronous runs get the default mode."""
    mamba = layout(FULL, MAMBA)
    asynchronous = ServingMode(async_scheduling=True)
    assert applying(mamba) == set()
    assert applying(mamba, asynchronous) == {"aphrodite-mamba-async-state-leak"}
    assert applying(mamba, ServingMode(admission_gate=True)) == set()
    engine = EngineUnderTest(
        name="aphrodite", factory=make_engine, known_divergences=KNOWN_DIVERGENCES
    )
    assert engine.serving_mode(asynchronous, True, mamba) == SYNC
    assert engine.serving_mode(asynchronous, True, layout(FULL, WINDOW)) == asynchronous


def test_features_name_pair_table_features() -> None:
    known = set(MODE_FEATURES) | set(GROUP_TYPES)
    assert all(set(d.features) <= known for d in KNOWN_DIVERGENCES)
    assert BY_NAME["aphrodite-no-lookahead-hashes"].features == ("lookahead-hashes",)
    assert BY_NAME["aphrodite-mamba-async-state-leak"].features == ("async", "mamba")


def test_the_factory_declares_aphrodite_s_modules_and_every_setting() -> None:
    assert make_engine.coverage_modules == tuple(
        f"aphrodite.v1.core.{m}"
        for m in (
            "kv_cache_manager",
            "kv_cache_coordinator",
            "single_type_kv_cache_manager",
            "block_pool",
            "kv_cache_utils",
        )
    )
    assert make_engine.production_settings == {"retention", "eagle", "admission_cap", "external"}
