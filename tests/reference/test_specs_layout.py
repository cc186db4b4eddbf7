"""Check values of spec sections 1 and 2.3-2.7: pages, skip rules, admission caps,
layer grouping, pool size and concurrency. Every expected value is written by hand."""

from __future__ import annotations

import pytest

from reference.layout import (
    KVCacheGroup,
    KVCacheLayout,
    group_layers,
    num_blocks_for_memory,
)
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)

# bs 16, 2 KV heads, head 64, fp32: 16 * 2 * (64 + 64) * 4 = 16384 bytes (spec 1.1).
FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype_bytes=4)
SWA = SlidingWindowSpec(
    block_size=16, num_kv_heads=2, head_size=64, dtype_bytes=4, sliding_window=1024
)


def _names(n: int) -> list[str]:
    return [f"l{i}" for i in range(1, n + 1)]


# -- 1. specs --------------------------------------------------------------------------


def test_attention_page_check_value() -> None:
    assert FULL.page_size_bytes == 16384
    assert SWA.page_size_bytes == 16384


def test_padded_page_wins_over_unpadded() -> None:
    assert FULL.with_padded_page(24576).page_size_bytes == 24576
    assert FULL.with_padded_page(24576).block_size == 16


def test_mamba_page_is_sum_of_state_shapes() -> None:
    # (4*8 + 2*3) elements * 2 bytes = 76
    spec = MambaSpec(block_size=4, shapes=((4, 8), (2, 3)), dtype_bytes=2)
    assert spec.page_size_bytes == 76
    assert spec.max_memory_usage_bytes(1000, 1000) == 152


def test_cdiv() -> None:
    assert cdiv(5, 2) == 3
    assert cdiv(4, 2) == 2
    assert cdiv(0, 7) == 0


def test_sliding_window_skip_and_hit_context() -> None:
    spec = SlidingWindowSpec(block_size=2, sliding_window=4)
    assert spec.num_skipped_tokens(7) == 4
    assert spec.num_skipped_tokens(3) == 0
    assert spec.num_skipped_tokens(4) == 1
    assert spec.hit_context_start(8) == 5
    assert spec.hit_context_start(2) == 0
    w1 = SlidingWindowSpec(block_size=2, sliding_window=1)
    assert w1.num_skipped_tokens(7) == 7
    assert w1.hit_context_start(7) == 7


def test_chunked_skip_check_values() -> None:
    spec = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8)
    assert spec.num_skipped_tokens(13) == 8
    assert spec.num_skipped_tokens(8) == 8
    assert spec.num_skipped_tokens(7) == 0
    assert spec.hit_context_start(13) == 8


def test_full_and_mamba_skip() -> None:
    assert FULL.num_skipped_tokens(10_000) == 0
    assert FULL.hit_context_start(64) == 0
    mamba = MambaSpec(block_size=4)
    assert mamba.num_skipped_tokens(9) == 8
    assert mamba.num_skipped_tokens(0) == 0
    assert mamba.hit_context_start(12) == 12


def test_swa_admission_blocks_check_values() -> None:
    assert SWA.max_admission_blocks(1024, 16384) == 129
    assert SWA.max_admission_blocks(2048, 16384) == 193
    # capped by max_model_len: min(1023 + 1024, 1000) = 1000 -> cdiv(1000, 16) + 1 = 64
    assert SWA.max_admission_blocks(1024, 1000) == 64


def test_chunked_admission_blocks_check_values() -> None:
    spec = ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=1024)
    assert spec.max_admission_blocks(1024, 16384) == 128
    assert spec.max_admission_blocks(2048, 16384) == 192


def test_full_memory_usage() -> None:
    # cdiv(16384, 16) = 1024 pages
    assert FULL.max_memory_usage_bytes(16384, 1024) == 1024 * 16384
    assert FULL.max_memory_usage_bytes(17, 1024) == 2 * 16384


# -- 2.3 scheduler / hash block size -------------------------------------------------


def test_scheduler_and_hash_block_size() -> None:
    groups = (
        KVCacheGroup(("a",), FullAttentionSpec(block_size=32)),
        KVCacheGroup(("b",), SlidingWindowSpec(block_size=16, sliding_window=8)),
    )
    on = KVCacheLayout(groups, num_blocks=10, max_model_len=64)
    assert on.scheduler_block_size == 32
    assert on.hash_block_size == 16
    assert on.cache_hit_alignment == 32
    off = KVCacheLayout(groups, num_blocks=10, max_model_len=64, enable_caching=False)
    assert off.hash_block_size == 32
    one = KVCacheLayout(groups[:1], num_blocks=10, max_model_len=64)
    assert one.scheduler_block_size == 32
    assert one.hash_block_size == 32


# -- 2.6 grouping --------------------------------------------------------------------


def _group_names(groups) -> list[tuple[str, ...]]:
    return [g.layer_names for g in groups]


