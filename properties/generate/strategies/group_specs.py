"""Windows, chunk sizes and the four KV cache spec kinds of one group.

A window or chunk size is drawn in every :func:`window_category` that exists for the
group's block size (1, smaller than a block, one block, not a multiple, many blocks):
with block size 4, 1 -> one, 3 -> sub_block, 4 -> one_block, 6 -> non_multiple,
8 -> multi_block. :func:`specs` draws one full / sliding-window / chunked-local / Mamba
spec of a block size.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from properties.core.constants import SPEC_KINDS
from properties.generate.strategies.reuse import _reused
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

#: The categories of :func:`window_category`.
WINDOW_CATEGORIES = ("one", "sub_block", "one_block", "non_multiple", "multi_block")


#: Mamba state tensor shape used by generated layouts (64 bytes at 2 bytes each).
_MAMBA_SHAPES = ((4, 8),)


def window_category(size: int, block_size: int) -> str:
    """The category of a window or chunk size relative to the group's block size.

    ``one`` (size 1), ``sub_block`` (1 < size < bs), ``one_block`` (size == bs),
    ``non_multiple`` (size > bs, not a multiple), ``multi_block`` (a multiple,
    at least 2 blocks). Examples with bs 4: 1 -> one, 3 -> sub_block,
    4 -> one_block, 6 -> non_multiple, 8 -> multi_block.
    """
    if size == 1:
        return "one"
    if size < block_size:
        return "sub_block"
    if size == block_size:
        return "one_block"
    if size % block_size:
        return "non_multiple"
    return "multi_block"


def windows(block_size: int) -> st.SearchStrategy[int]:
    """A sliding window in any :func:`window_category` that exists for ``block_size``."""
    branches: list[st.SearchStrategy[int]] = [st.just(1)]
    if block_size > 2:
        branches.append(st.integers(2, block_size - 1))
    if block_size > 1:
        branches.append(st.just(block_size))
        branches.append(
            st.builds(
                lambda k, r: k * block_size + r,
                st.integers(1, 8),
                st.integers(1, block_size - 1),
            )
        )
    branches.append(st.integers(2, 16).map(lambda k: k * block_size))
    return st.one_of(branches)


def chunk_sizes(block_size: int) -> st.SearchStrategy[int]:
    """A local-attention chunk size; the same categories as :func:`windows`."""
    return windows(block_size)


def _attention_fields(block_size: int, head_size: int) -> dict:
    return {"block_size": block_size, "num_kv_heads": 1, "head_size": head_size, "dtype_bytes": 2}


def full_specs(block_size: int, head_size: int = 8) -> st.SearchStrategy[KVCacheSpec]:
    return st.just(FullAttentionSpec(**_attention_fields(block_size, head_size)))


def sliding_window_specs(block_size: int, head_size: int = 8) -> st.SearchStrategy[KVCacheSpec]:
    fields = _attention_fields(block_size, head_size)
    return windows(block_size).map(lambda w: SlidingWindowSpec(**fields, sliding_window=w))


def chunked_local_specs(block_size: int, head_size: int = 8) -> st.SearchStrategy[KVCacheSpec]:
    fields = _attention_fields(block_size, head_size)
    return chunk_sizes(block_size).map(
        lambda c: ChunkedLocalAttentionSpec(**fields, attention_chunk_size=c)
    )


def mamba_specs(block_size: int, page_size: int | None = None) -> st.SearchStrategy[KVCacheSpec]:
    """A Mamba spec; ``page_size`` (>= 64) pads its page to match the attention pages."""
    spec = MambaSpec(block_size=block_size, shapes=_MAMBA_SHAPES, dtype_bytes=2)
    if page_size is not None and page_size != spec.page_size_bytes:
        spec = spec.with_padded_page(page_size)
    return st.just(spec)


@_reused
def _kind_specs(
    kind: str, block_size: int, page_size: int, window_sizes: Sequence[int] | None = None
) -> st.SearchStrategy[KVCacheSpec]:
    # page = block_size * 1 head * 2 (K, V) * head_size * 2 bytes.
    head_size = page_size // (4 * block_size)
    if window_sizes is not None and kind in ("sliding_window", "chunked_local"):
        fields = _attention_fields(block_size, head_size)
        if kind == "sliding_window":
            return st.sampled_from(tuple(window_sizes)).map(
                lambda w: SlidingWindowSpec(**fields, sliding_window=w)
            )
        return st.sampled_from(tuple(window_sizes)).map(
            lambda c: ChunkedLocalAttentionSpec(**fields, attention_chunk_size=c)
        )
    if kind == "full":
        return full_specs(block_size, head_size)
    if kind == "sliding_window":
        return sliding_window_specs(block_size, head_size)
    if kind == "chunked_local":
        return chunked_local_specs(block_size, head_size)
    return mamba_specs(block_size, page_size)


def specs(block_size: int) -> st.SearchStrategy[KVCacheSpec]:
    """Any of the four spec kinds with this block size (full attention first).

    A Mamba spec is only valid in a layout if its block size is the layout's hash
    block size; :func:`layouts` takes care of that.
    """
    page = 64 * block_size
    return st.one_of([_kind_specs(kind, block_size, page) for kind in SPEC_KINDS])
