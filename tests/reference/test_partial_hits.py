"""Partial (sub-block) prefix hits, vLLM 0.33 (``enable_partial_hash_hits``): worked
examples derived by hand from vLLM's rules (``FullAttentionManager`` /
``MambaManager.find_longest_cache_hit`` fine-grained phases, ``_has_partial_local_hit``,
``_apply_cow``, ``MambaManager._cache_partial_tail_block``, ``move_block_hashes``,
``take_kv_cache_block_copies``); the two whole scenarios were also run on vLLM 0.33.0
through its adapter, which gave the same tables, copies, free queues and ref counts."""

from __future__ import annotations

import pytest

from properties.core.engine import RequestInput
from properties.engines.reference import ReferenceEngine
from reference.coordinator import eagle_proof_margin
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.managers.full import full_attention_hit
from reference.managers.mamba import mamba_hit
from reference.managers.mamba_checkpoints import checkpoint_position
from reference.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec

A, B, C, D = (bytes([i]) * 32 for i in range(1, 5))


def _layout(*specs, num_blocks: int = 30, caching: bool = True) -> KVCacheLayout:
    groups = tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))
    return KVCacheLayout(groups, num_blocks=num_blocks, max_model_len=64, enable_caching=caching)


def _full(bs: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs)


def _mamba(bs: int) -> MambaSpec:
    return MambaSpec(block_size=bs)


@pytest.mark.parametrize(
    ("specs", "enabled", "alignment"),
    [
        ((_full(4), _mamba(8)), True, 4),  # Mamba coarser than H = gcd = 4
        ((_full(8), _mamba(8), SlidingWindowSpec(block_size=4, sliding_window=4)), True, 4),
        # the sliding window's block (8) is not the hash block (4): hits stay aligned
        ((_mamba(8), SlidingWindowSpec(block_size=8, sliding_window=4), _full(4)), False, 8),
        ((_full(8), _mamba(4)), False, 8),  # Mamba is the hash block itself
        ((_mamba(8),), False, 8),  # one group: H is its block size
    ],
)
def test_when_partial_hits_are_enabled(specs, enabled: bool, alignment: int) -> None:
    layout = _layout(*specs)
    assert layout.partial_hits_enabled is enabled
    assert layout.cache_hit_alignment == alignment


def test_no_partial_hits_without_prefix_caching() -> None:
    layout = _layout(_full(4), _mamba(8), caching=False)
    assert not layout.partial_hits_enabled
    assert layout.cache_hit_alignment == 8


def _lookup(cached: dict[bytes, str]):
    return lambda h: [cached[h]] if h in cached else None


def test_full_attention_fine_grained_scan() -> None:
    # bs 8, H 4: fine hashes A B C D (A 4, B 8, C 12, D 16 tokens). Block 0 is cached in
    # full (key B); block 1 is missing, but the 12-token prefix C is cached on "b".
    lookup = _lookup({B: "b0", C: "b"})
    spec = _full(8)
    assert full_attention_hit([A, B, C, D], 13, 1, spec, 4, lookup, None) == ([["b0", "b"]], 12)
    # EAGLE drops one hash block (min(A, bs) = 4): 8, one block
    assert full_attention_hit([A, B, C, D], 13, 1, spec, 4, lookup, None, True) == ([["b0"]], 8)
    # max 11: block 1 is probed at fine indices [2, min(3, 11 // 4 = 2)): none -> 8
    assert full_attention_hit([A, B, C, D], 11, 1, spec, 4, lookup, None) == ([["b0"]], 8)
    # coarse alignment (no partial hits): only whole blocks
    assert full_attention_hit([B, D], 13, 1, spec, 8, lookup, None) == ([["b0"]], 8)


def test_mamba_fine_grained_scan() -> None:
    # bs 8, H 4: the rightmost fine hash cached wins; block index j // (8 / 4)
    lookup = _lookup({C: "c", A: "a"})
    spec = _mamba(8)
    assert mamba_hit([A, B, C], 13, 1, spec, 4, lookup, "0") == ([["0", "c"]], 12)
    # max 11 -> fine hashes 0..1: A (4 tokens), in block 0
    assert mamba_hit([A, B, C], 11, 1, spec, 4, lookup, "0") == ([["a"]], 4)
    assert mamba_hit([B], 11, 1, spec, 4, _lookup({}), "0") == ([[]], 0)


def test_eagle_proof_margin() -> None:
    assert eagle_proof_margin(8, 4, True) == 4
    assert eagle_proof_margin(8, 4, False) == 8
    assert eagle_proof_margin(4, 4, True) == 4


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((14, 4), 12),  # floor(13 / 4) * 4
        ((16, 4), 12),  # the last token is recomputed
        ((14, 4, True), 8),  # EAGLE: floor(14 / 4) * 4 - 4
        ((14, 4, False, 3), 8),  # three lookahead tokens: floor(11 / 4) * 4
        ((3, 4), 0),
    ],
)
def test_checkpoint_position_of_partial_tails(args, expected: int) -> None:
    assert checkpoint_position(*args) == expected


def _run_prompt(eng: ReferenceEngine, rid: str, chunks: list[int]) -> list:
    """Allocate ``chunks`` one step each (no hit), taking the copies every step."""
    out = []
    computed = 0
    for n in chunks:
        eng.new_step()
        new = eng.allocate_slots(rid, n)
        out.append((new, eng.take_block_copies()))
        computed += n
        eng.set_num_computed_tokens(rid, computed)
    return out


