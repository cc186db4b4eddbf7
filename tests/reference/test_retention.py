"""Prefix-cache retention (spec 4.3, 4.5 masks; 5.2 junction): dense, sparse and k > 0.

Every expected value below is derived by hand in the comments, from the rules in
the spec (``reachable_block_mask``, ``replay_boundaries``, the hybrid junction).
"""

from __future__ import annotations

import pytest

from reference.errors import InvalidLayoutError
from reference.kv_cache_manager import KVCacheManager
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.retention import (
    mamba_block_mask,
    reachable_boundaries,
    replay_boundaries,
    sliding_window_block_mask,
)
from reference.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec


def _manager(
    *specs: KVCacheSpec, retention: int | None, num_blocks: int = 64, max_model_len: int = 128
) -> KVCacheManager:
    groups = tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))
    return KVCacheManager(
        KVCacheLayout(
            groups,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            prefix_cache_retention_interval=retention,
        )
    )


def _cached_ends(manager: KVCacheManager, group_id: int) -> list[int]:
    """Token counts of the blocks registered for ``group_id`` (prefix lengths they end)."""
    out = []
    for key, entries in manager.block_pool.cached.items():
        if int.from_bytes(key[-4:], "big") == group_id:
            out.extend(b.num_cached_tokens for b in entries.values())
    return sorted(out)


def _prefill(manager: KVCacheManager, rid: str, tokens: list[int]):
    req = manager.make_request(rid, tokens)
    computed, hit = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, len(tokens) - hit, hit, computed) is not None
    req.num_computed_tokens = len(tokens)
    return req, hit


# -- the pure rules --------------------------------------------------------------------


def test_replay_boundaries_without_and_with_eagle() -> None:
    # no EAGLE: (P - 1,)
    assert replay_boundaries(11, 4) == (10,)
    # EAGLE, P 11, S 4: resend floor(10/4)*4 = 8 -> 4; extension floor(11/4)*4 = 8 -> 4
    assert replay_boundaries(11, 4, use_eagle=True) == (4,)
    # EAGLE, P 12: resend floor(11/4)*4 = 8 -> 4; extension 12 -> 8
    assert replay_boundaries(12, 4, use_eagle=True) == (4, 8)
    # EAGLE, P 3: both 0
    assert replay_boundaries(3, 4, use_eagle=True) == (0,)


def test_reachable_boundaries_add_the_junction() -> None:
    assert reachable_boundaries(11, 0, 4, 2) == [10]
    assert reachable_boundaries(11, 8, 4, 2) == [10, 8]
    # EAGLE also keeps the junction one block lower: 8 - bs 2 = 6
    assert reachable_boundaries(11, 8, 4, 2, use_eagle=True) == [4, 8, 6]


def test_sliding_window_mask_dense_sparse_and_interval() -> None:
    # bs 2, A 4 (per segment 2), need 1, blocks 0..5
    dense = sliding_window_block_mask(0, 6, 4, 2, 1, None, [10])
    assert dense == [False, True, False, True, False, True]  # odd blocks
    # sparse: only the tail ending at floor(10/4)*4 = 8 -> block 3
    sparse = sliding_window_block_mask(0, 6, 4, 2, 1, 0, [10])
    assert sparse == [False, False, False, True, False, False]
    # interval 8 (per segment 4, tail = block i with i % 4 == 3) -> block 3; replay 3
    assert sliding_window_block_mask(0, 6, 4, 2, 1, 8, [10]) == [False] * 3 + [True] + [False] * 2
    # a junction at 4 adds the tail ending at 4 -> block 1
    assert sliding_window_block_mask(0, 6, 4, 2, 1, 0, [10, 4]) == [
        False,
        True,
        False,
        True,
        False,
        False,
    ]
    # the window of start..end only: blocks 4..5 of the sparse case -> none
    assert sliding_window_block_mask(4, 6, 4, 2, 1, 0, [10]) == [False, False]


