"""KV cache specs: what one attention type needs from the cache.

A spec is a frozen dataclass. Besides sizes (``block_size``, ``page_size_bytes``,
``max_memory_usage_bytes``) every spec states two rules that the managers build
on:

* ``num_skipped_tokens(n)``: how many leading tokens are no longer needed once
  the next token to compute is at position ``n``;
* ``hit_context_start(L)``: a prefix hit that resumes at position ``L`` needs the
  KV of tokens ``[hit_context_start(L), L)`` to be real (cached) blocks.

Worked example, ``SlidingWindowSpec(sliding_window=4)``: the query at 7 sees keys
``[4, 7]``, so ``num_skipped_tokens(7) == 4`` (tokens 0..3 are dead), and a hit
at ``L = 8`` needs tokens ``[5, 8)`` (``w - 1 = 3`` tokens): ``hit_context_start(8) == 5``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from reference.errors import InvalidSpecError, require_given, require_positive


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``: ``cdiv(5, 2) == 3``."""
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of all specs: a block holds ``block_size`` tokens of one layer."""

    block_size: int

    def __post_init__(self) -> None:
        require_positive(type(self).__name__, "block_size", self.block_size)

    @property
    def type_name(self) -> str:
        """Short, stable name of the attention type (``full``, ``sliding_window``, ...)."""
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer occupies."""
        raise NotImplementedError

    def with_block_size(self, block_size: int) -> KVCacheSpec:
        """A copy that differs only in ``block_size`` (page unification scales it)."""
        raise NotImplementedError

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose KV is dead when the next token is ``num_computed_tokens``."""
        return 0

    def hit_context_start(self, hit_length: int) -> int:
        """First token whose KV a prefix hit ending at ``hit_length`` must still hold."""
        return 0

    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """Most bytes one request of ``max_model_len`` tokens can pin in this group."""
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    def max_admission_blocks(self, max_in_flight_tokens: int, max_model_len: int) -> int | None:
        """The per-request admission cap in blocks (sliding window and chunked local
        recycle blocks, so a request never holds more); ``None``: no cap."""
        return None


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """Paged K and V: ``page = block_size * num_kv_heads * 2 * head_size * dtype_bytes``.

    Check value (spec 1.1): bs=16, 2 heads, head 64, fp32 -> 16*2*128*4 = 16384.
    """

    num_kv_heads: int = 1
    head_size: int = 8
    dtype_bytes: int = 2
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        require_positive(name, "num_kv_heads", self.num_kv_heads)
        require_positive(name, "head_size", self.head_size)
        require_positive(name, "dtype_bytes", self.dtype_bytes)
        if self.page_size_padded is not None and self.page_size_padded < self.unpadded_page_bytes:
            raise InvalidSpecError(
                f"{name}.page_size_padded must be >= the unpadded page "
                f"{self.unpadded_page_bytes}, got {self.page_size_padded}"
            )

    @property
    def unpadded_page_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * 2 * self.head_size * self.dtype_bytes

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.unpadded_page_bytes

    def with_block_size(self, block_size: int) -> AttentionSpec:
        return _replace(self, block_size=block_size)

    def with_padded_page(self, page_size: int) -> AttentionSpec:
        return _replace(self, page_size_padded=page_size)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Full causal attention: the query at ``p`` sees ``[0, p]``; nothing is ever skipped."""

    @property
    def type_name(self) -> str:
        return "full"


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding window ``w`` (keys seen, the query included): query ``p`` sees ``[p-w+1, p]``.

    * ``num_skipped_tokens(n) = max(0, n - w + 1)``: w=4, n=7 -> 4.
    * a hit at ``L`` needs ``[max(0, L - w + 1), L)``: ``w - 1`` tokens.
    * ``max_memory_usage_bytes = (cdiv(min(w - 1 + IFT, max_model_len), bs) + 1) * page``;
      the ``+ 1`` because the window need not start on a block boundary.
    """

    sliding_window: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        require_given("SlidingWindowSpec", "sliding_window", self.sliding_window)
        require_positive("SlidingWindowSpec", "sliding_window", self.sliding_window)

    @property
    def type_name(self) -> str:
        return "sliding_window"

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def hit_context_start(self, hit_length: int) -> int:
        return max(0, hit_length - self.sliding_window + 1)

    def max_admission_blocks(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """Blocks one request can hold: w=1024, bs=16, len 16384, IFT 1024 -> 129."""
        tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return cdiv(tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        blocks = self.max_admission_blocks(max_in_flight_tokens, max_model_len)
        return blocks * self.page_size_bytes


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention ``C``: query ``p`` sees ``[floor(p/C)*C, p]``.

    * ``num_skipped_tokens(n) = floor(n/C)*C``: C=8 -> n=13: 8, n=8: 8, n=7: 0.
    * a hit at ``L`` needs ``[floor(L/C)*C, L)`` (the current partial chunk).
    * ``max_memory_usage_bytes = cdiv(min(C + IFT, max_model_len), bs) * page``.
    """

    attention_chunk_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        require_given(
            "ChunkedLocalAttentionSpec", "attention_chunk_size", self.attention_chunk_size
        )
        require_positive(
            "ChunkedLocalAttentionSpec", "attention_chunk_size", self.attention_chunk_size
        )

    @property
    def type_name(self) -> str:
        return "chunked_local"

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        chunk = self.attention_chunk_size
        return num_computed_tokens // chunk * chunk

    def hit_context_start(self, hit_length: int) -> int:
        return self.num_skipped_tokens(hit_length)

    def max_admission_blocks(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """C=1024, bs=16, IFT 1024 -> 128; IFT 2048 -> 192."""
        tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(tokens, self.block_size)

    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        blocks = self.max_admission_blocks(max_in_flight_tokens, max_model_len)
        return blocks * self.page_size_bytes


#: Mamba caching modes of vLLM 0.33: ``"align"`` (prefix caching on or off: one state per
#: block boundary, the row position indexed) and ``"none"`` (prefix caching off: the state
#: lives in the request's first block, every block is a plain slot).
MAMBA_CACHE_MODES: tuple[str, ...] = ("align", "none")


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """Mamba / linear-attention state.

    Block ``i`` holds the recurrent state after token ``(i+1)*bs - 1``, i.e. the
    state at boundary ``(i+1)*bs``. Only the newest state is needed:
    ``num_skipped_tokens(n) = n - 1``. A hit at ``L`` needs the state at exactly
    ``L`` (``hit_context_start(L) == L`` and a cached state block ending at ``L``).
    The page is ``sum(prod(shape)) * dtype_bytes`` (or ``page_size_padded``).

    * ``mamba_cache_mode``: ``"align"`` (:mod:`reference.managers.mamba`) or ``"none"``
      (prefix caching must be off; the plain rules of
      :class:`reference.managers.base.SingleTypeKVCacheManager`).
    * ``num_speculative_blocks`` ``k``: extra state blocks for draft tokens (vLLM sets
      it to the speculative token count of MTP / EAGLE); a request holds ``k`` blocks
      past its running state.
    * ``num_prefill_checkpoint_blocks`` (align only) with
      ``prefill_checkpoint_alignment``: the backend can export one state from inside a
      prefill chunk into a reserved block (both needed: no alignment, no checkpoint).

    ``max_memory_usage_bytes``: align ``(2 + k + checkpoint blocks) * page``, none
    ``(1 + k) * page``. Example: align, k 2, one checkpoint block, page 64 -> 320.
    """

    shapes: tuple[tuple[int, ...], ...] = ((4, 8),)
    dtype_bytes: int = 2
    page_size_padded: int | None = None
    mamba_cache_mode: str = "align"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive("MambaSpec", "dtype_bytes", self.dtype_bytes)
        if not self.shapes or any(d < 1 for shape in self.shapes for d in shape):
            raise InvalidSpecError(
                f"MambaSpec.shapes must be non-empty positive shapes, got {self.shapes!r}"
            )
        if self.page_size_padded is not None and self.page_size_padded < self.unpadded_page_bytes:
            raise InvalidSpecError(
                f"MambaSpec.page_size_padded must be >= {self.unpadded_page_bytes}, "
                f"got {self.page_size_padded}"
            )
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise InvalidSpecError(
                f"MambaSpec.mamba_cache_mode must be one of {', '.join(MAMBA_CACHE_MODES)}, "
                f"got {self.mamba_cache_mode!r}"
            )
        for name in ("num_speculative_blocks", "num_prefill_checkpoint_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidSpecError(f"MambaSpec.{name} must be an integer >= 0, got {value!r}")
        if self.prefill_checkpoint_alignment is not None:
            require_positive(
                "MambaSpec", "prefill_checkpoint_alignment", self.prefill_checkpoint_alignment
            )

    @property
    def type_name(self) -> str:
        return "mamba"

    @property
    def is_align(self) -> bool:
        """Whether the group runs in ``"align"`` mode."""
        return self.mamba_cache_mode == "align"

    @property
    def has_prefill_checkpoints(self) -> bool:
        """Align mode with checkpoint blocks and an alignment: a prefill chunk may export
        an internal checkpoint (:func:`reference.managers.mamba_checkpoints.checkpoint_for`)."""
        return (
            self.is_align
            and self.num_prefill_checkpoint_blocks > 0
            and self.prefill_checkpoint_alignment is not None
        )

    @property
    def unpadded_page_bytes(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes) * self.dtype_bytes

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.unpadded_page_bytes

    def with_block_size(self, block_size: int) -> MambaSpec:
        return _replace(self, block_size=block_size)

    def with_padded_page(self, page_size: int) -> MambaSpec:
        return _replace(self, page_size_padded=page_size)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - 1)

    def hit_context_start(self, hit_length: int) -> int:
        return hit_length

    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        if self.is_align:
            resident = 2 + self.num_speculative_blocks + self.num_prefill_checkpoint_blocks
        else:
            resident = 1 + self.num_speculative_blocks
        return resident * self.page_size_bytes


def _replace(spec, **changes):
    return dataclasses.replace(spec, **changes)
