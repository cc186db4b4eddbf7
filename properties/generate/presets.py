"""Model presets: the KV cache layouts of real model families, usable by name.

Each preset keeps the real attention pattern (the ratio of local to global
layers, in the model's layer order), the real window / chunk sizes and KV head
shapes, and scales the layer count down to one period of the pattern (a
handful of layers). Grouping goes through :func:`reference.layout.group_layers`,
so the KV cache groups follow the rule of docs/spec.md §2.6: for example Gemma 3
has 5 sliding layers and 1 global layer per period; the buckets have 5 and 1
layers, ``group_size = min = 1``, so the preset has 5 sliding groups plus 1 full
group (6 groups), exactly as the 48-layer Gemma 3 12B (40 + 8 layers, group size
8 -> 5 + 1 groups).

Real values come from the Hugging Face ``config.json`` fields named in each
preset's description (``sliding_window``, ``layer_types``,
``attention_chunk_size``, ``no_rope_layer_interval``, ``attn_layer_period``,
``full_attention_interval``, ``num_key_value_heads``, ``head_dim``, ...).

For tests, ``layout(..., scale_windows=k)`` divides every window and chunk by
``k`` (at least 1), so that short traces make windows slide: gemma3's w=1024
with ``k=256`` becomes w=4.

Hybrid Mamba presets (jamba, qwen3-next) follow vLLM: the attention block size
is raised until one attention page holds a Mamba state, the Mamba block size
equals the attention block size (so partial hits stay off), and the smaller
page is padded so that every page is equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from reference.errors import InvalidLayoutError
from reference.layout import KVCacheLayout, group_layers
from reference.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)

#: vLLM's default ``--block-size`` (cache_config.block_size) for attention models.
DEFAULT_BLOCK_SIZE = 16
#: Kernel block alignment used when vLLM raises the attention block size of hybrid
#: Mamba models (FlashAttention kernels take multiples of 16).
KERNEL_BLOCK_ALIGNMENT = 16
#: bf16 everywhere.
BF16_BYTES = 2


@dataclass(frozen=True)
class LayerKind:
    """One layer of the pattern: ``kind`` is ``full``, ``sliding_window``,
    ``chunked_local`` or ``mamba``; ``size`` is the window or chunk (0 otherwise)."""

    kind: str
    size: int = 0


FULL = LayerKind("full")
MAMBA = LayerKind("mamba")


def sliding(window: int) -> LayerKind:
    return LayerKind("sliding_window", window)


def chunked(chunk: int) -> LayerKind:
    return LayerKind("chunked_local", chunk)


def hybrid_attention_block_size(
    attention_bytes_per_token: int, mamba_page_bytes: int, alignment: int = KERNEL_BLOCK_ALIGNMENT
) -> int:
    """Smallest multiple of ``alignment`` whose attention page holds one Mamba state.

    ``alignment * cdiv(mamba_page, alignment * attention_bytes_per_token)``.
    Jamba: 4096 B/token, Mamba page 311296 B -> 16 * cdiv(311296, 65536) = 16 * 5 = 80.
    """
    return alignment * cdiv(mamba_page_bytes, alignment * attention_bytes_per_token)


@dataclass(frozen=True)
class ModelPreset:
    """A model family's KV cache shape, scaled down to one period of its layer pattern.

    ``pattern`` lists the layers in model order. ``num_kv_heads``/``head_size`` are
    the attention layers' ``num_key_value_heads``/``head_dim``; ``mamba_shapes`` the
    per-layer state tensors (elements) of Mamba-like layers, all bf16.
    """

    name: str
    description: str
    pattern: tuple[LayerKind, ...]
    num_kv_heads: int
    head_size: int
    default_block_size: int = DEFAULT_BLOCK_SIZE
    mamba_shapes: tuple[tuple[int, ...], ...] = ()
    #: Number of KV cache groups the spec's grouping rule gives (written by hand).
    expected_num_groups: int = 1
    #: ``prefix_cache_retention_interval`` the family is served with: vLLM 0.33's
    #: production default is 0 (sparse retention) for every model.
    retention_interval: int | None = 0

    def __post_init__(self) -> None:
        if not self.pattern:
            raise InvalidLayoutError(f"ModelPreset {self.name!r}.pattern must not be empty")
        has_mamba = any(k.kind == "mamba" for k in self.pattern)
        if has_mamba and not self.mamba_shapes:
            raise InvalidLayoutError(
                f"ModelPreset {self.name!r} has Mamba layers but no mamba_shapes"
            )

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct window / chunk sizes of the pattern (before scaling)."""
        return tuple(sorted({k.size for k in self.pattern if k.size}))

    def layer_specs(self, block_size: int, scale_windows: int = 1) -> dict[str, KVCacheSpec]:
        """``{"layers.<i>": spec}`` in model order, with equalised page sizes."""
        if not isinstance(scale_windows, int) or scale_windows < 1:
            raise InvalidLayoutError(
                f"scale_windows must be an integer >= 1, got {scale_windows!r}"
            )
        specs = [self._spec(kind, block_size, scale_windows) for kind in self.pattern]
        specs = _equalise_pages(specs)
        return {f"layers.{i}": spec for i, spec in enumerate(specs)}

    def layout(
        self,
        num_blocks: int,
        max_model_len: int,
        block_size: int | None = None,
        scale_windows: int = 1,
        enable_caching: bool = True,
        max_in_flight_tokens: int | None = None,
    ) -> KVCacheLayout:
        """The preset's layout; windows and chunks divided by ``scale_windows`` (min 1),
        with the retention interval the family is served with (sparse: 0).

        Example: ``PRESETS["gpt-oss"].layout(64, 128, block_size=4, scale_windows=32)``
        gives a sliding group (w = 128 // 32 = 4) and a full group, both bs 4.
        """
        bs = self.default_block_size if block_size is None else block_size
        groups = group_layers(self.layer_specs(bs, scale_windows))
        suffix = "" if scale_windows == 1 else f"/{scale_windows}"
        return KVCacheLayout(
            groups=groups,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            enable_caching=enable_caching,
            max_in_flight_tokens=max_in_flight_tokens,
            prefix_cache_retention_interval=self.retention_interval,
            name=f"{self.name}{suffix}",
        )

    def _spec(self, kind: LayerKind, block_size: int, scale: int) -> KVCacheSpec:
        attention = {
            "block_size": block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype_bytes": BF16_BYTES,
        }
        if kind.kind == "full":
            return FullAttentionSpec(**attention)
        if kind.kind == "sliding_window":
            return SlidingWindowSpec(**attention, sliding_window=max(1, kind.size // scale))
        if kind.kind == "chunked_local":
            return ChunkedLocalAttentionSpec(
                **attention, attention_chunk_size=max(1, kind.size // scale)
            )
        if kind.kind == "mamba":
            return MambaSpec(
                block_size=block_size, shapes=self.mamba_shapes, dtype_bytes=BF16_BYTES
            )
        raise InvalidLayoutError(f"ModelPreset {self.name!r}: unknown layer kind {kind.kind!r}")


def _equalise_pages(specs: list[KVCacheSpec]) -> list[KVCacheSpec]:
    """Pad every smaller page to the largest one (vLLM's final state for hybrids).

    Without this, :func:`reference.layout.unify_page_sizes` could multiply an
    attention block size when its page divides the Mamba page (Jamba at bs 4:
    311296 / 16384 = 19), which real vLLM avoids by choosing the block size first.
    """
    target = max(s.page_size_bytes for s in specs)
    out: list[KVCacheSpec] = []
    for s in specs:
        if s.page_size_bytes < target and isinstance(s, (AttentionSpec, MambaSpec)):
            out.append(s.with_padded_page(target))
        else:
            out.append(s)
    return out


def _attention_bytes_per_token(num_kv_heads: int, head_size: int) -> int:
    return num_kv_heads * 2 * head_size * BF16_BYTES


def _mamba_page(shapes: tuple[tuple[int, ...], ...]) -> int:
    return MambaSpec(block_size=1, shapes=shapes, dtype_bytes=BF16_BYTES).page_size_bytes


def _pattern(length: int, kind_of: Callable[[int], LayerKind]) -> tuple[LayerKind, ...]:
    return tuple(kind_of(i) for i in range(length))


# Jamba v0.1: d_inner = mamba_expand * hidden_size = 2 * 4096 = 8192;
# conv state (d_inner, mamba_d_conv - 1) = (8192, 3); SSM state (d_inner, mamba_d_state).
_JAMBA_SHAPES = ((8192, 3), (8192, 16))
# Qwen3-Next 80B-A3B gated DeltaNet: conv_dim = 2 * linear_num_key_heads *
# linear_key_head_dim + linear_num_value_heads * linear_value_head_dim
# = 2*16*128 + 32*128 = 8192; conv state (8192, linear_conv_kernel_dim - 1);
# recurrent state (linear_num_value_heads, linear_key_head_dim, linear_value_head_dim).
_QWEN3_NEXT_SHAPES = ((8192, 3), (32, 128, 128))

GEMMA2 = ModelPreset(
    name="gemma2",
    description=(
        "Gemma 2 (9B): layer_types alternate sliding_attention / full_attention starting "
        "with sliding (1:1); sliding_window=4096; num_key_value_heads=8, head_dim=256. "
        "42 layers -> 21 + 21 -> 2 groups; here 4 layers -> 2 groups."
    ),
    pattern=_pattern(4, lambda i: sliding(4096) if (i + 1) % 2 else FULL),
    num_kv_heads=8,
    head_size=256,
    expected_num_groups=2,
)

GEMMA3 = ModelPreset(
    name="gemma3",
    description=(
        "Gemma 3 (12B): sliding_window_pattern=6, i.e. layer_types has 5 sliding_attention "
        "then 1 full_attention; sliding_window=1024; num_key_value_heads=8, head_dim=256. "
        "48 layers -> 40 sliding + 8 full, group size 8 -> 5 + 1 groups; here 6 layers "
        "-> group size 1 -> 5 sliding groups + 1 full group."
    ),
    pattern=_pattern(6, lambda i: sliding(1024) if (i + 1) % 6 else FULL),
    num_kv_heads=8,
    head_size=256,
    expected_num_groups=6,
)

GPT_OSS = ModelPreset(
    name="gpt-oss",
    description=(
        "gpt-oss (20B/120B): layer_types alternate sliding_attention / full_attention "
        "starting with sliding; sliding_window=128; num_key_value_heads=8, head_dim=64. "
        "24 or 36 layers -> 2 groups; here 4 layers -> 2 groups."
    ),
    pattern=_pattern(4, lambda i: sliding(128) if (i + 1) % 2 else FULL),
    num_kv_heads=8,
    head_size=64,
    expected_num_groups=2,
)

MISTRAL_7B = ModelPreset(
    name="mistral-7b",
    description=(
        "Mistral 7B v0.1: every layer uses sliding_window=4096 (no full layers); "
        "num_key_value_heads=8, head_dim = hidden_size / num_attention_heads = 128. "
        "All layers share one spec -> 1 group; here 2 layers."
    ),
    pattern=(sliding(4096), sliding(4096)),
    num_kv_heads=8,
    head_size=128,
    expected_num_groups=1,
)

LLAMA4_SCOUT = ModelPreset(
    name="llama4-scout",
    description=(
        "Llama 4 Scout: no_rope_layer_interval=4, so layer_types has 3 chunked_attention "
        "(RoPE) layers then 1 full_attention (NoPE) layer; attention_chunk_size=8192; "
        "num_key_value_heads=8, head_dim=128. 48 layers -> 36 + 12, group size 12 -> "
        "3 + 1 groups; here 4 layers -> group size 1 -> 3 chunked + 1 full groups."
    ),
    pattern=_pattern(4, lambda i: chunked(8192) if (i + 1) % 4 else FULL),
    num_kv_heads=8,
    head_size=128,
    expected_num_groups=4,
)

JAMBA = ModelPreset(
    name="jamba",
    description=(
        "Jamba v0.1: attn_layer_period=8, attn_layer_offset=4 (layer i is attention iff "
        "i % 8 == 4, the other 7 are Mamba); full attention, num_key_value_heads=8, "
        "head_dim = 4096 / 32 = 128; Mamba state from mamba_expand=2, mamba_d_conv=4, "
        "mamba_d_state=16 -> 311296 B. vLLM raises the attention block size to "
        "16 * cdiv(311296, 16 * 4096) = 80 and pads the Mamba page. 32 layers -> 28 Mamba + "
        "4 attention, group size 4 -> 7 + 1 groups; here 8 layers -> 7 Mamba + 1 full groups."
    ),
    pattern=_pattern(8, lambda i: FULL if i % 8 == 4 else MAMBA),
    num_kv_heads=8,
    head_size=128,
    default_block_size=hybrid_attention_block_size(
        _attention_bytes_per_token(8, 128), _mamba_page(_JAMBA_SHAPES)
    ),
    mamba_shapes=_JAMBA_SHAPES,
    expected_num_groups=8,
)

QWEN3_NEXT = ModelPreset(
    name="qwen3-next",
    description=(
        "Qwen3-Next 80B-A3B: full_attention_interval=4, so layer_types has 3 "
        "linear_attention (gated DeltaNet, a Mamba-like state) layers then 1 full_attention "
        "layer; num_key_value_heads=2, head_dim=256; state from linear_num_key_heads=16, "
        "linear_num_value_heads=32, linear_key_head_dim=linear_value_head_dim=128, "
        "linear_conv_kernel_dim=4 -> 1097728 B (bf16). Attention block size "
        "16 * cdiv(1097728, 16 * 2048) = 544. 48 layers -> 36 + 12, group size 12 -> "
        "3 + 1 groups; here 4 layers -> 3 Mamba + 1 full groups."
    ),
    pattern=_pattern(4, lambda i: MAMBA if (i + 1) % 4 else FULL),
    num_kv_heads=2,
    head_size=256,
    default_block_size=hybrid_attention_block_size(
        _attention_bytes_per_token(2, 256), _mamba_page(_QWEN3_NEXT_SHAPES)
    ),
    mamba_shapes=_QWEN3_NEXT_SHAPES,
    expected_num_groups=4,
)

#: Every preset by name (the CLI's ``--preset`` choices).
PRESETS: dict[str, ModelPreset] = {
    p.name: p for p in (GEMMA2, GEMMA3, GPT_OSS, MISTRAL_7B, LLAMA4_SCOUT, JAMBA, QWEN3_NEXT)
}


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; unknown names raise, listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidLayoutError(
            f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}"
        ) from None
