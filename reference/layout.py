"""Layout: layers -> KV cache groups, page unification, block sizes, pool size.

The rules (hybrid allocator on, docs/spec.md §2.6):

1. All layers with one spec (after merging equal specs) -> one group.
2. Otherwise page sizes are unified to the largest page: a smaller attention
   page that divides the largest gets its block size multiplied by the ratio; a
   Mamba page is padded; a non-dividing attention page is padded.
3. Layers are bucketed by identical spec. ``group_size = min(bucket sizes)``,
   except ``max(bucket sizes)`` when ``max < 1.5 * min``. A bucket of ``n`` layers
   becomes ``cdiv(n, group_size)`` groups; group ``i`` takes ``layers[i::k]``.
   Worked example: 2 full + 4 SWA layers -> ``(l1,l2), (l3,l5), (l4,l6)``.

The scheduler works in units of ``scheduler_block_size = lcm(group block sizes)``;
hashes are computed every ``hash_block_size`` tokens (``gcd`` of the group block
sizes with caching on and several groups; the block size itself otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from reference.errors import InvalidLayoutError, InvalidSpecError
from reference.retention import validate_retention_interval
from reference.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)
from reference.validation import require_bool, require_int


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV cache group: layers that share block ids, all with ``spec``."""

    layer_names: tuple[str, ...]
    spec: KVCacheSpec
    is_eagle_group: bool = False

    def __post_init__(self) -> None:
        names = self.layer_names
        if not isinstance(names, tuple) or not all(isinstance(n, str) and n for n in names):
            raise InvalidLayoutError(
                f"KVCacheGroup.layer_names must be a tuple of non-empty strings, got {names!r}"
            )
        if not isinstance(self.spec, KVCacheSpec):
            raise InvalidSpecError(f"KVCacheGroup.spec must be a KVCacheSpec, got {self.spec!r}")
        require_bool(InvalidLayoutError, "KVCacheGroup", "is_eagle_group", self.is_eagle_group)


