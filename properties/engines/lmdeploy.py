"""LMDeploy 0.18.0 adapter: the PyTorch engine's paging layer behind the engine protocol.

Run it with the interpreter of ``.engines/lmdeploy`` (``bash ci/engines/lmdeploy`` builds
it); LMDeploy is imported lazily by the factory, so importing this module never needs it.

What the adapter builds (all LMDeploy's own objects, as its PyTorch engine builds them)
-------------------------------------------------------------------------------------
``CacheConfig`` with the fields ``ConfigBuilder.build_cache_config`` sets (one reserved
GPU block for dummy inputs, no CPU blocks), ``window_size`` set afterwards as
``ExecutorBase.__init__`` sets it from the model, then the executor's own rule
(``ExecutorBase._maybe_disable_unsupported_prefix_caching``: prefix caching off for any
sliding window); ``SchedulerConfig``; ``SequenceMeta`` with the AR sequence strategy;
and LMDeploy's ``Scheduler``, which builds the block manager (``DefaultBlockManager``, or
``WindowBlockManager`` for a window), the ``BlockTrie`` (prefix caching), the state
manager, the sequence lifecycle and the recompute eviction helper. One
``SchedulerSession`` per request, its ``SchedulerSequence`` added with the prompt.

How each difference from the protocol (vLLM's shape) is bridged
---------------------------------------------------------------
1. **One block table for every layer.** LMDeploy keeps one block table per sequence
   and one block size for all layers; a hybrid of full and sliding-window layers runs
   with ``sliding_window = -1`` (its gemma and gpt-oss configurations: every block kept,
   the window applied in the kernel only). So the layout's attention groups must share
   one block size; every group reports the same table. With two or more groups the
   adapter declares ``separate_group_pools`` and one pool ``kv`` holding them all
   (:meth:`LMDeployEngine.pool_usage`): an id repeats across groups because one LMDeploy
   block holds every layer's KV. A layout whose groups are all sliding windows of one
   width ``w`` gets ``WindowBlockManager(window_size=w)`` (LMDeploy passes the model's
   ``sliding_window`` as is; its kernels read keys ``[p - w, p]`` and its block manager
   keeps them, one key more than the protocol's ``[p - w + 1, p]``).
2. **Block ids.** LMDeploy hands out *logical* ids and maps them to physical GPU
   blocks; the adapter reports the physical ids (``BlockManager.get_block_table``, what
   its kernels index). ``num_gpu_blocks = layout.num_blocks`` with
   ``num_reserved_gpu_blocks = 1``, as LMDeploy deploys it: physical block 0 (dummy
   inputs and padding) is never handed out and is the protocol's null block. A window
   group's dropped prefix reads null: ``num_ignored_history // block_size`` zeros, then
   the kept blocks.
3. **Lookups.** ``get_computed_blocks`` runs LMDeploy's tentative prefix match
   (``_TentativePrefixMatch.match``: ``BlockTrie.match`` takes sequence references and
   advances the step), reads the matched table and rolls the match back as the
   scheduler does when admission fails (``rollback``: references, step, cursors and the
   hit statistics restored). The allocator's access times of the matched blocks move,
   as a failed admission moves them; no free count or reference count changes. The hit
   is LMDeploy's own: whole blocks strictly before the last token (``n - 1`` cap).
   LMDeploy has no cache salt: the adapter partitions the trie roots by
   ``(LoRA, salt)`` (:func:`adapter_key`), the partition its roots already make per LoRA
   adapter, which is what a salt of block 0 does to chained keys.
4. **Admission.** ``allocate_slots`` of a waiting request is LMDeploy's prefill
   admission of that one sequence (``_PrefillAdmissionAttempt.run``: match, evict for
   capacity, allocate, attach full blocks to the trie, finalize, or roll back), then
   ``activate`` to READY and ``Scheduler.activate_seqs`` to RUNNING, as its scheduler and
   engine loop do. The step's token count is LMDeploy's per-step prefill budget:
   ``cache_config.max_prefill_token_num = n`` for that call, so a longer prompt gets a
   non-final chunk (``kv_token_limit = hit + n``) exactly as LMDeploy's long-context
   chunker cuts it. Lookahead slots are LMDeploy's ``prealloc_size``, which LMDeploy
   gives only to a step that finishes the prompt (a non-final chunk preallocates
   nothing: ``lookahead_on_prefill_chunks = False``, which the table check honours).
   The match LMDeploy makes must equal the lookup's hit (else :class:`EngineError`).
5. **Growth of a running request.** A prefill chunk is ``Scheduler.
   reserve_long_context_chunk`` (the lookahead is the last chunk's prealloc); a
   decode step is ``Scheduler.schedule_running`` of that sequence with
   ``num_required_tokens = prealloc_size = lookahead``. Both evict trie blocks before
   they refuse, and evictions stay. ``schedule_running`` preempts a sequence it cannot
   grow (RUNNING -> WAITING, blocks kept): the protocol leaves preemption to the caller,
   so the adapter puts the sequence back to RUNNING and returns ``None``.
6. **Progress.** ``set_num_computed_tokens`` is ``SchedulerSequence.set_step`` (the long
   context chunker's call); ``append_output_tokens`` is ``update_token_ids`` in PREFILL
   mode for the first output, DECODE after, as the AR strategy's ``update_running``.
7. **free** is the client's stop (``Scheduler.stop_session``: RUNNING -> STOPPED; the
   stopped sequence keeps its blocks, as LMDeploy keeps them for the session's next
   turn). Requests alternate (``keeps_session``): the even ones are reclaimed at once
   (``RecomputeEvictionHelper._reclaim_candidate``: ``release_paging_resources``, the
   trie keeping its own references), and ``remove_request`` ends their session
   (``Scheduler.end_session``); the odd ones keep their session open after
   ``remove_request``, with the stopped sequence holding its blocks until an admission
   that needs them reclaims it (the candidates ``try_make_capacity_for`` goes through
   before evicting trie blocks); the session ends at the next ``new_step`` once its
   blocks are gone. A preempted request (``set_num_computed_tokens(0)`` after ``free``)
   is reclaimed then, and activated (STOPPED -> WAITING) when admitted again.
8. **num_free_blocks** is the free GPU blocks, the blocks only stopped sequences hold,
   and the trie blocks LMDeploy's eviction can take once those are reclaimed (a node
   whose whole subtree no request holds, as leaf-by-leaf eviction needs), counted from
   the trie's topology, not from LMDeploy's own leaf index. ``ref_counts`` are the
   allocator's reference counts less the trie's own reference and the stopped
   sequences': the requests holding a block. ``cached_blocks`` are the trie's nodes.
9. **reset_prefix_cache**: LMDeploy has none. With no request holding blocks the
   adapter ends the kept sessions, reclaims any stopped sequence and evicts every trie
   block through ``BlockTrie.evict`` (the path memory pressure takes); ``False`` while a
   request holds blocks.
10. **Clock.** LMDeploy stamps access times with ``time.perf_counter()`` into an
    ``int64`` array, so LRU order is kept to whole seconds and ties go by the nodes'
    addresses (``id``): a run would not replay. The adapter gives the two paging modules
    that read the clock a logical one (:class:`LogicalClock`, one tick per read), so
    eviction order is the order of the calls and a trace replays exactly.
11. **Metrics.** At every ``new_step`` the adapter reads ``Scheduler.schedule_metrics``
    as LMDeploy's engine loop does and requires the adapter's own figures: the running
    requests, the ticks, the prefix-cache statistics of the committed admissions
    (rolled-back lookups and admissions count nothing, nor the first admission after a
    reclaim: ``suppress_match_stats``) and the cache usage: with LMDeploy's default
    ``enable_request_cache_usage_metric`` the blocks admitted requests hold, counted once
    over the pool; for one layout in four (``crc32`` of the layout) the metric is off and
    the usage is ``1 - free / blocks``. A difference is an :class:`EngineError`.

Refused layouts (:class:`UnsupportedLayoutError`)
-------------------------------------------------
* Mamba: LMDeploy keeps one runtime state slot per sequence, updated in place
  (``StateManager``), and copies prefix checkpoints in and out of it; the protocol's
  Mamba group is a row of state blocks, one per block boundary, which LMDeploy does not
  have.
* Chunked local attention: LMDeploy has no chunked local block manager.
* Attention groups of different block sizes (one LMDeploy block size); EAGLE drops,
  lookahead hashes, sparse retention and admission caps (vLLM settings LMDeploy lacks).
"""

