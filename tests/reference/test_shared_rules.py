"""The reference's rule functions that the optimized engine calls too (issue 17 item 6),
on plain values: block ids as ints, a dict as the cache. Expected values by hand."""

from __future__ import annotations

import pytest

from optimized.control.managers import registry_like
from reference.coordinator import SpecGroup, hybrid_cache_hit
from reference.errors import InvalidRequestError
from reference.kv_cache_manager import check_prompt_length, junction
from reference.managers.base import blocks_to_allocate
from reference.managers.chunked_local import chunked_local_hit
from reference.managers.full import full_attention_hit
from reference.managers.mamba import mamba_hit
from reference.managers.sliding_window import sliding_window_hit
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

HASHES = [b"h0", b"h1", b"h2", b"h3", b"h4"]


def _lookup(cached: dict[bytes, int]):
    """One group: ``[block]`` for a cached hash, else None."""
    return lambda h: [cached[h]] if h in cached else None


def test_full_attention_hit_rounds_down_to_the_alignment() -> None:
    """bs 4, A 8, blocks 0..2 cached (ids 10..12), max 15: 3 blocks match (12 tokens),
    rounded down to 8 -> ``[10, 11]``."""
    cached = {b"h0": 10, b"h1": 11, b"h2": 12}
    spec = FullAttentionSpec(block_size=4)
    assert full_attention_hit(HASHES, 15, 1, spec, 8, _lookup(cached), 0) == ([[10, 11]], 8)


def test_sliding_window_hit_takes_the_rightmost_run() -> None:
    """bs 4, w 8 (a run of 2), A 4, blocks 2 and 3 cached, max 16 -> ``[0, 0, 12, 13]``."""
    cached = {b"h2": 12, b"h3": 13}
    spec = SlidingWindowSpec(block_size=4, sliding_window=8)
    assert sliding_window_hit(HASHES, 16, 1, spec, 4, _lookup(cached), 0) == (
        [[0, 0, 12, 13]],
        16,
    )


def test_sliding_window_hit_scans_only_hashed_blocks() -> None:
    """max 40 asks for 10 blocks but only 5 are hashed: the scan starts at block 4."""
    cached = {b"h3": 13, b"h4": 14}
    spec = SlidingWindowSpec(block_size=4, sliding_window=8)
    assert sliding_window_hit(HASHES, 40, 1, spec, 4, _lookup(cached), 0) == (
        [[0, 0, 0, 13, 14]],
        20,
    )


def test_chunked_local_hit_counts_the_dead_chunk_as_null() -> None:
    """C 8, bs 4, max 13, nothing cached: start 8 -> ``[0, 0]``, hit 8."""
    spec = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8)
    assert chunked_local_hit(HASHES, 13, 1, spec, 4, _lookup({}), 0) == ([[0, 0]], 8)


def test_mamba_hit_takes_the_rightmost_aligned_state() -> None:
    """bs 4, A 8, states 1 and 2 cached, max 15: state 2 ends at 12 (not aligned), state
    1 at 8 -> ``[0, 21]``."""
    cached = {b"h1": 21, b"h2": 22}
    spec = MambaSpec(block_size=4)
    assert mamba_hit(HASHES, 15, 1, spec, 8, _lookup(cached), 0) == ([[0, 21]], 8)


def test_hybrid_cache_hit_reports_what_some_group_caches_beyond_the_hit() -> None:
    """Full (bs 4) answers 12 (3 blocks), SWA answers 8 below 12: one pass for one full
    and one other spec group; hit 8, full cut to 2 blocks, uncached 12 - 8 = 4."""
    full = SpecGroup(FullAttentionSpec(block_size=4), [0], object)
    swa = SpecGroup(SlidingWindowSpec(block_size=4, sliding_window=5), [1], object)
    answers = {0: ([[1, 2, 3]], 12), 1: ([[0, 7]], 8)}

    def find(sg, limit, drop):
        return answers[sg.group_ids[0]]

    assert hybrid_cache_hit([full, swa], 2, 15, 20, find) == ([[1, 2], [0, 7]], 8, 4)


def test_blocks_to_allocate_counts_evictable_hit_blocks() -> None:
    """SWA w 4, bs 2, new request, hits ``[a, b, c]``, computed 6, 10 slots: required 5,
    skipped 3 tokens -> 1 block, so 5 - max(1, 3) = 2 new; hits past the skipped one:
    ``b`` held, ``c`` free -> 3."""
    spec = SlidingWindowSpec(block_size=2, sliding_window=4)
    free = {"a", "c"}
    assert blocks_to_allocate(spec, 10, 0, False, ["a", "b", "c"], 6, free.__contains__) == 3
    assert blocks_to_allocate(spec, 10, 4, True, [], 6, free.__contains__) == 1
    assert blocks_to_allocate(spec, 10, 0, False, [], 0, free.__contains__, cap=3) == 3


def test_junction_and_prompt_length() -> None:
    assert junction(8, 8) == 16
    assert junction(8, 0) == 0
    check_prompt_length("r1", 128, 128)
    with pytest.raises(InvalidRequestError, match="129 tokens is longer than max_model_len 128"):
        check_prompt_length("r1", 129, 128)


def test_registry_like_names_a_missing_class() -> None:
    class FullAttentionManager:
        pass

    with pytest.raises(TypeError, match="no class named ChunkedLocalAttentionManager"):
        registry_like([FullAttentionManager])
