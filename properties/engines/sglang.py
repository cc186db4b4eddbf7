"""SGLang 0.5.23 adapter: ``UnifiedRadixCache(FULL, SWA, MAMBA)`` behind the engine protocol.

Scope: layouts of one full-attention group with a sliding-window group, a Mamba group
or both (SGLang's hybrid SWA models, its hybrid linear-attention models, and both); the
attention groups share one block size ``bs`` in {1, 2, 4}, which becomes SGLang's page
size; a Mamba group is bridged as note 10 says. Anything else raises
:class:`EngineError` naming the layout. Two factories pick the tree core:
``make_engine`` (``python``) and ``make_engine_rust`` (the bundled ``rust`` core).

Objects built per engine (all SGLang's own): ``SWAKVPool`` (a full pool of
``(num_blocks - 1) * bs`` token slots and an SWA pool of ``swa_full_tokens_ratio`` of
that, 1.0, 0.8 or 0.5 by layout: :func:`swa_pool_pages`), ``SWATokenToKVPoolAllocator``,
``ReqToTokenPool`` (one row per request, ``max_model_len + LOOKAHEAD_MARGIN`` wide),
``UnifiedRadixCache`` with ``tree_components=(FULL, SWA)``, and one real SGLang ``Req``
per request (its ``ReqKvInfo`` carries the row, protected length and SWA cursor).

How each difference from vLLM is bridged
---------------------------------------
1. **Window convention.** SGLang takes the window *exclusive* of the query
   (``sliding_window_size = w - 1``; the query at ``p`` sees ``[p - sws, p]``). The
   adapter passes ``w - 1``; ``w = 1`` gives ``sws = 0``, which SGLang's SWA component
   rejects, so it is an :class:`EngineError`. Example: ``w = 4`` -> ``sws = 3``.
2. **Two pools instead of one.** Full and SWA KV live in separate pools; a token has a
   full slot and (while its SWA KV is alive) an SWA slot found through
   ``full_to_swa_index_mapping`` (0 = no SWA KV). Block id of page ``i`` of a request:
   full group -> ``full_slot // bs``; SWA group -> ``mapping[full_slot] // bs``, or 0
   (null) where the mapping is 0. Slot 0 (page 0) of each pool is SGLang's padding
   slot and is never handed out, so 0 is a safe null id in both groups. Equal ids in
   the two groups are legal (``separate_group_pools = True``). As SGLang deploys it
   (``--swa-full-tokens-ratio``, default 0.8), the SWA pool may be the smaller one:
   then an allocation can find the full pool roomy and the SWA pool short, and the
   tree's SWA eviction walk runs on its own (it evicts an unlocked leaf whole, or
   frees an inner node's SWA KV and leaves a tombstone).
3. **Token-granular tree, page-rounded hits.** ``match_prefix`` walks a radix tree
   of tokens and rounds the key down to whole pages itself. SGLang's scheduler caps
   the key at ``Req._compute_max_prefix_len(n) = n - 1`` (``RadixKey.limit``); the
   adapter uses that very cap, so a hit is ``<= floor((n - 1) / bs) * bs``. Example:
   bs 2, 7 cached tokens, prompt of 7 -> limit 6 -> hit 6. An SWA hit at ``L`` needs
   ``sws`` live SWA tokens before ``L`` (SGLang's match validator).
4. **Lookups are not read-only in SGLang.** ``match_prefix`` refreshes LRU times along
   the matched path and may split a radix node at the hit boundary. No slot, lock or
   free count changes, but later eviction order can (see ``findings/sglang/``).
   ``get_computed_blocks`` keeps the matched node id (no lock); ``allocate_slots``
   locks it (``cache.lock``; the root for a miss) *before* evicting for new slots, as
   SGLang's scheduler does on admission, and ``free`` unlocks it. Every request is
   matched, as SGLang's ``match_kv_cache`` does: a one-token prompt (key limit 0) and
   a tree with prefix caching off (``disable``) answer no hit.
5. **Allocation.** ``allocate_slots`` grows the request's row to
   ``computed + hit + new + lookahead`` tokens (:meth:`SGLangEngine._alloc`). An extend
   (an admission, or a prefill chunk of a running request) is SGLang's
   ``alloc_for_extend``: the tree evicts (``evict_from_tree_cache``), then ``alloc``
   (bs 1) or ``alloc_extend`` (bs > 1) take a full *and* an SWA slot per token, and
   SGLang's allocator alone decides: its ``None`` (a pool short of pages even after
   evicting) is the protocol's refusal, where SGLang's ``alloc_token_slots`` would raise.
   One decode slot of a request that has computed its prompt is SGLang's decode step:
   ``check_decode_capacity`` first (``ScheduleBatch.check_decode_mem``: evict, then the
   page growth must fit both pools; ``False``, where SGLang retracts, is the refusal),
   then ``alloc_for_decode`` (evict one page, ``alloc_decode`` at bs > 1, ``alloc`` at
   bs 1). Tree entries evicted before a refusal stay evicted; the hit lock, the row and
   the request state are rolled back.
   There is no ``num_tokens - 1`` cap on slots; rows are capped at ``max_model_len``.
6. **Out-of-window SWA KV of a running request** is freed by SGLang at decode steps
   (``evict_sliding_windows`` -> ``free_swa_out_of_window_slots``): it keeps
   ``ceil(max(sws, bs) / bs)`` pages behind the next position ``p``, frees whole pages
   below, and never frees tree-owned (protected) pages itself. The adapter calls it at
   every ``allocate_slots`` of a request with computed tokens, with ``pre_len = p``, in a
   free group; once the window has passed the tree-owned prefix (``p - sws >=
   protected``) it releases the SWA part of the request's lock
   (``release_swa_prefix_lock``), and those pages read null from then on.
   The freed pages read as null (0) in the SWA group; the full group never frees.
   Pages of an adopted hit that SGLang's lock leaves evictable (all but the last
   ``ceil(max(sws, bs) / bs)``: it locks only the hit's last window in the SWA tree) read
   as null too: the request does not hold them (like vLLM's skipped hit blocks), so S1
   does not count them both held and reclaimable.
7. **free = insert, then release.** ``free`` follows SGLang's ``release_kv_cache(...,
   checkpoint=True)``: ``cache.checkpoint`` inserts the page-aligned computed prefix
   (the tree frees the request's duplicate slots itself and rewrites its row), then
   ``free_kv_row`` releases ``[protected, computed)`` and the over-allocated tail
   ``[ceil(computed / bs) * bs, allocated)``, the lock is dropped, ``on_release`` runs
   and the row is returned, all in a free group. Every other request (the second, the
   fourth, ... added) also publishes its computed prefix after each prefill step
   (``checkpoint_kv_cache``: ``cache.checkpoint`` of a running request), as SGLang's
   scheduler does; the others publish at ``free`` only, so both insert paths run.
   SGLang's own preemption (retract) does **not** insert;
   the protocol's preemption (free, then computed = 0) does, like vLLM. A request freed
   before its whole prompt is computed is released without the insert, as SGLang
   releases the chunked request it aborts (``checkpoint=False``).
8. **num_free_blocks** = ``min`` over the two pools of ``(available + evictable) //
   bs``: pages an allocation could obtain now, evicting unlocked tree entries.
   ``pool_usage`` (``ReportsPools``) reports each pool's figure, so S1-S3 check them
   one by one (the ``min`` hides a leak or an over-count in the larger pool).
9. **reset_prefix_cache** is SGLang's ``flush_cache``: allowed only when no request
   holds a row; it resets the tree, the row pool and the allocator.
10. **Mamba groups** (``tree_components`` with ``MAMBA``, built as SGLang's pool
   configurator builds a hybrid model without the extra buffer: ``HybridReqToTokenPool``
   with its ``MambaPool`` of :func:`mamba_pool_slots` slots and ``MambaSlotAllocator``;
   for full + Mamba the attention pool is ``MHATokenToKVPool`` with the token (page 1)
   or paged allocator, for full + SWA + Mamba the SWA pools of notes 2-8). SGLang keeps
   **one state slot per request**, updated in place by every step, and the tree caches
   states at node boundaries (a finished request hands its slot to the tree for the key
   of its computed tokens; a node split leaves the new parent without a state), so a
   hit ends where a cached state is. kvconform's universal checks see it as an
   ``"align"`` Mamba group whose block is at least ``max_model_len`` tokens: every row
   has one column, the request's slot id (block id = slot id; SGLang's slot 0 is its
   padding slot, so 0 is null), the step writes the state at its end into it and
   resumes from it (W3, exclusive writes), and the group's pool is the state pool
   (``pool_usage`` ``"mamba"``: free = free slots + unlocked tree states; S1-S3). With
   prefix caching, hits are partial hits (the hash block is the page, 1): a hit's
   Mamba row is the node's state (H2: it holds the state of exactly the hit), and the
   admission is SGLang's copy-on-write: with the matched node locked,
   ``ensure_mamba_capacity`` (evicting tree states; False refuses the admission), then
   ``finalize_match_result_in_cache(cow_mamba=True)`` gives the request its own slot with
   the node's state as the copy source; the copy ``(state, slot)`` is queued
   (``CopiesBlocks``) and runs at ``take_block_copies`` as SGLang's model runner runs it
   before the extend (``copy_mamba_state``; a miss's fresh slot is zeroed there,
   ``clear_slots``). The state stays locked by the request's node lock until ``free``.
   Left out, each named where it is checked: the extra buffer (``--mamba-scheduler
   -strategy extra_buffer``: ping-pong tracking slots whose states the model's forward
   tracks at chunk boundaries, so page sizes above 1 with caching; the adapter has no
   forward to track them), speculative state slots (drafts on Mamba layouts:
   ``num_speculative_blocks`` 0, no ``mamba_modes`` setting), the running-request
   checkpoint after each prefill chunk (SGLang copies the request's state into a new
   tree slot inside ``checkpoint``, a copy outside any allocation the protocol has no
   call for: Mamba layouts publish at ``free`` only), and HiCache and sessions on
   Mamba layouts (the host tier's Mamba pool). SGLang reads two flags as it builds its
   Mamba component (the chunk size, :data:`MAMBA_CHUNK_SIZE`, and the per-path state
   cap, default off): published for the build with its scoped ``override_server_args``.
   Nothing of it needs CUDA: the pool's slot copies and clears are torch indexing on
   CPU tensors (``MambaPool.copy_from``'s non-fused path).
"""

