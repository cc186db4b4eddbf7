"""vLLM 0.33.0 adapter: vLLM's own ``KVCacheManager`` behind the engine protocol.

Run it with the interpreter of ``.engines/vllm`` (``bash ci/engines/vllm`` builds it);
vLLM is imported lazily inside :func:`make_engine`, so importing this module never
needs vLLM. The package it imports is a parameter (:class:`V1CoreAPI`: the top-level
package and the API differences of a fork), so a fork that ships vLLM's v1 core is
driven by this same adapter (:mod:`properties.engines.aphrodite`).

How our layout maps to vLLM objects
-----------------------------------
* Each :class:`reference.layout.KVCacheGroup` becomes one ``KVCacheGroupSpec(layer_names,
  spec)`` in the same order, inside ``KVCacheConfig(num_blocks, kv_cache_tensors=[],
  kv_cache_groups)``. ``num_blocks`` counts the null block on both sides.
* Specs: ``FullAttentionSpec`` / ``RSWASpec(rswa_window=W)`` / ``CircularBufferSpec`` /
  ``SlidingWindowSpec(sliding_window=w)`` /
  ``ChunkedLocalAttentionSpec(attention_chunk_size=C)`` with our ``block_size``,
  ``num_kv_heads``, ``head_size``, ``page_size_padded``, and ``dtype`` chosen by
  ``dtype_bytes`` (1: uint8, 2: float16, 4: float32, 8: float64), so vLLM's page size
  equals ours. ``MambaSpec(shapes, dtypes=(dtype,) * len(shapes), page_size_padded,
  mamba_cache_mode, num_speculative_blocks, num_prefill_checkpoint_blocks,
  prefill_checkpoint_alignment)`` (our fields, same names).
* ``KVCacheManager(config, max_model_len, scheduler_block_size, hash_block_size,
  max_in_flight_tokens=layout.max_in_flight_tokens,
  enable_caching=layout.enable_caching, log_stats=on, enable_kv_cache_events=on)`` with
  ``on = observes_stats_and_events(layout)`` (off for one layout in four),
  ``dcp_world_size``, ``pcp_world_size`` (context parallelism: an attention spec's block
  size is the layout's divided by the DCP size); the scheduler and hash block sizes are
  vLLM's own (``resolve_kv_cache_block_sizes`` and ``resolve_cache_hit_alignment_tokens``
  from a config carrying what they read), which must equal the layout's;
  watermark 0, no EAGLE, no connector. Every other request asks for the ``full`` KV event
  report mode (events for its reused blocks too) and passes the lookup bound explicitly.
  KV events are drained at every ``new_step`` and
  after ``reset_prefix_cache`` and checked against the pool (every cached hash was
  announced by a ``BlockStored``, every ``BlockRemoved`` names an announced one); each
  admission with a lookup is recorded (``record_prefix_cache_stats``, as vLLM's scheduler
  does) and the prefix cache stats taken at every step must match the admissions;
  ``usage`` is checked at every step; ``free_queue`` compares ``get_all_free_blocks`` with
  the cursor walk ``iter_blocks_after``. With stats and events off, the stats must be
  ``None`` and no event may come. Every step the blocks vLLM would zero
  (``take_new_block_ids``) are checked against ``reference.zeroing.blocks_to_zero`` of
  the blocks each allocation added; one layout in two (``observes_block_metrics``) gets
  a KV block metrics collector sampling every block, whose eviction events and tracked
  blocks are checked against ``reference.block_metrics.BlockLifecycles``.
* Requests are vLLM ``Request`` objects (``SamplingParams(max_tokens=max_model_len)``),
  hashed by ``get_request_block_hasher(hash_block_size, sha256)`` when caching is on.
  ``cache_salt`` goes to ``Request(cache_salt=...)``; a LoRA name becomes
  ``LoRARequest(lora_name=name, lora_int_id=k, lora_path="/kvconform/lora/<name>")``
  (``k`` a per-engine number for the name; vLLM insists on a non-empty path), which
  vLLM hashes as the extra key ``("lora", name, path)``: a function of the name only.
  ``init_none_hash(sha256)`` runs once per process.

Calls: ``new_step`` -> ``new_step_starts``; ``set_num_computed_tokens`` sets
``request.num_computed_tokens`` (0 also marks the request PREEMPTED, as vLLM's
scheduler does); ``append_output_tokens`` -> ``append_output_token_ids``;
``get_computed_blocks`` -> vLLM's, whose ``KVCacheBlocks`` object is kept per request
and handed back unchanged to ``allocate_slots`` (a hit the adapter did not produce is
an :class:`EngineError`); ``free`` -> ``free``; ``reset_prefix_cache`` ->
``reset_prefix_cache``. Every vLLM exception becomes
``EngineError("vllm: <call>(<args>) raised <type>: <msg>")``.

Not bridged / differences
-------------------------
* vLLM's Mamba "align" manager returns the null padding it appended in a step as
  part of its new blocks (e.g. ``[0, 3]``); ``allocate_slots`` drops the ``0`` ids, so
  the result lists only real new blocks. ``get_block_ids`` is vLLM's row unchanged.
* Production settings of the layout: ``prefix_cache_retention_interval`` goes to
  ``KVCacheConfig``; ``use_eagle`` and ``num_hash_lookahead_tokens`` to
  ``KVCacheManager(use_eagle=use_eagle and not lookahead, num_hash_lookahead_tokens)``
  (vLLM's scheduler turns the drop off under lookahead hashes) and to the request
  hasher; ``is_eagle_group`` to ``KVCacheGroupSpec``. After each lookup the adapter
  stores the returned ``shared_prefix_boundary`` on the request, as vLLM's scheduler
  does (sparse retention keeps that junction).
* Serving modes: ``set_in_flight`` sets ``request.num_in_flight_tokens`` and
  ``num_output_placeholders`` (asynchronous scheduling; skipped blocks are then freed
  on the processed count), ``cache_blocks`` is ``KVCacheManager.cache_blocks`` (what
  vLLM's ``update_from_output`` calls for requests with placeholders), and
  ``allocate_slots(full_sequence_must_fit=True)`` is the admission gate with the
  per-group caps from ``max_in_flight_tokens``.
* Partial hits (a Mamba group coarser than the hash block size: vLLM's
  ``enable_partial_hash_hits``): the layout goes to vLLM as it is; ``pending_block_copies``
  reads each manager's queued copy-on-write copies and ``take_block_copies`` does what
  vLLM's scheduler does once a step is scheduled (``take_kv_cache_block_copies``, then
  ``free_blocks`` of their retained endpoints, nothing deferred). Such a layout asks for the
  ``full`` KV event report mode on one layout in four only (:func:`reports_reused_blocks`;
  those are the known divergence ``vllm-partial-hit-reused-block-events``), and so does a
  layout with decode context parallelism (``vllm-dcp-reused-block-events``).
* ``last_allocation_estimate`` (A4): the adapter wraps the ``get_num_blocks_to_allocate``
  of its manager's coordinator (that instance only) and keeps what the per-step call of
  ``allocate_slots`` returned (step 9 of vLLM's ``allocate_slots``; the gate's call with
  ``apply_admission_cap=True`` is ignored).
* vLLM's exact rules, with worked examples, are in ``docs/vllm-behaviour.md``.
"""