from __future__ import annotations

import itertools
import os
import types
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
    PoolUsage,
    RequestInput,
    UnsupportedLayoutError,
    quiet_loggers,
)
from reference.layout import KVCacheLayout
from reference.specs import FullAttentionSpec, SlidingWindowSpec

#: The LMDeploy release the adapter drives (``version`` of the factory).
LMDEPLOY_VERSION = "0.18.0"
#: Block sizes the layout strategy draws: powers of two as LMDeploy's kernel pages are,
#: scaled down so that a prompt of a few hundred tokens spans many blocks (LMDeploy's
#: paging code takes any size; ``PytorchEngineConfig`` asks 16 or more for its kernels).
LAYOUT_BLOCK_SIZES = (1, 2, 4, 8, 16)
#: ``SchedulerConfig.max_batches`` / ``CacheConfig.max_batches``: above any trace's
#: concurrency (the admission is per sequence, so it never binds).
MAX_BATCHES = 4096
#: The pool name of :meth:`LMDeployEngine.pool_usage`.
KV_POOL = "kv"


class LogicalClock:
    """A stand-in for the ``time`` module of LMDeploy's paging modules: ``perf_counter``
    returns 1, 2, 3, ... (one tick per read), so access times order the calls exactly and
    a trace replays. Example: two reads give ``1.0`` then ``2.0``."""

    def __init__(self) -> None:
        self._ticks = itertools.count(1)

    def perf_counter(self) -> float:
        return float(next(self._ticks))

    def time(self) -> float:
        return self.perf_counter()


@dataclass(frozen=True)
class LMDeployConfig:
    """What the adapter builds from a layout (module docstring, notes 1 and 2).

    ``window_size`` is LMDeploy's (``-1``: every block kept); ``enable_prefix_caching``
    is the layout's before LMDeploy's executor rule turns it off for a window.
    Example: one sliding-window group, bs 4, ``w = 6``, 20 blocks -> ``block_size=4,
    num_gpu_blocks=20, window_size=6, attention_groups=(0,)``.
    """

    block_size: int
    num_gpu_blocks: int
    window_size: int
    enable_prefix_caching: bool
    attention_groups: tuple[int, ...]
    max_model_len: int


