"""The Mamba settings drawn on top of a layout (``mamba_modes``): what each draw may give."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from properties.generate.strategies.mamba_modes import SPECULATIVE_BLOCKS, mamba_settings
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec

#: full bs 16 + Mamba bs 16, max_model_len 100 (not a multiple of 16), sparse retention
BASE = KVCacheLayout(
    (
        KVCacheGroup(("f",), FullAttentionSpec(block_size=16)),
        KVCacheGroup(("m",), MambaSpec(block_size=16)),
    ),
    num_blocks=20,
    max_model_len=100,
    prefix_cache_retention_interval=32,
)


@settings(max_examples=60, deadline=None, database=None)
@given(st.data())
def test_mamba_settings_give_valid_deployed_layouts(data) -> None:
    layout = data.draw(mamba_settings(BASE))
    spec = layout.groups[1].spec
    assert isinstance(spec, MambaSpec)
    assert spec.num_speculative_blocks in SPECULATIVE_BLOCKS
    extra = spec.num_speculative_blocks + spec.num_prefill_checkpoint_blocks
    assert layout.num_blocks == 20 + 2 * extra
    if spec.mamba_cache_mode == "none":
        # caching off, one block of max_model_len (100 rounded down to 16s: 96)
        assert not layout.enable_caching and layout.max_model_len == 96
        assert spec.block_size == 96 and spec.num_prefill_checkpoint_blocks == 0
        assert layout.prefix_cache_retention_interval is None  # 32 is not a multiple of 96
    else:
        assert layout.enable_caching and (layout.max_model_len, spec.block_size) == (100, 16)
        assert spec.prefill_checkpoint_alignment in (None, 1, 16)
        assert (spec.prefill_checkpoint_alignment is None) == (
            spec.num_prefill_checkpoint_blocks == 0
        )


PLAIN = KVCacheLayout(
    (KVCacheGroup(("f",), FullAttentionSpec(block_size=4)),), num_blocks=8, max_model_len=32
)


@settings(max_examples=5, deadline=None, database=None)
@given(st.data())
def test_a_layout_without_mamba_is_left_as_it_is(data) -> None:
    assert data.draw(mamba_settings(PLAIN)) is PLAIN