from __future__ import annotations

import importlib
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from properties.core.engine import (
    BlockIds,
    CachedBlock,
    CacheHit,
    EngineError,
    KnownDivergence,
    KnownDivergenceMet,
    RequestInput,
    UnsupportedLayoutError,
    quiet_loggers,
)
from properties.core.modes import PRODUCTION_SETTINGS
from reference.block_metrics import BlockLifecycles
from reference.connector_blocks import blocks_covering
from reference.layout import KVCacheLayout
from reference.managers.base import num_skipped_hit_blocks
from reference.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    RSWASpec,
    SlidingWindowSpec,
)
from reference.zeroing import blocks_to_zero, needs_zeroing

#: ``dtype_bytes`` -> name of the torch dtype that gives vLLM the same page size.
DTYPE_BY_BYTES: dict[int, str] = {1: "uint8", 2: "float16", 4: "float32", 8: "float64"}

#: the packages whose ``init_none_hash`` ran in this process
_NONE_HASH_READY: set[str] = set()


def _fmt_args(args: Sequence[Any]) -> str:
    return ", ".join(repr(a) for a in args)


def call_engine(
    label: str, name: str, args: Sequence[Any], fn: Any, *call_args: Any, **kwargs: Any
) -> Any:
    """Run one call of engine ``label``; any exception becomes an :class:`EngineError`
    naming it.

    Example message: ``vllm: allocate_slots('r1', 4, 0) raised AssertionError: ...``.
    """
    try:
        return fn(*call_args, **kwargs)
    except KnownDivergenceMet:
        raise
    except Exception as exc:  # every engine failure is reported, never swallowed
        raise EngineError(
            f"{label}: {name}({_fmt_args(args)}) raised {type(exc).__name__}: {exc}"
        ) from exc


def _call(name: str, args: Sequence[Any], fn: Any, *call_args: Any, **kwargs: Any) -> Any:
    """:func:`call_engine` for vLLM (``vllm: ...`` messages)."""
    return call_engine("vllm", name, args, fn, *call_args, **kwargs)


@dataclass(frozen=True)
class V1CoreAPI:
    """A package that ships vLLM's v1 KV cache manager, and where its API differs.

    ``root`` is the top-level package (``vllm``, or a fork's: ``aphrodite``): every name
    the adapter imports lives at the same path under it (``ROOT.v1.core.kv_cache_manager``,
    ``ROOT.v1.request``, ...), and its logging level is ``ROOT_LOGGING_LEVEL``.
    ``lookahead_hashes``: ``KVCacheManager`` and ``get_request_block_hasher`` take
    ``num_hash_lookahead_tokens``. ``lookup_bound``: ``get_computed_blocks`` takes the
    hit bound (``max_cache_hit_length``). ``hit_alignment``: ``kv_cache_utils`` has
    ``resolve_cache_hit_alignment_tokens`` (the adapter checks the layout's hit alignment
    against it). Example: vLLM 0.33 has all three; a fork made before they were added has
    none.
    """

    root: str
    label: str
    release: str
    lookahead_hashes: bool = True
    lookup_bound: bool = True
    hit_alignment: bool = True


#: vLLM 0.33.0 itself.
VLLM_API = V1CoreAPI(root="vllm", label="vllm", release="vLLM 0.33.0")


class _VLLM:
    """The names of a v1 core (:class:`V1CoreAPI`) the adapter uses, imported once by
    :func:`_import_vllm`."""

    def __init__(self, api: V1CoreAPI = VLLM_API) -> None:
        root = api.root
        os.environ.setdefault(f"{root.upper()}_LOGGING_LEVEL", "ERROR")
        import torch

        def module(path: str) -> Any:
            return importlib.import_module(f"{root}.{path}")

        kv_events = module("distributed.kv_events")
        utils = module("v1.core.kv_cache_utils")
        request = module("v1.request")
        self.api = api
        self.torch = torch
        self.kvi = module("v1.kv_cache_interface")
        self.KVCacheManager = module("v1.core.kv_cache_manager").KVCacheManager
        self.Request = request.Request
        self.RequestStatus = request.RequestStatus
        self.SamplingParams = module("sampling_params").SamplingParams
        self.LoRARequest = module("lora.request").LoRARequest
        inputs = module("multimodal.inputs")
        self.MultiModalFeatureSpec = inputs.MultiModalFeatureSpec
        self.PlaceholderRange = inputs.PlaceholderRange
        self.sha256 = module("utils.hashing").sha256
        self.get_request_block_hasher = utils.get_request_block_hasher
        self.init_none_hash = utils.init_none_hash
        self.resolve_block_sizes = utils.resolve_kv_cache_block_sizes
        #: None where the package has no hit-alignment resolver (V1CoreAPI.hit_alignment)
        self.resolve_alignment = (
            utils.resolve_cache_hit_alignment_tokens if api.hit_alignment else None
        )
        self.events = (kv_events.AllBlocksCleared, kv_events.BlockRemoved, kv_events.BlockStored)
        self.pool_key = (utils.get_group_id, utils.get_block_hash, utils.maybe_convert_block_hash)
        quiet_loggers(root)

    def call(self, name: str, args: Sequence[Any], fn: Any, *call_args: Any, **kwargs: Any) -> Any:
        """:func:`call_engine` under this package's label."""
        return call_engine(self.api.label, name, args, fn, *call_args, **kwargs)


def _import_vllm(api: V1CoreAPI = VLLM_API) -> _VLLM:
    """The names of ``api``'s package, imported (its none hash set once per process)."""
    try:
        v = _VLLM(api)
    except ImportError as exc:
        raise EngineError(
            f"{api.label}: cannot import {api.release} ({exc}); run ci/engines/{api.label} "
            f"and use .engines/{api.label}/bin/python"
        ) from exc
    if api.root not in _NONE_HASH_READY:
        v.init_none_hash(v.sha256)
        _NONE_HASH_READY.add(api.root)
    return v