@dataclass(frozen=True)
class KVCacheLayout:
    """Everything an engine needs to build its KV cache manager.

    ``num_blocks`` counts the null block (id 0). ``max_in_flight_tokens`` feeds
    the admission cap of sliding-window and chunked groups; ``None`` means
    ``max_model_len`` (the cap then has no effect).
    ``prefix_cache_retention_interval``: which sliding-window and Mamba blocks are
    registered in the prefix cache (:mod:`reference.retention`): ``None`` dense (a
    hand-built vLLM config), ``0`` sparse (vLLM's production default), ``k > 0`` one
    tail per ``k`` tokens plus the sparse ones.
    ``use_eagle``: EAGLE speculative decoding; a hit drops its last block in the
    EAGLE groups (those flagged ``is_eagle_group``, or all when none is flagged; a Mamba
    group never drops, but its prefill checkpoints move one unit down),
    unless ``num_hash_lookahead_tokens > 0`` (lookahead hashes prove the boundary,
    so nothing is dropped).
    ``dcp_world_size``: decode context parallelism, :func:`check_context_parallel`;
    ``pcp_world_size``: prefill context parallelism (every group full attention; it
    changes no manager rule).
    """

    groups: tuple[KVCacheGroup, ...]
    num_blocks: int
    max_model_len: int
    enable_caching: bool = True
    max_in_flight_tokens: int | None = None
    prefix_cache_retention_interval: int | None = None
    use_eagle: bool = False
    num_hash_lookahead_tokens: int = 0
    dcp_world_size: int = 1
    pcp_world_size: int = 1
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _check_layout_fields(self)
        if not self.groups:
            raise InvalidLayoutError("KVCacheLayout.groups must not be empty, got ()")
        if self.num_blocks < 2:
            raise InvalidLayoutError(
                f"KVCacheLayout.num_blocks must be >= 2 (the null block and one more), "
                f"got {self.num_blocks}"
            )
        if self.max_model_len < 1:
            raise InvalidLayoutError(
                f"KVCacheLayout.max_model_len must be >= 1, got {self.max_model_len}"
            )
        if self.scheduler_block_size > self.max_model_len:
            raise InvalidLayoutError(
                f"scheduler_block_size (lcm of group block sizes) {self.scheduler_block_size} "
                f"is larger than KVCacheLayout.max_model_len {self.max_model_len}"
            )
        lcm = self.scheduler_block_size
        for gid, g in enumerate(self.groups):
            if (
                self.enable_caching
                and len(self.groups) > 1
                and isinstance(g.spec, ChunkedLocalAttentionSpec)
                and g.spec.block_size != lcm
            ):
                raise InvalidLayoutError(
                    f"KVCacheLayout.groups[{gid}] is chunked local attention with block_size "
                    f"{g.spec.block_size}; with prefix caching it must equal the scheduler "
                    f"block size (lcm of the group block sizes) {lcm}"
                )
        validate_retention_interval(
            self.prefix_cache_retention_interval,
            self.scheduler_block_size,
            any(isinstance(s, (SlidingWindowSpec, MambaSpec)) for s in self.specs),
        )
        if self.num_hash_lookahead_tokens < 0:
            raise InvalidLayoutError(
                "KVCacheLayout.num_hash_lookahead_tokens must be >= 0, got "
                f"{self.num_hash_lookahead_tokens}"
            )
        check_context_parallel(self)
        if (
            self.enable_caching
            and len(self.groups) > 1
            and not any(s.prefix_cacheable for s in self.specs)
        ):
            raise InvalidLayoutError(
                "KVCacheLayout.groups: with prefix caching, several groups need one in "
                "prefix caching (every group is a circular buffer)"
            )
        if self.use_eagle and any(isinstance(s, ChunkedLocalAttentionSpec) for s in self.specs):
            raise InvalidLayoutError(
                "KVCacheLayout.use_eagle with a chunked-local group is out of scope "
                "(vLLM turns the hybrid manager off with chunked local attention and EAGLE)"
            )
        _check_mamba_groups(self)

    @cached_property
    def drop_eagle_group_ids(self) -> frozenset[int]:
        """Groups whose hits drop their last block: with ``use_eagle`` and no lookahead
        hashes, the flagged EAGLE groups, or every group when none is flagged."""
        if not self.use_eagle or self.num_hash_lookahead_tokens > 0:
            return frozenset()
        flagged = frozenset(i for i, g in enumerate(self.groups) if g.is_eagle_group)
        return flagged or frozenset(range(len(self.groups)))

    @cached_property
    def specs(self) -> tuple[KVCacheSpec, ...]:
        return tuple(g.spec for g in self.groups)

    @cached_property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(g.spec.block_size for g in self.groups)

    @cached_property
    def scheduler_block_size(self) -> int:
        """``lcm`` of the group block sizes: hit lengths are multiples of it (hybrid)."""
        return math.lcm(*self.block_sizes)

    @cached_property
    def hash_block_size(self) -> int:
        """Token granularity of block hashes.

        One group: its block size. Several groups: ``gcd`` of the block sizes of the groups
        in prefix caching (a circular buffer is not) with caching on, else the scheduler
        block size. Example: full bs 32 + SWA bs 16 -> hash 16, scheduler 32; full bs 8 +
        a circular buffer of 4 -> hash 8, scheduler 8.
        """
        if len(self.groups) == 1:
            return self.groups[0].spec.block_size
        if not self.enable_caching:
            return self.scheduler_block_size
        cacheable = [s.block_size for s in self.specs if s.prefix_cacheable]
        return math.gcd(*(cacheable or self.block_sizes))

    @cached_property
    def partial_hits_enabled(self) -> bool:
        """Whether hits may end inside a block (partial, sub-block hits; vLLM 0.33's
        ``enable_partial_hash_hits``): several groups with prefix caching, a Mamba group
        coarser than the hash block size, and every group either of the hash block size
        or of a type whose hit rule can end inside a block (full attention, Mamba). Hit
        lengths are then multiples of the hash block size (:attr:`cache_hit_alignment`).
        Examples: full bs 4 + Mamba bs 8 (H 4) -> True; full bs 8 + Mamba bs 8 + SWA bs 4
        (H 4) -> True; Mamba bs 8 + SWA bs 8 + full bs 4 (H 4) -> False (the SWA group's
        hits stay block aligned); full bs 8 + Mamba bs 4 -> False (Mamba not coarser)."""
        if len(self.groups) == 1 or not self.enable_caching:
            return False
        h = self.hash_block_size
        # with decode context parallelism a Mamba group of the hash block size counts too
        least = h if self.dcp_world_size > 1 else h + 1
        mamba_coarse = any(isinstance(s, MambaSpec) and s.block_size >= least for s in self.specs)
        others_ok = all(
            s.block_size == h
            or isinstance(s, (FullAttentionSpec, MambaSpec))
            or not s.prefix_cacheable
            for s in self.specs
        )
        return mamba_coarse and others_ok

    @cached_property
    def cache_hit_alignment(self) -> int:
        """Hit lengths are multiples of this: the LCM of the group block sizes (the
        block size itself with one group), or the hash block size when partial hits are
        enabled. Example: bs 16 and 32 -> 32; bs 16 -> 16; full bs 4 + Mamba bs 8 -> 4."""
        if self.partial_hits_enabled:
            return self.hash_block_size
        return self.scheduler_block_size

    def admission_in_flight_tokens(self) -> int:
        return (
            self.max_model_len if self.max_in_flight_tokens is None else self.max_in_flight_tokens
        )

    def blocks_per_request(self) -> int:
        """Blocks one request of ``max_model_len`` tokens can pin, summed over groups."""
        ift = self.admission_in_flight_tokens()
        return sum(
            cdiv(g.spec.max_memory_usage_bytes(self.max_model_len, ift), g.spec.page_size_bytes)
            for g in self.groups
        )

    def max_concurrency(self) -> float:
        """``num_blocks / sum_g cdiv(max_mem_g, page_g)`` (spec 2.7)."""
        return self.num_blocks / self.blocks_per_request()

    def describe(self) -> str:
        parts = []
        for gid, g in enumerate(self.groups):
            s = g.spec
            extra = ""
            if hasattr(s, "sliding_window"):
                extra = f" w={s.sliding_window}"
            elif hasattr(s, "attention_chunk_size"):
                extra = f" C={s.attention_chunk_size}"
            elif isinstance(s, MambaSpec):
                extra = _mamba_settings(s)
            elif hasattr(s, "rswa_window"):
                extra = f" W={s.rswa_window}"
            eagle = "*" if g.is_eagle_group else ""
            parts.append(f"g{gid}{eagle}:{s.type_name}(bs={s.block_size}{extra})")
        retention = ""
        if self.prefix_cache_retention_interval is not None:
            retention = f" retention={self.prefix_cache_retention_interval}"
        if self.use_eagle:
            retention += " eagle"
        if self.num_hash_lookahead_tokens:
            retention += f" lookahead_hashes={self.num_hash_lookahead_tokens}"
        if self.dcp_world_size > 1:
            retention += f" dcp={self.dcp_world_size}"
        if self.pcp_world_size > 1:
            retention += f" pcp={self.pcp_world_size}"
        return (
            f"{' '.join(parts)} num_blocks={self.num_blocks} "
            f"max_model_len={self.max_model_len} caching={self.enable_caching}{retention}"
        )


