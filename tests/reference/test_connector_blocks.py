"""The blocks a connector is told cover a request's computed tokens, by hand."""

from __future__ import annotations

from reference.connector_blocks import blocks_covering
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec


def test_attention_rows_are_cut_mamba_rows_are_whole() -> None:
    layout = KVCacheLayout(
        (
            KVCacheGroup(("f",), FullAttentionSpec(block_size=2)),
            KVCacheGroup(("m",), MambaSpec(block_size=2, shapes=((4,),))),
        ),
        num_blocks=16,
        max_model_len=32,
    )
    # 3 computed tokens: cdiv(3, 2) = 2 full blocks; the Mamba row whole
    assert blocks_covering(layout, ((1, 2, 3), (0, 4)), 3) == ((1, 2), (0, 4))
    assert blocks_covering(layout, ((1, 2, 3), (0, 4)), 0) == ((), (0, 4))


def test_a_window_keeps_its_null_entries() -> None:
    layout = KVCacheLayout(
        (KVCacheGroup(("s",), SlidingWindowSpec(block_size=2, sliding_window=2)),),
        num_blocks=16,
        max_model_len=32,
    )
    assert blocks_covering(layout, ((0, 0, 7, 8),), 6) == ((0, 0, 7),)