def _dtype(v: _VLLM, owner: str, dtype_bytes: int) -> Any:
    name = DTYPE_BY_BYTES.get(dtype_bytes)
    if name is None:
        raise EngineError(
            f"{v.api.label}: {owner}.dtype_bytes must be one of {sorted(DTYPE_BY_BYTES)}, "
            f"got {dtype_bytes}"
        )
    return getattr(v.torch, name)


def to_vllm_spec(v: _VLLM, spec: KVCacheSpec, dcp_world_size: int = 1) -> Any:
    """Our spec -> vLLM's spec of the same type, block size and page size.

    Example: ``SlidingWindowSpec(block_size=2, sliding_window=4)`` ->
    ``vllm SlidingWindowSpec(block_size=2, num_kv_heads=1, head_size=8,
    dtype=torch.float16, sliding_window=4)``. With decode context parallelism of size
    ``d`` an attention spec's block size is ours divided by ``d`` (ours is the manager's,
    :func:`reference.layout.check_context_parallel`); a Mamba spec's stays.
    """
    kvi = v.kvi
    owner = type(spec).__name__
    if isinstance(spec, MambaSpec):
        dtype = _dtype(v, owner, spec.dtype_bytes)
        return kvi.MambaSpec(
            block_size=spec.block_size,
            shapes=tuple(spec.shapes),
            dtypes=(dtype,) * len(spec.shapes),
            page_size_padded=spec.page_size_padded,
            mamba_cache_mode=spec.mamba_cache_mode,
            num_speculative_blocks=spec.num_speculative_blocks,
            num_prefill_checkpoint_blocks=spec.num_prefill_checkpoint_blocks,
            prefill_checkpoint_alignment=spec.prefill_checkpoint_alignment,
        )
    common: dict[str, Any] = {}
    if isinstance(spec, AttentionSpec):
        common = dict(
            block_size=spec.block_size // dcp_world_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            dtype=_dtype(v, owner, spec.dtype_bytes),
            page_size_padded=spec.page_size_padded,
        )
    if isinstance(spec, RSWASpec):
        return kvi.RSWASpec(rswa_window=spec.rswa_window, **common)
    if isinstance(spec, CircularBufferSpec):
        return kvi.CircularBufferSpec(**common)
    if isinstance(spec, FullAttentionSpec):
        return kvi.FullAttentionSpec(**common)
    if isinstance(spec, SlidingWindowSpec):
        return kvi.SlidingWindowSpec(sliding_window=spec.sliding_window, **common)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return kvi.ChunkedLocalAttentionSpec(
            attention_chunk_size=spec.attention_chunk_size, **common
        )
    raise EngineError(f"{v.api.label}: no {v.api.release} spec for {owner} {spec!r}")


def observes_stats_and_events(layout: KVCacheLayout) -> bool:
    """Whether the adapter builds vLLM's manager with ``log_stats`` and KV cache events on.

    Rule: on, except for one layout in four chosen by ``crc32(layout.describe()) % 4 == 0``
    (a function of the layout, so a replayed example builds the same manager): vLLM's
    paths with stats and events off (the early returns of ``make_prefix_cache_stats``,
    ``take_events``, the event hooks of the pool) run too. Example: a layout whose
    description hashes to 8 runs with both off; its stats are ``None`` and it emits no
    event.
    """
    return zlib.crc32(layout.describe().encode()) % 4 != 0


def observes_block_metrics(layout: KVCacheLayout) -> bool:
    """Whether the adapter gives vLLM's manager a KV block metrics collector: for one
    layout in two, ``crc32("metrics:" + layout.describe()) % 2 == 0`` (so vLLM's paths
    without a collector run too; a replay builds the same manager), and never for a
    Mamba group with speculative or prefill checkpoint blocks: kvconform's block
    lifecycles (:class:`BlockLifecycles`) model neither the relocation of speculative
    blocks (full bs 1 + Mamba bs 1 with 4 speculative blocks: vLLM emits no eviction event
    where the lifecycles expect one with 0 reuse gaps) nor the eviction of a checkpoint
    block the step does not keep (vLLM's Mamba manager evicts it explicitly, and its
    collector ends the block's life with an event, a life the adapter's lifecycles still
    hold: full bs 16 + Mamba bs 4 with one checkpoint block, DCP 4). Open gaps, not
    findings."""
    if any(
        isinstance(s, MambaSpec) and (s.num_speculative_blocks or s.num_prefill_checkpoint_blocks)
        for s in layout.specs
    ):
        return False
    return zlib.crc32(("metrics:" + layout.describe()).encode()) % 2 == 0


def reports_reused_blocks(layout: KVCacheLayout) -> bool:
    """Whether every other request asks vLLM for the ``full`` KV event report mode (events
    of its reused blocks too: ``emit_cached_block_events`` at each lookup with a hit).

    Rule: with events on (:func:`observes_stats_and_events`), always, except on a layout
    with partial hits or decode context parallelism, where only one in four does
    (``crc32(layout.describe()) % 4 == 1``): there vLLM 0.33's reused-block events crash
    (the known divergences ``vllm-partial-hit-reused-block-events`` and
    ``vllm-dcp-reused-block-events``, whose layouts are not drawn). Example: a full +
    Mamba layout with partial hits whose description hashes to 6 keeps events on in the
    ``incremental`` mode only."""
    if not observes_stats_and_events(layout):
        return False
    if not layout.partial_hits_enabled and layout.dcp_world_size == 1:
        return True
    return zlib.crc32(layout.describe().encode()) % 4 == 1