def test_sliding_window_mask_falls_back_to_all_blocks() -> None:
    # need 2 >= per segment 2 under dense -> every block (None)
    assert sliding_window_block_mask(0, 6, 4, 2, 2, None, [10]) is None
    # alignment 6 not a multiple of bs 4 -> None
    assert sliding_window_block_mask(0, 6, 6, 4, 1, 0, [10]) is None
    # sparse never falls back: need 2, boundary 10 (A 2, bs 2) -> end 5 -> blocks 3, 4
    assert sliding_window_block_mask(0, 6, 2, 2, 2, 0, [10]) == [False] * 3 + [True, True, False]


def test_mamba_mask_dense_sparse_and_interval() -> None:
    assert mamba_block_mask(0, 6, 4, 4, None, [23]) is None
    # sparse, boundary 23 (A 4) -> floor(23/4)*4 = 20 -> block 20/4 - 1 = 4
    assert mamba_block_mask(0, 6, 4, 4, 0, [23]) == [False] * 4 + [True, False]
    # interval 8 -> per segment 2 -> blocks 1, 3, 5; plus replay block 4
    assert mamba_block_mask(0, 6, 4, 4, 8, [23]) == [False, True, False, True, True, True]
    # interval 4 -> per segment 1 -> every block
    assert mamba_block_mask(0, 6, 4, 4, 4, [23]) is None
    # starting mid-segment: blocks 2..5, per segment 2 -> first boundary block 3
    assert mamba_block_mask(2, 6, 4, 4, 8, []) == [False, True, False, True]


# -- layout validation -------------------------------------------------------------------


def test_retention_interval_validation() -> None:
    full4 = FullAttentionSpec(block_size=4)
    swa2 = SlidingWindowSpec(block_size=2, sliding_window=3)
    # full bs 4 + SWA bs 2: scheduler block size 4; 8 valid, 6 not, -4 not
    _manager(full4, swa2, retention=8)
    _manager(full4, swa2, retention=0)
    with pytest.raises(InvalidLayoutError, match="multiple of the scheduler block size 4"):
        _manager(full4, swa2, retention=6)
    with pytest.raises(InvalidLayoutError, match="multiple of the scheduler block size 4"):
        _manager(full4, swa2, retention=-4)
    # full attention only: None and 0 accepted, 8 rejected
    _manager(full4, retention=0)
    with pytest.raises(InvalidLayoutError, match="no sliding-window or Mamba group"):
        _manager(full4, retention=8)


# -- whole scenarios -------------------------------------------------------------------


def test_sliding_window_sparse_caches_only_the_replay_tail() -> None:
    # SWA w 3, bs 2 alone (A 2, need 1); prompt of 11 tokens computed at once:
    # 5 full blocks (ending at 2, 4, 6, 8, 10). Dense: all five. Sparse: only the
    # block ending at floor(10/2)*2 = 10 (block 4). Interval 4: segment tails at
    # blocks 1, 3 (ending 4, 8) plus block 4.
    swa = SlidingWindowSpec(block_size=2, sliding_window=3)
    prompt = list(range(100, 111))
    for retention, expected in ((None, [2, 4, 6, 8, 10]), (0, [10]), (4, [4, 8, 10])):
        m = _manager(swa, retention=retention)
        _prefill(m, "a", prompt)
        assert _cached_ends(m, 0) == expected, retention


def test_sparse_replay_still_hits() -> None:
    # same layout, sparse: the identical prompt again looks up <= 10 tokens; block 4
    # (tokens 8, 9) is the only one needed (need 1) -> hit 10, table [0,0,0,0,b4].
    swa = SlidingWindowSpec(block_size=2, sliding_window=3)
    m = _manager(swa, retention=0)
    prompt = list(range(100, 111))
    a, _ = _prefill(m, "a", prompt)
    table_a = m.get_block_ids("a")[0]
    m.free(a)
    b = m.make_request("b", prompt)
    computed, hit = m.get_computed_blocks(b)
    assert hit == 10
    assert computed.block_ids() == ((0, 0, 0, 0, table_a[4]),)


