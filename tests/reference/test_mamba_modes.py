"""Worked examples of vLLM 0.33's Mamba modes: mode "none", speculative blocks in "align"
mode (relocation, the estimate never below zero after a draft rollback) and prefill
checkpoint blocks.

Every block id and estimate below is derived by hand from vLLM 0.33's rules
(``vllm/v1/core/single_type_kv_cache_manager.py``, ``MambaManager``): a fresh pool's free
queue is ``1..N-1``, allocation pops from the front, groups allocate in group order, a
freed unhashed block goes to the front of the queue.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from properties.core.engine import RequestInput
from properties.engines.reference import ReferenceEngine
from reference.errors import InvalidLayoutError, InvalidSpecError
from reference.layout import KVCacheGroup, KVCacheLayout, draft_token_limit
from reference.managers.mamba_checkpoints import (
    checkpoint_exportable,
    checkpoint_kept,
    checkpoint_position,
)
from reference.specs import FullAttentionSpec, KVCacheSpec, MambaSpec

#: builds an engine of a layout (the reference here; tests/properties/engines/
#: test_vllm_mamba_modes.py runs the same checks on vLLM)
Factory = Callable[[KVCacheLayout], object]


def _layout(*specs: KVCacheSpec, num_blocks: int = 16, **kw) -> KVCacheLayout:
    groups = tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))
    return KVCacheLayout(groups, num_blocks=num_blocks, **{"max_model_len": 64, **kw})


def _cached(engine) -> set[tuple[int, int, int]]:
    return {(c.block_id, c.group_id, c.num_tokens) for c in engine.cached_blocks()}


# -- specs and layouts ----------------------------------------------------------------


def test_resident_blocks_by_mode() -> None:
    # align: 2 + k + checkpoint blocks; none: 1 + k (page 64 bytes: (4, 8) of 2 bytes)
    align = MambaSpec(block_size=4, num_speculative_blocks=2, num_prefill_checkpoint_blocks=1)
    none = MambaSpec(block_size=64, mamba_cache_mode="none", num_speculative_blocks=2)
    assert align.max_memory_usage_bytes(64, 64) == 5 * 64
    assert none.max_memory_usage_bytes(64, 64) == 3 * 64
    assert MambaSpec(block_size=4).max_memory_usage_bytes(64, 64) == 2 * 64


def test_mamba_settings_are_validated() -> None:
    with pytest.raises(InvalidSpecError, match="mamba_cache_mode must be one of align, none"):
        MambaSpec(block_size=4, mamba_cache_mode="all")
    with pytest.raises(InvalidSpecError, match="num_speculative_blocks must be an integer >= 0"):
        MambaSpec(block_size=4, num_speculative_blocks=-1)
    with pytest.raises(InvalidSpecError, match="prefill_checkpoint_alignment"):
        MambaSpec(block_size=4, prefill_checkpoint_alignment=0)
    none = MambaSpec(block_size=64, mamba_cache_mode="none")
    with pytest.raises(InvalidLayoutError, match="needs enable_caching=False"):
        _layout(none)
    with pytest.raises(InvalidLayoutError, match="block_size must be >= max_model_len 64"):
        _layout(MambaSpec(block_size=32, mamba_cache_mode="none"), enable_caching=False)
    with pytest.raises(InvalidLayoutError, match="same mamba_cache_mode and num_speculative"):
        _layout(MambaSpec(block_size=4), MambaSpec(block_size=4, num_speculative_blocks=1))


def test_draft_token_limit_is_the_speculative_block_count() -> None:
    assert draft_token_limit(_layout(FullAttentionSpec(block_size=4))) is None
    assert draft_token_limit(_layout(MambaSpec(block_size=4))) == 0
    spec = MambaSpec(block_size=4, num_speculative_blocks=2)
    assert draft_token_limit(_layout(FullAttentionSpec(block_size=4), spec)) == 2


# -- mode "none" ------------------------------------------------------------------------


def check_none_mode_takes_the_state_and_speculative_blocks_at_once(
    make: Factory = ReferenceEngine,
) -> None:
    # bs 32 = max_model_len, k 2: cdiv(10 + 2 * 32, 32) = 3 blocks on admission, then
    # nothing (the slots never pass 32 + 64); nothing is freed before (n - 1) // 32 = 0
    spec = MambaSpec(block_size=32, mamba_cache_mode="none", num_speculative_blocks=2)
    eng = make(_layout(spec, num_blocks=8, max_model_len=32, enable_caching=False))
    eng.add_request(RequestInput("r", tuple(range(10))))
    assert eng.allocate_slots("r", 10) == ((1, 2, 3),)
    assert eng.last_allocation_estimate() == 3
    eng.set_num_computed_tokens("r", 10)
    for computed in range(10, 20):
        eng.append_output_tokens("r", [computed])
        assert eng.allocate_slots("r", 1) == ((),)
        assert eng.last_allocation_estimate() == 0
        eng.set_num_computed_tokens("r", computed + 1)
    assert eng.get_block_ids("r") == ((1, 2, 3),)
    eng.free("r")  # tail first, unhashed: to the front in that order
    assert eng.free_queue() == [3, 2, 1, 4, 5, 6, 7]


# -- "align" mode with speculative blocks ---------------------------------------------


def check_speculative_blocks_are_relocated_when_the_state_passes_them(
    make: Factory = ReferenceEngine,
) -> None:
    # bs 4, k 2. Chunk [0, 8): required cdiv(8, 4) + 2 = 4: column 0 null, then the
    # state (1) and two speculative blocks (2, 3); estimate min(4, 1 + 2) = 3.
    spec = MambaSpec(block_size=4, num_speculative_blocks=2)
    eng = make(_layout(spec, enable_caching=False))
    eng.add_request(RequestInput("r", tuple(range(24))))
    assert eng.allocate_slots("r", 8) == ((1, 2, 3),)
    assert eng.get_block_ids("r") == ((0, 1, 2, 3),)
    assert eng.last_allocation_estimate() == 3
    eng.set_num_computed_tokens("r", 8)
    # chunk [8, 20): required 5 + 2 = 7, running column 4: columns 2 and 3 (the
    # speculative blocks) lie before it and move to the end; one block (4) is taken
    eng.new_step()
    assert eng.allocate_slots("r", 12) == ((2, 3, 4),)
    assert eng.get_block_ids("r") == ((0, 1, 0, 0, 2, 3, 4),)
    assert eng.last_allocation_estimate() == 1
    eng.set_num_computed_tokens("r", 20)
    # chunk [20, 24): first (20 - 1) // 4 = 4 columns retire (block 1 freed, to the
    # front), then required 6 + 2 = 8 takes one block: block 1 again
    eng.new_step()
    assert eng.allocate_slots("r", 4) == ((1,),)
    assert eng.get_block_ids("r") == ((0, 0, 0, 0, 2, 3, 4, 1),)
    assert eng.last_allocation_estimate() == 1


def check_estimate_never_below_zero_after_a_draft_rollback(
    make: Factory = ReferenceEngine,
) -> None:
    # bs 4, k 4, prompt 6: required 2 + 4 = 6: row (0, 1..5), estimate min(6, 1 + 4) = 5
    spec = MambaSpec(block_size=4, num_speculative_blocks=4)
    eng = make(_layout(spec, enable_caching=False))
    eng.add_request(RequestInput("r", tuple(range(6))))
    assert eng.allocate_slots("r", 6) == ((1, 2, 3, 4, 5),)
    assert eng.last_allocation_estimate() == 5
    eng.set_num_computed_tokens("r", 6)
    eng.append_output_tokens("r", [100])
    # a decode at 6 with 4 drafts: main 11, required 3 + 4 = 7: one block
    eng.new_step()
    eng.set_in_flight("r", 0, 4)
    assert eng.allocate_slots("r", 5) == ((6,),)
    assert eng.get_block_ids("r") == ((0, 1, 2, 3, 4, 5, 6),)
    # every draft rejected: computed 7; the next step schedules one token (main 8):
    # required 2 + 4 = 6 < 7 held -> nothing taken, estimate 0 (vLLM 0.33 says -1)
    eng.set_num_computed_tokens("r", 7)
    eng.set_in_flight("r", 0, 0)
    eng.append_output_tokens("r", [101])
    eng.new_step()
    assert eng.allocate_slots("r", 1) == ((),)
    assert eng.last_allocation_estimate() == 0
    assert eng.get_block_ids("r") == ((0, 1, 2, 3, 4, 5, 6),)


def check_rollback_fills_a_null_running_state_column(make: Factory = ReferenceEngine) -> None:
    # bs 1, k 2, prompt 6: required 6 + 2 = 8: nulls at 0-4, state 1 at 5, spec 2, 3
    spec = MambaSpec(block_size=1, num_speculative_blocks=2)
    eng = make(_layout(spec, enable_caching=False))
    eng.add_request(RequestInput("r", tuple(range(6))))
    assert eng.allocate_slots("r", 6) == ((1, 2, 3),)
    eng.set_num_computed_tokens("r", 6)
    eng.append_output_tokens("r", [100])
    # a decode at 6 with 2 drafts: main 9, required 11, running column 8: the speculative
    # blocks 2 and 3 move to columns 8 and 9 (6 and 7 become null), block 4 at 10
    eng.new_step()
    eng.set_in_flight("r", 0, 2)
    assert eng.allocate_slots("r", 3) == ((2, 3, 4),)
    assert eng.get_block_ids("r") == ((0, 0, 0, 0, 0, 1, 0, 0, 2, 3, 4),)
    # both drafts rejected: computed 7 (state 1 at column 5 is freed, unhashed: to the
    # front of the queue); one token, main 8: required 10 < 11 held, but the running
    # column 7 is null: one fresh block there, block 1 again (vLLM 0.33 takes none and
    # the worker saves the state into the null block)
    eng.set_num_computed_tokens("r", 7)
    eng.set_in_flight("r", 0, 0)
    eng.append_output_tokens("r", [101])
    eng.new_step()
    assert eng.allocate_slots("r", 1) == ((1,),)
    assert eng.last_allocation_estimate() == 1
    assert eng.get_block_ids("r") == ((0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4),)


def test_rollback_fills_a_null_running_state_column() -> None:
    check_rollback_fills_a_null_running_state_column()


# -- prefill checkpoints --------------------------------------------------------------


def test_checkpoint_position_and_exportable_by_hand() -> None:
    assert checkpoint_position(14, 8, False) == 8  # (14 - 1) // 8 * 8
    assert checkpoint_position(16, 8, False) == 8  # (16 - 1) // 8 * 8
    assert checkpoint_position(16, 8, True) == 8  # 16 // 8 * 8 - 8
    assert checkpoint_position(16, 4, False, 2) == 12  # (16 - 2) // 4 * 4
    assert checkpoint_position(3, 4, False) == 0
    # H 4, bs 4, alignment 1: the chunk [0, 14) can export 8 (column 2 > -1)
    assert checkpoint_exportable(0, 14, 8, 4, 4, 1)
    assert not checkpoint_exportable(0, 14, 8, 4, 4, None)  # no backend alignment
    assert not checkpoint_exportable(0, 14, 8, 4, 4, 3)  # 8 - 0 not a multiple of 3
    assert not checkpoint_exportable(6, 14, 8, 4, 4, 1)  # 6 not on a hash boundary
    assert not checkpoint_exportable(0, 14, 2, 4, 4, 1)  # 0 + 4 > 2
    # H 2, bs 8: [8, 16) at 12 would go to column 0, the state the chunk starts from
    assert not checkpoint_exportable(8, 16, 12, 2, 8, 1)
    assert checkpoint_exportable(0, 16, 12, 2, 8, 1)  # from 0: column 0 > -1
    assert checkpoint_kept(8, 8, False, 0) and checkpoint_kept(4, 16, True, 0)
    assert not checkpoint_kept(4, 16, False, 0) and checkpoint_kept(4, 16, False, 4)


def check_checkpoint_reserves_a_block_keyed_at_its_position(
    make: Factory = ReferenceEngine,
) -> None:
    # full bs 8 + Mamba bs 4 (S 8, H 4), checkpoint blocks with alignment 1, one chunk
    # [0, 14): position (14 - 1) // 8 * 8 = 8, reserved column cdiv(14, 4) - 2 = 2.
    # Full takes blocks 1, 2; Mamba nulls columns 0, 1 and takes 3 (checkpoint) and 4
    # (state at 14): estimate 2 + min(4, 1 + 1) = 4. Caching rounds to 8 tokens: full
    # block 1; Mamba columns 0, 1 are null; the checkpoint block 3 is keyed at 8.
    ckpt = MambaSpec(block_size=4, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)
    eng = make(_layout(FullAttentionSpec(block_size=8), ckpt))
    prompt = tuple(range(14))
    eng.add_request(RequestInput("r", prompt))
    hit = eng.get_computed_blocks("r")
    assert eng.allocate_slots("r", 14, 0, hit) == ((1, 2), (3, 4))
    assert eng.get_block_ids("r") == ((1, 2), (0, 0, 3, 4))
    assert eng.last_allocation_estimate() == 4
    assert _cached(eng) == {(1, 0, 8), (3, 1, 8)}
    eng.set_num_computed_tokens("r", 14)
    eng.new_step()
    eng.add_request(RequestInput("s", prompt))
    hit = eng.get_computed_blocks("s")
    assert (hit.num_tokens, hit.block_ids) == (8, ((1,), (0, 3)))


def check_without_checkpoint_blocks_the_same_chunk_caches_no_state(
    make: Factory = ReferenceEngine,
) -> None:
    eng = make(_layout(FullAttentionSpec(block_size=8), MambaSpec(block_size=4)))
    prompt = tuple(range(14))
    eng.add_request(RequestInput("r", prompt))
    assert eng.allocate_slots("r", 14, 0, eng.get_computed_blocks("r")) == ((1, 2), (3,))
    assert eng.get_block_ids("r") == ((1, 2), (0, 0, 0, 3))
    assert _cached(eng) == {(1, 0, 8)}
    eng.set_num_computed_tokens("r", 14)
    eng.new_step()
    eng.add_request(RequestInput("s", prompt))
    assert eng.get_computed_blocks("s").num_tokens == 0


@pytest.mark.parametrize(
    ("retention", "cached"),
    [
        # dense: the checkpoint at 4 is also the state of column 0: kept, as cached
        (None, {(1, 0, 4), (2, 0, 8)}),
        # one state per 8 tokens: the checkpoint at 4 is neither the prompt's (16), a
        # retained state nor the junction: its keys are dropped
        (8, {(2, 0, 8)}),
    ],
)
def test_checkpoint_outside_the_retention_is_not_kept(retention, cached) -> None:
    check_checkpoint_outside_the_retention_is_not_kept(retention, cached)


def check_checkpoint_outside_the_retention_is_not_kept(
    retention, cached, make: Factory = ReferenceEngine
) -> None:
    # Mamba bs 4 alone, checkpoints of alignment 1, a 20-token prompt, first chunk
    # [0, 8): position (8 - 1) // 4 * 4 = 4, column 0 reserved: row (1, 2), estimate 2
    ckpt = MambaSpec(block_size=4, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)
    eng = make(_layout(ckpt, prefix_cache_retention_interval=retention))
    eng.add_request(RequestInput("r", tuple(range(20))))
    assert eng.allocate_slots("r", 8, 0, eng.get_computed_blocks("r")) == ((1, 2),)
    assert eng.last_allocation_estimate() == 2
    assert _cached(eng) == cached


def test_none_mode_takes_the_state_and_speculative_blocks_at_once() -> None:
    check_none_mode_takes_the_state_and_speculative_blocks_at_once()


def test_speculative_blocks_are_relocated_when_the_state_passes_them() -> None:
    check_speculative_blocks_are_relocated_when_the_state_passes_them()


def test_estimate_never_below_zero_after_a_draft_rollback() -> None:
    check_estimate_never_below_zero_after_a_draft_rollback()


def test_checkpoint_reserves_a_block_keyed_at_its_position() -> None:
    check_checkpoint_reserves_a_block_keyed_at_its_position()


def test_without_checkpoint_blocks_the_same_chunk_caches_no_state() -> None:
    check_without_checkpoint_blocks_the_same_chunk_caches_no_state()


# -- EAGLE with a Mamba group -----------------------------------------------------------


def check_eagle_hit_with_a_mamba_group(make: Factory = ReferenceEngine) -> None:
    """Full bs 4 + Mamba bs 4, EAGLE on both groups (none flagged). A writer computes 12
    tokens in chunks [0, 8) and [8, 12): full blocks 1, 2, 4 cached at 4, 8, 12; Mamba
    states 3 (at 8) and 5 (at 12); freed (hashed: to the back). A reader of those 12
    tokens and 4 more (lookup bound 15): full looks up to min(15 + 4, 16) = 16, finds 12
    and drops one block: 8; Mamba looks no further than 8 (its hit never drops): the state
    at 8 (block 3). Hit 8, rows (1, 2) and (0, 3) (with a look past 8, Mamba would find
    the state at 12 and the hit would outgrow the full group's)."""
    eng = make(_layout(FullAttentionSpec(block_size=4), MambaSpec(block_size=4), use_eagle=True))
    prompt = tuple(range(12))
    eng.add_request(RequestInput("w", prompt))
    assert eng.allocate_slots("w", 8, 0, eng.get_computed_blocks("w")) == ((1, 2), (3,))
    eng.set_num_computed_tokens("w", 8)
    eng.new_step()
    assert eng.allocate_slots("w", 4) == ((4,), (5,))
    eng.set_num_computed_tokens("w", 12)
    assert _cached(eng) == {(1, 0, 4), (2, 0, 8), (4, 0, 12), (3, 1, 8), (5, 1, 12)}
    eng.free("w")
    eng.new_step()
    eng.add_request(RequestInput("r", prompt + (50, 51, 52, 53)))
    hit = eng.get_computed_blocks("r")
    assert (hit.num_tokens, hit.block_ids) == (8, ((1, 2), (0, 3)))


def check_prompt_tail_keyed_at_the_hash_grid(make: Factory = ReferenceEngine) -> None:
    """Full attention and Mamba of bs 4, sparse retention, lookahead hashes L 2 (EAGLE
    without the drop), a 9-token prompt: one hash ((0 + 1) * 4 + 2 <= 9; block 1 would
    need 10 tokens). The chunk [0, 4) caches 4 tokens (full block 1); for Mamba the
    replay boundary (9 - 1 = 8) keeps only the state at 8, but the prompt's own
    checkpoint on the hash grid is (9 - 2) // 4 * 4 = 4: the state block 2 (at 4) is
    keyed there."""
    layout = _layout(
        FullAttentionSpec(block_size=4),
        MambaSpec(block_size=4),
        prefix_cache_retention_interval=0,
        use_eagle=True,
        num_hash_lookahead_tokens=2,
    )
    eng = make(layout)
    eng.add_request(RequestInput("r", tuple(range(9))))
    assert eng.allocate_slots("r", 4, 0, eng.get_computed_blocks("r")) == ((1,), (2,))
    assert _cached(eng) == {(1, 0, 4), (2, 1, 4)}


def test_eagle_hit_with_a_mamba_group() -> None:
    check_eagle_hit_with_a_mamba_group()


def test_prompt_tail_keyed_at_the_hash_grid() -> None:
    check_prompt_tail_keyed_at_the_hash_grid()


def test_describe_names_the_mamba_settings_other_than_the_defaults() -> None:
    spec = MambaSpec(
        block_size=4,
        num_speculative_blocks=2,
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=1,
    )
    assert "g0:mamba(bs=4 spec=2 ckpt=1/1)" in _layout(spec).describe()
    none = MambaSpec(block_size=64, mamba_cache_mode="none")
    assert "g0:mamba(bs=64 mode=none)" in _layout(none, enable_caching=False).describe()
    assert "g0:mamba(bs=4) " in _layout(MambaSpec(block_size=4)).describe()


def test_a_checkpoint_inside_the_drafts_is_not_keyed() -> None:
    """``findings/vllm/mamba-checkpoint-inside-drafts.json``: Mamba bs 2 (hash block 2),
    4 speculative blocks, one prefill checkpoint block; a 2-token prompt, then a decode
    of one token and 2 drafts (the chunk [2, 5)) reserves the checkpoint at 4 with 3
    tokens known (one hash). vLLM 0.33 asserts there; the reference keys nothing past
    the hashed tokens (it raised IndexError reading the missing hash) and every check
    passes."""
    from pathlib import Path

    from properties.core.trace import load_trace
    from properties.engines.under_test import resolve_engine
    from properties.runner.config import CheckConfig
    from properties.runner.run import replay_trace

    root = Path(__file__).resolve().parents[2]
    trace = load_trace(root / "findings" / "vllm" / "mamba-checkpoint-inside-drafts.json")
    assert trace.mode.num_draft_tokens > 0
    run, failure = replay_trace(trace, CheckConfig(level="exact"), resolve_engine("reference"))
    assert failure is None, failure
    assert run is not None and len(run.operations) == len(trace.operations)