class VLLMEngine:
    """vLLM's ``KVCacheManager`` driven through the engine protocol."""

    name = "vllm"

    def __init__(self, layout: KVCacheLayout, v: _VLLM) -> None:
        self.layout = layout
        self._v = v
        dcp = layout.dcp_world_size
        groups = [
            v.kvi.KVCacheGroupSpec(
                list(g.layer_names), to_vllm_spec(v, g.spec, dcp), is_eagle_group=g.is_eagle_group
            )
            for g in layout.groups
        ]
        self._config = v.kvi.KVCacheConfig(
            num_blocks=layout.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=groups,
            prefix_cache_retention_interval=layout.prefix_cache_retention_interval,
        )
        self._block_sizes = self._resolve_block_sizes(groups)
        #: whether vLLM's manager keeps prefix cache stats, and emits KV cache events
        self._stats_on = self._events_on = observes_stats_and_events(layout)
        #: vLLM's KV block metrics collector (every block sampled; one layout in two) and
        #: the lifecycles kvconform expects it to record
        self._metrics: Any = None
        if observes_block_metrics(layout):
            metrics = importlib.import_module(f"{v.api.root}.v1.core.kv_cache_metrics")
            self._metrics = metrics.KVCacheMetricsCollector(sample_rate=1.0)
        self._lifecycles = BlockLifecycles(layout.enable_caching)
        self._build_manager()
        self._hasher = (
            v.get_request_block_hasher(
                layout.hash_block_size, v.sha256, *self._lookahead_option().values()
            )
            if layout.enable_caching
            else None
        )
        self.requests: dict[str, Any] = {}
        #: whether a request was ever added (the manager is then no longer fresh)
        self._used = False
        self._hits: dict[str, tuple[CacheHit, Any]] = {}
        self._lora_ids: dict[str, int] = {}
        self._estimate: int | None = None
        #: (group, hash) that BlockStored events announced since the last clear
        self._announced: set[tuple[int, Any]] = set()
        #: whether _drain_events checks the events against the pool (HasSelfChecks)
        self._self_checks = True
        #: per allocation since the last step, the blocks it added to the request's table
        self._added: list[tuple[tuple[int, ...], ...]] = []
        #: (tokens, hit tokens, preempted) of each admission recorded since the last step
        self._admissions: list[tuple[int, int, bool]] = []
        #: whether reset_prefix_cache succeeded since the last step
        self._reset_since_stats = False
        #: (block id, group, tokens) -> the CachedBlock handed out for it
        self._cached_entries: dict[tuple[int, int, int], CachedBlock] = {}

    def _lookahead_option(self) -> dict[str, int]:
        """``num_hash_lookahead_tokens`` for the manager and the hasher, where the package
        takes it (:attr:`V1CoreAPI.lookahead_hashes`; the factory's divergences keep
        layouts with lookahead hashes away from one that does not)."""
        lookahead = self.layout.num_hash_lookahead_tokens
        if self._v.api.lookahead_hashes:
            return {"num_hash_lookahead_tokens": lookahead}
        if lookahead:
            raise UnsupportedLayoutError(
                f"{self.name}: {self._v.api.release} has no lookahead hashes "
                f"(num_hash_lookahead_tokens={lookahead})"
            )
        return {}

    def _resolve_block_sizes(self, groups: list[Any]) -> tuple[int, int]:
        """vLLM's own scheduler and hash block sizes of the layout
        (``resolve_kv_cache_block_sizes``, as the engine core derives them, and
        ``resolve_cache_hit_alignment_tokens``, where the package has it:
        :attr:`V1CoreAPI.hit_alignment`), from a config carrying what they read: the
        block size of a one-group layout (vLLM's, per rank), no prefix match unit, prefix
        caching as the layout has it, the DCP size, no KV connector. They must be the
        layout's (``scheduler_block_size``, ``hash_block_size``, ``cache_hit_alignment``);
        a difference is an :class:`EngineError` naming both."""
        layout, v = self.layout, self._v
        from types import SimpleNamespace

        one = groups[0].kv_cache_spec.block_size
        config = SimpleNamespace(
            cache_config=SimpleNamespace(
                block_size=one, prefix_match_unit=None, enable_prefix_caching=layout.enable_caching
            ),
            parallel_config=SimpleNamespace(decode_context_parallel_size=layout.dcp_world_size),
            kv_transfer_config=None,
        )
        scheduler, hashed = v.call(
            "resolve_kv_cache_block_sizes", (), v.resolve_block_sizes, self._config, config
        )
        alignment = layout.cache_hit_alignment
        if v.resolve_alignment is not None:
            alignment = v.call(
                "resolve_cache_hit_alignment_tokens",
                (),
                v.resolve_alignment,
                self._config,
                config,
                scheduler,
                hashed,
            )
        ours = (layout.scheduler_block_size, layout.hash_block_size)
        if (scheduler, hashed) != ours or (
            layout.enable_caching and alignment != layout.cache_hit_alignment
        ):
            raise EngineError(
                f"{v.api.label}: block sizes of {layout.describe()}: vLLM resolves (scheduler "
                f"{scheduler}, hash {hashed}, hit alignment {alignment}), the layout has "
                f"({ours[0]}, {ours[1]}, {layout.cache_hit_alignment})"
            )
        return scheduler, hashed

    def _build_manager(self) -> None:
        """vLLM's ``KVCacheManager`` of the layout, with stats and events as set."""
        layout, v = self.layout, self._v
        # vLLM's scheduler turns the block drop off when lookahead hashes are on
        drop_eagle = layout.use_eagle and layout.num_hash_lookahead_tokens == 0
        self.manager = self._v.call(
            "KVCacheManager",
            (layout.describe(),),
            v.KVCacheManager,
            self._config,
            max_model_len=layout.max_model_len,
            scheduler_block_size=self._block_sizes[0],
            hash_block_size=self._block_sizes[1],
            max_in_flight_tokens=layout.max_in_flight_tokens,
            enable_caching=layout.enable_caching,
            use_eagle=drop_eagle,
            log_stats=self._stats_on,
            enable_kv_cache_events=self._events_on,
            **self._lookahead_option(),
            metrics_collector=self._metrics,
            dcp_world_size=layout.dcp_world_size,
            pcp_world_size=layout.pcp_world_size,
        )
        self._record_estimates(self.manager.coordinator)

    def build_as_deployed(self) -> None:
        """``BuildsAsDeployed``: vLLM's manager again, as ``vllm serve`` builds it by
        default: prefix cache stats on (unless ``--disable-log-stats``), KV cache events
        off (unless a KV events config is given). Only before the first request."""
        if self._used:
            raise EngineError(f"{self.name}: build_as_deployed() after requests were added")
        if (self._stats_on, self._events_on) != (True, False):
            self._stats_on, self._events_on = True, False
            self._build_manager()

    def _record_estimates(self, coordinator: Any) -> None:
        """Wrap this coordinator's ``get_num_blocks_to_allocate`` (on the instance only) to
        keep what it returns when ``allocate_slots`` asks for the step's blocks; the
        admission gate's call (``apply_admission_cap=True``) is not kept."""
        estimate = coordinator.get_num_blocks_to_allocate

        def recording(*args: Any, **kwargs: Any) -> Any:
            need = estimate(*args, **kwargs)
            if not kwargs.get("apply_admission_cap", False):
                self._estimate = int(need)
            return need

        coordinator.get_num_blocks_to_allocate = recording
        for gid, manager in enumerate(coordinator.single_type_managers):
            spec = self.layout.groups[gid].spec
            if isinstance(spec, MambaSpec) and spec.is_align and spec.num_speculative_blocks:
                _stop_at_negative_estimate(manager, gid)

    # -- helpers -------------------------------------------------------------
    def _request(self, request_id: str) -> Any:
        try:
            return self.requests[request_id]
        except KeyError:
            raise EngineError(f"{self.name}: unknown request {request_id!r}") from None

    def _lora(self, name: str | None) -> Any:
        if name is None:
            return None
        lora_id = self._lora_ids.setdefault(name, len(self._lora_ids) + 1)
        return self._v.LoRARequest(
            lora_name=name, lora_int_id=lora_id, lora_path=f"/kvconform/lora/{name}"
        )

    @property
    def _pool(self) -> Any:
        return self.manager.block_pool

    # -- protocol ------------------------------------------------------------
    def add_request(self, request: RequestInput) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise EngineError(f"{self.name}: request {rid!r} added twice")
        v = self._v
        # every other request asks for events of its reused blocks too (vLLM's "full"
        # report mode), the others for newly cached blocks only ("incremental")
        full = reports_reused_blocks(self.layout) and len(self.requests) % 2
        mode = "full" if full else "incremental"
        self._used = True
        params = v.SamplingParams(
            max_tokens=max(1, self.layout.max_model_len),
            extra_args={"kv_cache_report_mode": mode},
        )
        self.requests[rid] = self._v.call(
            "Request",
            (rid, len(request.prompt_token_ids)),
            v.Request,
            rid,
            list(request.prompt_token_ids),
            params,
            None,
            lora_request=self._lora(request.lora_name),
            cache_salt=request.cache_salt,
            block_hasher=self._hasher,
            **self._media(request),
        )

    def _media(self, request: RequestInput) -> dict[str, Any]:
        """A request's multimodal items as vLLM's ``MultiModalFeatureSpec`` (an image
        whose content hash is the identifier, at ``PlaceholderRange(offset, length)``;
        no processed data, as for a cached item) and its prompt embeddings as a float32
        tensor with one row per prompt position (every entry of row ``p`` the embedding id
        of ``p``: equal ids give equal bytes, the key vLLM hashes); the token ids stay
        (both given: every position has its token and an embedding)."""
        v = self._v
        out: dict[str, Any] = {}
        if request.mm_items:
            out["mm_features"] = [
                v.MultiModalFeatureSpec(
                    data=None,
                    modality="image",
                    identifier=identifier,
                    mm_position=v.PlaceholderRange(offset=offset, length=length),
                )
                for identifier, offset, length in request.mm_items
            ]
        if request.prompt_embeds is not None:
            ids = v.torch.tensor(request.prompt_embeds, dtype=v.torch.float32)
            out["prompt_embeds"] = ids.unsqueeze(1).repeat(1, 4)
        return out

    def append_output_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        req = self._request(request_id)
        self._v.call(
            "append_output_token_ids",
            (request_id, list(token_ids)),
            req.append_output_token_ids,
            list(token_ids),
        )

    def set_num_computed_tokens(self, request_id: str, num_computed_tokens: int) -> None:
        req = self._request(request_id)
        limit = req.num_tokens + req.num_output_placeholders
        if num_computed_tokens < 0 or num_computed_tokens > limit:
            raise EngineError(
                f"{self.name}: set_num_computed_tokens({request_id!r}, {num_computed_tokens}): "
                f"num_computed_tokens must be in [0, {limit}] (tokens + placeholders)"
            )
        req.num_computed_tokens = num_computed_tokens
        if num_computed_tokens == 0:
            req.status = self._v.RequestStatus.PREEMPTED

    def new_step(self) -> None:
        self._drain_events()
        self._check_zeroing()
        self._check_block_metrics()
        self._check_connector_blocks()
        stats = self._v.call("make_prefix_cache_stats", (), self.manager.make_prefix_cache_stats)
        if self._self_checks:
            self._check_stats(stats)
            self._check_usage()
        self._admissions.clear()
        self._reset_since_stats = False
        self._v.call("new_step_starts", (), self.manager.new_step_starts)

    def _check_zeroing(self) -> None:
        """vLLM's blocks to zero since the last step (``take_new_block_ids``, drained every
        step as its scheduler does) against :func:`reference.zeroing.blocks_to_zero` of
        the blocks each allocation added (the tables before and after, hits excluded).
        Example: full + Mamba, ``r0`` allocated full (1, 2) and Mamba (3): ``[1, 2]``."""
        got = list(self._v.call("take_new_block_ids", (), self.manager.take_new_block_ids))
        added, self._added = self._added, []
        if not self._self_checks:
            return
        want = blocks_to_zero(self.layout, added)
        if got != want:
            raise EngineError(
                f"vllm: take_new_block_ids gave {got}; the blocks the step's allocations "
                f"added to attention groups are {want} (zeroing "
                f"{'on' if needs_zeroing(self.layout) else 'off'})"
            )

    def _check_connector_blocks(self) -> None:
        """What vLLM would tell a KV connector covers each live request's computed tokens
        (``get_block_ids_for_computed_tokens``) against
        :func:`reference.connector_blocks.blocks_covering` of its rows."""
        if not self._self_checks:
            return
        for rid, req in self.requests.items():
            n = req.num_computed_tokens
            got = self._v.call(
                "get_block_ids_for_computed_tokens",
                (rid, n),
                self.manager.get_block_ids_for_computed_tokens,
                rid,
                n,
            )
            got = tuple(tuple(row) for row in got)
            want = blocks_covering(self.layout, self.manager.get_block_ids(rid), n)
            if got != want:
                raise EngineError(
                    f"vllm: get_block_ids_for_computed_tokens({rid!r}, {n}) gave {got}; the "
                    f"rows cut to {n} computed tokens are {want}"
                )

    def _check_block_metrics(self) -> None:
        """With a metrics collector: the eviction events vLLM's collector emitted since
        the last step (their numbers of reuse gaps) and the blocks it tracks against
        :class:`reference.block_metrics.BlockLifecycles` fed with the blocks the
        adapter's allocations handed out and its hits adopted. Example: a block cached,
        hit twice, then reused: one event with one gap."""
        if self._metrics is None:
            return
        events = self._metrics.drain_events()
        want = self._lifecycles.take_events()
        if not self._self_checks:
            return
        got = [len(e.reuse_gaps_seconds) for e in events]
        tracked = set(self._metrics.block_metrics)
        if got != want or tracked != set(self._lifecycles.accesses):
            raise EngineError(
                f"vllm: the block metrics collector emitted events with {got} reuse gaps "
                f"and tracks {sorted(tracked)}; kvconform's lifecycles give {want} and "
                f"{sorted(self._lifecycles.accesses)}"
            )

    def _check_stats(self, stats: Any) -> None:
        """vLLM's prefix cache stats of a step against the admissions the adapter recorded.

        Rule: with stats on, the step's ``requests``, ``queries`` and ``hits`` (plus their
        ``preempted_`` parts) are the count, token sum and hit sum of the admissions the
        adapter passed to ``record_prefix_cache_stats``, and ``reset`` says whether
        ``reset_prefix_cache`` succeeded; with stats off the stats are ``None``. Example:
        two admissions of 9 and 5 tokens hitting 4 and 0 give requests 2, queries 14, hits 4.
        """
        if not self._stats_on:
            if stats is not None:
                raise EngineError(
                    f"{self.name}: make_prefix_cache_stats gave {stats!r} with stats off"
                )
            return
        got = (
            stats.requests + stats.preempted_requests,
            stats.queries + stats.preempted_queries,
            stats.hits + stats.preempted_hits,
            bool(stats.reset),
        )
        want = (
            len(self._admissions),
            sum(a[0] for a in self._admissions),
            sum(a[1] for a in self._admissions),
            self._reset_since_stats,
        )
        if got != want:
            raise EngineError(
                f"{self.name}: prefix cache stats (requests, queries, hits, reset) = {got}, "
                f"the step's admissions give {want}"
            )

    def _check_usage(self) -> None:
        """``KVCacheManager.usage`` is ``1 - free / (num_blocks - 1)`` (null block excluded).

        Example: 7 blocks (6 usable), 3 free: usage 0.5.
        """
        usage = self._v.call("usage", (), lambda: self.manager.usage)
        usable = self.layout.num_blocks - 1
        want = 1.0 - self.num_free_blocks() / usable if usable else 0
        if abs(usage - want) > 1e-9:
            raise EngineError(f"{self.name}: usage {usage} != 1 - free / usable blocks = {want}")

    def disable_self_checks(self) -> None:
        """Stop the adapter's own checks of vLLM (KV events against the pool, prefix cache
        stats, usage, the free-queue cursor walk): the bench times vLLM alone."""
        self._self_checks = False

    def _drain_events(self) -> None:
        """Take vLLM's KV cache events and check them against its pool: a BlockRemoved
        names a hash a BlockStored announced (since the last AllBlocksCleared), and every
        hash the pool holds was announced. Example: a block cached and evicted in one step
        gives BlockStored([h]) then BlockRemoved([h]), and ``h`` leaves the pool."""
        events = self._v.call("take_events", (), self.manager.take_events)
        if not self._events_on and events:
            raise EngineError(f"{self.name}: take_events gave {events!r} with events off")
        if not self._self_checks or not self._events_on:
            return
        cleared, removed, stored = self._v.events
        for event in events:
            if isinstance(event, cleared):
                self._announced.clear()
                continue
            keys = [(event.group_idx, h) for h in event.block_hashes]
            if isinstance(event, stored):
                self._announced.update(keys)
            elif isinstance(event, removed) and not self._announced.issuperset(keys):
                raise EngineError(f"{self.name}: KV event {event!r} removes a hash never stored")
        group_of, hash_of, external = self._v.pool_key
        for key in self._pool.cached_block_hash_to_block._cache:
            if (group_of(key), external(hash_of(key))) not in self._announced:
                raise EngineError(
                    f"{self.name}: the pool caches hash {hash_of(key).hex()} of group "
                    f"{group_of(key)} that no BlockStored event announced"
                )

    def get_computed_blocks(self, request_id: str) -> CacheHit:
        req = self._request(request_id)
        # the "full" report-mode requests pass vLLM's default bound (tokens - 1)
        # explicitly, as vLLM's scheduler does when it bounds the lookup itself
        explicit = req.sampling_params.extra_args["kv_cache_report_mode"] == "full"
        bound = (req.num_tokens - 1,) if explicit and self._v.api.lookup_bound else ()
        blocks, num_tokens, junction = self._v.call(
            "get_computed_blocks",
            (request_id, *bound),
            self.manager.get_computed_blocks,
            req,
            *bound,
        )
        # vLLM's scheduler keeps the junction on the request after every lookup
        req.shared_prefix_boundary = junction
        ids = blocks.get_block_ids()
        hit = CacheHit(tuple(tuple(group) for group in ids), num_tokens)
        self._hits[request_id] = (hit, blocks)
        return hit

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        hit: CacheHit | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> BlockIds | None:
        req = self._request(request_id)
        blocks = None
        if hit is not None:
            kept = self._hits.pop(request_id, None)
            if kept is None or kept[0] != hit:
                raise EngineError(
                    f"{self.name}: allocate_slots({request_id!r}) got a hit this adapter did not "
                    f"return from its last get_computed_blocks({request_id!r})"
                )
            blocks = kept[1]
        args: tuple = (request_id, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens)
        if num_external_computed_tokens or delay_cache_blocks:
            args += (num_external_computed_tokens, delay_cache_blocks)
        self._estimate = None
        before = self.manager.get_block_ids(request_id)
        new = self._v.call(
            "allocate_slots",
            args,
            self.manager.allocate_slots,
            req,
            num_new_tokens,
            num_new_computed_tokens,
            blocks,
            num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks,
            full_sequence_must_fit=full_sequence_must_fit,
        )
        if new is None:
            return None
        hit_rows = () if hit is None else hit.block_ids
        after = self.manager.get_block_ids(request_id)
        # per position: a block freed from the row (a window's skipped block, a hit's
        # block among them) may come back at another position in the same call, so a
        # set difference would miss it
        added = tuple(
            tuple(
                b
                for i, b in enumerate(row)
                if b
                and (i >= len(old) or old[i] != b)
                and not (g < len(hit_rows) and i < len(hit_rows[g]) and hit_rows[g][i] == b)
            )
            for g, (old, row) in enumerate(zip(before, after))
        )
        self._added.append(added)
        # vLLM touches a hit's blocks past each group's skip boundary at the local and
        # external computed tokens: external tokens can move it past a window's hit blocks
        external = num_external_computed_tokens
        self._lifecycles.adopted(
            b
            for g, row in enumerate(hit_rows)
            for b in row[
                num_skipped_hit_blocks(
                    self.layout.groups[g].spec, num_new_computed_tokens, external
                ) :
            ]
            if b
        )
        self._lifecycles.handed_out(b for row in added for b in row)
        if hit is not None:
            # vLLM's scheduler records the lookup at admission (allocation succeeded)
            self._v.call(
                "record_prefix_cache_stats",
                (request_id, hit.num_tokens),
                self.manager.record_prefix_cache_stats,
                req,
                hit.num_tokens,
            )
            if self.layout.enable_caching:
                self._admissions.append((req.num_tokens, hit.num_tokens, req.num_preemptions > 0))
        # vLLM's scheduler reads the new blocks with allow_none (None: no group got one)
        ids = new.get_block_ids(allow_none=True)
        if ids is None:
            return tuple(() for _ in self.layout.groups)
        return tuple(tuple(b for b in group if b != 0) for group in ids)

    # -- serving modes (SupportsServingModes) -------------------------------------
    def set_in_flight(
        self, request_id: str, num_in_flight_tokens: int, num_pending_tokens: int
    ) -> None:
        """``request.num_in_flight_tokens`` and ``num_output_placeholders``, as vLLM's
        scheduler keeps them under asynchronous scheduling."""
        req = self._request(request_id)
        req.num_in_flight_tokens = num_in_flight_tokens
        req.num_output_placeholders = num_pending_tokens

    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        req = self._request(request_id)
        args = (request_id, num_tokens)
        self._v.call("cache_blocks", args, self.manager.cache_blocks, req, num_tokens)

    def free(self, request_id: str) -> None:
        req = self._request(request_id)
        self._v.call("free", (request_id,), self.manager.free, req)
        self._hits.pop(request_id, None)

    def remove_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._hits.pop(request_id, None)

    def reset_prefix_cache(self) -> bool:
        done = bool(self._v.call("reset_prefix_cache", (), self.manager.reset_prefix_cache))
        if done:
            self._lifecycles.reset()
        self._reset_since_stats = self._reset_since_stats or done
        self._drain_events()
        return done

    def get_block_ids(self, request_id: str) -> BlockIds:
        ids = self._v.call("get_block_ids", (request_id,), self.manager.get_block_ids, request_id)
        return tuple(tuple(group) for group in ids)

    def num_free_blocks(self) -> int:
        return int(self._pool.get_num_free_blocks())

    # -- copy-on-write of partial hits (CopiesBlocks) ------------------------------
    def pending_block_copies(self) -> list[tuple[int, int]]:
        """The copies vLLM's managers queued and nobody took yet (each manager's
        ``_pending_cow_copies``, group by group: the order ``take_kv_cache_block_copies``
        gives them)."""
        return [
            (source.block_id, copy.block_id)
            for manager in self.manager.coordinator.single_type_managers
            for source, copy in manager._pending_cow_copies
        ]

    def take_block_copies(self) -> list[tuple[int, int]]:
        """What vLLM's scheduler does once a step is scheduled: take the copies
        (``take_kv_cache_block_copies``) and free their retained endpoints at once
        (``_free_cow_retained_blocks`` without deferred frees)."""
        copies, retained = self._v.call(
            "take_kv_cache_block_copies", (), self.manager.take_kv_cache_block_copies
        )
        self._v.call("free_blocks", ("retained copy endpoints",), self._pool.free_blocks, retained)
        return [(int(c.src_block_id), int(c.dst_block_id)) for c in copies]

    # -- optional capabilities (read from vLLM's BlockPool) ---------------------
    def last_allocation_estimate(self) -> int | None:
        """What vLLM's ``coordinator.get_num_blocks_to_allocate`` returned for the step in
        the last ``allocate_slots`` (None: the admission gate refused it first)."""
        return self._estimate

    def ref_counts(self) -> dict[int, int]:
        """``block_id -> ref_cnt`` for ids ``1 .. num_blocks - 1`` (null excluded)."""
        return {b.block_id: b.ref_cnt for b in self._pool.blocks[1:]}

    def free_queue(self) -> list[int]:
        """The free list from the front (next to allocate) to the back (vLLM's own walk,
        ``FreeKVCacheBlockQueue.get_all_free_blocks``)."""
        queue = self._pool.free_block_queue
        free = self._v.call("get_all_free_blocks", (), queue.get_all_free_blocks)
        ids = [b.block_id for b in free]
        if self._self_checks:
            # vLLM's cursor walk (what its offloading connector uses) gives the same order,
            # from the head (cursor None) and from after the first block
            def walk(cursor: Any) -> list[int]:
                blocks = self._v.call(
                    "iter_blocks_after", (cursor,), list, queue.iter_blocks_after(cursor)
                )
                return [b.block_id for b in blocks]

            walked = walk(None)
            after_first = walk(queue.fake_free_list_head.next_free_block) if ids else []
            if walked != ids or after_first != ids[1:]:
                raise EngineError(
                    f"{self.name}: free queue walks differ: get_all_free_blocks {ids}, "
                    f"iter_blocks_after(None) {walked}, after the first {after_first}"
                )
        return ids

    def cached_blocks(self) -> list[CachedBlock]:
        """Every block registered in the prefix cache under its primary key.

        The group id is the key's last 4 bytes (big endian); ``num_tokens`` is the
        block's ``block_hash_num_tokens`` (a multiple of ``bs``, or the prompt-tail
        boundary of a partial entry). Secondary keys of a block (vLLM keeps them in
        ``cached_block_hashes_by_block`` without a token count) are not reported.
        """
        out: list[CachedBlock] = []
        # the checks read the cached blocks after every lookup and commit: an entry seen
        # before is handed out again (CachedBlock is frozen) instead of built anew
        seen = self._cached_entries
        for key, entry in self._pool.cached_block_hash_to_block._cache.items():
            group_id = int.from_bytes(key[-4:], "big")
            entries = entry.values() if isinstance(entry, dict) else (entry,)
            for block in entries:
                if block.block_hash == key and block.block_hash_num_tokens is not None:
                    fields = (block.block_id, group_id, int(block.block_hash_num_tokens))
                    cached = seen.get(fields)
                    if cached is None:
                        cached = seen[fields] = CachedBlock(*fields)
                    out.append(cached)
        return out