def test_two_full_layers_make_one_group() -> None:
    groups = group_layers({"l1": FULL, "l2": FULL})
    assert _group_names(groups) == [("l1", "l2")]
    assert groups[0].spec == FULL


def test_full_plus_swa_make_two_groups() -> None:
    groups = group_layers({"l1": FULL, "l2": SWA})
    assert _group_names(groups) == [("l1",), ("l2",)]
    assert [g.spec for g in groups] == [FULL, SWA]


def test_two_full_four_swa() -> None:
    names = _names(6)
    specs = dict(zip(names, [FULL] * 2 + [SWA] * 4))
    groups = group_layers(specs)
    assert _group_names(groups) == [("l1", "l2"), ("l3", "l5"), ("l4", "l6")]
    assert [g.spec for g in groups] == [FULL, SWA, SWA]


def test_three_full_seven_swa() -> None:
    names = _names(10)
    groups = group_layers(dict(zip(names, [FULL] * 3 + [SWA] * 7)))
    assert _group_names(groups) == [
        ("l1", "l2", "l3"),
        ("l4", "l7", "l10"),
        ("l5", "l8"),
        ("l6", "l9"),
    ]


def test_six_full_five_swa_uses_larger_group_size() -> None:
    names = _names(11)
    groups = group_layers(dict(zip(names, [FULL] * 6 + [SWA] * 5)))
    assert _group_names(groups) == [
        ("l1", "l2", "l3", "l4", "l5", "l6"),
        ("l7", "l8", "l9", "l10", "l11"),
    ]


def test_smaller_dividing_page_doubles_block_size() -> None:
    swa32 = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=32, dtype_bytes=4, sliding_window=1024
    )
    assert swa32.page_size_bytes == 8192
    groups = group_layers({"l1": FULL, "l2": swa32})
    assert [g.spec.block_size for g in groups] == [16, 32]
    assert [g.spec.page_size_bytes for g in groups] == [16384, 16384]
    assert groups[1].spec.sliding_window == 1024


def test_non_dividing_page_is_padded() -> None:
    swa96 = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=96, dtype_bytes=4, sliding_window=1024
    )
    assert swa96.page_size_bytes == 24576
    groups = group_layers({"l1": FULL, "l2": swa96})
    # 24576 is not a multiple of 16384: the full page is padded, block size kept
    assert [g.spec.block_size for g in groups] == [16, 16]
    assert [g.spec.page_size_bytes for g in groups] == [24576, 24576]
    assert groups[0].spec.page_size_padded == 24576


def test_mamba_page_is_padded_to_attention_page() -> None:
    mamba = MambaSpec(block_size=16, shapes=((16, 16),), dtype_bytes=2)
    assert mamba.page_size_bytes == 512
    groups = group_layers({"l1": FULL, "l2": mamba})
    assert [g.spec.page_size_bytes for g in groups] == [16384, 16384]
    assert [g.spec.block_size for g in groups] == [16, 16]


# -- 2.7 num_blocks and concurrency ---------------------------------------------------


def test_num_blocks_for_memory_check_values() -> None:
    memory = 64 * 16384
    two_full = (KVCacheGroup(("l1", "l2"), FULL),)
    assert num_blocks_for_memory(two_full, memory) == 32
    full_swa = (KVCacheGroup(("l1",), FULL), KVCacheGroup(("l2",), SWA))
    assert num_blocks_for_memory(full_swa, memory) == 64
    # 2 full + 4 SWA -> three groups of two layers: two pages per block id
    assert (
        num_blocks_for_memory(
            (
                KVCacheGroup(("l1", "l2"), FULL),
                KVCacheGroup(("l3", "l5"), SWA),
                KVCacheGroup(("l4", "l6"), SWA),
            ),
            memory,
        )
        == 32
    )


def _concurrency_layout(groups, num_blocks: int) -> KVCacheLayout:
    return KVCacheLayout(
        tuple(groups), num_blocks=num_blocks, max_model_len=16384, max_in_flight_tokens=1024
    )


def test_max_concurrency_check_values() -> None:
    full = KVCacheGroup(("f",), FULL)
    swa = KVCacheGroup(("s",), SWA)
    full_only = _concurrency_layout([full], 1536)
    assert full_only.blocks_per_request() == 1024
    assert full_only.max_concurrency() == pytest.approx(1.5)
    swa_only = _concurrency_layout([swa], 387)
    assert swa_only.blocks_per_request() == 129
    assert swa_only.max_concurrency() == pytest.approx(3.0)
    hybrid = _concurrency_layout([full, swa], (1024 + 129) * 3)
    assert hybrid.blocks_per_request() == 1153
    assert hybrid.max_concurrency() == pytest.approx(3.0)


def test_admission_in_flight_defaults_to_max_model_len() -> None:
    layout = KVCacheLayout((KVCacheGroup(("s",), SWA),), num_blocks=10, max_model_len=16384)
    assert layout.admission_in_flight_tokens() == 16384
    # min(1023 + 16384, 16384) = 16384 -> 1024 + 1
    assert layout.blocks_per_request() == 1025
