"""Hypothesis strategies: layouts, prompts and whole traces (docs/spec.md §11).

Building blocks, smallest first (each is a ``SearchStrategy``):

* ``token_ids()``, ``cache_salts()``, ``lora_names()``: a small vocabulary
  (``0..VOCAB_SIZE-1``) so that equal content behind different prefixes happens;
  salts from ``{None, "s1"}``; LoRA names from ``{None, "lora-a"}`` (rare).
* ``windows(bs)`` / ``chunk_sizes(bs)``: sizes in every category of
  :func:`window_category` (1, smaller than a block, one block, not a multiple,
  many blocks).
* ``specs(bs)``: one full / sliding-window / chunked-local / Mamba spec.
* ``layouts(...)``: 1 to 6 groups in any order, block sizes 1..32 with
  ``lcm <= 64``, pools from tiny to roomy; always a valid ``KVCacheLayout``.
  Shrinks toward one full-attention group with block size 1.
* ``preset_layouts(...)``: a model preset (:mod:`properties.generate.presets`) with windows
  scaled down so that they slide within a short trace.
* ``prefix_pools(layout)``, ``prompts(layout, pool)``, ``request_inputs(...)``:
  prompts made of a shared prefix (possibly cut short) plus a random suffix.
* ``token_budgets(layout)``, ``lookaheads(layout)``, ``step_ops(layout)``,
  ``abort_ops(ids)``, ``preempt_ops(ids)``, ``reset_ops()``: single operations,
  for the stateful machine's rules.
* ``operations(layout)``: a whole trace body; ``traces()``: a whole ``Trace``.

Worked example of the block-size rule: sizes ``(16, 4)`` give ``lcm = 16`` and
``gcd = 4``; a Mamba group in that layout gets block size 4 (= hash block size),
so partial prefix hits stay disabled as the layout requires.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

from properties.core.constants import SPEC_KINDS
from properties.core.modes import PRODUCTION_SETTINGS, ServingMode
from properties.core.trace import (
    Abort,
    Arrive,
    Operation,
    Preempt,
    ResetPrefixCache,
    Step,
    Trace,
)
from properties.generate.presets import PRESETS
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

#: Token ids are drawn from ``range(VOCAB_SIZE)``.
VOCAB_SIZE = 8
#: Largest block size of one group.
MAX_BLOCK_SIZE = 32
#: Largest ``lcm`` of the group block sizes (the scheduler block size).
MAX_LCM = 64
#: The categories of :func:`window_category`.
WINDOW_CATEGORIES = ("one", "sub_block", "one_block", "non_multiple", "multi_block")
#: Presets in shrinking order (fewest, simplest groups first).
PRESET_ORDER = ("mistral-7b", "gpt-oss", "gemma2", "gemma3", "llama4-scout", "qwen3-next", "jamba")
#: Mamba state tensor shape used by generated layouts (64 bytes at 2 bytes each).
_MAMBA_SHAPES = ((4, 8),)


# ---------------------------------------------------------------------------
# Tokens and request extras


def token_ids() -> st.SearchStrategy[int]:
    """A token id in ``0..VOCAB_SIZE-1``."""
    return st.integers(0, VOCAB_SIZE - 1)


def cache_salts() -> st.SearchStrategy[str | None]:
    """``None`` three times out of four, else ``"s1"``."""
    return st.sampled_from((None, None, None, "s1"))


def lora_names() -> st.SearchStrategy[str | None]:
    """``None`` seven times out of eight, else ``"lora-a"``."""
    return st.sampled_from((None,) * 7 + ("lora-a",))


def random_tokens(seed: int, length: int) -> tuple[int, ...]:
    """``length`` tokens from ``random.Random(seed)``: compact to draw, deterministic.

    Drawing one seed instead of ``length`` integers keeps long prompts within
    Hypothesis's buffer; ``seed`` shrinks to 0.
    """
    rng = random.Random(seed)
    return tuple(rng.randrange(VOCAB_SIZE) for _ in range(length))


_seeds = st.integers(0, 2**16 - 1)


def _reused(factory):
    """One strategy object per distinct arguments of ``factory`` (a function returning a
    strategy): Hypothesis validates a strategy object and computes its properties (is it
    empty, its label: for a lambda, from its source) on its first draw, and the stateful
    machine draws prompts, outputs, pools and specs thousands of times from factories
    called anew each time. What is drawn is the same: a strategy's draws depend on its
    definition and arguments, never on which object it is. Unhashable arguments (a list)
    build a new object as before. Example: ``outputs(layout, 31) is outputs(layout, 31)``.
    """
    memo = functools.lru_cache(maxsize=4096)(factory)

    @functools.wraps(factory)
    def reused(*args, **kwargs):
        try:
            return memo(*args, **kwargs)
        except TypeError as exc:
            if "unhashable" not in str(exc):
                raise
            return factory(*args, **kwargs)

    return reused


@functools.lru_cache(maxsize=4096)
def _sampled_list(values: tuple) -> st.SearchStrategy:
    """``st.sampled_from(list(values))``, one object per ``values``: the list form (its
    label is computed element by element, unlike a tuple's) as the strategies drew it."""
    return st.sampled_from(list(values))


@functools.lru_cache(maxsize=4096)
def _integers_either(low: tuple[int, int], high: tuple[int, int]) -> st.SearchStrategy[int]:
    """``st.one_of(st.integers(*low), st.integers(*high))``, one object per bounds."""
    return st.one_of(st.integers(*low), st.integers(*high))


# ---------------------------------------------------------------------------
# Windows, chunks, specs


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


# ---------------------------------------------------------------------------
# Layouts


@_reused
@st.composite
def block_size_lists(draw, num_groups: int) -> list[int]:
    """``num_groups`` block sizes in ``1..MAX_BLOCK_SIZE`` with ``lcm <= MAX_LCM``.

    A quarter of the time every group shares one size (mixed sizes are where hybrid
    alignment bugs live). Otherwise each next size is drawn
    from the sizes that keep the running lcm within bounds: after 16, size 12 fits
    (lcm 48) but 5 does not (lcm 80 > 64).
    """
    first = draw(st.integers(1, MAX_BLOCK_SIZE))
    if draw(st.integers(0, 3)) == 0:
        return [first] * num_groups
    sizes = [first]
    running = first
    for _ in range(num_groups - 1):
        fits = [d for d in range(1, MAX_BLOCK_SIZE + 1) if math.lcm(running, d) <= MAX_LCM]
        size = draw(_sampled_list(tuple(fits)))
        running = math.lcm(running, size)
        sizes.append(size)
    return sizes


def _blocks_one_request_needs(layout: KVCacheLayout) -> int:
    return layout.blocks_per_request()


@_reused
@st.composite
def pool_sizes(
    draw, layout: KVCacheLayout, min_blocks: int = 5, max_blocks: int | None = None
) -> int:
    """``num_blocks`` from tiny to roomy for ``layout``.

    ``need`` = blocks one request of ``max_model_len`` tokens pins (summed over
    groups). Tiny pools hold ``need + 1 .. 2 * need + 2`` blocks (one full-length
    request fits, two do not: eviction and ``None`` allocations); roomy pools up
    to ``8 * need``. Never below ``min_blocks``; ``max_blocks`` caps everything
    (then even one request may not fit).
    """
    if max_blocks is not None and max_blocks < max(2, min_blocks):
        raise ValueError(
            f"pool_sizes(max_blocks=...) must be >= max(2, min_blocks={min_blocks}), "
            f"got {max_blocks}"
        )
    need = _blocks_one_request_needs(layout)
    lo = max(min_blocks, need + 1)
    hi_tiny = max(lo, 2 * need + 2)
    hi_roomy = max(hi_tiny, 8 * need)
    if max_blocks is not None:
        lo, hi_tiny, hi_roomy = (min(v, max_blocks) for v in (lo, hi_tiny, hi_roomy))
    return draw(_integers_either((lo, hi_tiny), (hi_tiny, hi_roomy)))


@st.composite
def layouts(
    draw,
    max_groups: int = 6,
    min_blocks: int = 5,
    max_blocks: int | None = None,
    max_len: int = 256,
    kinds: Sequence[str] = SPEC_KINDS,
    enable_caching: bool = True,
    group_kinds: Sequence[str] | None = None,
    block_sizes: Sequence[int] | None = None,
    window_sizes: Sequence[int] | None = None,
) -> KVCacheLayout:
    """A valid ``KVCacheLayout`` of 1..``max_groups`` groups of the given ``kinds``.

    The larger scale tiers (:class:`ScaleTier`) pass ``group_kinds`` (exactly these
    groups, in this order), ``block_sizes`` (each group's size drawn from them) and
    ``window_sizes`` (windows and chunks drawn from them); left at ``None`` (the small
    tier) nothing else is drawn, so the small tier's stream is today's.

    Rules: group kinds in any order (interleaved); block sizes from
    :func:`block_size_lists`; each Mamba group gets block size ``gcd`` of all sizes
    (= hash block size, so no partial hits), each chunked-local group of a multi-group
    layout the lcm (vLLM requires it); every page is ``64 * lcm`` bytes
    (attention head size ``16 * lcm / bs``, Mamba padded) as after vLLM's page
    unification; ``max_model_len`` in ``[lcm, max(lcm, max_len)]``; ``num_blocks``
    from :func:`pool_sizes`. Shrinks toward one full group with block size 1.
    """
    if max_groups < 1:
        raise ValueError(f"layouts(max_groups=...) must be >= 1, got {max_groups}")
    unknown = [k for k in kinds if k not in SPEC_KINDS]
    if not kinds or unknown:
        raise ValueError(
            f"layouts(kinds=...) must be a non-empty subset of {SPEC_KINDS}, got {tuple(kinds)!r}"
        )
    # hybrids of 2-4 groups drawn as often as any count (they are where bugs live);
    # still shrinks toward 1 group
    if group_kinds is None:
        num_groups = draw(
            _integers_either((1, max_groups), (min(2, max_groups), min(4, max_groups)))
        )
        group_kinds = draw(
            st.lists(st.sampled_from(tuple(kinds)), min_size=num_groups, max_size=num_groups)
        )
    num_groups = len(group_kinds)
    if block_sizes is None:
        sizes = draw(block_size_lists(num_groups))
    else:
        sizes = [draw(st.sampled_from(tuple(block_sizes))) for _ in group_kinds]
    hash_size = math.gcd(*sizes)
    sizes = [hash_size if k == "mamba" else s for k, s in zip(group_kinds, sizes)]
    lcm = math.lcm(*sizes)
    if num_groups > 1 and enable_caching:
        # vLLM's chunked-local hit search needs the group's block size to be the LCM
        sizes = [lcm if k == "chunked_local" else s for k, s in zip(group_kinds, sizes)]
    page = 64 * lcm
    groups = tuple(
        KVCacheGroup((f"layer.{i}",), draw(_kind_specs(kind, bs, page, window_sizes)))
        for i, (kind, bs) in enumerate(zip(group_kinds, sizes))
    )
    max_model_len = draw(st.integers(lcm, max(lcm, max_len)))
    sizing = KVCacheLayout(
        groups=groups, num_blocks=2, max_model_len=max_model_len, enable_caching=enable_caching
    )
    num_blocks = draw(pool_sizes(sizing, min_blocks, max_blocks))
    return dataclasses.replace(sizing, num_blocks=num_blocks)


#: :func:`preset_layouts`' block sizes, the first the shrink target.
PRESET_BLOCK_SIZES: tuple[int, ...] = (4, 1, 2, 8, 16)


@st.composite
def preset_layouts(
    draw,
    names: Sequence[str] | None = None,
    max_len: int = 256,
    min_blocks: int = 5,
    max_blocks: int | None = None,
    served: bool = False,
    block_sizes: Sequence[int] = PRESET_BLOCK_SIZES,
) -> KVCacheLayout:
    """A preset's layout with a small block size (one of ``block_sizes``, the first the
    shrink target) and windows scaled to a few blocks; dense retention unless ``served``
    (then the retention the family is served with).

    ``scale_windows = max(1, largest window // target)`` with ``target`` drawn in
    ``1..8 * bs``: gemma3 (w=1024) with bs 4 and target 16 gets w = 1024 // 64 = 16.
    """
    chosen = tuple(PRESET_ORDER if names is None else names)
    missing = [n for n in chosen if n not in PRESETS]
    if not chosen or missing:
        raise ValueError(
            f"preset_layouts(names=...) must name presets of {sorted(PRESETS)}, got {chosen!r}"
        )
    preset = PRESETS[draw(st.sampled_from(chosen))]
    block_size = draw(st.sampled_from(tuple(block_sizes)))
    target = draw(st.integers(1, 8 * block_size))
    largest = max(preset.windows, default=1)
    scale = max(1, largest // target)
    max_model_len = draw(st.integers(block_size, max(block_size, max_len)))
    sizing = preset.layout(2, max_model_len, block_size=block_size, scale_windows=scale)
    num_blocks = draw(pool_sizes(sizing, min_blocks, max_blocks))
    # ``served``: the retention the family is served with (sparse); else the textbook
    # dense retention (the production property draws retention on top)
    retention = sizing.prefix_cache_retention_interval if served else None
    return dataclasses.replace(
        sizing, num_blocks=num_blocks, prefix_cache_retention_interval=retention
    )


def retention_intervals(layout: KVCacheLayout) -> st.SearchStrategy[int | None]:
    """A retention interval valid for ``layout``: dense (``None``, the shrink target),
    sparse (``0``) or ``k * S`` for ``k`` in 1..3 (``S`` the scheduler block size; only
    with a sliding-window or Mamba group, as vLLM requires)."""
    sparse_groups = any(isinstance(s, (SlidingWindowSpec, MambaSpec)) for s in layout.specs)
    unit = layout.scheduler_block_size
    if not sparse_groups:
        return st.sampled_from((None, 0))
    return st.sampled_from((None, 0, 0, unit, 2 * unit, 3 * unit))


def _without_chunked_and_mamba(layout: KVCacheLayout) -> KVCacheLayout:
    """``layout`` with its chunked-local and Mamba groups left out (one full-attention
    group of the smallest block size when nothing is left): EAGLE is modelled only
    with full and sliding-window groups."""
    kept = tuple(
        g for g in layout.groups if not isinstance(g.spec, (ChunkedLocalAttentionSpec, MambaSpec))
    )
    if len(kept) == len(layout.groups):
        return layout
    if not kept:
        bs = min(layout.block_sizes)
        kept = (KVCacheGroup(("layer.0",), FullAttentionSpec(block_size=bs)),)
    return dataclasses.replace(layout, groups=kept, name="")


#: Whether a production layout runs EAGLE, drawn from these: two in three when all its
#: groups are full or sliding-window attention, one in four when EAGLE would take its
#: chunked-local or Mamba groups away (:func:`production_layouts`).
_EAGLE_ODDS_PLAIN = (False, True, True)
_EAGLE_ODDS_WITH_CHUNKED_OR_MAMBA = (False, False, False, True)


@st.composite
def production_layouts(
    draw,
    base: st.SearchStrategy[KVCacheLayout],
    max_len: int = 128,
    settings: frozenset[str] = PRODUCTION_SETTINGS,
) -> KVCacheLayout:
    """``base`` with the production settings drawn on top, each with its own draws
    (after the base layout's, so the base stays as it was):

    * EAGLE: ``use_eagle``, the groups flagged as EAGLE groups (none flagged: all
      drop), and lookahead hashes ``L`` in ``{0, 1, 2}``, 0 half the time (``L > 0``
      turns the drop off). EAGLE is modelled without chunked-local and Mamba groups
      (vLLM turns the hybrid manager off with chunked local attention), so such groups
      are left out of an EAGLE layout; it is drawn two times in three on a layout
      without them, one time in four on a layout with them (three in four keep them,
      so they meet the other settings: swarm testing counts pairs);
    * the retention interval (:func:`retention_intervals`);
    * ``max_in_flight_tokens`` (``None``, or 1 or 2 scheduler blocks): the bound of
      the per-request admission caps of windowed groups (the pool is then redrawn
      with those bounds, as vLLM sizes it at startup).

    Only the ``settings`` named (:data:`properties.core.modes.PRODUCTION_SETTINGS`: the
    ones the engine declares) are drawn. Example: gpt-oss (SWA + full) may come out
    sparse, EAGLE on the full group only, ``L = 0``.
    """
    layout = draw(base)
    plain = _without_chunked_and_mamba(layout) is layout
    odds = _EAGLE_ODDS_PLAIN if plain else _EAGLE_ODDS_WITH_CHUNKED_OR_MAMBA
    eagle = "eagle" in settings and draw(st.sampled_from(odds), label="eagle")
    if eagle:
        layout = _without_chunked_and_mamba(layout)
    if "retention" in settings:
        retention = draw(retention_intervals(layout), label="retention interval")
        layout = dataclasses.replace(layout, prefix_cache_retention_interval=retention)
    unit = layout.scheduler_block_size
    in_flight = None
    if "admission_cap" in settings:
        in_flight = draw(
            st.sampled_from((unit, None, 2 * unit, unit)), label="max in-flight tokens"
        )
        layout = dataclasses.replace(layout, max_in_flight_tokens=in_flight)
    if in_flight is not None:
        # a tight pool sized as vLLM sizes it: one request of max_model_len fits with
        # its windowed groups at their admission bound, two do not
        need = _blocks_one_request_needs(layout)
        layout = dataclasses.replace(
            layout,
            num_blocks=draw(st.integers(max(5, need + 1), max(5, 2 * need + 2)), label="pool"),
        )
    if eagle:
        flags = [draw(st.booleans(), label="is_eagle_group") for _ in layout.groups]
        layout = dataclasses.replace(
            layout,
            groups=tuple(
                dataclasses.replace(g, is_eagle_group=f) for g, f in zip(layout.groups, flags)
            ),
            use_eagle=True,
            num_hash_lookahead_tokens=draw(st.sampled_from((0, 1, 0, 2)), label="lookahead hashes"),
        )
    return layout


@st.composite
def small_block_hybrids(draw, max_len: int = 256) -> KVCacheLayout:
    """A hybrid where a windowed group's block size is smaller than the hit alignment.

    One "coarse" group (full attention, or a second sliding window, or nothing) has
    block size ``A`` in ``{4, 8, 16}``; a sliding-window group has ``A / k`` (``k`` in
    ``{2, 4}``), so its hit search must stop at aligned ends and its cached blocks are
    masked per segment; a Mamba group (block size ``gcd``) joins a third of the time.
    Example: full bs 8 + sliding window bs 2 (w 5): alignment 8, the window's hit must
    end on a block whose end is a multiple of 8.
    """
    coarse = draw(st.sampled_from((4, 8, 16)))
    fine = coarse // draw(st.sampled_from((2, 4)))
    partners = (("full",), ("sliding_window",), ("sliding_window", "mamba"), ("full", "mamba"))
    kinds = ["sliding_window", *draw(st.sampled_from(partners))]
    # the partner attention group has the coarse size; Mamba the hash block size
    sizes = [fine, coarse] + [fine] * (len(kinds) - 2)
    if kinds[1] != "sliding_window":  # two windows: the fine one searches first
        order = draw(st.permutations(range(len(kinds))))
        kinds = [kinds[i] for i in order]
        sizes = [sizes[i] for i in order]
    tight = draw(st.booleans())  # eviction takes a segment's blocks tail first
    layout = draw(_layout_of(kinds, sizes, max_len, min_len=2 * coarse))
    # The fine window is either wider than the alignment (every block of a segment is
    # cached, so a hit search can meet a cached block that ends off the alignment) or
    # at most one block past it (only each segment's last block is cached: the mask).
    width = draw(_integers_either((coarse + 1, 3 * coarse), (1, fine + 1)))
    groups = tuple(
        dataclasses.replace(g, spec=dataclasses.replace(g.spec, sliding_window=width))
        if isinstance(g.spec, SlidingWindowSpec) and g.spec.block_size == fine
        else g
        for g in layout.groups
    )
    return draw(_sized(groups, max_len, 2 * coarse, tight_pool=tight))


@st.composite
def _layout_of(
    draw,
    kinds: Sequence[str],
    sizes: Sequence[int],
    max_len: int,
    min_len: int = 1,
    enable_caching: bool = True,
    tight_pool: bool = False,
) -> KVCacheLayout:
    """A layout with these group kinds and block sizes (pages unified as in
    :func:`layouts`); ``tight_pool`` draws only pools that fit about one request."""
    page = 64 * math.lcm(*sizes)
    groups = tuple(
        KVCacheGroup((f"layer.{i}",), draw(_kind_specs(kind, bs, page)))
        for i, (kind, bs) in enumerate(zip(kinds, sizes))
    )
    return draw(_sized(groups, max_len, min_len, enable_caching, tight_pool))


@st.composite
def _sized(
    draw,
    groups: tuple[KVCacheGroup, ...],
    max_len: int,
    min_len: int = 1,
    enable_caching: bool = True,
    tight_pool: bool = False,
) -> KVCacheLayout:
    """``groups`` with a ``max_model_len`` in ``[max(lcm, min_len), max_len]`` and a pool
    from :func:`pool_sizes` (``tight_pool``: room for about one request only)."""
    lcm = math.lcm(*(g.spec.block_size for g in groups))
    low = max(lcm, min(min_len, max_len))
    max_model_len = draw(st.integers(low, max(low, max_len)))
    sizing = KVCacheLayout(
        groups=groups, num_blocks=2, max_model_len=max_model_len, enable_caching=enable_caching
    )
    if tight_pool:
        need = _blocks_one_request_needs(sizing)
        num_blocks = draw(st.integers(max(5, need + 1), max(5, need + 3)))
    else:
        num_blocks = draw(pool_sizes(sizing))
    return dataclasses.replace(sizing, num_blocks=num_blocks)


@st.composite
def tight_pool_layouts(draw, max_len: int = 256) -> KVCacheLayout:
    """One or two groups with a pool that holds about one request: cached blocks must
    be evicted for new ones and hits re-adopted from the free queue (the
    allocation-failure and eviction paths)."""
    kinds = draw(
        st.sampled_from(
            (("full",), ("sliding_window",), ("full", "sliding_window"), ("full", "mamba"))
        )
    )
    bs = draw(st.sampled_from((1, 2, 4)))
    return draw(_layout_of(kinds, [bs] * len(kinds), min(max_len, 48), tight_pool=True))


@st.composite
def chunked_layouts(draw, max_len: int = 256) -> KVCacheLayout:
    """One chunked-local group whose chunk is not a multiple of its block size (the hit
    search must retry from an earlier chunk), alone or beside full attention of the same
    block size. Example: bs 4, chunk 6: a hit search up to 19 starts the chunk at 18,
    inside block 4."""
    bs = draw(st.sampled_from((2, 4, 8)))
    chunk = draw(st.integers(1, 4)) * bs + draw(st.integers(1, bs - 1))
    fields = _attention_fields(bs, 16)
    groups = [
        KVCacheGroup(("layer.0",), ChunkedLocalAttentionSpec(**fields, attention_chunk_size=chunk))
    ]
    if draw(st.booleans()):
        groups.insert(0, KVCacheGroup(("layer.1",), FullAttentionSpec(**fields)))
    return draw(_sized(tuple(groups), max_len, min_len=4 * bs))


def uncached_layouts(max_len: int = 256) -> st.SearchStrategy[KVCacheLayout]:
    """Layouts with prefix caching off (no hits, nothing registered)."""
    return layouts(max_groups=3, max_len=max_len, enable_caching=False)


def targeted_layouts(max_len: int = 256) -> st.SearchStrategy[KVCacheLayout]:
    """Layouts built to reach particular rules on purpose: sliding windows finer than
    the hit alignment, tight pools, prefix caching off."""
    fine = small_block_hybrids(max_len=max_len)
    return st.one_of(
        fine,
        tight_pool_layouts(max_len=max_len),
        fine,
        chunked_layouts(max_len=max_len),
        fine,
        uncached_layouts(max_len=max_len),
    )


def presets_of_kinds(kinds: Sequence[str] = SPEC_KINDS) -> tuple[str, ...]:
    """The presets (in :data:`PRESET_ORDER`) whose layers are all of ``kinds``:
    ``("full", "sliding_window")`` -> mistral-7b, gpt-oss, gemma2, gemma3."""
    return tuple(
        name for name in PRESET_ORDER if {k.kind for k in PRESETS[name].pattern} <= set(kinds)
    )


def any_layouts(
    max_len: int = 256, kinds: Sequence[str] = SPEC_KINDS
) -> st.SearchStrategy[KVCacheLayout]:
    """The scenario mix: generated layouts half the time (drawn first: they shrink
    best), presets and :func:`targeted_layouts` a quarter each.

    ``kinds`` (an engine's ``spec_types``) keeps only layouts made of those spec types:
    generated ones of those kinds, the presets made of them (:func:`presets_of_kinds`)
    and, when sliding windows are among them, the targeted layouts that qualify. With
    all four kinds the mix (and so every derandomized stream) is the unrestricted one.
    """
    if set(SPEC_KINDS) <= set(kinds):
        generated = layouts(max_len=max_len)
        return st.one_of(
            generated, preset_layouts(max_len=max_len), generated, targeted_layouts(max_len)
        )
    generated = layouts(max_len=max_len, kinds=kinds)
    parts = [generated]
    names = presets_of_kinds(kinds)
    if names:
        parts.append(preset_layouts(names=names, max_len=max_len))
    parts.append(generated)
    if "sliding_window" in kinds:
        allowed = set(kinds)
        parts.append(
            targeted_layouts(max_len).filter(
                lambda layout: {s.type_name for s in layout.specs} <= allowed
            )
        )
    return st.one_of(parts)


def connector_modes() -> st.SearchStrategy[ServingMode]:
    """The attention property's modes: synchronous scheduling without a KV connector, or
    with one over the host tier, loading synchronously or asynchronously, asynchronous
    loads failing at times (the content that goes out to the tier and comes back, and
    blocks of a failed load that must not be read, are then checked through attention
    outputs;
    asynchronous scheduling and drafts are not drawn there: their pending tokens are not
    known when a step is planned); shrinks toward no connector."""
    return st.sampled_from(
        (
            ServingMode(),
            ServingMode(external_hits=True),
            ServingMode(external_hits=True, async_loads=True, load_failures=True),
        )
    )


#: The serving mode of a deployed vLLM 0.33 (``--preset`` runs of the production
#: property): asynchronous scheduling, admission gate on (``scheduler_reserve_full_isl``).
PRODUCTION_MODE = ServingMode(async_scheduling=True, admission_gate=True)


# ---------------------------------------------------------------------------
# Prompts and requests


def prompt_lengths(layout: KVCacheLayout, max_len: int) -> st.SearchStrategy[int]:
    """A length in ``1..max_len``: short, near a multiple of the scheduler block size
    (``k * lcm - 1``, ``k * lcm``, ``k * lcm + 1``), near ``max_len``, or anything.

    One strategy object per ``(scheduler block size, max_len)``: the stateful machine
    draws thousands of prompts, and a strategy built anew is validated anew."""
    return _prompt_lengths(layout.scheduler_block_size, max_len)


@functools.lru_cache(maxsize=4096)
def _prompt_lengths(unit: int, max_len: int) -> st.SearchStrategy[int]:
    if max_len < 1:
        raise ValueError(f"prompt_lengths(max_len=...) must be >= 1, got {max_len}")
    near_multiple = st.builds(
        lambda k, d: min(max_len, max(1, k * unit + d)),
        st.integers(1, max(1, max_len // unit)),
        st.integers(-1, 1),
    )
    return st.one_of(
        st.integers(1, min(max_len, 3 * unit)),
        near_multiple,
        st.integers(max(1, max_len - unit), max_len),
        st.integers(1, max_len),
    )


@_reused
@st.composite
def prefix_pools(draw, layout: KVCacheLayout, max_prefixes: int = 3) -> tuple[tuple[int, ...], ...]:
    """1..``max_prefixes`` shared prefixes; later ones may fork an earlier one.

    A fork keeps ``base[:cut]`` and continues differently, so two prompts share a
    prefix and then diverge (possibly inside a block; with lookahead hashes, also inside
    a block's lookahead: :func:`_cuts`).
    """
    limit = layout.max_model_len
    pool: list[tuple[int, ...]] = []
    for _ in range(draw(st.integers(1, max_prefixes))):
        length = draw(prompt_lengths(layout, limit))
        head: tuple[int, ...] = ()
        if pool and draw(st.booleans()):
            base = draw(_sampled_list(tuple(pool)))
            if layout.num_hash_lookahead_tokens:
                unit, lookahead = layout.hash_block_size, layout.num_hash_lookahead_tokens
                cut = draw(_cuts(min(len(base), length), unit, lookahead))
            else:
                cut = draw(st.integers(0, min(len(base), length)))
            head = base[:cut]
        pool.append(head + random_tokens(draw(_seeds), length - len(head)))
    return tuple(pool)


@_reused
@st.composite
def prompts(
    draw,
    layout: KVCacheLayout,
    prefix_pool: Sequence[tuple[int, ...]] = (),
    max_len: int | None = None,
) -> tuple[int, ...]:
    """A prompt of ``1..max_len`` tokens (default ``max_model_len``): half the time a
    pool prefix (whole, or cut anywhere) followed by random tokens."""
    limit = layout.max_model_len if max_len is None else max_len
    length = draw(prompt_lengths(layout, limit))
    head: tuple[int, ...] = ()
    if prefix_pool and draw(st.booleans()):
        prefix = prefix_pool[draw(st.integers(0, len(prefix_pool) - 1))]
        lookahead = layout.num_hash_lookahead_tokens
        cut = draw(_cuts(len(prefix), layout.hash_block_size if lookahead else 0, lookahead))
        head = prefix[: min(cut, length)]
    return head + random_tokens(draw(_seeds), length - len(head))


@functools.lru_cache(maxsize=4096)
def _cuts(length: int, unit: int = 0, lookahead: int = 0) -> st.SearchStrategy[int]:
    """Where to cut a pool prefix: the whole prefix, or anywhere; with ``lookahead``
    hashes (``L`` tokens after a block of ``unit`` tokens are part of its hash) also
    inside a block's lookahead: ``k * unit + d`` with ``0 <= d < L``, so the two
    prompts share block ``k - 1`` but not its whole hash (a hit there is wrong).
    Example: ``unit`` 4, ``L`` 2, a 12-token prefix: 4, 5, 8 or 9 among the cuts."""
    whole_or_any = (st.just(length), st.integers(0, length))
    if not lookahead or length < unit:
        return st.one_of(*whole_or_any)
    edge = st.builds(
        lambda k, d: min(length, k * unit + d),
        st.integers(1, length // unit),
        st.integers(0, lookahead - 1),
    )
    return st.one_of(*whole_or_any, edge)


@functools.lru_cache(maxsize=4096)
def _output_lengths(longest: int, long_cap: int) -> st.SearchStrategy[int]:
    short = st.integers(0, longest)
    return st.one_of(short, short, short, st.integers(0, long_cap))


@_reused
@st.composite
def outputs(draw, layout: KVCacheLayout, max_len: int) -> tuple[int, ...]:
    """The tokens a request will decode: ``0..min(max_len, 2 * lcm + 4)`` tokens, or a
    quarter of the time a long decode of up to ``min(max_len, 24)`` tokens (it crosses
    windows, chunks and Mamba state blocks one token per step)."""
    longest = max(0, min(max_len, 2 * layout.scheduler_block_size + 4))
    length = draw(_output_lengths(longest, max(0, min(max_len, 24))))
    return random_tokens(draw(_seeds), length)


@st.composite
def request_inputs(
    draw, layout: KVCacheLayout, prefix_pool: Sequence[tuple[int, ...]], request_id: str
) -> Arrive:
    """An arrival with ``len(prompt) >= 1`` and ``len(prompt) + len(output) <= max_model_len``."""
    output = draw(outputs(layout, layout.max_model_len - 1))
    prompt = draw(prompts(layout, prefix_pool, layout.max_model_len - len(output)))
    return Arrive(
        request_id=request_id,
        prompt=prompt,
        output=output,
        cache_salt=draw(cache_salts()),
        lora_name=draw(lora_names()),
    )


_RESEND_KINDS = st.sampled_from(("same", "turn", "turn+", "cut"))


@functools.lru_cache(maxsize=4096)
def boundaries(layout: KVCacheLayout, length: int) -> tuple[int, ...]:
    """Cut points ``1..length`` at and next to every group's block boundary and the hit
    alignment. Example: block sizes 2 and 4, length 9 -> 1, 2, 3, 4, 5, 6, 7, 8, 9."""
    sizes = {g.spec.block_size for g in layout.groups} | {layout.cache_hit_alignment}
    cuts = {
        k * bs + d
        for bs in sizes
        for k in range(1, length // bs + 1)
        for d in (-1, 0, 1)
        if 1 <= k * bs + d <= length
    }
    return tuple(sorted(cuts)) or (length,)


@st.composite
def resend_ops(draw, layout: KVCacheLayout, old: Arrive, request_id: str) -> Arrive:
    """An earlier prompt again: a retry (the same prompt), the next turn of a chat (the
    prompt, its output and a few new tokens), or the prompt cut at or next to a block
    boundary (:func:`boundaries`), with the same or another salt."""
    room = layout.max_model_len - len(old.prompt)
    kind = draw(_RESEND_KINDS)
    if kind == "cut" and len(old.prompt) > 1:
        cuts = boundaries(layout, len(old.prompt))
        prompt = old.prompt[: cuts[draw(st.integers(0, len(cuts) - 1))]]
    else:
        extension = {"turn": old.output, "turn+": old.output + (1, 2, 3)}.get(kind, ())
        prompt = old.prompt + extension[: max(0, room - 1)]
    room = layout.max_model_len - len(prompt)
    return Arrive(
        request_id,
        prompt,
        old.output[: max(0, min(room, 4))],
        (old.cache_salt, None, "s2")[draw(st.integers(0, 2))],
        old.lora_name,
    )


def burst_ops(layout: KVCacheLayout, old: Arrive, first_id: int) -> tuple[Arrive, ...]:
    """Two arrivals from ``old``: its prompt cut at the largest multiple of the hit
    alignment below its length, then that cut plus 3 new tokens (the next chat turn).
    Example: alignment 8, a 21-token prompt -> 16 tokens, then those 16 and 3 more.
    Nothing when the prompt is not longer than the alignment."""
    unit = layout.cache_hit_alignment
    cut = (len(old.prompt) - 1) // unit * unit
    if cut < unit or cut + 3 > layout.max_model_len:
        return ()
    first = Arrive(f"r{first_id}", old.prompt[:cut], (), old.cache_salt, old.lora_name)
    turn = old.prompt[:cut] + (1, 2, 3)
    return (first, Arrive(f"r{first_id + 1}", turn, (), old.cache_salt, old.lora_name))


def reload_ops(layout: KVCacheLayout, old: Arrive, first_id: int) -> tuple[Arrive, ...]:
    """Two arrivals from ``old`` for a KV connector (external hits): the first half of
    the aligned blocks of its prompt and output, then its prompt, output and 3 new
    tokens (the next chat turn). Scheduled in one step after the device cache was reset,
    the first computes the head on the device and the second's hit combines that head
    with the rest of ``old``'s computed tokens from the host tier. Example: alignment 4,
    a 17-token prompt and 4 output tokens (5 aligned blocks) -> 8 tokens, then 24.
    Nothing when there are fewer than two aligned blocks."""
    unit = layout.cache_hit_alignment
    seen = old.prompt + old.output
    blocks = (len(seen) - 1) // unit
    if blocks < 2 or len(seen) + 3 > layout.max_model_len:
        return ()
    head = Arrive(f"r{first_id}", seen[: blocks // 2 * unit], (), old.cache_salt, old.lora_name)
    turn = seen + (1, 2, 3)
    return (head, Arrive(f"r{first_id + 1}", turn, (), old.cache_salt, old.lora_name))


# ---------------------------------------------------------------------------
# Single operations


@_reused
def token_budgets(layout: KVCacheLayout) -> st.SearchStrategy[int]:
    """A step's token budget: ``max_model_len`` (the shrink target), 1 to a few
    scheduler blocks (chunked prefill, drawn twice as often), or anything up to
    ``2 * max_model_len``."""
    small = st.integers(1, 3 * layout.scheduler_block_size)
    return st.one_of(
        st.just(layout.max_model_len),
        small,
        small,
        st.integers(1, 2 * layout.max_model_len),
    )


@_reused
def lookaheads(layout: KVCacheLayout) -> st.SearchStrategy[int]:
    """Speculative lookahead slots: 0 mostly, 1..4 sometimes; always 0 with a Mamba
    group (its spec has no speculative blocks)."""
    if any(isinstance(s, MambaSpec) for s in layout.specs):
        return st.just(0)
    return st.sampled_from((0, 0, 0, 0, 1, 2, 3, 4))


@_reused
def step_ops(layout: KVCacheLayout) -> st.SearchStrategy[Step]:
    return st.builds(Step, token_budgets(layout), lookaheads(layout))


def abort_ops(request_ids: Sequence[str]) -> st.SearchStrategy[Abort]:
    """Abort one of ``request_ids`` (must be non-empty)."""
    return st.sampled_from(tuple(request_ids)).map(Abort)


def preempt_ops(request_ids: Sequence[str]) -> st.SearchStrategy[Preempt]:
    """Preempt one of ``request_ids`` (must be non-empty)."""
    return st.sampled_from(tuple(request_ids)).map(Preempt)


def reset_ops() -> st.SearchStrategy[ResetPrefixCache]:
    return st.just(ResetPrefixCache())


_OP_CHOICES = (
    "step",
    "arrive",
    "step",
    "step",
    "arrive",
    "step",
    "preempt",
    "abort",
    "reset_prefix_cache",
)


@st.composite
def operations(
    draw, layout: KVCacheLayout, max_ops: int = 40, max_requests: int = 8
) -> tuple[Operation, ...]:
    """A whole trace body: ``Arrive("r0", ...)`` first, then ``1..max_ops`` ops in all.

    Arrivals are named ``r0, r1, ...`` in order (at most ``max_requests``);
    ``Abort``/``Preempt`` name an arrived, not yet aborted id (it may have finished
    or be waiting). Steps outnumber the other operations. The result always passes
    :func:`properties.core.trace.validate_references`.
    """
    if max_ops < 1 or max_requests < 1:
        raise ValueError(
            f"operations(max_ops={max_ops}, max_requests={max_requests}) must both be >= 1"
        )
    pool = draw(prefix_pools(layout))
    count = draw(st.integers(1, max_ops))
    ops: list[Operation] = [draw(request_inputs(layout, pool, "r0"))]
    num_arrived = 1
    live = ["r0"]  # arrived and not aborted
    for _ in range(count - 1):
        kind = draw(st.sampled_from(_OP_CHOICES))
        if kind == "arrive" and num_arrived < max_requests:
            request_id = f"r{num_arrived}"
            ops.append(draw(request_inputs(layout, pool, request_id)))
            num_arrived += 1
            live.append(request_id)
        elif kind == "preempt" and live:
            ops.append(draw(preempt_ops(live)))
        elif kind == "abort" and live:
            op = draw(abort_ops(live))
            live.remove(op.request_id)
            ops.append(op)
        elif kind == "reset_prefix_cache":
            ops.append(ResetPrefixCache())
        else:
            ops.append(draw(step_ops(layout)))
    return tuple(ops)


@st.composite
def traces(
    draw, layout_strategy: st.SearchStrategy[KVCacheLayout] | None = None, max_ops: int = 40
) -> Trace:
    """A ``Trace`` (no seed, nothing observed) over generated or preset layouts."""
    layout = draw(any_layouts() if layout_strategy is None else layout_strategy)
    return Trace(layout=layout, operations=draw(operations(layout, max_ops=max_ops)))


# ---------------------------------------------------------------------------
# Scale tiers and swarm testing (issue 18)


#: Every window and chunk size of the model presets, unscaled (gemma3's 1024,
#: gpt-oss's 128, llama4-scout's 8192 chunks, ...): the production tier's windows.
PRESET_WINDOWS: tuple[int, ...] = tuple(sorted({w for p in PRESETS.values() for w in p.windows}))


#: The trace shapes of a large tier (:attr:`ScaleTier.workload`).
ONLINE, OFFLINE_WORKLOAD = WORKLOADS = ("online", "offline")


@dataclass(frozen=True)
class ScaleTier:
    """The bounds of one scale tier of generated examples.

    ``max_len`` bounds ``max_model_len`` (and so the prompts); the pool holds
    ``min_blocks..max_blocks`` blocks; at most ``max_requests`` requests arrive (in bulk:
    :func:`bulk_arrivals`); a trace has at most ``max_steps`` operations after its first
    bulk arrival; a step's token budget is one of ``token_budgets``; group block sizes
    come from ``block_sizes`` and windows and chunks from ``window_sizes`` (``None``:
    the small tier's own draws). The small tier is run by the stateful machine with
    today's strategies, unchanged: its entry records those bounds
    (``CheckConfig.max_len``, ``layouts()``'s pools, ``operations()``'s 8 requests).
    ``workload`` is the shape of a trace (:func:`tier_operations`): ``"online"``
    (arrivals, aborts, preemptions and resets between steps) or ``"offline"``
    (:func:`offline_operations`: one batch at once, then steps only).
    Example: ``TIERS["medium"].max_requests == 64``.
    """

    name: str
    max_len: int
    min_blocks: int
    max_blocks: int | None
    max_requests: int
    max_steps: int
    token_budgets: tuple[int, ...] | None = None
    block_sizes: tuple[int, ...] | None = None
    window_sizes: tuple[int, ...] | None = None
    workload: str = ONLINE

    def __post_init__(self) -> None:
        if self.max_len < 1 or self.min_blocks < 2 or self.max_requests < 1:
            raise ValueError(f"ScaleTier {self.name!r}: bounds must be positive, got {self!r}")
        if self.workload not in WORKLOADS:
            raise ValueError(
                f"ScaleTier {self.name!r}: workload must be one of {', '.join(WORKLOADS)}, "
                f"got {self.workload!r}"
            )
        if self.max_blocks is not None and self.max_blocks < self.min_blocks:
            raise ValueError(f"ScaleTier {self.name!r}: max_blocks < min_blocks")


#: The tier names, smallest first (``offline`` is at the medium scale). (The first three
#: are written as one string from the time Hypothesis mixed the source's short literals
#: into its derandomized streams; :mod:`properties.runner.profiles` now pins that pool to
#: an empty one, so a new literal moves no stream.)
SMALL, MEDIUM, PRODUCTION = tuple("small medium production".split())  # noqa: SIM905
OFFLINE = "offline"
TIER_NAMES: tuple[str, ...] = (SMALL, MEDIUM, OFFLINE, PRODUCTION)

_MEDIUM_TIER = ScaleTier(
    MEDIUM,
    max_len=2**13,  # 8192
    min_blocks=256,
    max_blocks=4096,
    max_requests=64,
    max_steps=24,
    token_budgets=(2**9, 2**11, 2**13),  # 512, 2048, 8192
    block_sizes=(4, 8, 16, 32),
)
TIERS: dict[str, ScaleTier] = {
    SMALL: ScaleTier(
        SMALL, max_len=128, min_blocks=5, max_blocks=None, max_requests=8, max_steps=40
    ),
    MEDIUM: _MEDIUM_TIER,
    # an offline batch (a list of prompts handed to the engine at once) at the medium
    # scale: up to 128 requests prefilled in waves or, with a budget that holds the whole
    # batch, in one step, then decoding in lock step (the engine's many-item paths), with
    # steps for outputs of up to OFFLINE_OUTPUT tokens
    OFFLINE: dataclasses.replace(
        _MEDIUM_TIER,
        name=OFFLINE,
        max_requests=128,
        max_steps=96,
        token_budgets=(2**11, 2**13, 2**15),  # 2048, 8192, 32768
        workload=OFFLINE_WORKLOAD,
    ),
    PRODUCTION: ScaleTier(
        PRODUCTION,
        max_len=2**17,  # 131072
        min_blocks=10**4,
        max_blocks=10**5,
        max_requests=4096,
        max_steps=24,
        token_budgets=(2**13, 2**14, 2**15),  # 8192, 16384, 32768
        block_sizes=(16, 32, 64),
        window_sizes=PRESET_WINDOWS,
    ),
}
#: The tiers run after the small one, in order.
LARGE_TIERS: tuple[str, ...] = (MEDIUM, OFFLINE, PRODUCTION)


def tier(name: str) -> ScaleTier:
    """The tier called ``name``; a clear error for an unknown one."""
    if name not in TIERS:
        raise ValueError(f"unknown scale tier {name!r}; known: {', '.join(TIERS)}")
    return TIERS[name]


#: The scheduling feature of a swarm mode: synchronous, asynchronous, or synchronous with
#: draft tokens (drafts with asynchronous scheduling are not modelled, so the two are
#: levels of one feature rather than two switches that would cancel each other); listed
#: with repeats so that asynchronous scheduling and drafts come with two examples in five
#: each (a derandomized stream draws the first entry, its shrink target, more often).
SCHEDULING: tuple[str, ...] = ("sync", "async", "drafts", "async", "drafts")
#: The connector feature of a swarm mode, by level: 0 none, 1 external hits loaded
#: synchronously, 2 loaded asynchronously, 3 asynchronous loads that may fail (each level
#: needs the one before it); failing loads in a third of the draws.
CONNECTOR_LEVELS: tuple[int, ...] = (0, 1, 2, 3, 3, 2)


def swarm_modes() -> st.SearchStrategy[ServingMode]:
    """Swarm testing of the serving modes, at every tier (the small tier's production
    property and the large tiers): each feature is drawn independently of the others,
    scheduling (:data:`SCHEDULING`), the admission gate (half), the draft count (2, 3 or
    4, used with ``drafts``) and the connector level (:data:`CONNECTOR_LEVELS`).
    Features that need one another are levels of one draw, so no switch is wasted: load
    failures come with a third of the examples, drafts with external hits with a third.
    Shrinks toward the synchronous, ungated mode without a connector. Example:
    ``drafts``, gate, 3, level 3 -> ``ServingMode(admission_gate=True,
    num_draft_tokens=3, external_hits=True, async_loads=True, load_failures=True)``."""
    return st.builds(
        _levelled_mode,
        st.sampled_from(SCHEDULING),
        st.booleans(),
        st.sampled_from((2, 3, 4)),
        st.sampled_from(CONNECTOR_LEVELS),
    )


def _levelled_mode(scheduling: str, gate: bool, drafts: int, connector: int) -> ServingMode:
    """The mode of one swarm draw (:func:`swarm_modes`); connector levels count up:
    ``connector >= 1`` external hits, ``>= 2`` asynchronous loads, ``3`` failures."""
    return _valid_mode(
        scheduling == "async",
        gate,
        drafts if scheduling == "drafts" else 0,
        connector >= 1,
        connector >= 2,
        connector >= 3,
    )


def _valid_mode(
    async_scheduling: bool, gate: bool, drafts: int, external: bool, loads: bool, fails: bool
) -> ServingMode:
    loads = loads and external
    return ServingMode(
        async_scheduling=async_scheduling,
        admission_gate=gate,
        num_draft_tokens=0 if async_scheduling else drafts,
        external_hits=external,
        async_loads=loads,
        load_failures=fails and loads,
    )


def mode_for_layout(mode: ServingMode, layout: KVCacheLayout) -> ServingMode:
    """``mode`` without what a layout with a Mamba group does not model (external hits
    and drafts: no loaded or speculative Mamba states)."""
    if not any(isinstance(s, MambaSpec) for s in layout.specs):
        return mode
    return dataclasses.replace(
        mode, num_draft_tokens=0, external_hits=False, async_loads=False, load_failures=False
    )


@st.composite
def swarm_layouts(draw, scale: ScaleTier, kinds: Sequence[str] = SPEC_KINDS) -> KVCacheLayout:
    """A layout of tier ``scale`` whose group types are switched on independently (each of
    ``kinds``, at least one; full attention when none is drawn), with pool pressure as a
    feature too. A tier with a ``max_blocks`` bound (medium, offline, production): under pressure
    the pool holds ``min_blocks..2 * min_blocks`` blocks, else up to ``max_blocks``. The
    small tier (no bound; pools are sized by the request, :func:`pool_sizes`): under
    pressure the pool holds one request of ``max_model_len`` but not two
    (``need + 1..2 * need`` blocks, at least ``min_blocks``), else :func:`pool_sizes`
    draws it, and chunked-local chunks are a multiple of their block size
    (:func:`_chunks_aligned`: every engine takes those; the scenario mix's targeted
    layouts draw the other chunks). Example: production, sliding window and Mamba drawn -> two
    groups (a window from :data:`PRESET_WINDOWS`), block sizes from 16/32/64; small, full
    attention of block size 4 and ``max_model_len`` 32 under pressure -> 9..16 blocks."""
    chosen = [k for k in kinds if draw(st.booleans(), label=f"group {k}")]
    if not chosen:
        chosen = ["full"] if "full" in kinds else [kinds[0]]
    if chosen == ["mamba"]:
        chosen = ["full", "mamba"] if "full" in kinds else chosen
    chosen = list(draw(st.permutations(chosen)))
    pressure = draw(st.booleans())
    if scale.max_blocks is None:
        cap = None
    else:
        cap = min(scale.max_blocks, 2 * scale.min_blocks) if pressure else scale.max_blocks
    layout = draw(
        layouts(
            min_blocks=scale.min_blocks,
            max_blocks=cap,
            max_len=scale.max_len,
            kinds=kinds,
            group_kinds=chosen,
            block_sizes=scale.block_sizes,
            window_sizes=scale.window_sizes,
        )
    )
    if scale.max_blocks is None and "chunked_local" in chosen:
        layout = _chunks_aligned(layout)
    if pressure and scale.max_blocks is None:
        need = _blocks_one_request_needs(layout)
        low = max(scale.min_blocks, need + 1)
        pool = draw(st.integers(low, max(low, 2 * need)), label="pool under pressure")
        layout = dataclasses.replace(layout, num_blocks=pool)
    return layout


def _chunks_aligned(layout: KVCacheLayout) -> KVCacheLayout:
    """``layout`` with every chunked-local chunk rounded up to a multiple of its group's
    block size (as deployed models have them: llama4's 8192 over blocks of 16 to 64; an
    engine may refuse other chunks). Example: chunk 6 over blocks of 4 -> 8; chunk 1 ->
    4; chunk 8 stays 8."""
    groups = tuple(
        dataclasses.replace(
            g,
            spec=dataclasses.replace(
                g.spec,
                attention_chunk_size=-(-g.spec.attention_chunk_size // g.spec.block_size)
                * g.spec.block_size,
            ),
        )
        if isinstance(g.spec, ChunkedLocalAttentionSpec)
        else g
        for g in layout.groups
    )
    return dataclasses.replace(layout, groups=groups)


#: The cases of :func:`edge_layouts`: (group kinds, block size of each as a multiple of
#: the base size ``b``: 2 for the coarse full group beside a fine window).
_EDGE_CASES: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...] = (
    (("chunked_local",), (1,)),
    (("full", "chunked_local"), (1, 1)),
    (("full", "mamba"), (1, 1)),
    (("full", "sliding_window"), (2, 1)),
)


def edge_case_kinds(kinds: Sequence[str]) -> tuple[int, ...]:
    """The indexes of :data:`_EDGE_CASES` made only of ``kinds``.

    Example: ``("full", "sliding_window")`` -> ``(3,)``; all four kinds -> ``(0, 1, 2, 3)``.
    """
    return tuple(i for i, (case, _) in enumerate(_EDGE_CASES) if set(case) <= set(kinds))


@st.composite
def edge_layouts(
    draw,
    max_len: int = 128,
    kinds: Sequence[str] = SPEC_KINDS,
    settings: frozenset[str] = frozenset(),
) -> KVCacheLayout:
    """Layouts at the edges of the hit rules that the generic draws rarely make (only
    the cases made of ``kinds``, at least one must be):

    * chunked-local attention alone or beside full attention of the same block size
      ``b`` in ``{2, 4}``, with a chunk of 2..4 blocks: a lookup whose range ends past
      the chunk's first block stops at the first uncached block of its chunk (bs 4,
      chunk 8, a fresh 16-token prompt: the search bound 15 starts the chunk at block
      2, uncached, so the hit is the 8 tokens of the two null blocks before it);
    * full attention + Mamba, both of block size ``b`` (the scheduler block size): a
      retention interval of one scheduler block then makes every Mamba block a segment
      boundary (the production property draws that interval one time in six);
    * (drawn twice as often) full attention of block size ``2b`` beside a sliding
      window of block size ``b`` wider than the hit alignment (``w`` in ``3b+2 .. 8b``):
      a hit shorter than the window's run ends on an aligned block, and under EAGLE
      lower; with 2 lookahead hashes the full group's view of the hashes can end
      before the lookup bound. That edge needs EAGLE, so where ``settings`` (the
      production settings the engine declares) has ``"eagle"``, this case comes with
      ``use_eagle`` on and lookahead hashes ``L`` in ``{0, 0, 2}`` (the settings that
      :func:`production_layouts` draws on top may replace them; drawn alone, they
      would meet this case rarely: Hypothesis' generation keeps the settings of a few
      draws).

    ``max_model_len`` is at least 4 alignments (``_sized``); pools from tiny to roomy.
    Example: ``settings={"eagle"}``, the fine window drawn with ``b = 2``: full
    attention bs 4, a window bs 2 of ``w = 11``, EAGLE on, ``L = 0``.
    """
    cases = edge_case_kinds(kinds)
    if not cases:
        raise ValueError(f"edge_layouts(kinds=...) has no case made of {tuple(kinds)!r}")
    # the fine window counts twice: its edge needs EAGLE (drawn on top) as well
    weighted = cases + tuple(i for i in cases if _EDGE_CASES[i][0] == ("full", "sliding_window"))
    group_kinds, multiples = _EDGE_CASES[draw(st.sampled_from(weighted), label="edge case")]
    base = draw(st.sampled_from((2, 4)), label="edge block size")
    sizes = [m * base for m in multiples]
    page = 64 * math.lcm(*sizes)
    if "chunked_local" in group_kinds:
        extent = draw(st.integers(2, 4)) * base  # the chunk
    elif "sliding_window" in group_kinds:
        extent = draw(st.integers(3 * base + 2, 8 * base))  # the window
    else:
        extent = None
    windows_of = None if extent is None else (extent,)
    groups = tuple(
        KVCacheGroup((f"layer.{i}",), draw(_kind_specs(kind, bs, page, windows_of)))
        for i, (kind, bs) in enumerate(zip(group_kinds, sizes))
    )
    layout = draw(_sized(groups, max_len, 4 * math.lcm(*sizes)))
    if group_kinds == ("full", "sliding_window") and "eagle" in settings:
        lookahead = draw(st.sampled_from((0, 0, 2)), label="edge lookahead hashes")
        layout = dataclasses.replace(layout, use_eagle=True, num_hash_lookahead_tokens=lookahead)
    return layout


def production_base_layouts(
    max_len: int = 128,
    kinds: Sequence[str] = SPEC_KINDS,
    settings: frozenset[str] = frozenset(),
) -> st.SearchStrategy[KVCacheLayout]:
    """The small tier's layouts of the production property, before its settings
    (:func:`production_layouts`), one branch each (Hypothesis flattens the nested
    choices): the scenario mix's generated layouts, presets and targeted layouts
    (:func:`any_layouts`), a swarm layout of the small tier (:func:`swarm_layouts`: each
    group type and pool pressure an independent switch, so that every serving mode and
    setting meets every group type), and two branches of :func:`edge_layouts` (where one
    of its cases is made of ``kinds``, with the engine's production ``settings``), so
    that the settings meet the hit rules' edges (an EAGLE drop re-aligning a fine
    window's hit, a retention interval of one Mamba block): two branches of six with
    every kind.
    Example: a swarm draw with chunked local and Mamba switched on -> a two-group
    layout of at most ``max_len`` tokens."""
    small = dataclasses.replace(TIERS[SMALL], max_len=max_len)
    mixed = any_layouts(max_len=max_len, kinds=kinds)
    swarm = swarm_layouts(small, kinds)
    if not edge_case_kinds(kinds):
        return st.one_of(mixed, swarm)
    # Hypothesis flattens nested ``one_of``s into one list of branches and drops a
    # branch object it has seen: two separate edge strategies weigh two branches
    edges = [edge_layouts(max_len=max_len, kinds=kinds, settings=settings) for _ in range(2)]
    return st.one_of(mixed, swarm, *edges)


#: Outputs of a bulk arrival: up to this many tokens (an online tier's chat turns).
BULK_OUTPUT = 16
#: Outputs of an offline batch: up to this many tokens, so that its requests decode
#: across several block boundaries after the batch's first decode step.
OFFLINE_OUTPUT = 64


def bulk_arrivals(
    layout: KVCacheLayout,
    prefix_pool: Sequence[tuple[int, ...]],
    first_id: int,
    count: int,
    seed: int,
    batch: bool = False,
    documents: bool | None = None,
    max_output: int = BULK_OUTPUT,
) -> tuple[Arrive, ...]:
    """``count`` arrivals ``r<first_id>..`` made from one seed (drawing thousands of
    requests one by one would overrun Hypothesis's buffer): a prompt's length is
    log-uniform in ``1..min(room, BULK_SHORT)`` (a chat turn), or one time in
    ``BULK_LONG_ONE_IN`` in ``1..room`` (up to ``max_model_len``: a long document);
    half of them start with a cut of a pool prefix; outputs of ``0..max_output`` tokens
    (16 by default); one in eight has salt ``"s1"``. Always ``len(prompt) + len(output)
    <= max_model_len``. With ``batch``, :func:`batch_arrivals` instead (``documents`` and
    ``max_output`` passed on).
    Example: ``bulk_arrivals(layout, (), 0, 2, 7)`` -> ``Arrive("r0", ...), Arrive("r1", ...)``.
    """
    rng = random.Random(seed)
    if batch:
        return batch_arrivals(layout, prefix_pool, first_id, count, rng, documents, max_output)
    limit = layout.max_model_len
    out = []
    for i in range(count):
        output_len, length = _bulk_lengths(rng, limit, max_output)
        head = _pool_head(rng, prefix_pool, length)
        prompt = head + _bulk_tokens(rng, length - len(head))
        output = _bulk_tokens(rng, output_len)
        salt = "s1" if rng.randrange(8) == 0 else None
        out.append(Arrive(f"r{first_id + i}", prompt, output, salt, None))
    return tuple(out)


def batch_arrivals(
    layout: KVCacheLayout,
    prefix_pool: Sequence[tuple[int, ...]],
    first_id: int,
    count: int,
    rng: random.Random,
    documents: bool | None = None,
    max_output: int = BULK_OUTPUT,
) -> tuple[Arrive, ...]:
    """``count`` arrivals alike, as an offline batch or an evaluation set sends them: one
    prompt length (drawn as :func:`bulk_arrivals` draws one) and one output length for
    all; the prompts distinct, or one time in two all starting with the same cut of a
    pool prefix (a shared system prompt, so its blocks are held by every request; the
    whole prompt when the cut covers it: one prompt sampled many times). A
    batch prefilled in one step decodes in lock step: every request crosses its block
    boundaries and drops its window blocks in the same steps (the engine's uniform,
    many-item paths). On a layout with windows or chunks, one batch in two is a batch of
    distinct documents longer than the widest of them (:func:`_past_the_window`): its
    first decode step drops blocks held once in every row at once; ``documents`` True
    makes every batch on such a layout one of documents, False none (None: one in two).
    Example: ``count`` 3 -> three prompts of one length, each with the same number of
    output tokens."""
    output_len, length = _bulk_lengths(rng, layout.max_model_len, max_output)
    widest = _widest_reach(layout)
    if widest > 0:  # the coin is tossed whatever ``documents`` says: one stream
        coin = rng.randrange(2) == 0
        documents = coin if documents is None else documents
    else:
        documents = False
    if documents:
        length = _past_the_window(rng, layout, widest, output_len, length)
    head = () if documents else _pool_head(rng, prefix_pool, length)
    return tuple(
        Arrive(
            f"r{first_id + i}",
            head + _bulk_tokens(rng, length - len(head)),
            _bulk_tokens(rng, output_len),
            None,
            None,
        )
        for i in range(count)
    )


def _widest_reach(layout: KVCacheLayout) -> int:
    """The widest sliding window or attention chunk of ``layout`` (0: none). Example:
    full + SWA 32 + SWA 128 -> 128."""
    reach = 0
    for group in layout.groups:
        spec = group.spec
        if isinstance(spec, SlidingWindowSpec):
            reach = max(reach, spec.sliding_window)
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            reach = max(reach, spec.attention_chunk_size or 0)
    return reach


def _past_the_window(
    rng: random.Random, layout: KVCacheLayout, widest: int, output_len: int, length: int
) -> int:
    """A prompt length past ``widest`` and within 8 of the layout's largest blocks after
    the block it ends in, so every windowed group has blocks to drop at the first
    decode step: one time in two a whole number of blocks (that step also starts a new
    block in every group, so it pops too), else cut inside a block; ``length``
    unchanged when that does not fit ``max_model_len`` with the output. Example: w 40,
    blocks of 16, room 512 -> one of ``48, 64, ..., 160`` or a length in ``41..159``."""
    block = max(g.spec.block_size for g in layout.groups)
    aligned = (widest // block + rng.randint(1, 8)) * block
    past = aligned if rng.randrange(2) else max(widest + 1, aligned - rng.randrange(block))
    return past if past + output_len <= layout.max_model_len else length


def _bulk_lengths(rng: random.Random, limit: int, max_output: int = BULK_OUTPUT) -> tuple[int, int]:
    """``(output length, prompt length)`` of a bulk arrival: ``0..max_output`` output
    tokens; the prompt log-uniform in ``1..min(room, BULK_SHORT)``, or one time in
    ``BULK_LONG_ONE_IN`` in ``1..room`` (``room``: ``limit`` less the output)."""
    output_len = min(rng.randrange(max_output + 1), limit - 1)
    room = limit - output_len
    top = room if rng.randrange(BULK_LONG_ONE_IN) == 0 else min(room, BULK_SHORT)
    return output_len, max(1, min(top, int(math.exp(rng.uniform(0, math.log(top))))))


def _pool_head(
    rng: random.Random, prefix_pool: Sequence[tuple[int, ...]], length: int
) -> tuple[int, ...]:
    """One time in two (with a pool), a cut of a pool prefix of at most ``length``
    tokens to start a prompt with; else nothing."""
    if prefix_pool and rng.randrange(2) == 0:
        prefix = prefix_pool[rng.randrange(len(prefix_pool))]
        return prefix[: min(length, rng.randrange(len(prefix) + 1))]
    return ()


#: One bulk arrival of a large tier in this many is a batch of requests alike
#: (:func:`batch_arrivals`).
BATCH_ONE_IN = 4
#: Prompts of a bulk arrival: log-uniform up to this many tokens, or one in
#: ``BULK_LONG_ONE_IN`` up to ``max_model_len``.
BULK_SHORT = 2**11  # 2048
BULK_LONG_ONE_IN = 32
#: ``bytes.translate`` table of a byte to a token id (``VOCAB_SIZE`` divides 256).
_BYTE_TO_TOKEN = bytes(b % VOCAB_SIZE for b in range(256))


def _bulk_tokens(rng: random.Random, length: int) -> tuple[int, ...]:
    """``length`` token ids from ``rng``'s bytes (uniform: ``VOCAB_SIZE`` divides 256);
    a hundred times faster than :func:`random_tokens` for the large tiers' millions of
    tokens (the small tier keeps :func:`random_tokens`, so its stream does not move)."""
    return tuple(rng.randbytes(length).translate(_BYTE_TO_TOKEN))


_TIER_OPS = ("step", "step", "step", "step", "arrive", "abort", "preempt", "reset_prefix_cache")


@st.composite
def tier_operations(draw, layout: KVCacheLayout, scale: ScaleTier) -> tuple[Operation, ...]:
    """A trace body of a large tier: a bulk arrival (:func:`bulk_arrivals`; one in
    ``BATCH_ONE_IN`` a batch of requests alike) of up to ``max_requests`` requests,
    then up to ``max_steps`` operations: steps with a budget from ``token_budgets``
    (most), more bulk arrivals while the request bound allows, aborts and preemptions of
    live requests, prefix-cache resets. A few dozen operations move thousands of blocks.
    Passes :func:`properties.core.trace.validate_references`. A tier whose workload is
    ``"offline"`` draws :func:`offline_operations` instead."""
    if scale.workload == OFFLINE_WORKLOAD:
        return draw(offline_operations(layout, scale))
    budgets = scale.token_budgets or (layout.max_model_len,)
    pool = draw(prefix_pools(layout))
    first = draw(st.integers(1, scale.max_requests))
    batch = draw(st.integers(0, BATCH_ONE_IN - 1)) == 0
    ops: list[Operation] = list(bulk_arrivals(layout, pool, 0, first, draw(_seeds), batch))
    arrived = first
    live = [op.request_id for op in ops]
    steps = lookaheads(layout)
    for _ in range(draw(st.integers(1, scale.max_steps))):
        kind = draw(st.sampled_from(_TIER_OPS))
        if kind == "arrive" and arrived < scale.max_requests:
            more = draw(st.integers(1, max(1, (scale.max_requests - arrived + 3) // 4)))
            batch = draw(st.integers(0, BATCH_ONE_IN - 1)) == 0
            new = bulk_arrivals(layout, pool, arrived, more, draw(_seeds), batch)
            ops.extend(new)
            arrived += len(new)
            live.extend(op.request_id for op in new)
        elif kind in ("abort", "preempt") and live:
            request_id = live[draw(st.integers(0, len(live) - 1))]
            if kind == "abort":
                live.remove(request_id)
                ops.append(Abort(request_id))
            else:
                ops.append(Preempt(request_id))
        elif kind == "reset_prefix_cache":
            ops.append(ResetPrefixCache())
        else:
            ops.append(Step(draw(st.sampled_from(budgets)), draw(steps)))
    return tuple(ops)


def offline_layouts(
    scale: ScaleTier, kinds: Sequence[str] = SPEC_KINDS
) -> st.SearchStrategy[KVCacheLayout]:
    """The layouts of an offline tier: a served model (a preset made of ``kinds``,
    :func:`preset_layouts` with the retention its family is served with, windows scaled
    to a few blocks) within the tier's bounds, three times in four; else, and always when
    no preset is made of ``kinds``, :func:`swarm_layouts`. Example: gpt-oss at block size
    8, its window of 128 scaled to 32, ``max_model_len`` up to 8192, 256..4096 blocks."""
    swarm = swarm_layouts(scale, kinds)
    names = presets_of_kinds(kinds)
    if not names:
        return swarm
    served = preset_layouts(
        names=names,
        max_len=scale.max_len,
        min_blocks=scale.min_blocks,
        max_blocks=scale.max_blocks,
        served=True,
        block_sizes=scale.block_sizes or PRESET_BLOCK_SIZES,
    )
    return st.one_of(served, served, served, swarm)


def workload_layouts(
    scale: ScaleTier, kinds: Sequence[str] = SPEC_KINDS
) -> st.SearchStrategy[KVCacheLayout]:
    """The layouts of a large tier, by its workload: :func:`swarm_layouts` (online) or
    :func:`offline_layouts` (offline), made of ``kinds``."""
    if scale.workload == OFFLINE_WORKLOAD:
        return offline_layouts(scale, kinds)
    return swarm_layouts(scale, kinds)


@st.composite
def offline_operations(draw, layout: KVCacheLayout, scale: ScaleTier) -> tuple[Operation, ...]:
    """A trace body of an offline batch (a list of prompts handed to the engine at once, as
    vLLM's ``LLM.generate`` does): :func:`offline_batch` of a drawn prefix pool, request
    count (up to ``max_requests``), kind of batch (alike one time in two), seed, token
    budget (from ``token_budgets``; one time in two raised to hold every prompt at once,
    an offline run's large ``max_num_batched_tokens``); no lookahead slots (the swarm
    mode's drafts speculate on their own)."""
    budgets = scale.token_budgets or (layout.max_model_len,)
    pool = draw(prefix_pools(layout))
    count = draw(st.integers(1, scale.max_requests))
    alike = draw(st.booleans())
    seed = draw(_seeds)
    budget = draw(st.sampled_from(budgets))
    whole = draw(st.booleans())
    return offline_batch(layout, scale, pool, count, alike, seed, budget, whole)


def offline_batch(
    layout: KVCacheLayout,
    scale: ScaleTier,
    prefix_pool: Sequence[tuple[int, ...]],
    count: int,
    alike: bool,
    seed: int,
    budget: int,
    whole: bool,
) -> tuple[Operation, ...]:
    """One bulk arrival of ``count`` requests made from ``seed`` (``alike``: a batch of
    requests alike, :func:`batch_arrivals`, on a layout with windows or chunks documents
    longer than the widest; else :func:`bulk_arrivals`' mix, prompts may start with a cut
    of a pool prefix), then steps only, all ``Step(budget, 0)``: as many as the
    batch needs to finish when nothing is preempted (its prompt tokens over the budget,
    plus the longest output, plus one), at most ``scale.max_steps``. ``whole`` raises the
    budget to hold every prompt, so the whole batch is prefilled in one step and then
    decodes in lock step: every request crosses its block boundaries and drops its window
    blocks in the same steps (the engine's uniform and many-item decode paths).
    Example: 3 alike requests of 200-token prompts and 4 output tokens, budget 2048 ->
    ``Arrive`` x 3, then 1 + 4 + 1 = 6 ``Step(2048, 0)``."""
    ops: list[Operation] = list(
        bulk_arrivals(layout, prefix_pool, 0, count, seed, alike, True, OFFLINE_OUTPUT)
    )
    prompt_tokens = sum(len(op.prompt) for op in ops)
    if whole:
        budget = max(budget, prompt_tokens)
    longest_output = max(len(op.output) for op in ops)
    steps = min(scale.max_steps, -(-prompt_tokens // budget) + longest_output + 1)
    ops.extend(Step(budget, 0) for _ in range(steps))
    return tuple(ops)