#: The known divergence of a Mamba group's estimate below zero (met at run time).
NEGATIVE_MAMBA_ESTIMATE = "vllm-mamba-negative-estimate-after-rollback"


def _stop_at_negative_estimate(manager: Any, group_id: int) -> None:
    """Wrap this Mamba manager's ``get_num_blocks_to_allocate`` (on the instance only) to
    raise :class:`KnownDivergenceMet` when it returns fewer than 0 blocks: vLLM 0.33's
    align-mode estimate after a step scheduled fewer tokens than the last one (a rejected
    draft's columns are still held), which the coordinator adds to the other groups' needs
    (``findings/vllm/mamba-negative-estimate-after-rollback.md``). Example: k 4, bs 4, a
    draft step to 11 tokens then a step to 8 -> -1: the example stops."""
    estimate = manager.get_num_blocks_to_allocate

    def checked(request_id: str, *args: Any, **kwargs: Any) -> Any:
        need = estimate(request_id, *args, **kwargs)
        if need < 0:
            raise KnownDivergenceMet(
                NEGATIVE_MAMBA_ESTIMATE,
                f"Mamba group {group_id} estimated {need} blocks for request {request_id!r}",
            )
        return need

    manager.get_num_blocks_to_allocate = checked


def make_engine(layout: KVCacheLayout) -> VLLMEngine:
    """Build a :class:`VLLMEngine` for ``layout`` (vLLM is imported here)."""
    return VLLMEngine(layout, _import_vllm())