def _mamba_settings(spec: MambaSpec) -> str:
    """A Mamba group's settings other than the defaults, for :meth:`KVCacheLayout.describe`.
    Example: mode "none" with 2 speculative blocks -> ``" mode=none spec=2"``; a
    checkpoint block of alignment 1 -> ``" ckpt=1/1"``; the defaults -> ``""``."""
    out = ""
    if not spec.is_align:
        out += f" mode={spec.mamba_cache_mode}"
    if spec.num_speculative_blocks:
        out += f" spec={spec.num_speculative_blocks}"
    if spec.num_prefill_checkpoint_blocks or spec.prefill_checkpoint_alignment is not None:
        out += f" ckpt={spec.num_prefill_checkpoint_blocks}/{spec.prefill_checkpoint_alignment}"
    return out


def _check_layout_fields(layout: KVCacheLayout) -> None:
    """Types first: ``num_blocks=16.0`` or ``enable_caching="yes"`` name the field."""
    owner, err = "KVCacheLayout", InvalidLayoutError
    if not isinstance(layout.groups, tuple) or not all(
        isinstance(g, KVCacheGroup) for g in layout.groups
    ):
        raise err(f"{owner}.groups must be a tuple of KVCacheGroup, got {layout.groups!r}")
    require_int(err, owner, "num_blocks", layout.num_blocks)
    require_int(err, owner, "max_model_len", layout.max_model_len)
    require_bool(err, owner, "enable_caching", layout.enable_caching)
    if layout.max_in_flight_tokens is not None:
        require_int(err, owner, "max_in_flight_tokens", layout.max_in_flight_tokens, lowest=1)
    if not isinstance(layout.name, str):
        raise err(f"{owner}.name must be a string, got {layout.name!r}")