def test_hybrid_junction_is_pinned_for_the_next_sibling() -> None:
    # full bs 2 + SWA w 3 bs 2 (A 2, need 1), sparse.
    # A: 12 tokens T; full caches blocks 0..5, SWA only block 4 (boundary 11 -> 10).
    full = FullAttentionSpec(block_size=2)
    swa = SlidingWindowSpec(block_size=2, sliding_window=3)
    m = _manager(full, swa, retention=0)
    t = list(range(200, 212))
    a, _ = _prefill(m, "a", t)
    assert _cached_ends(m, 1) == [10]
    m.free(a)
    # B: T[:8] + 4 new tokens. Full hits 8 (block 4 differs); SWA asked <= 8 finds
    # no cached block ending at 8 or below -> 0. Hit 0, uncached 8 -> junction 8.
    b = m.make_request("b", t[:8] + [1, 2, 3, 4])
    computed, hit = m.get_computed_blocks(b)
    assert (hit, b.shared_prefix_boundary) == (0, 8)
    assert m.allocate_slots(b, 12, 0, computed) is not None
    # B's SWA blocks: boundary 11 -> block 4 (ends 10), junction 8 -> block 3 (ends 8)
    assert _cached_ends(m, 1) == [8, 10, 10]
    m.free(b)
    # C: T[:8] + 4 other tokens -> full 8, SWA finds block 3 -> hit 8, no junction.
    c = m.make_request("c", t[:8] + [9, 9, 9, 9])
    computed, hit = m.get_computed_blocks(c)
    assert (hit, c.shared_prefix_boundary) == (8, 0)


def test_hybrid_mamba_sparse_and_junction() -> None:
    # full bs 4 + Mamba bs 4 (A 4), sparse. A: 16 tokens, prefill in one step:
    # Mamba row [0, 0, 0, s] (one state, at 16); mask: boundary 15 -> 12 -> block 2,
    # which is null in the row -> nothing registered for Mamba.
    full = FullAttentionSpec(block_size=4)
    mamba = MambaSpec(block_size=4, shapes=((4,),), dtype_bytes=2)
    m = _manager(full, mamba, retention=0)
    t = list(range(300, 316))
    a, _ = _prefill(m, "a", t)
    assert _cached_ends(m, 0) == [4, 8, 12, 16]
    assert _cached_ends(m, 1) == []
    m.free(a)
    # B: the same 16 tokens again: full hits 12 (<= 15), Mamba finds no state -> 0;
    # uncached 12 -> junction 12.
    b = m.make_request("b", t)
    computed, hit = m.get_computed_blocks(b)
    assert (hit, b.shared_prefix_boundary) == (0, 12)
    # prefill in chunks of 12 then 4: the chunk ending at 12 caches Mamba block 2
    # (replay boundary 15 -> 12 and the junction 12 both give block 2).
    assert m.allocate_slots(b, 12, 0, computed) is not None
    b.num_computed_tokens = 12
    assert _cached_ends(m, 1) == [12]


def test_dense_is_the_old_behaviour() -> None:
    # full bs 4 + SWA w 3 bs 2 (A 4, need 1): dense registers only odd SWA blocks
    # (ends 4, 8) of an 11-token prompt: the 2 full blocks of each 4-token segment
    # end at 2/4 and 6/8; cacheable tokens rounded to 8.
    full = FullAttentionSpec(block_size=4)
    swa = SlidingWindowSpec(block_size=2, sliding_window=3)
    m = _manager(full, swa, retention=None)
    _prefill(m, "a", list(range(400, 411)))
    assert _cached_ends(m, 1) == [4, 8]
    # sparse: boundary 10 -> floor(10/4)*4 = 8 -> block 3 (ends 8) only
    m = _manager(full, swa, retention=0)
    _prefill(m, "a", list(range(400, 411)))
    assert _cached_ends(m, 1) == [8]