def _chunk_not_multiple_of_block(layout: KVCacheLayout) -> bool:
    return any(
        isinstance(g.spec, ChunkedLocalAttentionSpec)
        and g.spec.attention_chunk_size % g.spec.block_size != 0
        for g in layout.groups
    )


def _lookahead_past_the_hashes(layout: KVCacheLayout) -> bool:
    """Lookahead hashes of 2+ tokens with no full-attention group: a sliding-window,
    chunked or Mamba lookup indexes a block hash that does not exist yet."""
    return (
        layout.enable_caching
        and layout.num_hash_lookahead_tokens >= 2
        and not any(isinstance(g.spec, FullAttentionSpec) for g in layout.groups)
    )


def _reused_block_events_past_the_hashes(layout: KVCacheLayout) -> bool:
    """Partial hits with the ``full`` KV event report mode (:func:`reports_reused_blocks`):
    a lookup that reuses a block ending inside a coarser group's block raises."""
    return layout.partial_hits_enabled and reports_reused_blocks(layout)


def _reused_block_events_at_rank_block_size(layout: KVCacheLayout) -> bool:
    """Decode context parallelism with the ``full`` KV event report mode
    (:func:`reports_reused_blocks`): a lookup with a hit asserts."""
    return layout.dcp_world_size > 1 and reports_reused_blocks(layout)