from __future__ import annotations

import os
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from properties.core.engine import (
    BlockIds,
    CacheHit,
    EngineError,
    HostPoolUsage,
    HostTransfer,
    PoolUsage,
    RequestInput,
    UnsupportedLayoutError,
    quiet_loggers,
)
from properties.engines import sglang_metrics
from properties.engines.sglang_hicache import (
    HiCacheConfig,
    HostTier,
    deployed,
    storage_directory,
)
from reference.layout import KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec

#: Page sizes the adapter supports (the block size of both groups).
SUPPORTED_PAGE_SIZES = (1, 2, 4)
#: Extra row width beyond ``max_model_len`` for lookahead slots.
LOOKAHEAD_MARGIN = 64
#: Request rows in the ``ReqToTokenPool`` (concurrent requests holding KV).
MAX_RUNNING_REQUESTS = 256
#: SGLang's ``--swa-full-tokens-ratio`` (SWA pool tokens / full pool tokens) values the
#: adapter builds: equal pools, SGLang's default (0.8) and a small SWA pool (0.5). Which
#: one a layout gets is :func:`swa_full_tokens_ratio` (a function of the layout, so a
#: saved trace replays with the same pools).
SWA_FULL_TOKENS_RATIOS = (1.0, 0.8, 0.5)
#: The model's Mamba chunk size SGLang reads when it builds its Mamba component
#: (``mamba_cache_chunk_size``: ``max(chunk, page)``; without a model config SGLang falls
#: back to its FLA kernels' chunk of 64). It sets the grid of the branching checkpoints
#: only, which the extra buffer tracks; the adapter deploys no extra buffer (note 10).
MAMBA_CHUNK_SIZE = 64
#: The Mamba layer's id (the attention pools hold layers 0 and 1).
MAMBA_LAYER_ID = 2


#: The deployments the adapter builds, one per layout (:func:`hicache_deployment`):
#: without HiCache, and each write policy with SGLang's default host pool (``2.0`` times
#: the device pool) or a smaller one (the host tier then evicts too), half of them with
#: SGLang's file-backed storage tier (L3) behind the host tier.
HICACHE_DEPLOYMENTS: tuple[HiCacheConfig | None, ...] = (
    None,
    HiCacheConfig("write_through", 2.0),
    HiCacheConfig("write_back", 0.5),
    HiCacheConfig("write_through_selective", 1.0, storage="file"),
    HiCacheConfig(
        "write_through", 0.5, storage="file", prefetch_policy="best_effort", staged_storage=True
    ),
    HiCacheConfig("write_back", 2.0, storage="file"),
)


def session_radix_cache(layout: KVCacheLayout) -> bool:
    """Whether ``layout`` is deployed with ``--enable-session-radix-cache`` (SGLang tags
    a finished request's radix nodes with its session, evicts session-held nodes last
    and releases them when the session closes): every other layout by the CRC-32 of
    its description (next to :func:`hicache_deployment`'s). The protocol carries no
    session: a request's cache salt stands for its session id (the requests of one
    conversation share both), and a session closes when its last request leaves
    (``remove_request``). Only with the Python tree core (:func:`config_for`): SGLang
    runs a session-aware cache on it whatever core was asked for, so the Rust factory
    would silently test the Python core. Example: a layout whose description has CRC 7
    -> ``7 // 6 % 2 = 1``: on."""
    return zlib.crc32(layout.describe().encode()) // len(HICACHE_DEPLOYMENTS) % 2 == 1


def hicache_deployment(layout: KVCacheLayout) -> HiCacheConfig | None:
    """The HiCache deployment of ``layout``: :data:`HICACHE_DEPLOYMENTS` indexed by a
    CRC-32 of the layout's description (a function of the layout, so a saved trace
    replays with the same deployment, and independent of the SWA ratio's ``num_blocks %
    3``). Example: a layout whose description has CRC 7 gets index ``7 % 6 = 1``,
    write-through with a host pool twice the device pool."""
    index = zlib.crc32(layout.describe().encode()) % len(HICACHE_DEPLOYMENTS)
    return HICACHE_DEPLOYMENTS[index]


@dataclass(frozen=True)
class SGLangConfig:
    """What the adapter builds from a layout: page size, window, pool sizes, core."""

    page_size: int
    sliding_window: int
    pool_pages: int
    max_model_len: int
    enable_caching: bool
    tree_core: str
    full_group: int
    #: the sliding-window group, or None (full + Mamba)
    swa_group: int | None
    #: pages of the SWA pool (:func:`swa_pool_pages`); ``pool_pages`` is the full pool's
    swa_pool_pages: int = 0
    #: the Mamba group, or None; its states live in SGLang's ``MambaPool`` of
    #: ``mamba_slots`` slots (:func:`mamba_pool_slots`), one per request plus the tree's
    mamba_group: int | None = None
    mamba_slots: int = 0
    #: the host tier (``--enable-hierarchical-cache``), or None
    hicache: HiCacheConfig | None = None
    #: ``--enable-session-radix-cache``: a request's cache salt is its session id
    #: (:func:`session_radix_cache`)
    session_radix_cache: bool = False

    @property
    def has_swa(self) -> bool:
        return self.swa_group is not None

    @property
    def has_mamba(self) -> bool:
        return self.mamba_group is not None

    @property
    def sglang_window(self) -> int:
        """SGLang's exclusive window: ``w - 1`` (w=4 -> 3)."""
        return self.sliding_window - 1

    @property
    def pool_tokens(self) -> int:
        return self.pool_pages * self.page_size

    @property
    def swa_pool_tokens(self) -> int:
        return (self.swa_pool_pages or self.pool_pages) * self.page_size


def swa_full_tokens_ratio(layout: KVCacheLayout) -> float:
    """The ``--swa-full-tokens-ratio`` the adapter deploys SGLang with for ``layout``:
    :data:`SWA_FULL_TOKENS_RATIOS` indexed by ``num_blocks`` modulo 3, so the layouts a
    strategy draws spread over the three and a trace replays with its own. Example:
    ``num_blocks`` 33 -> 1.0, 34 -> 0.8, 35 -> 0.5."""
    return SWA_FULL_TOKENS_RATIOS[layout.num_blocks % len(SWA_FULL_TOKENS_RATIOS)]