def _check_mamba_groups(layout: KVCacheLayout) -> None:
    """vLLM 0.33 builds every Mamba group from one cache config: one caching mode and one
    speculative block count for all of them, and mode ``"none"`` only with prefix caching
    off (its Mamba manager asserts it) and a block of at least ``max_model_len`` tokens
    (the state lives in the row's first block). Example: a Mamba group in mode
    ``"none"`` in a layout with ``enable_caching=True`` is refused."""
    mambas = [s for s in layout.specs if isinstance(s, MambaSpec)]
    if not mambas:
        return
    modes = {s.mamba_cache_mode for s in mambas}
    counts = {s.num_speculative_blocks for s in mambas}
    if len(modes) > 1 or len(counts) > 1:
        raise InvalidLayoutError(
            "KVCacheLayout.groups: every Mamba group must have the same mamba_cache_mode and "
            f"num_speculative_blocks (one cache config), got modes {sorted(modes)} and "
            f"speculative blocks {sorted(counts)}"
        )
    if modes == {"none"} and layout.enable_caching:
        raise InvalidLayoutError(
            "KVCacheLayout.groups: a Mamba group in mamba_cache_mode 'none' needs "
            "enable_caching=False (Mamba prefix caching requires 'align')"
        )
    if modes == {"none"} and any(s.block_size < layout.max_model_len for s in mambas):
        raise InvalidLayoutError(
            "KVCacheLayout.groups: a Mamba group in mamba_cache_mode 'none' keeps its state "
            "in one block: its block_size must be >= max_model_len "
            f"{layout.max_model_len} (vLLM sets it to max_model_len), got "
            f"{sorted(s.block_size for s in mambas)}"
        )


def draft_token_limit(layout: KVCacheLayout) -> int | None:
    """The most draft tokens a step of ``layout`` may schedule: the speculative block
    count of its Mamba groups (vLLM sizes them by the speculative token count), None (no
    limit) without a Mamba group. Example: full + Mamba with 2 speculative blocks -> 2;
    full attention alone -> None."""
    counts = [s.num_speculative_blocks for s in layout.specs if isinstance(s, MambaSpec)]
    return min(counts) if counts else None


def check_context_parallel(layout: KVCacheLayout) -> None:
    """Context parallelism, as vLLM 0.33 takes it (``dcp_world_size``, ``pcp_world_size``
    >= 1).

    Decode context parallelism (DCP, size ``d``) shards each attention block's tokens over
    ``d`` ranks: at the manager level a block of an attention group holds ``d`` times the
    tokens of one rank's block, and every rule (hits, allocation, caching, the scheduler
    and hash block sizes) works on that size. The block sizes of this layout are those
    manager block sizes: an attention group's must be a multiple of ``d`` (vLLM's spec
    holds ``block_size / d``); a Mamba group keeps its state whole on every rank (not
    sharded, not scaled). vLLM allows DCP with full-attention and Mamba groups only (a
    sliding-window or chunked-local hit search asserts ``d == 1``). Prefill context
    parallelism (``p > 1``) needs every group full attention and changes no manager rule.

    Example: full attention of (manager) block size 8 + Mamba of 8 with ``d = 2``: vLLM's
    full spec has block size 4, its manager 8; hash block and scheduler block 8; with ``d
    > 1`` a Mamba group of the hash block size already enables partial hits.
    """
    owner, err = "KVCacheLayout", InvalidLayoutError
    require_int(err, owner, "dcp_world_size", layout.dcp_world_size, lowest=1)
    require_int(err, owner, "pcp_world_size", layout.pcp_world_size, lowest=1)
    d = layout.dcp_world_size
    if d > 1:
        for gid, s in enumerate(layout.specs):
            if not isinstance(s, (FullAttentionSpec, MambaSpec)):
                raise err(
                    f"{owner}.dcp_world_size {d}: groups[{gid}] is {s.type_name}; decode "
                    "context parallelism takes full-attention and Mamba groups only"
                )
            if isinstance(s, FullAttentionSpec) and s.block_size % d:
                raise err(
                    f"{owner}.dcp_world_size {d}: groups[{gid}] block_size {s.block_size} is "
                    "not a multiple of it (it is the manager's block size: d ranks' blocks)"
                )
    if layout.pcp_world_size > 1 and not all(
        isinstance(s, FullAttentionSpec) for s in layout.specs
    ):
        raise err(
            f"{owner}.pcp_world_size {layout.pcp_world_size}: prefill context parallelism "
            "takes full-attention groups only"
        )