def _mamba_prefill_checkpoints(layout: KVCacheLayout) -> bool:
    """A Mamba group with prefill checkpoint blocks, with prefix caching on."""
    return layout.enable_caching and any(
        isinstance(s, MambaSpec) and s.has_prefill_checkpoints for s in layout.specs
    )


#: vLLM 0.33 behaviours that break a property; see findings/vllm/.
KNOWN_DIVERGENCES = (
    KnownDivergence(
        name="vllm-mamba-checkpoint-inside-drafts",
        summary="with Mamba prefill checkpoint blocks, a decode chunk whose drafts cross a "
        "hash block boundary reserves a checkpoint past the request's hashed tokens, and "
        "cache_blocks asserts in BlockPool.cache_partial_block (allocate_slots raises)",
        finding="findings/vllm/mamba-checkpoint-inside-drafts.md",
        applies=_mamba_prefill_checkpoints,
        modes=lambda mode: mode.num_draft_tokens > 0,
    ),
    KnownDivergence(
        name=NEGATIVE_MAMBA_ESTIMATE,
        summary="an align-mode Mamba group with speculative blocks estimates fewer than 0 "
        "blocks when a step schedules fewer tokens than the last (rejected or fewer drafts), "
        "hiding another group's need from the pool check (vLLM issue 39271's scenario)",
        finding="findings/vllm/mamba-negative-estimate-after-rollback.md",
        applies=lambda layout: False,
        at_run_time=True,
    ),
    KnownDivergence(
        name="vllm-lookahead-hash-index-error",
        summary="get_computed_blocks raises IndexError with num_hash_lookahead_tokens >= 2 "
        "when no full-attention group bounds the lookup (sliding-window-only or "
        "sliding-window + Mamba models with multi-token MTP)",
        finding="findings/vllm/lookahead-hash-index-error.md",
        applies=_lookahead_past_the_hashes,
    ),
    KnownDivergence(
        name="vllm-chunked-hit-in-previous-chunk",
        summary="chunked-local hit lands in the previous chunk with its tokens nulled "
        "when attention_chunk_size % block_size != 0",
        finding="findings/vllm/chunked-hit-in-previous-chunk.md",
        applies=_chunk_not_multiple_of_block,
    ),
    KnownDivergence(
        name="vllm-partial-hit-reused-block-events",
        summary="get_computed_blocks raises IndexError for a request in the 'full' KV "
        "event report mode whose hit ends inside a block of a coarser group (partial "
        "hits): emit_cached_block_events indexes the group's block-aligned hashes past "
        "their end",
        finding="findings/vllm/partial-hit-reused-block-events.md",
        applies=_reused_block_events_past_the_hashes,
    ),
    KnownDivergence(
        name="vllm-dcp-reused-block-events",
        summary="get_computed_blocks raises AssertionError for a request in the 'full' KV "
        "event report mode with decode context parallelism: emit_cached_block_events reads "
        "the hashes at the spec's per-rank block size, which the hash block size does not "
        "divide",
        finding="findings/vllm/dcp-reused-block-events.md",
        applies=_reused_block_events_at_rank_block_size,
    ),
)
make_engine.known_divergences = KNOWN_DIVERGENCES  # type: ignore[attr-defined]
#: The adapter bridges every production layout setting (retention, EAGLE, caps).
make_engine.production_settings = PRODUCTION_SETTINGS  # type: ignore[attr-defined]
#: The modules of vLLM's cache manager the adapter drives (``--engine-coverage``).
make_engine.coverage_modules = (  # type: ignore[attr-defined]
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.kv_cache_coordinator",
    "vllm.v1.core.single_type_kv_cache_manager",
    "vllm.v1.core.block_pool",
    "vllm.v1.core.kv_cache_utils",
)