def config_for(layout: KVCacheLayout) -> LMDeployConfig:
    """Check that LMDeploy can serve ``layout`` and derive its configuration; refuse
    (:class:`UnsupportedLayoutError`, one reason per kind) what it cannot.

    Example: full(bs 4) + sliding window(bs 4, w 8) -> ``window_size=-1`` (a hybrid keeps
    every block, as LMDeploy's gemma configuration does); two windows of 8 -> ``8``.
    """
    for spec in layout.specs:
        if spec.type_name == "mamba":
            raise UnsupportedLayoutError(
                "lmdeploy adapter: Mamba groups are not bridged: LMDeploy keeps one runtime "
                "state slot per sequence, updated in place, and copies checkpoints in and "
                "out of it; there is no row of state blocks to report, got layout "
                f"{layout.describe()}"
            )
        if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
            raise UnsupportedLayoutError(
                f"lmdeploy adapter: LMDeploy has no {spec.type_name} attention block "
                f"manager, got layout {layout.describe()}"
            )
    sizes = {spec.block_size for spec in layout.specs}
    if len(sizes) != 1:
        raise UnsupportedLayoutError(
            "lmdeploy adapter: LMDeploy has one block size for every layer, got layout "
            f"{layout.describe()}"
        )
    if (
        layout.use_eagle
        or layout.num_hash_lookahead_tokens
        or layout.prefix_cache_retention_interval is not None
        or layout.max_in_flight_tokens is not None
    ):
        raise UnsupportedLayoutError(
            "lmdeploy adapter: EAGLE drops, lookahead hashes, retention intervals and "
            f"admission caps are vLLM settings LMDeploy does not have, got layout "
            f"{layout.describe()}"
        )
    windows = {spec.sliding_window for spec in layout.specs if isinstance(spec, SlidingWindowSpec)}
    only_windows = all(isinstance(spec, SlidingWindowSpec) for spec in layout.specs)
    window = windows.pop() if only_windows and len(windows) == 1 else -1
    return LMDeployConfig(
        block_size=sizes.pop(),
        num_gpu_blocks=layout.num_blocks,
        window_size=window,
        enable_prefix_caching=layout.enable_caching,
        attention_groups=tuple(range(len(layout.groups))),
        max_model_len=layout.max_model_len,
    )


def adapter_key(lora_name: str | None, cache_salt: str | None) -> str | None:
    """The ``adapter_name`` a request's sequence gets: its trie root (note 3). ``None``
    without LoRA and salt (LMDeploy's base model root), the LoRA name alone without a
    salt, else a string naming both. Example: ``("a", None) -> "a"``; ``(None, "s") ->
    "lora=None;salt='s'"``."""
    if cache_salt is None:
        return lora_name
    return f"lora={lora_name!r};salt={cache_salt!r}"


class _LMDeployModules:
    """LMDeploy imported once per process (the import takes seconds), with the logical
    clock installed in the paging modules that read access times (note 10)."""

    _loaded: types.SimpleNamespace | None = None

    @classmethod
    def get(cls) -> types.SimpleNamespace:
        if cls._loaded is None:
            os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
            try:
                import numpy as np
                from lmdeploy.pytorch import envs
                from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig
                from lmdeploy.pytorch.engine.executor.base import ExecutorBase
                from lmdeploy.pytorch.messages import (
                    MessageStatus,
                    SequenceMeta,
                    UpdateTokenMode,
                )
                from lmdeploy.pytorch.paging import prefill_scheduler
                from lmdeploy.pytorch.paging.block_manager import base_block_manager
                from lmdeploy.pytorch.paging.block_trie import checkpoint_lifecycle
                from lmdeploy.pytorch.paging.scheduler import Scheduler
                from lmdeploy.pytorch.paging.seq_states.states import RunningState
                from lmdeploy.pytorch.strategies.ar.sequence import ARSequenceStrategy
            except ImportError as exc:
                raise EngineError(
                    f"lmdeploy adapter: cannot import LMDeploy {LMDEPLOY_VERSION} ({exc}); "
                    "run ci/engines/lmdeploy and use .engines/lmdeploy/bin/python"
                ) from exc
            quiet_loggers("lmdeploy")
            clock = LogicalClock()
            base_block_manager.time = clock
            checkpoint_lifecycle.time = clock
            cls._loaded = types.SimpleNamespace(
                np=np,
                envs=envs,
                CacheConfig=CacheConfig,
                SchedulerConfig=SchedulerConfig,
                ExecutorBase=ExecutorBase,
                MessageStatus=MessageStatus,
                SequenceMeta=SequenceMeta,
                UpdateTokenMode=UpdateTokenMode,
                Scheduler=Scheduler,
                RunningState=RunningState,
                ARSequenceStrategy=ARSequenceStrategy,
                AdmissionAttempt=prefill_scheduler._PrefillAdmissionAttempt,
                AdmissionAction=prefill_scheduler._PrefillAdmissionAction,
                TurnPolicy=prefill_scheduler._PrefillTurnPolicy,
                TentativePrefixMatch=prefill_scheduler._TentativePrefixMatch,
            )
        return cls._loaded


@dataclass
class _Request:
    """Adapter-side state of one request: LMDeploy's sequence and session, and the
    protocol counters."""

    seq: Any
    session_id: int
    num_tokens: int
    #: its session stays open after ``remove_request`` (an interactive session: the
    #: stopped sequence keeps its blocks until an admission reclaims them); every other
    #: request, as LMDeploy's ``end_session`` does, releases them at ``free`` (note 7)
    keeps_session: bool = False
    num_computed_tokens: int = 0
    num_generated: int = 0
    #: admitted (holds LMDeploy paging resources, RUNNING) since its last free
    admitted: bool = False