def swa_pool_pages(pool_pages: int, ratio: float, page: int, max_model_len: int) -> int:
    """SGLang's SWA pool for a full pool of ``pool_pages`` pages: its pool configurator's
    ``align_page_size(int(full_tokens * ratio))``, in pages, raised to what one request
    of ``max_model_len`` tokens needs at once (``cdiv(max_model_len, page) + 1`` pages, the
    bound the layouts give the full pool: the adapter's prefill takes an SWA slot per
    token) and at most the full pool. Example: 32 pages of 2 tokens, ratio 0.5,
    ``max_model_len`` 20 -> ``int(64 * 0.5) // 2 = 16`` pages (11 needed)."""
    share = int(pool_pages * page * ratio) // page
    return min(pool_pages, max(share, -(-max_model_len // page) + 1))


def mamba_pool_slots(layout: KVCacheLayout) -> int:
    """The slots of SGLang's Mamba state pool (``--max-mamba-cache-size``) for a layout
    with a Mamba group: an eighth of the full pool's pages, at least 3 (a running
    request's own state, the tree state its hit locks, one to spare) and below
    ``num_blocks`` (block ids of every pool are in ``[1, num_blocks)``), so the tree's
    states are evicted when requests need slots. Example: ``num_blocks`` 41 -> 5."""
    return min(layout.num_blocks - 1, max(3, (layout.num_blocks - 1) // 8))


def config_for(layout: KVCacheLayout, tree_core: str) -> SGLangConfig:
    """Check ``layout`` is in scope and derive the SGLang configuration.

    Example: full(bs=2) + SWA(bs=2, w=4), num_blocks=17 -> page 2, window 3, 16 pages
    (32 slots) in the full pool and :func:`swa_pool_pages` pages in the SWA pool.
    Full(bs=1) + Mamba(bs=max_model_len), num_blocks=41 -> page 1, 40 slots in the full
    pool and :func:`mamba_pool_slots` (5) Mamba states.
    """
    if tree_core not in ("python", "rust"):
        raise EngineError(
            f"sglang adapter: tree_core must be 'python' or 'rust', got {tree_core!r}"
        )
    specs = layout.specs
    full = [i for i, s in enumerate(specs) if isinstance(s, FullAttentionSpec)]
    swa = [i for i, s in enumerate(specs) if isinstance(s, SlidingWindowSpec)]
    mamba = [i for i, s in enumerate(specs) if isinstance(s, MambaSpec)]
    if (
        len(full) != 1
        or len(swa) > 1
        or len(mamba) > 1
        or not (swa or mamba)
        or len(specs) != 1 + len(swa) + len(mamba)
    ):
        raise UnsupportedLayoutError(
            "sglang adapter supports one full-attention group with a sliding-window group, "
            f"a Mamba group or both, got layout {layout.describe()}"
        )
    attention = full + swa
    page = specs[full[0]].block_size
    if any(specs[i].block_size != page for i in attention):
        raise UnsupportedLayoutError(
            f"sglang adapter needs equal block sizes in the attention groups, got layout "
            f"{layout.describe()}"
        )
    if page not in SUPPORTED_PAGE_SIZES:
        raise UnsupportedLayoutError(
            f"sglang adapter supports block_size in {SUPPORTED_PAGE_SIZES}, got layout "
            f"{layout.describe()}"
        )
    if layout.use_eagle or layout.num_hash_lookahead_tokens:
        # SGLang's radix cache has no EAGLE block drop or lookahead keys to drive
        raise UnsupportedLayoutError(
            "sglang adapter: EAGLE block drop and lookahead hashes are not bridged, got "
            f"layout {layout.describe()}"
        )
    if mamba:
        _check_mamba_spec(layout, specs[mamba[0]], page)
    # prefix_cache_retention_interval is vLLM's caching policy; SGLang has its own
    # (universal level only), so the field does not apply to it.
    window = specs[swa[0]].sliding_window if swa else 0
    if swa and window < 2:
        raise UnsupportedLayoutError(
            "sglang adapter needs sliding_window >= 2 (SGLang's window is w - 1 and must "
            f"be positive), got layout {layout.describe()}"
        )
    pool_pages = layout.num_blocks - 1
    python_core = layout.enable_caching and tree_core == "python" and not mamba
    return SGLangConfig(
        page_size=page,
        sliding_window=window,
        pool_pages=pool_pages,
        max_model_len=layout.max_model_len,
        enable_caching=layout.enable_caching,
        tree_core=tree_core,
        full_group=full[0],
        swa_group=swa[0] if swa else None,
        swa_pool_pages=(
            swa_pool_pages(pool_pages, swa_full_tokens_ratio(layout), page, layout.max_model_len)
            if swa
            else 0
        ),
        mamba_group=mamba[0] if mamba else None,
        mamba_slots=mamba_pool_slots(layout) if mamba else 0,
        # the host tier and sessions are deployed on full + SWA layouts only (note 10)
        hicache=hicache_deployment(layout) if python_core else None,
        session_radix_cache=python_core and session_radix_cache(layout),
    )


def _check_mamba_spec(layout: KVCacheLayout, spec: MambaSpec, page: int) -> None:
    """The Mamba groups the adapter bridges (note 10): ``"align"`` mode without
    speculative or prefill checkpoint blocks (SGLang's drafts and its extra buffer are
    not deployed), one state column per request (``block_size >= max_model_len``:
    SGLang keeps one state slot per request, updated in place), and page 1 with prefix
    caching (SGLang's Mamba component without the extra buffer asserts it)."""
    if (
        not spec.is_align
        or spec.num_speculative_blocks
        or spec.num_prefill_checkpoint_blocks
        or spec.block_size < layout.max_model_len
    ):
        raise UnsupportedLayoutError(
            "sglang adapter bridges Mamba groups in 'align' mode without speculative or "
            "checkpoint blocks and with block_size >= max_model_len (one state per "
            f"request), got layout {layout.describe()}"
        )
    if layout.enable_caching and page != 1:
        raise UnsupportedLayoutError(
            "sglang adapter: SGLang's Mamba component without the extra buffer caches "
            f"states at page size 1 only, got layout {layout.describe()}"
        )


@dataclass
class _PendingHit:
    """The node a ``get_computed_blocks`` matched, kept (unlocked) for allocation, and
    what its host tier holds past it (HiCache: ``best_match_node``, the host hit
    lengths of the match, the tokens a load-back would bring)."""

    node: Any
    num_tokens: int
    swa_branching_seqlen: int | None
    best_match_node: Any = None
    host_hit_length: int = 0
    swa_host_hit_length: int = 0
    host_tokens: int = 0
    #: the lookup's ``MatchResult`` and key (a Mamba layout: the admission copies the
    #: matched state from it)
    match: Any = None
    key: Any = None


@dataclass
class _Request:
    """Adapter-side state of one request: SGLang's ``Req`` plus the protocol counters."""

    req: Any
    num_computed_tokens: int = 0
    pending: _PendingHit | None = None
    tokens: list[int] = field(default_factory=list)
    #: SWA row entries below this page index read null: pages of the adopted hit that
    #: SGLang's lock leaves evictable (it locks only the last window of the hit)
    swa_unlocked_pages: int = 0
    #: publish the computed prefix after each prefill step (``checkpoint_kv_cache``);
    #: False: at ``free`` only
    checkpoints: bool = False
    #: tokens of planned steps not processed yet (asynchronous scheduling)
    num_in_flight_tokens: int = 0
    #: ``computed - in flight`` when last seen (:meth:`SGLangEngine._publish_processed`)
    num_processed: int = 0
    #: an asynchronous load is not complete yet (``delay_cache_blocks``): nothing is
    #: published before ``cache_blocks``
    loading: bool = False


class _SGLangModules:
    """SGLang (and torch) imported once per process: the import takes seconds."""

    _loaded: dict[str, Any] = {}

    @classmethod
    def get(cls) -> dict[str, Any]:
        if not cls._loaded:
            os.environ.setdefault("SGLANG_LOG_LEVEL", "warning")
            try:
                import torch
                from sglang.srt.configs.mamba_utils import (
                    Mamba2CacheParams,
                    Mamba2StateDType,
                    Mamba2StateShape,
                )
                from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
                from sglang.srt.mem_cache.allocation import ensure_mamba_capacity
                from sglang.srt.mem_cache.allocator import (
                    PagedTokenToKVPoolAllocator,
                    TokenToKVPoolAllocator,
                )
                from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
                from sglang.srt.mem_cache.base_prefix_cache import (
                    InitLoadBackParams,
                    MatchPrefixParams,
                )
                from sglang.srt.mem_cache.cache_init_params import CacheInitParams
                from sglang.srt.mem_cache.common import evict_from_tree_cache
                from sglang.srt.mem_cache.memory_pool import (
                    HybridReqToTokenPool,
                    MHATokenToKVPool,
                    ReqToTokenPool,
                )
                from sglang.srt.mem_cache.radix_cache import RadixKey
                from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
                from sglang.srt.mem_cache.unified_cache.components import ComponentType
                from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
                from sglang.srt.runtime_context import get_context
                from sglang.srt.sampling.sampling_params import SamplingParams
            except ImportError as exc:
                raise EngineError(f"sglang adapter: cannot import sglang: {exc}") from exc
            quiet_loggers("sglang")
            cls._loaded.update(
                torch=torch,
                Req=Req,
                FINISH_LENGTH=FINISH_LENGTH,
                SWATokenToKVPoolAllocator=SWATokenToKVPoolAllocator,
                MatchPrefixParams=MatchPrefixParams,
                InitLoadBackParams=InitLoadBackParams,
                CacheInitParams=CacheInitParams,
                evict_from_tree_cache=evict_from_tree_cache,
                ReqToTokenPool=ReqToTokenPool,
                HybridReqToTokenPool=HybridReqToTokenPool,
                MHATokenToKVPool=MHATokenToKVPool,
                TokenToKVPoolAllocator=TokenToKVPoolAllocator,
                PagedTokenToKVPoolAllocator=PagedTokenToKVPoolAllocator,
                Mamba2CacheParams=Mamba2CacheParams,
                Mamba2StateDType=Mamba2StateDType,
                Mamba2StateShape=Mamba2StateShape,
                ensure_mamba_capacity=ensure_mamba_capacity,
                RadixKey=RadixKey,
                SWAKVPool=SWAKVPool,
                ComponentType=ComponentType,
                UnifiedRadixCache=UnifiedRadixCache,
                SamplingParams=SamplingParams,
                get_context=get_context,
            )
        return cls._loaded


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SGLangEngine:
    """SGLang's hybrid full + SWA KV cache driven through the engine protocol."""

    separate_group_pools = True

    def __init__(
        self,
        layout: KVCacheLayout,
        tree_core: str = "python",
        hicache: HiCacheConfig | None | str = "per layout",
    ) -> None:
        """``hicache``: the host tier's deployment; ``"per layout"`` (the factories):
        :func:`hicache_deployment`, else the one given (None: no host tier; hand
        scenarios choose)."""
        self.layout = layout
        self.config = config_for(layout, tree_core)
        if hicache != "per layout":
            self.config = replace(self.config, hicache=hicache)
        m = _SGLangModules.get()
        self._m = m
        torch = m["torch"]
        cfg = self.config
        dtype = torch.float32 if _dtype_bytes(layout) == 4 else torch.float16
        heads, head_dim = _heads(layout)
        if cfg.has_swa:
            self.kv_pool = m["SWAKVPool"](
                size=cfg.pool_tokens,
                size_swa=cfg.swa_pool_tokens,
                page_size=cfg.page_size,
                dtype=dtype,
                head_num=heads,
                head_dim=head_dim,
                swa_attention_layer_ids=[0],
                full_attention_layer_ids=[1],
                device="cpu",
            )
            self.allocator = m["SWATokenToKVPoolAllocator"](
                size=cfg.pool_tokens,
                size_swa=cfg.swa_pool_tokens,
                page_size=cfg.page_size,
                dtype=dtype,
                device="cpu",
                kvcache=self.kv_pool,
                need_sort=False,
            )
        else:
            # full + Mamba: the attention layers' one pool and SGLang's token (page 1)
            # or paged allocator, as its pool configurator picks for a non-SWA model
            self.kv_pool = m["MHATokenToKVPool"](
                size=cfg.pool_tokens,
                page_size=cfg.page_size,
                dtype=dtype,
                head_num=heads,
                head_dim=head_dim,
                layer_num=1,
                device="cpu",
                enable_memory_saver=False,
            )
            kwargs = {"page_size": cfg.page_size} if cfg.page_size > 1 else {}
            kind = "PagedTokenToKVPoolAllocator" if cfg.page_size > 1 else "TokenToKVPoolAllocator"
            self.allocator = m[kind](
                size=cfg.pool_tokens,
                dtype=dtype,
                device="cpu",
                kvcache=self.kv_pool,
                need_sort=False,
                **kwargs,
            )
        self.row_width = cfg.max_model_len + LOOKAHEAD_MARGIN
        if cfg.has_mamba:
            # SGLang's hybrid row pool: the rows and the Mamba state pool (``MambaPool``
            # with its slot allocator), as its pool configurator builds it for a hybrid
            # model without the extra buffer
            self.req_to_token_pool = m["HybridReqToTokenPool"](
                size=MAX_RUNNING_REQUESTS,
                mamba_size=cfg.mamba_slots,
                mamba_spec_state_size=MAX_RUNNING_REQUESTS,
                max_context_len=self.row_width,
                device="cpu",
                enable_memory_saver=False,
                cache_params=_mamba_cache_params(m, torch),
                mamba_layer_ids=[MAMBA_LAYER_ID],
                enable_mamba_extra_buffer=False,
                enable_overlap_schedule=False,
            )
        else:
            self.req_to_token_pool = m["ReqToTokenPool"](
                size=MAX_RUNNING_REQUESTS,
                max_context_len=self.row_width,
                device="cpu",
                enable_memory_saver=False,
            )
        ct = m["ComponentType"]
        components = (
            (ct.FULL,) + ((ct.SWA,) if cfg.has_swa else ()) + ((ct.MAMBA,) if cfg.has_mamba else ())
        )
        params = m["CacheInitParams"](
            disable=not cfg.enable_caching,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=cfg.page_size,
            sliding_window_size=cfg.sglang_window if cfg.has_swa else None,
            tree_components=components,
            tree_core_backend=tree_core,
            enable_session_radix_cache=cfg.session_radix_cache,
            # --enable-metrics with the host tier: SGLang's counters of its copies,
            # recorded (sglang_metrics) and checked against them
            enable_metrics=cfg.hicache is not None,
        )
        #: the state copies (tree state -> the request's slot) queued by admissions with
        #: a hit and not handed over yet (``CopiesBlocks``), with their requests
        self._mamba_copies: list[tuple[str, int, int]] = []
        #: SGLang's host tier (``--enable-hierarchical-cache``), or None
        self.host: HostTier | None = None
        if cfg.has_mamba:
            # SGLang's Mamba component reads its flags as it is built (the chunk size,
            # the per-path state cap): published for the build, as its server does
            with m["get_context"]().override_server_args(page_size=cfg.page_size) as args:
                args._mamba_cache_chunk_size = MAMBA_CHUNK_SIZE
                self.cache = m["UnifiedRadixCache"](params)
        elif cfg.hicache is None:
            self.cache = m["UnifiedRadixCache"](params)
        else:
            storage_dir = storage_directory(self, cfg.hicache)
            flags = {
                **cfg.hicache.server_args(storage_dir),
                "enable_metrics": True,
                "stat_loggers": sglang_metrics.stat_loggers(),
            }
            with deployed(m["get_context"], flags) as args:
                self.cache = m["UnifiedRadixCache"](params)
                self.host = HostTier(
                    self.cache,
                    params,
                    args,
                    cfg.hicache,
                    cfg.page_size,
                    {"full": cfg.full_group, "swa": cfg.swa_group},
                    m["InitLoadBackParams"],
                    storage_dir,
                )
        self._requests: dict[str, _Request] = {}

    # ----------------------------------------------------------------- requests
    def add_request(self, request: RequestInput) -> None:
        if request.request_id in self._requests:
            raise EngineError(f"sglang adapter: request_id {request.request_id!r} exists")
        m = self._m
        req = m["Req"](
            request.request_id, "", array("q", request.prompt_token_ids), m["SamplingParams"]()
        )
        req.extra_key = request.lora_name
        req.cache_salt = request.cache_salt or None
        if self.config.session_radix_cache and req.cache_salt is not None:
            # SGLang's scheduler for a request of a radix-native session
            req.session_id = req.cache_salt
            req.session_generation = self.cache.ensure_session_generation(req.cache_salt)
        req.refresh_fill_ids()
        # every other request publishes its prefix after each prefill step, as SGLang's
        # scheduler does; the others at free only, so both insert paths are driven
        self._requests[request.request_id] = _Request(
            req=req,
            tokens=list(request.prompt_token_ids),
            checkpoints=len(self._requests) % 2 == 1 and not self.config.has_mamba,
        )
        if self.host is not None:
            self.host.prefetch(req)

    def append_output_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        state = self._get(request_id)
        state.req.output_ids.extend(int(t) for t in token_ids)
        state.tokens.extend(int(t) for t in token_ids)
        state.req.refresh_fill_ids()

    def set_num_computed_tokens(self, request_id: str, num_computed_tokens: int) -> None:
        state = self._get(request_id)
        if num_computed_tokens < 0 or num_computed_tokens > len(state.tokens) + LOOKAHEAD_MARGIN:
            raise EngineError(
                f"sglang adapter: num_computed_tokens out of range for "
                f"{request_id!r}: {num_computed_tokens}"
            )
        state.num_computed_tokens = num_computed_tokens
        kv = state.req.kv
        if kv.holds_kv:
            kv.kv_committed_len = min(num_computed_tokens, kv.kv_allocated_len)
        self._publish_processed(state)

    def _publish_processed(self, state: _Request) -> None:
        """A step's output was processed (synchronous scheduling: as soon as it ran): a
        request that publishes its prefix after each prefill chunk does so now
        (``checkpoint_kv_cache``), once nothing of it is in flight and no asynchronous
        load is pending. Under its overlap scheduler SGLang checkpoints a chunk while the
        next one may already run (``stash_chunked_request``), and the insert can re-point
        the request's row to the tree's copy of the same prefix: safe on one device
        stream, but the blocks the running chunk reads would leave its table
        (``findings/sglang/README.md``, the overlap checkpoint), so the adapter waits
        for the flight to land.
        Example: a 20-token prompt computed in chunks of 8 synchronously publishes 8, then
        16 tokens."""
        kv = state.req.kv
        processed = state.num_computed_tokens - state.num_in_flight_tokens
        previous, state.num_processed = state.num_processed, processed
        if (
            kv.holds_kv
            and state.checkpoints
            and not state.loading
            and state.num_in_flight_tokens == 0
            and previous < len(state.req.origin_input_ids)
            and processed > previous
        ):
            self._checkpoint_unfinished(state, min(processed, kv.kv_committed_len))

    def _checkpoint_unfinished(self, state: _Request, up_to: int) -> None:
        """After a prefill (extend) step, publish what the running request computed, as
        SGLang's scheduler does (``checkpoint_kv_cache``): the tree takes the page-aligned
        prefix ``[protected, up_to)``, frees the request's slots it already held, rewrites
        the row with its own and moves the request's lock onto the inserted node.

        Then pages of the row below the lock's SWA window are tree-owned and unlocked, so
        they read null in the SWA group (note 6). Example: bs 2, sws 3, a 9-token prompt
        computed in one chunk of 9: the tree takes 8 tokens (4 pages); the lock keeps
        ``ceil(3 / 2) = 2`` SWA pages, so pages 0 and 1 read null.
        """
        req, kv = state.req, state.req.kv
        if up_to <= kv.cache_protected_len:
            return
        # the round just computed ends at ``up_to`` (SGLang's ``PrefillAdder`` sets
        # ``extend_end`` per chunk; ``get_fill_ids`` is the fill ids up to it): after a
        # branch insert the tree frees the request's out-of-window SWA slots up to the
        # fill ids' end, so the whole prompt there would free row entries past the chunk
        req.extend_end = up_to
        self.cache.checkpoint(req, up_to=up_to)
        page = self.config.page_size
        kept = _cdiv(max(self.config.sglang_window, page), page)
        state.swa_unlocked_pages = max(
            state.swa_unlocked_pages, kv.cache_protected_len // page - kept
        )

    # ------------------------------------------------------------ serving modes
    def set_in_flight(
        self, request_id: str, num_in_flight_tokens: int, num_pending_tokens: int
    ) -> None:
        """Asynchronous scheduling (SGLang's overlap scheduler plans a batch while the
        previous one runs): the window slides on the processed tokens only, ``computed -
        in flight`` (note 6). Pending sampled tokens need nothing: SGLang's rows hold
        their slots already."""
        state = self._get(request_id)
        if num_in_flight_tokens < 0 or num_pending_tokens < 0:
            raise EngineError(
                f"sglang adapter: negative in-flight counts for {request_id!r}: "
                f"{num_in_flight_tokens}, {num_pending_tokens}"
            )
        state.num_in_flight_tokens = num_in_flight_tokens
        self._publish_processed(state)

    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        """The scheduler committed the processed tokens ``[0, num_tokens)``. SGLang
        publishes a request's prefix when it frees it and, for the requests that do,
        after each prefill step (note 7), so the commit itself inserts nothing; it ends
        an asynchronous load (``delay_cache_blocks``), after which those steps publish
        again."""
        state = self._get(request_id)
        if num_tokens < 0 or num_tokens > len(state.tokens) + LOOKAHEAD_MARGIN:
            raise EngineError(
                f"sglang adapter: cache_blocks({request_id!r}, {num_tokens}) out of range"
            )
        state.loading = False
        self._publish_processed(state)

    def new_step(self) -> None:
        """A scheduler step begins: with HiCache, SGLang's scheduler polls its transfers
        first (``check_hicache_events``: the queued backups are submitted, finished writes
        publish their nodes as host-backed and unlock them, finished loads unlock theirs).
        With no request holding a row, SGLang's idle self-check runs (``on_idle`` ->
        ``InvariantChecker._check_tree_cache`` -> ``UnifiedRadixCache.sanity_check``: the
        tree's structure, leaf sets, LRU lists, sizes and ongoing copies; SGLang gates it
        behind ``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK``, the adapter deploys it on): an
        inconsistency is SGLang's own assertion, an engine error."""
        if self.host is not None:
            self.host.pump_storage()
            self.cache.check_hicache_events()
            self.host.audit_metrics()
        if self.config.enable_caching and not any(
            s.req.kv.holds_kv for s in self._requests.values()
        ):
            self.cache.sanity_check()

    def remove_request(self, request_id: str) -> None:
        state = self._get(request_id)
        if state.req.kv.holds_kv:
            self.free(request_id)
        if self.host is not None:
            self.host.release(state.req)
        del self._requests[request_id]
        session = state.req.session_id
        if session is not None and not any(
            s.req.session_id == session for s in self._requests.values()
        ):
            # the session's last request left: it closes (``close_session`` ->
            # ``release_radix_session``)
            self.cache.release_radix_session(session)

    # ---------------------------------------------------------------- lookups
    def get_computed_blocks(self, request_id: str) -> CacheHit:
        state = self._get(request_id)
        state.pending = None
        n = len(state.tokens)
        req = state.req
        if self.host is not None and not req.kv.holds_kv:
            self.host.prefetch_done(req)
        # SGLang's scheduler matches every request (``match_kv_cache``), a one-token
        # prompt (key limit 0) and a tree with caching off (``disable``) included
        limit = req._compute_max_prefix_len(n)  # SGLang's own cap: n - 1
        key = self._m["RadixKey"](
            array("q", state.tokens),
            extra_key=req.extra_key,
            limit=limit,
            cache_salt=req.cache_salt,
        )
        match = self.cache.match_prefix(self._m["MatchPrefixParams"](key=key, req=req))
        hit = int(match.device_prefix_len)
        page = self.config.page_size
        if hit > max(0, n - 1) or hit % page or (hit and not self.config.enable_caching):
            raise EngineError(
                f"sglang adapter: match_prefix returned {hit} tokens for "
                f"{n} tokens at page size {page}"
            )
        pending = _PendingHit(
            match.last_device_node,
            hit,
            match.swa_branching_seqlen,
            match.best_match_node,
            int(match.host_hit_length),
            int(match.swa_host_hit_length),
        )
        if self.host is not None and (pending.host_hit_length or pending.swa_host_hit_length):
            pending.host_tokens = self.host.tokens_to_load(match.best_match_node, hit, req)
        if hit == 0:
            state.pending = pending if pending.host_tokens else None
            return CacheHit(self._block_ids_of([]), 0)
        slots = self.cache.path_device_indices(match.last_device_node)
        if int(slots.numel()) != hit:
            raise EngineError(
                f"sglang adapter: matched node holds {int(slots.numel())} "
                f"slots for a hit of {hit} tokens"
            )
        state.pending = pending
        mamba = ()
        if self.config.has_mamba:
            # the hit's state: the Mamba value of the node SGLang copies it from on
            # admission (``finalize_match_result_in_cache`` with ``cow_mamba``)
            source = self.cache.tree_core.get_component_device_value(
                match.best_match_node, self._m["ComponentType"].MAMBA
            )
            if source is None:
                raise EngineError(f"sglang adapter: a hit of {hit} tokens without a Mamba state")
            pending.match = match
            pending.key = key
            mamba = (int(source.view(-1)[0]),)
        return CacheHit(self._block_ids_of(slots.tolist(), mamba), hit)

    def get_block_ids(self, request_id: str) -> BlockIds:
        kv = self._get(request_id).req.kv
        if not kv.holds_kv or kv.kv_allocated_len == 0:
            return self._block_ids_of([])
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx, : kv.kv_allocated_len]
        ids = self._block_ids_of(row.tolist(), self._mamba_row(kv))
        unlocked = self._get(request_id).swa_unlocked_pages
        if unlocked and self.config.has_swa:
            swa = self.config.swa_group
            ids = tuple(
                (0,) * unlocked + g[unlocked:] if gid == swa else g for gid, g in enumerate(ids)
            )
        return ids

    # ------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        hit: CacheHit | None = None,
        num_lookahead_tokens: int = 0,
        *,
        full_sequence_must_fit: bool = False,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> BlockIds | None:
        state = self._get(request_id)
        kv = state.req.kv
        hit_tokens = hit.num_tokens if hit is not None else 0
        external = num_external_computed_tokens
        if num_new_computed_tokens != hit_tokens:
            raise EngineError(
                f"sglang adapter: num_new_computed_tokens "
                f"{num_new_computed_tokens} != hit.num_tokens {hit_tokens}"
            )
        if num_new_tokens < 0 or num_lookahead_tokens < 0 or external < 0:
            raise EngineError(
                f"sglang adapter: negative token count for {request_id!r}: "
                f"new={num_new_tokens} lookahead={num_lookahead_tokens} external={external}"
            )
        admitted_now = False
        if not kv.holds_kv:
            if full_sequence_must_fit and not self._whole_sequence_fits(state, hit_tokens):
                return None
            if external and not self._load_back(state, hit_tokens, external):
                return None
            if self.config.has_mamba:
                if not self._admit_mamba(state, hit_tokens):
                    return None
                admitted_now = True
                self._admit(state, hit_tokens, state.req.kv.req_pool_idx)
            else:
                rows = self.req_to_token_pool.alloc_rows(1)
                if rows is None:
                    return None
                admitted_now = True
                hit_tokens += external
                self._admit(state, hit_tokens, rows[0])
        elif hit_tokens or external:
            raise EngineError(
                f"sglang adapter: a hit or external tokens for running request {request_id!r}"
            )
        elif state.num_computed_tokens > 0 and self.config.has_swa:
            self._slide_window(state)
        state.loading = delay_cache_blocks
        computed = state.num_computed_tokens + hit_tokens
        target = computed + num_new_tokens + num_lookahead_tokens
        if target > self.row_width:
            raise EngineError(
                f"sglang adapter: {request_id!r} needs {target} slots, row holds {self.row_width}"
            )
        before = kv.kv_allocated_len
        new_slots: list[int] | None = []
        if target > before:
            decode = not admitted_now and computed >= len(state.req.origin_input_ids)
            new_slots = self._alloc(kv, before, target, decode=decode)
        if new_slots is None:
            if admitted_now:
                self._rollback_admission(state)
            return None
        page = self.config.page_size
        first_new_page = _cdiv(before, page)
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx, :target].tolist()
        ids = self._block_ids_of(row, self._mamba_row(kv) if admitted_now else ())
        mamba = self.config.mamba_group
        return tuple(g if gid == mamba else tuple(g[first_new_page:]) for gid, g in enumerate(ids))

    def _whole_sequence_fits(self, state: _Request, hit_tokens: int) -> bool:
        """The admission gate (``full_sequence_must_fit``), SGLang's ``PrefillAdder``
        budget: the request is admitted only if every token it has past its hit fits in
        both pools now, evicting unlocked tree entries. Example: bs 2, a 20-token request
        with a 4-token hit needs 8 pages in the full and the SWA pool."""
        page = self.config.page_size
        need = (_cdiv(len(state.tokens), page) - hit_tokens // page) * page
        return min(self._obtainable_slots()) >= need

    def _load_back(self, state: _Request, hit_tokens: int, external: int) -> bool:
        """An admission with a host hit (HiCache): SGLang's ``init_load_back`` of the
        lookup's ``best_match_node`` (``PrefillAdder.add_one_req``), which loads
        ``external`` tokens past the device hit into fresh device pages of the tree, and
        the copy starts. False when SGLang loaded nothing (its device pool is short even
        after evicting): the admission is refused."""
        pending = state.pending
        if (
            self.host is None
            or pending is None
            or pending.num_tokens != hit_tokens
            or pending.host_tokens != external
        ):
            raise EngineError(
                f"sglang adapter: {external} external tokens for {state.req.rid!r}, but its "
                f"lookup found {0 if pending is None else pending.host_tokens} on the host"
            )
        req = state.req
        req.last_node = pending.node
        req.host_hit_length = pending.host_hit_length
        req.swa_host_hit_length = pending.swa_host_hit_length
        node = self.host.load_back(pending.best_match_node, pending.host_hit_length, req, external)
        if node is None:
            return False
        slots = self.cache.path_device_indices(node)
        if int(slots.numel()) != hit_tokens + external:
            raise EngineError(
                f"sglang adapter: the loaded node holds {int(slots.numel())} slots for "
                f"{hit_tokens} + {external} tokens"
            )
        pending.node = node
        pending.num_tokens = hit_tokens + external
        return True

    def _slide_window(self, state: _Request) -> None:
        """The decode-time window slide of SGLang's ``ScheduleBatch.maybe_evict_swa``, in a
        free group as there: free the out-of-window SWA slots the request owns, and once
        the window ``[p - sws, p]`` has passed the tree-owned prefix (``p - sws >=
        protected``), release the SWA part of the request's tree lock
        (``release_swa_prefix_lock``), which leaves the prefix's SWA pages evictable: they
        read null from then on. Example: sws 3, a protected prefix of 8 tokens, bs 2: at
        ``p = 11`` the lock's SWA part is released and pages 0-3 read null."""
        req, kv = state.req, state.req.kv
        p = state.num_computed_tokens - state.num_in_flight_tokens
        self.allocator.free_group_begin()
        self.cache.evict_sliding_windows(req, p)
        self.allocator.free_group_end()
        protected = kv.cache_protected_len
        if req.lock is not None and protected and p - self.config.sglang_window >= protected:
            self.cache.release_swa_prefix_lock(req)
            page = self.config.page_size
            state.swa_unlocked_pages = max(state.swa_unlocked_pages, protected // page)

    def _admit(self, state: _Request, hit_tokens: int, row: int) -> None:
        """Take ``row``, lock and write the hit (what ``match_kv_cache`` records)."""
        req, kv = state.req, state.req.kv
        kv.req_pool_idx = row
        pending = state.pending
        state.pending = None
        if hit_tokens and (pending is None or pending.num_tokens != hit_tokens):
            raise EngineError(
                f"sglang adapter: allocate_slots got a hit of {hit_tokens} tokens "
                f"for {req.rid!r} without a matching get_computed_blocks"
            )
        # SGLang locks the matched node of every admitted request, the root for a miss
        # (``PrefillAdder._commit_prefill_admission``: ``tree_cache.lock(req.last_node)``)
        if hit_tokens:
            node = pending.node
        else:  # a miss (or no lookup): the root
            node = self.cache.tree_core.empty_match_result.last_device_node
        req.lock = self.cache.lock(node)
        if hit_tokens:
            slots = self.cache.path_device_indices(pending.node)
            self.req_to_token_pool.write((kv.req_pool_idx, slice(0, hit_tokens)), slots)
            req.last_node = pending.node
            req.swa_branching_seqlen = pending.swa_branching_seqlen
        if self.config.has_swa:
            page = self.config.page_size
            kept = _cdiv(max(self.config.sglang_window, page), page)
            state.swa_unlocked_pages = max(0, hit_tokens // page - kept)
        req.prefix_len = hit_tokens
        kv.cache_protected_len = hit_tokens
        kv.kv_allocated_len = hit_tokens
        kv.kv_committed_len = hit_tokens

    def _rollback_admission(self, state: _Request) -> None:
        req = state.req
        self.cache.unlock(req.lock)
        if self.config.has_mamba and req.kv.holds_mamba:
            self._drop_mamba_copy(req.rid)
            self.req_to_token_pool.free_mamba_cache(req)
            req.kv.mamba_cow_src_index = None
        self.req_to_token_pool.free(req)
        req.kv.mark_kv_released()
        req.reset_for_retract()

    def _admit_mamba(self, state: _Request, hit_tokens: int) -> bool:
        """A Mamba layout's admission (note 10): with the matched node locked, SGLang's
        ``ensure_mamba_capacity`` (evict tree states until the request's state slot is
        free; False: the admission is refused), then for a hit SGLang's copy-on-write of
        the matched state (``finalize_match_result_in_cache`` with ``cow_mamba``: a slot
        of the request's own, the node's state as its source), then the row and, for a
        miss, a fresh state slot (``HybridReqToTokenPool.alloc``). The copy is queued
        (``pending_block_copies``) and runs when the step's copies are handed over.
        Example: a hit on a node holding state 3 admits with slot 5 and queues
        ``(3, 5)``."""
        m, req = self._m, state.req
        pending = state.pending
        if hit_tokens and (pending is None or pending.num_tokens != hit_tokens):
            return True  # _admit reports the mismatch
        root = self.cache.tree_core.empty_match_result.last_device_node
        lock = self.cache.lock(pending.node if hit_tokens else root)
        try:
            if not m["ensure_mamba_capacity"](self.req_to_token_pool, [req], self.cache):
                return False
            if hit_tokens:
                mamba = self.cache.components[m["ComponentType"].MAMBA]
                params = m["MatchPrefixParams"](key=pending.key, req=req, cow_mamba=True)
                mamba.finalize_match_result_in_cache(params, pending.match)
            rows = self.req_to_token_pool.alloc([req])
            if rows is None:
                if req.kv.holds_mamba:
                    self.req_to_token_pool.free_mamba_cache(req)
                req.kv.mamba_cow_src_index = None
                return False
        finally:
            self.cache.unlock(lock)
        source = req.kv.mamba_cow_src_index
        if source is not None:
            self._mamba_copies.append(
                (req.rid, int(source.view(-1)[0]), int(req.kv.mamba_pool_idx))
            )
        return True

    def _drop_mamba_copy(self, request_id: str) -> None:
        self._mamba_copies = [c for c in self._mamba_copies if c[0] != request_id]

    def pending_block_copies(self) -> list[tuple[int, int]]:
        """``CopiesBlocks``: the Mamba state copies queued since the last hand-over
        (``(tree state, the request's slot)``, note 10)."""
        return [(source, target) for _, source, target in self._mamba_copies]

    def take_block_copies(self) -> list[tuple[int, int]]:
        """``CopiesBlocks``: the step's copies run, as SGLang's model runner does before
        an extend batch (``ScheduleBatch``'s deferred copy-on-write and clear, then
        ``HybridReqToTokenPool.copy_mamba_state`` and ``MambaPool.clear_slots``): each
        admitted request's slot gets its matched state, or is zeroed for a miss."""
        taken = self.pending_block_copies()
        self._mamba_copies = []
        if not self.config.has_mamba:
            return taken
        pool = self.req_to_token_pool
        for s in self._requests.values():
            kv = s.req.kv
            if not kv.holds_mamba:
                continue
            slot = kv.mamba_pool_idx.view(1)
            if kv.mamba_cow_src_index is not None:
                source = kv.mamba_cow_src_index.view(-1)
                pool.copy_mamba_state(
                    pool.translate_mamba_indices(source), pool.translate_mamba_indices(slot)
                )
                kv.mamba_cow_src_index = None
            elif kv.mamba_needs_clear:
                pool.mamba_pool.clear_slots(pool.translate_mamba_indices(slot))
            kv.mamba_needs_clear = False
        return taken

    def _obtainable_slots(self) -> tuple[int, int]:
        """Slots an allocation could obtain now in the full and the SWA pool: available
        plus evictable (unlocked tree entries). Without an SWA group both are the full
        pool's."""
        if not self.config.has_swa:
            full = self.allocator.available_size() + self.cache.full_evictable_size()
            return full, full
        full = self.allocator.full_available_size() + self.cache.full_evictable_size()
        swa = self.allocator.swa_available_size() + self.cache.swa_evictable_size()
        return full, swa

    def _obtainable_states(self) -> int:
        """Mamba state slots an admission could obtain now: free slots plus the tree's
        unlocked states (``ensure_mamba_capacity`` evicts them)."""
        free = self.req_to_token_pool.mamba_allocator.available_size()
        return free + self.cache.mamba_evictable_size()

    def _alloc(self, kv: Any, before: int, target: int, decode: bool) -> list[int] | None:
        """Allocate slots ``[before, target)`` of the row as SGLang's scheduler does (note
        5); ``None`` when SGLang's own checks refuse.

        ``decode`` (one slot of a request past its prompt): ``check_decode_capacity`` with
        the page growth, then ``alloc_for_decode``. Otherwise ``alloc_for_extend``: evict
        ``need`` (bs 1) or ``need + bs`` tokens (SGLang's one-extra-page estimate), then the
        allocator answers. Example: bs 2, a row of 5 slots, target 6: a decode within page
        2, growth 0: the check evicts nothing and passes, ``alloc_decode`` hands out the
        slot after slot 4's.
        """
        m = self._m
        torch = m["torch"]
        page = self.config.page_size
        need = target - before
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        last = int(row[before - 1]) if before > 0 else -1

        def t(v: int) -> Any:
            return torch.tensor([v], dtype=torch.int64)

        if decode and need == 1:
            growth = (_cdiv(target, page) - _cdiv(before, page)) * page
            if not self.allocator.check_decode_capacity(num_tokens=growth, tree_cache=self.cache):
                return None
            m["evict_from_tree_cache"](self.cache, page)
            if page == 1:
                out = self.allocator.alloc(1)
            else:
                out = self.allocator.alloc_decode(t(target), t(target), t(last))
            if out is None:
                raise EngineError(
                    f"sglang adapter: the decode allocation failed after "
                    f"check_decode_capacity({growth}) passed"
                )
        elif page == 1:
            m["evict_from_tree_cache"](self.cache, need)
            out = self.allocator.alloc(need)
        else:
            m["evict_from_tree_cache"](self.cache, need + page)
            out = self.allocator.alloc_extend(
                t(before), t(before), t(target), t(target), t(last), need
            )
        if out is None:
            return None
        self.req_to_token_pool.write((kv.req_pool_idx, slice(before, target)), out.to(torch.int32))
        kv.kv_allocated_len = target
        return out.tolist()

    # ------------------------------------------------------------------- free
    def free(self, request_id: str) -> None:
        state = self._get(request_id)
        kv = state.req.kv
        state.pending = None
        self._drop_mamba_copy(request_id)
        kv.mamba_cow_src_index = None
        if not kv.holds_kv:
            return
        # SGLang releases finished requests inside a free group (the result processing
        # of a batch): the pools take the freed slots back at free_group_end
        self.allocator.free_group_begin()
        try:
            self._release(state)
        finally:
            self.allocator.free_group_end()
        state.num_in_flight_tokens = 0
        state.num_processed = 0
        state.loading = False

    def _release(self, state: _Request) -> None:
        """``release_kv_cache(req, checkpoint=...)`` of note 7: with the insert unless
        :meth:`_inserts_at_release` says no."""
        req, kv = state.req, state.req.kv
        page = self.config.page_size
        committed = min(state.num_computed_tokens, kv.kv_allocated_len)
        kv.kv_committed_len = committed
        req.refresh_fill_ids()
        checkpoint = committed > 0 and self._inserts_at_release(state)
        if checkpoint:
            req.finished_reason = self._m["FINISH_LENGTH"](length=len(req.output_ids))
            self.cache.checkpoint(req, up_to=committed)
        # the tree owns [0, protected) (the adopted hit, a loaded host hit, what was
        # published): never the request's to free, also when nothing was computed (a
        # failed asynchronous load resets the computed tokens to 0)
        protected = kv.cache_protected_len
        ranges = [
            (protected, committed),
            (max(protected, _cdiv(committed, page) * page), kv.kv_allocated_len),
        ]
        ranges = [(a, b) for a, b in ranges if a < b]
        if ranges:
            self.cache.free_kv_row(kv, ranges)
        self.cache.unlock(req.lock)
        req.lock = None
        self.cache.on_release(req, checkpointed=checkpoint)
        self.req_to_token_pool.free(req)
        kv.mark_kv_released()
        req.finished_reason = None
        req.reset_for_retract()

    @staticmethod
    def _inserts_at_release(state: _Request) -> bool:
        """Whether ``free`` inserts the request's computed prefix first (SGLang's
        ``release_kv_cache(..., checkpoint=True)``). Not while its prompt is still being
        computed: SGLang frees a request mid-prefill only when it aborts its chunked
        request, without an insert (``Scheduler``: ``release_kv_cache(req, tree_cache,
        checkpoint=False)``; only decoding requests are retracted). Example: a 20-token
        prompt freed after a first chunk of 8 -> no insert; after its first output token
        -> insert."""
        return state.num_computed_tokens >= len(state.req.origin_input_ids)

    def reset_prefix_cache(self) -> bool:
        if any(s.req.kv.holds_kv for s in self._requests.values()):
            return False
        self.cache.reset()
        self.req_to_token_pool.clear()
        self.allocator.clear()
        for s in self._requests.values():
            s.pending = None
        return True

    # -------------------------------------------------------------- host tier
    def host_hit(self, request_id: str) -> int:
        """``OwnsHostTier``: the tokens past the last lookup's device hit that SGLang's
        admission would load back from its host tier (0 without HiCache, or where its
        ``load_back`` declines: :meth:`HostTier.tokens_to_load`)."""
        pending = self._get(request_id).pending
        return 0 if pending is None else pending.host_tokens

    def host_pools(self) -> tuple[HostPoolUsage, ...]:
        """``OwnsHostTier``: SGLang's host pools (none without HiCache)."""
        if self.host is None:
            return ()
        return self.host.pools(idle=not any(s.req.kv.holds_kv for s in self._requests.values()))

    def take_host_transfers(self) -> list[HostTransfer]:
        """``OwnsHostTier``: the copies between the tiers since the last call."""
        return [] if self.host is None else self.host.take_transfers()

    def num_free_blocks(self) -> int:
        return min(p.num_free for p in self.pool_usage())

    def pool_usage(self) -> tuple[PoolUsage, ...]:
        """The full pool (``pool_pages`` pages) and the SWA pool (``swa_pool_pages``), free =
        obtainable slots // page."""
        cfg = self.config
        full, swa = self._obtainable_slots()
        pools = [PoolUsage("full", (cfg.full_group,), cfg.pool_pages, full // cfg.page_size)]
        if cfg.has_swa:
            pools.append(
                PoolUsage(
                    "swa",
                    (cfg.swa_group,),
                    cfg.swa_pool_tokens // cfg.page_size,
                    swa // cfg.page_size,
                )
            )
        if cfg.has_mamba:
            pools.append(
                PoolUsage("mamba", (cfg.mamba_group,), cfg.mamba_slots, self._obtainable_states())
            )
        return tuple(pools)

    # ---------------------------------------------------------------- helpers
    def _block_ids_of(self, slots: list[int], mamba: tuple[int, ...] = ()) -> BlockIds:
        """Page ids per group for a row of full-pool slots (first slot of each page);
        ``mamba``: the Mamba group's row (note 10)."""
        cfg = self.config
        page = cfg.page_size
        heads = slots[::page]
        ids: list[tuple[int, ...]] = [() for _ in self.layout.groups]
        ids[cfg.full_group] = tuple(int(s) // page for s in heads)
        if cfg.swa_group is not None:
            mapping = self.allocator.full_to_swa_index_mapping
            ids[cfg.swa_group] = tuple(int(mapping[s]) // page for s in heads) if heads else ()
        if cfg.mamba_group is not None:
            ids[cfg.mamba_group] = mamba
        return tuple(ids)

    @staticmethod
    def _mamba_row(kv: Any) -> tuple[int, ...]:
        """The Mamba group's row of a request: its state slot (note 10)."""
        return (int(kv.mamba_pool_idx),) if kv.holds_mamba else ()

    def _get(self, request_id: str) -> _Request:
        state = self._requests.get(request_id)
        if state is None:
            raise EngineError(f"sglang adapter: unknown request_id {request_id!r}")
        return state


def _mamba_cache_params(m: dict[str, Any], torch: Any) -> Any:
    """A small Mamba2 state (one layer, a conv state and an SSM state in float32): the
    pool's slot accounting does not depend on the state's size."""
    shape = m["Mamba2StateShape"].create(
        tp_world_size=1,
        intermediate_size=8,
        n_groups=1,
        num_heads=2,
        head_dim=4,
        state_size=2,
        conv_kernel=2,
    )
    dtypes = m["Mamba2StateDType"](conv=torch.float32, temporal=torch.float32)
    return m["Mamba2CacheParams"](shape=shape, layers=[MAMBA_LAYER_ID], dtype=dtypes)


def _dtype_bytes(layout: KVCacheLayout) -> int:
    return getattr(layout.groups[0].spec, "dtype_bytes", 2)


def _heads(layout: KVCacheLayout) -> tuple[int, int]:
    spec = layout.groups[0].spec
    return getattr(spec, "num_kv_heads", 1), getattr(spec, "head_size", 8)


def make_engine(layout: KVCacheLayout) -> SGLangEngine:
    """SGLang with the Python tree core."""
    return SGLangEngine(layout, tree_core="python")


def make_engine_rust(layout: KVCacheLayout) -> SGLangEngine:
    """SGLang with the bundled Rust tree core."""
    return SGLangEngine(layout, tree_core="rust")


#: The group kinds of the layouts :func:`sglang_layouts` draws: SGLang's hybrid SWA
#: models, its hybrid linear-attention models (full + Mamba: Qwen3-Next, Nemotron-H,
#: Falcon-H1, Jamba) and both at once (full + SWA + Mamba).
LAYOUT_KINDS = ("swa", "mamba", "swa+mamba")
#: How often each kind is drawn, in sixths: full + SWA four times in six (it alone
#: deploys HiCache and sessions, whose paths need the most draws), each Mamba kind once.
LAYOUT_KIND_SIXTHS = {"swa": 4, "mamba": 1, "swa+mamba": 1}


def sglang_layouts(kinds: Sequence[str] = LAYOUT_KINDS):
    """The layouts this adapter drives: one full-attention group with a sliding-window
    group (``w >= 2``), a Mamba group or both; the attention groups share one block size
    (SGLang's page size) in ``SUPPORTED_PAGE_SIZES``; a Mamba group holds one state per
    request (``"align"``, ``block_size = max_model_len``) and comes with page 1 when
    prefix caching is on (:func:`_check_mamba_spec`). Prefix caching is off in one layout
    of eight. ``kinds``: a subset of :data:`LAYOUT_KINDS`."""
    from hypothesis import strategies as st

    from reference.layout import KVCacheGroup

    @st.composite
    def build(draw) -> KVCacheLayout:
        weighted = [k for k in kinds for _ in range(LAYOUT_KIND_SIXTHS[k])]
        kind = draw(st.sampled_from(weighted)) if len(set(kinds)) > 1 else kinds[0]
        if kind == "swa":  # the draws of the full + SWA layouts before Mamba came
            page = draw(st.sampled_from(SUPPORTED_PAGE_SIZES))
            window = draw(st.integers(2, 6 * page))
            full_first = draw(st.booleans())
            max_len = draw(st.integers(8 * page, 96))
            num_blocks = draw(_pool_blocks(max_len, page))
            # one layout in eight turns prefix caching off (SGLang's ``disable``)
            caching = draw(st.integers(0, 7)) != 0
            full, swa = _full_group(page), _swa_group(page, window)
            groups = (full, swa) if full_first else (swa, full)
            return KVCacheLayout(groups, num_blocks, max_len, enable_caching=caching)
        caching = draw(st.integers(0, 7)) != 0
        page = 1 if caching else draw(st.sampled_from(SUPPORTED_PAGE_SIZES))
        max_len = draw(st.integers(8 * page, 96))
        max_len -= max_len % page  # the Mamba block (max_model_len) is whole pages
        found = [_full_group(page)]
        if kind == "swa+mamba":
            found.append(_swa_group(page, draw(st.integers(2, 6 * page))))
        found.append(KVCacheGroup(("layer.mamba",), MambaSpec(block_size=max_len)))
        order = draw(st.permutations(range(len(found))))
        num_blocks = draw(_pool_blocks(max_len, page))
        groups = tuple(found[i] for i in order)
        return KVCacheLayout(groups, num_blocks, max_len, enable_caching=caching)

    def _pool_blocks(max_len: int, page: int):
        per_request = -(-max_len // page) + 1
        return st.integers(per_request + 2, 4 * per_request)

    def _full_group(page: int) -> KVCacheGroup:
        return KVCacheGroup(("layer.full",), FullAttentionSpec(block_size=page))

    def _swa_group(page: int, window: int) -> KVCacheGroup:
        return KVCacheGroup(
            ("layer.swa",), SlidingWindowSpec(block_size=page, sliding_window=window)
        )

    return build()


make_engine.layout_strategy = sglang_layouts  # type: ignore[attr-defined]
make_engine_rust.layout_strategy = sglang_layouts  # type: ignore[attr-defined]
#: The group types the adapter builds (SGLang's full, SWA and Mamba state pools): pairs
#: with chunked local attention are the adapter's exclusions, not gaps of the draws.
SGLANG_SPEC_TYPES = ("full", "sliding_window", "mamba")
make_engine.spec_types = SGLANG_SPEC_TYPES  # type: ignore[attr-defined]
make_engine_rust.spec_types = SGLANG_SPEC_TYPES  # type: ignore[attr-defined]
#: The SGLang modules the adapter drives: the radix cache, its Python tree core and
#: components, and the SWA allocator with its token allocators (``--engine-coverage``).
SGLANG_COVERAGE_MODULES = (
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core",
    "sglang.srt.mem_cache.unified_cache.components.full",
    "sglang.srt.mem_cache.unified_cache.components.swa",
    "sglang.srt.mem_cache.unified_cache.components.mamba",
    "sglang.srt.mem_cache.allocator.swa",
    "sglang.srt.mem_cache.allocator.mamba",
    "sglang.srt.mem_cache.allocator.token",
)
make_engine.coverage_modules = SGLANG_COVERAGE_MODULES  # type: ignore[attr-defined]
#: The production settings the adapter implements: external hits, served by SGLang's own
#: host tier (HiCache, :meth:`SGLangEngine.host_hit`); the serving modes come with
#: ``SupportsServingModes`` (asynchronous scheduling, the admission gate, drafts).
SGLANG_PRODUCTION_SETTINGS = ("external",)
make_engine.production_settings = SGLANG_PRODUCTION_SETTINGS  # type: ignore[attr-defined]
make_engine_rust.production_settings = SGLANG_PRODUCTION_SETTINGS  # type: ignore[attr-defined]