def merge_key(spec: KVCacheSpec) -> KVCacheSpec:
    """Specs that are equal group together; the spec itself is the bucket key."""
    return spec


def unify_page_sizes(specs: Sequence[KVCacheSpec]) -> list[KVCacheSpec]:
    """Make every page the size of the largest one (rule 2 of the module docstring).

    Example: full(head 64) + SWA(head 32), both bs 16 -> the SWA block size doubles
    to 32. Full(head 64) + SWA(head 96): the full page is padded to the SWA page.
    """
    target = max(s.page_size_bytes for s in specs)
    out: list[KVCacheSpec] = []
    for s in specs:
        page = s.page_size_bytes
        if page == target:
            out.append(s)
        elif isinstance(s, MambaSpec):
            out.append(s.with_padded_page(target))
        elif isinstance(s, AttentionSpec) and s.page_size_padded is None and target % page == 0:
            out.append(s.with_block_size(s.block_size * (target // page)))
        elif isinstance(s, AttentionSpec):
            out.append(s.with_padded_page(target))
        else:
            raise InvalidLayoutError(
                f"page size {page} of {type(s).__name__} cannot be unified with {target}"
            )
    return out


def group_layers(layer_specs: Mapping[str, KVCacheSpec]) -> tuple[KVCacheGroup, ...]:
    """Group layers into KV cache groups (hybrid allocator on).

    Check values (spec 2.6): 3 full + 7 SWA -> group size 3 ->
    ``(l1,l2,l3), (l4,l7,l10), (l5,l8), (l6,l9)``; 6 full + 5 SWA -> 6 < 1.5*5 ->
    group size 6 -> ``(l1..l6), (l7..l11)``.
    """
    if not layer_specs:
        raise InvalidLayoutError("layer_specs must name at least one layer, got {}")
    names = list(layer_specs)
    specs = [layer_specs[n] for n in names]
    if len(set(specs)) == 1:
        return (KVCacheGroup(tuple(names), specs[0]),)
    specs = unify_page_sizes(specs)
    buckets: dict[KVCacheSpec, list[str]] = {}
    for name, spec in zip(names, specs):
        buckets.setdefault(merge_key(spec), []).append(name)
    sizes = [len(v) for v in buckets.values()]
    lo, hi = min(sizes), max(sizes)
    group_size = hi if hi < 1.5 * lo else lo
    groups: list[KVCacheGroup] = []
    for spec, layers in buckets.items():
        k = cdiv(len(layers), group_size)
        for i in range(k):
            groups.append(KVCacheGroup(tuple(layers[i::k]), spec))
    return tuple(groups)


def num_blocks_for_memory(groups: Sequence[KVCacheGroup], memory_bytes: int) -> int:
    """``num_blocks = memory // bytes_per_block``, ``bytes_per_block = page * max layers``.

    With uniform pages each block id costs one page per layer of the largest group:
    2 full layers and 64 pages of memory -> 32 blocks; one full and one SWA group of
    one layer each with the same memory -> 64 blocks.
    """
    page = max(g.spec.page_size_bytes for g in groups)
    bytes_per_block = page * max(len(g.layer_names) for g in groups)
    return memory_bytes // bytes_per_block