# -- EAGLE and lookahead hashes ----------------------------------------------------------


def _eagle_manager(*specs: KVCacheSpec, lookahead: int = 0, num_blocks: int = 10):
    groups = tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))
    return KVCacheManager(
        KVCacheLayout(
            groups,
            num_blocks=num_blocks,
            max_model_len=256,
            use_eagle=True,
            num_hash_lookahead_tokens=lookahead,
        )
    )


@pytest.mark.parametrize("prompt_len", [48, 37])
def test_eagle_identical_prompt_hit(prompt_len: int) -> None:
    # spec 4.2 check values (test_eagle_identical_prompt_hit, bs 16, 10 blocks):
    # EAGLE: max N - 1 = 47 or 36 -> 2 blocks found, one dropped -> 16 tokens;
    # lookahead hashes (L 1, no drop): 2 blocks -> 32 tokens.
    full = FullAttentionSpec(block_size=16)
    tokens = list(range(1000, 1000 + prompt_len))
    for lookahead, expected in ((0, 16), (1, 32)):
        m = _eagle_manager(full, lookahead=lookahead)
        a, _ = _prefill(m, "a", tokens)
        m.free(a)
        _, hit = m.get_computed_blocks(m.make_request("b", tokens))
        assert hit == expected, lookahead


def test_lookahead_hash_waits_for_the_next_tokens() -> None:
    # H 4, L 1: 8 tokens -> only block 0 hashed (block 1 needs a 9th token); its extra
    # keys are (None, 5th token)
    from reference.hashing import NONE_HASH, hash_block_tokens

    m = _eagle_manager(FullAttentionSpec(block_size=4), lookahead=1)
    req = m.make_request("r", [1, 2, 3, 4, 5, 6, 7, 8])
    assert req.block_hashes == [hash_block_tokens(NONE_HASH, [1, 2, 3, 4], (None, 5))]
    req.append_output_token_ids([9])
    assert len(req.block_hashes) == 2


def test_eagle_sliding_window_needs_one_more_block_and_caches_a_shifted_tail() -> None:
    # SWA w 3 bs 2 alone, EAGLE: need cdiv(2, 2) + 1 = 2. 11 tokens computed:
    # dense (A 2, per segment 1): every block 0..4 cached. Resend: max 10 -> blocks
    # 4, 3 hit -> run 2 -> drop block 4 -> hit 8, row [0, 0, 0, b3].
    swa = SlidingWindowSpec(block_size=2, sliding_window=3)
    m = _eagle_manager(swa, num_blocks=32)
    tokens = list(range(50, 61))
    a, _ = _prefill(m, "a", tokens)
    table = m.get_block_ids("a")[0]
    m.free(a)
    computed, hit = m.get_computed_blocks(m.make_request("b", tokens))
    assert hit == 8
    assert computed.block_ids() == ((0, 0, 0, table[3]),)


def test_eagle_hybrid_caches_one_block_past_the_boundary() -> None:
    # full bs 4 + SWA w 3 bs 2 (S 4), EAGLE, 11 tokens: cacheable per group
    # min(11, floor(11/4)*4 + bs) -> full 11 -> blocks ending 4, 8 (bs 4), plus the
    # partial prompt-tail entry (bs 4 != H 2) at floor(P / 2) * 2 = 10 on block 2;
    # SWA min(11, 8 + 2) = 10 -> 5 full blocks; dense mask need 1 + 1 = 2 >= per
    # segment 2 -> every block: ends 2, 4, 6, 8, 10.
    m = _eagle_manager(
        FullAttentionSpec(block_size=4),
        SlidingWindowSpec(block_size=2, sliding_window=3),
        num_blocks=32,
    )
    _prefill(m, "a", list(range(60, 71)))
    assert _cached_ends(m, 0) == [4, 8, 10]
    assert _cached_ends(m, 1) == [2, 4, 6, 8, 10]