def test_mamba_partial_tail_is_copied_and_hit() -> None:
    # full bs 4 + Mamba bs 8 (H 4), 20 blocks, a 14-token prompt in the chunks vLLM's
    # scheduler makes: [0, 8) (the last whole Mamba block), [8, 12) (the prompt's tail
    # prefill_checkpoint_position(14, 4) = 12), [12, 14).
    eng = ReferenceEngine(_layout(_full(4), _mamba(8), num_blocks=20))
    prompt = tuple(range(1, 15))
    eng.add_request(RequestInput("a", prompt))
    steps = _run_prompt(eng, "a", [8, 4])
    assert steps == [(((1, 2), (3,)), []), (((4,), (5,)), [])]
    # at 12 cached tokens the state block 5 (column 1) is keyed by the 12-token prefix
    assert (5, 1, 12) in {(c.block_id, c.group_id, c.num_tokens) for c in eng.cached_blocks()}
    # the next step keeps writing block 5: its key moves to a fresh block 7, copied from 5;
    # 7 is held by no table, so once the copy is handed over it sits in the free queue
    eng.new_step()
    assert eng.allocate_slots("a", 2) == ((6,), ())
    assert eng.pending_block_copies() == [(5, 7)]
    assert eng.ref_counts()[5] == 2 and eng.ref_counts()[7] == 1
    assert eng.take_block_copies() == [(5, 7)]
    eng.set_num_computed_tokens("a", 14)
    assert eng.get_block_ids("a") == ((1, 2, 4, 6), (0, 5))
    assert eng.free_queue() == [*range(8, 20), 3, 7]
    assert {(c.block_id, c.group_id, c.num_tokens) for c in eng.cached_blocks()} == {
        (1, 0, 4),
        (2, 0, 8),
        (4, 0, 12),
        (3, 1, 8),
        (7, 1, 12),
    }
    # a resend hits 12 tokens: the Mamba state in block 7 (inside its block: [null, 7])
    eng.add_request(RequestInput("b", prompt))
    eng.new_step()
    hit = eng.get_computed_blocks("b")
    assert (hit.block_ids, hit.num_tokens) == (((1, 2, 4), (0, 7)), 12)
    # full: 1 new block; Mamba: the copy of 7 (reserved) + 7 itself (evictable)
    assert eng.allocate_slots("b", 2, 12, hit) == ((8,), (9,))
    assert eng.last_allocation_estimate() == 3
    assert eng.take_block_copies() == [(7, 9)]
    assert eng.get_block_ids("b") == ((1, 2, 4, 8), (0, 9))
    assert eng.ref_counts()[7] == 0 and eng.ref_counts()[9] == 1
    assert eng.free_queue() == [*range(10, 20), 3, 7]


def test_full_attention_copy_on_write_across_groups() -> None:
    # full bs 8 (g0), full bs 4 (g1), Mamba bs 8 (g2): H 4. Prompt 1..14 in chunks [0, 8),
    # [8, 12), [12, 14). g0's block 5 ([8, 16)) gets the partial tail key of 12 tokens.
    full4 = FullAttentionSpec(block_size=4, head_size=16)
    eng = ReferenceEngine(_layout(_full(8), full4, _mamba(8)))
    prompt = tuple(range(1, 15))
    eng.add_request(RequestInput("a", prompt))
    steps = _run_prompt(eng, "a", [8, 4, 2])
    assert steps == [
        (((1,), (2, 3), (4,)), []),
        (((5,), (6,), (7,)), []),
        # the Mamba partial tail (block 7) moves to 9; block 4 (state at 8) leaves
        (((), (8,), ()), [(7, 9)]),
    ]
    assert eng.free_queue() == [*range(10, 30), 4, 9]
    eng.add_request(RequestInput("b", prompt))
    eng.new_step()
    hit = eng.get_computed_blocks("b")
    # g0: block 1 in full, then the 12-token key inside block 5; g1 three whole blocks;
    # g2 the state of 12 tokens in block 9
    assert (hit.block_ids, hit.num_tokens) == (((1, 5), (2, 3, 6), (0, 9)), 12)
    # g0 copies 5 -> 10, g1 takes 11, g2 copies 9 -> 12 (9 was free: evictable)
    assert eng.allocate_slots("b", 2, 12, hit) == ((10,), (11,), (12,))
    assert eng.last_allocation_estimate() == 4
    assert eng.pending_block_copies() == [(5, 10), (9, 12)]
    refs = eng.ref_counts()
    assert (refs[5], refs[10], refs[9], refs[12]) == (2, 2, 1, 2)
    assert eng.take_block_copies() == [(5, 10), (9, 12)]
    assert eng.get_block_ids("a") == ((1, 5), (2, 3, 6, 8), (0, 7))
    assert eng.get_block_ids("b") == ((1, 10), (2, 3, 6, 11), (0, 12))
    refs = eng.ref_counts()
    assert [refs[b] for b in range(1, 13)] == [2, 2, 2, 0, 1, 2, 1, 1, 0, 1, 1, 1]
    assert eng.free_queue() == [*range(13, 30), 4, 9]
    assert sorted((c.group_id, c.block_id, c.num_tokens) for c in eng.cached_blocks()) == [
        (0, 1, 8),
        (0, 5, 12),
        (0, 10, 12),  # b's copy registered the prompt's tail too
        (1, 2, 4),
        (1, 3, 8),
        (1, 6, 12),
        (2, 4, 8),
        (2, 9, 12),
    ]
