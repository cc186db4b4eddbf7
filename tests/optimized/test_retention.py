"""The optimized engine registers the sliding-window and Mamba blocks the retention interval
names (:mod:`reference.retention`), as the reference does.

Regressions of the bench divergences (issue 18): the optimized managers cached every
sliding-window block of an aligned segment tail and every Mamba state whatever the layout's
``prefix_cache_retention_interval``, and their lookups recorded no shared-prefix junction,
so the bench's presets (served with sparse retention, ``0``) hit far more tokens on the
optimized engine (``hybrid-6``: 214752 against 10240). Expected entries are computed by
hand in each test.

Layout of every test: group 0 full attention (bs 2), group 1 sliding window ``w = 3``
(bs 2), so ``A = S = 2`` and a window hit needs ``cdiv(2, 2) = 1`` block; a prompt of ``P``
tokens first allocated with no hit takes ids ``1 .. cdiv(P, 2)`` in group 0, then the next
``cdiv(P, 2)`` ids in group 1.
"""

from __future__ import annotations

import pytest

from optimized.control.kv_cache_manager import KVCacheManager as OptimizedManager
from reference.kv_cache_manager import KVCacheManager as ReferenceManager
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec

PROMPT_A = list(range(1, 12))  # 11 tokens
#: shares A's first 8 tokens (4 blocks), then differs: 13 tokens
PROMPT_B = PROMPT_A[:8] + [90, 91, 92, 93, 94]


def _layout(second, retention: int | None) -> KVCacheLayout:
    return KVCacheLayout(
        (KVCacheGroup(("l0",), FullAttentionSpec(block_size=2)), KVCacheGroup(("l1",), second)),
        num_blocks=40,
        max_model_len=64,
        prefix_cache_retention_interval=retention,
    )


def _swa_layout(retention: int | None) -> KVCacheLayout:
    return _layout(SlidingWindowSpec(block_size=2, sliding_window=3), retention)


def _entries(manager, group: int) -> list[tuple[int, int]]:
    """``(block id, tokens)`` of every cached block of ``group``, sorted."""
    if isinstance(manager, OptimizedManager):
        cached = manager.block_pool.cached_block_entries()
        return sorted((b, n) for b, g, n in cached if g == group)
    return sorted(
        (b.block_id, b.num_cached_tokens)
        for key, entries in manager.block_pool.cached.items()
        if int.from_bytes(key[-4:], "big") == group
        for b in entries.values()
    )


def _prefill(manager, rid: str, prompt: list[int]):
    request = manager.make_request(rid, prompt)
    hit, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(prompt) - num_hit, num_hit, hit) is not None
    request.num_computed_tokens = len(prompt)
    return request


@pytest.mark.parametrize("manager_cls", [ReferenceManager, OptimizedManager])
def test_sparse_retention_caches_only_the_replay_tail(manager_cls) -> None:
    """Sparse (``0``): P = 11 -> replay boundary 10 -> end block ``10 // 2 = 5`` -> only
    window block 4 (id ``6 + 5 = 11``, 10 tokens). Full attention caches its 5 full
    blocks of the 10 cacheable tokens (ids 1..5). Dense retention would cache window
    blocks 0..4 (ids 7..11): ``need = 1 >= A / bs = 1`` keeps every block."""
    manager = manager_cls(_swa_layout(0))
    _prefill(manager, "a", PROMPT_A)
    assert _entries(manager, 0) == [(1, 2), (2, 4), (3, 6), (4, 8), (5, 10)]
    assert _entries(manager, 1) == [(11, 10)]


@pytest.mark.parametrize("manager_cls", [ReferenceManager, OptimizedManager])
def test_dense_retention_caches_every_window_block(manager_cls) -> None:
    """Dense (``None``): window blocks 0..4 (ids 7..11) for the 10 cacheable tokens."""
    manager = manager_cls(_swa_layout(None))
    _prefill(manager, "a", PROMPT_A)
    assert _entries(manager, 1) == [(7, 2), (8, 4), (9, 6), (10, 8), (11, 10)]


@pytest.mark.parametrize("manager_cls", [ReferenceManager, OptimizedManager])
def test_lookup_records_the_junction_and_its_tail_is_cached(manager_cls) -> None:
    """A holds ids 1..6 (full) and 7..12 (window), window block 4 (id 11) cached. B
    shares 8 tokens: full attention matches 4 blocks (8 tokens), the window needs block 3
    (ending at 8), which sparse retention did not keep -> hit 0, longest answer 8, so the
    junction ``shared_prefix_boundary`` is ``0 + 8``. B then allocates 13 tokens with no
    hit: 7 blocks a group, ids 13..19 (full) and 20..26 (window), and caches 12 tokens;
    the window keeps the replay tail (boundary 12 -> block 5, id 25) and the junction's
    (boundary 8 -> block 3, id 23)."""
    manager = manager_cls(_swa_layout(0))
    _prefill(manager, "a", PROMPT_A)
    b = manager.make_request("b", PROMPT_B)
    hit, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 0
    assert b.shared_prefix_boundary == 8
    assert manager.allocate_slots(b, len(PROMPT_B)) is not None
    assert _entries(manager, 1) == [(11, 10), (23, 8), (25, 12)]


@pytest.mark.parametrize(("retention", "expected"), [(0, [(7, 10)]), (None, [(3, 4), (7, 10)])])
@pytest.mark.parametrize("manager_cls", [ReferenceManager, OptimizedManager])
def test_retention_picks_the_mamba_states(manager_cls, retention, expected) -> None:
    """Full (bs 2) + Mamba (bs 2), A's 11 tokens prefilled in chunks of 4 then 6. Chunk
    1: full ids 1, 2; Mamba column 1 (the state at 4) gets id 3. Chunk 2 (10 tokens):
    full ids 4..6, Mamba column 4 (the state at 10) gets id 7. Sparse: the replay
    boundary 10 keeps only the state at 10; dense keeps both states."""
    manager = manager_cls(_layout(MambaSpec(block_size=2), retention))
    a = manager.make_request("a", PROMPT_A)
    assert manager.allocate_slots(a, 4) == _ids(manager, [[1, 2], [3]])
    a.num_computed_tokens = 4
    manager.new_step_starts()
    assert manager.allocate_slots(a, 6) == _ids(manager, [[4, 5, 6], [7]])
    assert _entries(manager, 1) == expected


def _ids(manager, ids: list[list[int]]):
    """``ids`` as ``manager.allocate_slots`` returns new blocks (objects in the reference)."""
    if isinstance(manager, OptimizedManager):
        return ids
    return [[manager.block_pool.blocks[b] for b in group] for group in ids]