class LMDeployEngine:
    """LMDeploy's paging layer (scheduler, block manager, block trie) driven through the
    engine protocol (module docstring)."""

    #: LMDeploy preallocates lookahead (``prealloc_size``) only for a step that
    #: finishes the prompt (note 4)
    lookahead_on_prefill_chunks = False

    def __init__(self, layout: KVCacheLayout) -> None:
        self.layout = layout
        self.config = config_for(layout)
        m = _LMDeployModules.get()
        self._m = m
        cfg = self.config
        cache_config = m.CacheConfig(
            max_batches=MAX_BATCHES,
            block_size=cfg.block_size,
            num_cpu_blocks=0,
            num_gpu_blocks=cfg.num_gpu_blocks,
            enable_prefix_caching=cfg.enable_prefix_caching,
            num_reserved_gpu_blocks=1,
        )
        # ExecutorBase.__init__: the model's window, then the executor's caching rule
        cache_config.window_size = cfg.window_size
        m.ExecutorBase._maybe_disable_unsupported_prefix_caching(
            types.SimpleNamespace(cache_config=cache_config), check_window=True
        )
        scheduler_config = m.SchedulerConfig(
            max_batches=MAX_BATCHES, max_session_len=cfg.max_model_len
        )
        self.scheduler = m.Scheduler(
            scheduler_config,
            cache_config,
            seq_meta=m.SequenceMeta(cfg.block_size, strategy=m.ARSequenceStrategy()),
        )
        self.cache_config = cache_config
        self.block_manager = self.scheduler.block_manager
        self.block_trie = self.scheduler.block_trie
        #: several attention groups share LMDeploy's one table (note 1)
        self.separate_group_pools = len(cfg.attention_groups) > 1
        self._requests: dict[str, _Request] = {}
        self._session_ids = itertools.count()
        #: sessions of removed requests kept open: session id -> its stopped sequence,
        #: ended once LMDeploy has reclaimed its blocks
        self._kept_sessions: dict[int, Any] = {}
        #: the prefix-cache statistics LMDeploy should hold: (query, hit) tokens of the
        #: admissions whose match it counts (note 11)
        self._expected_stats = [0, 0]
        self._ticks = 0
        #: the request-level cache usage metric (LMDeploy's default) or the pool's
        self.request_usage_metric = zlib.crc32(layout.describe().encode()) % 4 != 0
        #: num_free_blocks of the current state (None: not computed since the last call
        #: into LMDeploy)
        self._num_free: int | None = None

    # ----------------------------------------------------------------- requests
    def add_request(self, request: RequestInput) -> None:
        self._num_free = None
        if request.request_id in self._requests:
            raise EngineError(f"lmdeploy adapter: request_id {request.request_id!r} exists")
        if not request.prompt_token_ids:
            raise EngineError(f"lmdeploy adapter: request {request.request_id!r} has no prompt")
        session_id = next(self._session_ids)
        session = self.scheduler.add_session(session_id)
        seq = session.add_sequence(
            self._m.np.asarray(request.prompt_token_ids, dtype=self._m.np.int64),
            adapter_name=adapter_key(request.lora_name, request.cache_salt),
        )
        self._requests[request.request_id] = _Request(
            seq=seq,
            session_id=session_id,
            num_tokens=len(request.prompt_token_ids),
            keeps_session=session_id % 2 == 1,
        )

    def append_output_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """``update_token_ids`` as the AR strategy's ``update_running`` (note 6): the
        sequence's pending tokens join its history, the new ones are pending."""
        self._num_free = None
        state = self._get(request_id)
        m = self._m
        for token in token_ids:
            mode = m.UpdateTokenMode.DECODE if state.num_generated else m.UpdateTokenMode.PREFILL
            state.seq.update_token_ids(m.np.asarray([int(token)], dtype=m.np.int64), mode=mode)
            state.num_generated += 1
            state.num_tokens += 1
        # the history is what the protocol computed (update_token_ids assumed every
        # pending token computed, which the scheduler guarantees before an output)
        state.seq.set_step(state.num_computed_tokens)

    def set_num_computed_tokens(self, request_id: str, num_computed_tokens: int) -> None:
        self._num_free = None
        state = self._get(request_id)
        if not 0 <= num_computed_tokens <= state.num_tokens:
            raise EngineError(
                f"lmdeploy adapter: num_computed_tokens {num_computed_tokens} out of "
                f"[0, {state.num_tokens}] for {request_id!r}"
            )
        seq = state.seq
        if not state.admitted and seq.num_blocks:
            if num_computed_tokens:
                raise EngineError(
                    f"lmdeploy adapter: {request_id!r} was freed; it can only restart from 0, "
                    f"got {num_computed_tokens} computed tokens"
                )
            # preempted: its prefix is computed again, so its kept blocks go now
            self._reclaim(seq)
        state.num_computed_tokens = num_computed_tokens
        seq.set_step(num_computed_tokens)

    def new_step(self) -> None:
        """One scheduler progress step (``Scheduler.tick``, once per forward dispatch);
        kept sessions whose blocks LMDeploy reclaimed end (note 7)."""
        self._num_free = None
        self._check_metrics()
        self.scheduler.tick()
        self._ticks += 1
        for session_id, seq in list(self._kept_sessions.items()):
            if not seq.num_blocks:
                self.scheduler.end_session(session_id)
                del self._kept_sessions[session_id]

    def _check_metrics(self) -> None:
        """Note 11: ``Scheduler.schedule_metrics``, as the engine loop reads it every step,
        against the adapter's own figures: running sequences, scheduler ticks, the
        prefix-cache hit counts of the admissions, and the cache usage (the blocks
        admitted requests hold, counted once, with LMDeploy's default request-level
        metric; ``1 - free / blocks`` without it)."""
        m = self._m
        m.envs.enable_request_cache_usage_metric = self.request_usage_metric
        metrics = self.scheduler.schedule_metrics
        stats = self.block_trie.stats
        running = [s for s in self._requests.values() if s.admitted]
        total = self.config.num_gpu_blocks
        if self.request_usage_metric:
            held = {
                b for s in running for b in self._physical(s.seq.logical_blocks.get_real_blocks())
            }
            usage = len(held) / total
        else:
            usage = 1.0 - self.block_manager.get_num_free_gpu_blocks() / total
        got = (
            metrics.active_seqs,
            metrics.scheduler_tick,
            stats.num_query_tokens,
            stats.num_hit_tokens,
        )
        want = (len(running), self._ticks, *self._expected_stats)
        if got != want or abs(metrics.cache_usage - usage) > 1e-9:
            raise EngineError(
                "lmdeploy adapter: schedule_metrics (active, tick, query, hit tokens, usage) "
                f"{(*got, metrics.cache_usage)} != {(*want, usage)}"
            )

    def remove_request(self, request_id: str) -> None:
        """``Scheduler.end_session``, or, for a request that keeps its session, the
        session left open with its stopped sequence (note 7)."""
        self._num_free = None
        state = self._get(request_id)
        if state.admitted:
            self.free(request_id)
        if state.keeps_session and state.seq.num_blocks:
            self._kept_sessions[state.session_id] = state.seq
        else:
            self.scheduler.end_session(state.session_id)
        del self._requests[request_id]

    # ---------------------------------------------------------------- lookups
    def get_computed_blocks(self, request_id: str) -> CacheHit:
        """LMDeploy's tentative match, read, then rolled back (note 3)."""
        self._num_free = None
        state = self._get(request_id)
        seq = state.seq
        if state.admitted or seq.num_blocks:
            raise EngineError(f"lmdeploy adapter: lookup for {request_id!r}, which holds blocks")
        if not self.block_trie.enabled:
            return CacheHit(self._per_group(()), 0)
        match = self._m.TentativePrefixMatch(
            seq,
            self.block_trie,
            self.block_manager,
            is_ssm=False,
            preserve_existing_state=False,
        )
        match.match()
        try:
            hit = int(seq.num_history_ids)
            ids = self._physical(seq.logical_blocks.get_real_blocks())
        finally:
            match.rollback("kvconform lookup")
        if seq.num_blocks or seq.num_history_ids:
            raise EngineError(
                f"lmdeploy adapter: rolling back the lookup of {request_id!r} left "
                f"{seq.num_blocks} blocks at step {seq.num_history_ids}"
            )
        return CacheHit(self._per_group(ids), hit)

    # ------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        hit: CacheHit | None = None,
        num_lookahead_tokens: int = 0,
    ) -> BlockIds | None:
        self._num_free = None
        state = self._get(request_id)
        hit_tokens = hit.num_tokens if hit is not None else 0
        if num_new_computed_tokens != hit_tokens:
            raise EngineError(
                f"lmdeploy adapter: num_new_computed_tokens {num_new_computed_tokens} != "
                f"hit.num_tokens {hit_tokens}"
            )
        if num_new_tokens < 1 or num_lookahead_tokens < 0:
            raise EngineError(
                f"lmdeploy adapter: {request_id!r} asks for {num_new_tokens} new and "
                f"{num_lookahead_tokens} lookahead tokens"
            )
        admission = not state.admitted
        if not admission:
            if hit_tokens:
                raise EngineError(f"lmdeploy adapter: a hit for running request {request_id!r}")
            before = self.get_block_ids(request_id)
            ok = self._grow(state, num_new_tokens, num_lookahead_tokens)
        else:  # the new blocks follow the adopted hit's
            before = hit.block_ids if hit_tokens else self._per_group(())
            ok = self._admit(state, hit_tokens, num_new_tokens, num_lookahead_tokens)
        if not ok:
            return None
        after = self.get_block_ids(request_id)
        # an admission's table starts with the adopted hit; a running request's table
        # does not shrink (LMDeploy's window nulls entries, and its trie may substitute
        # its own block for one the request holds: findings/lmdeploy/README.md)
        if any(
            len(row) < len(old) or (admission and tuple(row[: len(old)]) != tuple(old))
            for row, old in zip(after, before)
        ):
            raise EngineError(
                f"lmdeploy adapter: allocate_slots({request_id!r}) left a table {after} "
                f"that does not extend {before}"
            )
        return tuple(tuple(row[len(old) :]) for row, old in zip(after, before))

    def _admit(self, state: _Request, hit_tokens: int, n: int, lookahead: int) -> bool:
        """Note 4: LMDeploy's prefill admission of this sequence, ``n`` tokens after the
        hit; False when it stops (its match rolled back, evictions kept)."""
        seq = state.seq
        m = self._m
        if hit_tokens + n > state.num_tokens:
            raise EngineError(
                f"lmdeploy adapter: {n} new tokens after a hit of {hit_tokens} pass the "
                f"request's {state.num_tokens} tokens"
            )
        if state.num_computed_tokens or seq.num_history_ids or seq.num_blocks:
            raise EngineError(
                f"lmdeploy adapter: admitting {seq.seq_id} at step {seq.num_history_ids} "
                f"with {seq.num_blocks} blocks"
            )
        if seq.status == m.MessageStatus.STOPPED:  # freed before: back to the queue
            seq.activate()
        self.cache_config.max_prefill_token_num = n
        attempt = m.AdmissionAttempt(
            self.scheduler._prefill_scheduler,
            seq,
            stopped=self.scheduler.hanging,
            evictable_waiting=[s for s in self.scheduler.waiting if s is not seq],
            prealloc_size=lookahead,
            batch_prefill_tokens=0,
            batch_has_prefill=False,
            turn_policy=m.TurnPolicy.STANDARD,
        )
        counted = self.block_trie.enabled and not seq.prefix_cache.suppress_match_stats
        admitted = attempt.run().action is m.AdmissionAction.ADMIT
        if not admitted:
            if seq.num_blocks:
                raise EngineError(
                    f"lmdeploy adapter: a refused admission left {seq.num_blocks} blocks"
                )
            return False
        if seq.num_history_ids != hit_tokens:
            raise EngineError(
                f"lmdeploy adapter: LMDeploy's admission matched {seq.num_history_ids} "
                f"tokens, the lookup {hit_tokens}"
            )
        if counted:  # BlockTrie._record_match_stats of the committed match
            self._expected_stats[0] += state.num_tokens
            self._expected_stats[1] += hit_tokens
        seq.state.activate()
        self.scheduler.activate_seqs([seq])
        state.admitted = True
        return True

    def _grow(self, state: _Request, n: int, lookahead: int) -> bool:
        """Note 5: a prefill chunk or a decode step of a running sequence."""
        seq = state.seq
        m = self._m
        end = state.num_computed_tokens + n
        if end > state.num_tokens:
            raise EngineError(
                f"lmdeploy adapter: {n} new tokens from {state.num_computed_tokens} pass the "
                f"request's {state.num_tokens} tokens"
            )
        scheduler = self.scheduler
        last = end >= state.num_tokens
        if seq.kv_token_limit is None and n == 1 and last:
            valid = scheduler.schedule_running(
                [seq], num_required_tokens=lookahead, prealloc_size=lookahead
            )
            if valid[0]:
                return True
            # LMDeploy preempted it (blocks kept); the protocol's caller decides
            if seq.status != m.MessageStatus.RUNNING:
                scheduler.sequence_lifecycle.transition(seq, m.RunningState)
            return False
        return scheduler.reserve_long_context_chunk(
            seq, n, prealloc_size=lookahead if last else 0, is_last_chunk=last
        )

    # ------------------------------------------------------------------- free
    def free(self, request_id: str) -> None:
        """Note 7: a request that keeps its session finishes (``finish``: RUNNING ->
        STOPPED, blocks kept); the others are stopped (``Scheduler.stop_session``) and
        reclaimed at once."""
        self._num_free = None
        state = self._get(request_id)
        if not state.admitted:
            return
        state.admitted = False
        if state.keeps_session:  # the generation's own end: RUNNING -> STOPPED
            state.seq.finish()
        else:  # the client's stop, then the reclaim
            self.scheduler.stop_session(state.session_id)
            self._reclaim(state.seq)

    def _reclaim(self, seq: Any) -> None:
        """LMDeploy's reclaim of a stopped sequence
        (``RecomputeEvictionHelper._reclaim_candidate``: ``release_paging_resources``)."""
        if not self.scheduler.eviction_helper._reclaim_candidate(seq) or seq.num_blocks:
            raise EngineError(
                f"lmdeploy adapter: reclaiming sequence {seq.seq_id} left {seq.num_blocks} blocks"
            )

    def reset_prefix_cache(self) -> bool:
        """Note 9: evict every trie block when no request holds blocks (the kept
        sessions end first)."""
        self._num_free = None
        if any(s.admitted for s in self._requests.values()):
            return False
        for session_id in list(self._kept_sessions):
            self.scheduler.end_session(session_id)
        self._kept_sessions.clear()
        for state in self._requests.values():
            if state.seq.num_blocks:
                self._reclaim(state.seq)
        if self.block_trie.enabled:
            self.block_trie.evict(self.config.num_gpu_blocks)
        return True

    # ------------------------------------------------------------- observations
    def get_block_ids(self, request_id: str) -> BlockIds:
        """The sequence's table while the request is admitted; empty after ``free`` (a
        stopped sequence's kept blocks are LMDeploy's to reclaim, note 7)."""
        state = self._get(request_id)
        seq = state.seq
        if not state.admitted or not seq.num_blocks:
            return self._per_group(())
        dropped = seq.num_ignored_history // self.config.block_size
        row = (0,) * dropped + self._physical(seq.logical_blocks.get_real_blocks())
        return self._per_group(row)

    def num_free_blocks(self) -> int:
        """Note 8: free GPU blocks, blocks only stopped sequences hold, and the trie
        blocks eviction can take once they are reclaimed (computed once per state: every
        call into LMDeploy forgets it)."""
        if self._num_free is None:
            self._num_free = int(self.block_manager.get_num_free_gpu_blocks()) + self._reclaimable()
        return self._num_free

    def pool_usage(self) -> tuple[PoolUsage, ...]:
        """One pool, ``kv``, for every attention group (note 1)."""
        return (
            PoolUsage(
                KV_POOL,
                self.config.attention_groups,
                self.config.num_gpu_blocks - 1,
                self.num_free_blocks(),
            ),
        )

    def ref_counts(self) -> dict[int, int]:
        """Per physical block: the requests holding it, i.e. the allocator's reference
        count less the trie's own reference and the stopped sequences' (note 8); 0 for a
        free block."""
        np = self._m.np
        allocator = self.block_manager.allocator
        owners = self._request_refs()
        trie = self._trie_walk()[0]
        np.subtract.at(owners, np.asarray(trie, dtype=np.int64), 1)
        counts = dict.fromkeys(range(1, self.config.num_gpu_blocks), 0)
        held = np.flatnonzero(owners)
        for logical, physical in zip(held, allocator.get_physical_blocks(held)):
            counts[int(physical)] = int(owners[logical])
        return counts

    def cached_blocks(self) -> list[CachedBlock]:
        """Every trie node, in every attention group (one table serves them all)."""
        out: list[CachedBlock] = []
        nodes = self._trie_nodes()
        if not nodes:
            return out
        physical = self._physical([node.block_id for node in nodes])
        for node, block in zip(nodes, physical):
            for gid in self.config.attention_groups:
                out.append(CachedBlock(block, gid, int(node.prefix_len)))
        return out

    # ---------------------------------------------------------------- helpers
    def _trie_nodes(self) -> list[Any]:
        """Every attached non-root node of every adapter root."""
        if not self.block_trie.enabled:
            return []
        nodes: list[Any] = []
        stack = list(self.block_trie._roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                nodes.append(child)
                stack.append(child)
        return nodes

    def _request_refs(self) -> Any:
        """Per logical block, the allocator's reference count less the references of the
        sequences no admitted request owns (stopped, their blocks kept for a reclaim)."""
        np = self._m.np
        allocator = self.block_manager.allocator
        refs = np.array(allocator.get_ref_count(np.arange(allocator._num_blocks)))
        admitted = {id(s.seq) for s in self._requests.values() if s.admitted}
        for seq in self.scheduler.seq_manager.get_all_sequences():
            if seq.num_blocks and id(seq) not in admitted:
                np.subtract.at(refs, seq.logical_blocks.get_real_blocks(), 1)
        return refs

    def _trie_walk(self) -> tuple[list[int], list[int], list[bool]]:
        """The trie's non-root nodes in preorder: their logical block ids, the end of each
        node's subtree interval ``[i, end)``, and whether a checkpoint pins it."""
        block_ids: list[int] = []
        ends: list[int] = []
        pinned: list[bool] = []
        if not self.block_trie.enabled:
            return block_ids, ends, pinned
        # entries: a node to enter, or the index of a node whose subtree is complete
        stack: list[Any] = [
            child for root in self.block_trie._roots.values() for child in root.children.values()
        ]
        while stack:
            item = stack.pop()
            if isinstance(item, int):
                ends[item] = len(block_ids)
                continue
            stack.append(len(block_ids))
            block_ids.append(item.block_id)
            checkpoint = item.state_checkpoint
            pinned.append(checkpoint is not None and checkpoint.pin_count > 0)
            ends.append(0)
            stack.extend(item.children.values())
        return block_ids, ends, pinned

    def _reclaimable(self) -> int:
        """Blocks an allocation can take besides the free ones (note 8): those only
        stopped sequences hold (LMDeploy reclaims them first), and the trie nodes whose
        whole subtree (the node included) no request holds then, no checkpoint pinned,
        as leaf-by-leaf eviction needs; from the trie's topology, not LMDeploy's leaf
        index. Example: a path ``a -> b`` no request holds: 2; while a request holds
        ``a`` only: 1 (``b``); while one holds ``b`` (and so ``a``): 0.

        One preorder walk gives each node its subtree's interval; a node is evictable
        when no node of its interval is held (a prefix sum of the held ones)."""
        np = self._m.np
        refs = self._request_refs()
        block_ids, ends, pinned = self._trie_walk()
        in_trie = np.zeros(len(refs), dtype=bool)
        in_trie[np.asarray(block_ids, dtype=np.int64)] = True
        allocated = np.asarray(self.block_manager.allocator.get_ref_count(np.arange(len(refs))))
        stopped_only = int(np.count_nonzero((allocated > 0) & (refs == 0) & ~in_trie))
        if not block_ids:
            return stopped_only
        held = (refs[np.asarray(block_ids)] != 1) | np.asarray(pinned)
        prefix = np.concatenate(([0], np.cumsum(held)))
        starts = np.arange(len(block_ids))
        return stopped_only + int(np.count_nonzero(prefix[np.asarray(ends)] == prefix[starts]))

    def _physical(self, logical: Any) -> tuple[int, ...]:
        if len(logical) == 0:
            return ()
        np = self._m.np
        phys = self.block_manager.allocator.get_physical_blocks(np.asarray(logical))
        return tuple(int(b) for b in phys)

    def _per_group(self, row: tuple[int, ...]) -> BlockIds:
        return tuple(row for _ in self.layout.groups)

    def _get(self, request_id: str) -> _Request:
        state = self._requests.get(request_id)
        if state is None:
            raise EngineError(f"lmdeploy adapter: unknown request_id {request_id!r}")
        return state


def make_engine(layout: KVCacheLayout) -> LMDeployEngine:
    """Build an :class:`LMDeployEngine` for ``layout`` (LMDeploy is imported here)."""
    return LMDeployEngine(layout)


def lmdeploy_layouts():
    """The layouts this adapter drives: one to three attention groups of one block size
    (:data:`LAYOUT_BLOCK_SIZES`), each full or a sliding window; the windows of a
    window-only layout one width (so LMDeploy's window manager runs) one time in two;
    prefix caching off in one layout of eight; pools from one request's worth (eviction
    and refusals) to roomy."""
    from hypothesis import strategies as st

    from reference.layout import KVCacheGroup

    @st.composite
    def build(draw) -> KVCacheLayout:
        bs = draw(st.sampled_from(LAYOUT_BLOCK_SIZES))
        kinds = draw(st.lists(st.sampled_from(("full", "sliding_window")), min_size=1, max_size=3))
        one_window = draw(st.integers(1, 6 * bs + 2))
        shared = draw(st.booleans())
        groups = []
        for i, kind in enumerate(kinds):
            if kind == "full":
                spec = FullAttentionSpec(block_size=bs)
            else:
                w = one_window if shared else draw(st.integers(1, 6 * bs + 2))
                spec = SlidingWindowSpec(block_size=bs, sliding_window=w)
            groups.append(KVCacheGroup((f"layer.{i}",), spec))
        max_len = draw(st.integers(max(8, 2 * bs), 160))
        per_request = -(-max_len // bs) + 1
        num_blocks = draw(
            st.one_of(
                st.integers(per_request + 1, 2 * per_request + 2),
                st.integers(per_request + 1, 6 * per_request),
            )
        )
        caching = draw(st.integers(0, 7)) != 0
        return KVCacheLayout(tuple(groups), num_blocks, max_len, enable_caching=caching)

    return build()


#: The most lookahead slots a kvconform step asks for (``properties.generate.strategies.
#: lookaheads``): a window manager with blocks this small or smaller can hold a
#: preallocated block past its history when it next allocates.
MAX_LOOKAHEAD_TOKENS = 4


def uses_window_manager(layout: KVCacheLayout) -> bool:
    """LMDeploy builds its ``WindowBlockManager`` for ``layout``: every group a sliding
    window of one width (note 1). Example: two windows of 8 -> True; full + window ->
    False."""
    try:
        return config_for(layout).window_size > 0
    except UnsupportedLayoutError:
        return False


def _prefix_caching_on(layout: KVCacheLayout) -> bool:
    """LMDeploy runs its prefix trie for ``layout`` (caching on, no window manager)."""
    return layout.enable_caching and not uses_window_manager(layout)


def _window_can_hold_preallocation(layout: KVCacheLayout) -> bool:
    """The window manager with a block size a step's lookahead can fill (``<=``
    :data:`MAX_LOOKAHEAD_TOKENS`): a decode's preallocated block then lies past the
    window's last block at the next allocation."""
    return uses_window_manager(layout) and layout.groups[0].spec.block_size <= MAX_LOOKAHEAD_TOKENS


#: LMDeploy 0.18.0 behaviours that break a property; see findings/lmdeploy/.
KNOWN_DIVERGENCES = (
    KnownDivergence(
        name="lmdeploy-trie-dedup-writes-shared-block",
        summary="BlockTrie.allocate substitutes the trie's block for a block the coming "
        "forward computes (the one holding the last prompt token, or a later chunk's), so "
        "two requests write one block",
        finding="findings/lmdeploy/README.md#trie-dedup-writes-shared-block",
        applies=_prefix_caching_on,
        checks=("exclusive_write",),
    ),
    KnownDivergence(
        name="lmdeploy-window-overdrop",
        summary="WindowBlockManager drops one window block more for every block the "
        "sequence holds past its history (preallocated), freeing keys the next forward reads",
        finding="findings/lmdeploy/README.md#window-overdrop",
        applies=_window_can_hold_preallocation,
    ),
)
make_engine.known_divergences = KNOWN_DIVERGENCES  # type: ignore[attr-defined]
make_engine.layout_strategy = lmdeploy_layouts  # type: ignore[attr-defined]
#: Full attention and sliding windows (note 1); Mamba and chunked local are refused.
make_engine.spec_types = ("full", "sliding_window")  # type: ignore[attr-defined]
make_engine.version = LMDEPLOY_VERSION  # type: ignore[attr-defined]
#: LMDeploy's paging modules the adapter drives (``--engine-coverage``): the block
#: managers, the block trie (its checkpoint modules are the SSM prefix cache), the
#: scheduler and its prefill admission, the sequence states, the state manager and the
#: recompute eviction helper. The KV transfer coordinators (PD disaggregation and
#: external KV stores) are LMDeploy's connector layer, as vLLM's adapter leaves vLLM's.
make_engine.coverage_modules = (  # type: ignore[attr-defined]
    "lmdeploy.pytorch.paging.block_manager.base_block_manager",
    "lmdeploy.pytorch.paging.block_manager.default_block_manager",
    "lmdeploy.pytorch.paging.block_manager.window_block_manager",
    "lmdeploy.pytorch.paging.block_trie.trie",
    "lmdeploy.pytorch.paging.block_trie.node",
    "lmdeploy.pytorch.paging.block_trie.kv_lifecycle",
    "lmdeploy.pytorch.paging.block_trie.checkpoint",
    "lmdeploy.pytorch.paging.block_trie.checkpoint_lifecycle",
    "lmdeploy.pytorch.paging.scheduler",
    "lmdeploy.pytorch.paging.prefill_scheduler",
    "lmdeploy.pytorch.paging.seq_states.states",
    "lmdeploy.pytorch.paging.state_manager",
    "lmdeploy.pytorch.paging.eviction_helper.recompute_eviction_helper",
)
