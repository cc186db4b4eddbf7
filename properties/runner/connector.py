"""The scheduler's KV connector: a host tier behind the primary pool (connector modes).

:class:`Connector` is the part of the scheduler (:mod:`properties.runner.scheduler`) that
serves the ``external_hits``, ``async_loads`` and ``load_failures`` serving modes
(:class:`properties.core.modes.ServingMode`; never with a Mamba group: loaded Mamba states
are not modelled). It owns a :class:`reference.host_tier.HostTier` (capacity twice the
pool), the requests whose load is in flight, and its own per-request state (the load not
read by a step yet, the attempts, the blocks already detached). Rules:

* **Offload.** Blocks go to the tier when they leave the primary pool: a sliding-window
  or chunked-local block once its tokens are all below the group's skip boundary on the
  processed basis (*detach*, :meth:`Connector.processed`), and every full computed
  block of a request's table when the request is freed (finished, preempted, aborted:
  :meth:`Connector.release`). Null entries hold nothing and are not offloaded.
* **External hits.** A waiting request's device hit ``h`` is extended by the tokens
  the tier holds beyond it (``e``: every group must serve ``h + e``,
  :meth:`Connector.external_tokens`); the scheduler calls ``allocate_slots(n, h, hit
  blocks, ..., num_external_computed_tokens=e)``, the connector loads ``[h, h + e)`` into
  the request's blocks (:meth:`Connector.load`) and the request computes from ``h + e``.
* **Asynchronous loads** (``async_loads``): the admission allocates only the loaded
  blocks (``allocate_slots(0, h, hit blocks, 0, num_external_computed_tokens=e,
  delay_cache_blocks=True)``) and the request waits in :attr:`Connector.loading` (no
  budget used, :meth:`Connector.start_load`). The load completes at the start of the
  next step (:meth:`Connector.complete_load`: ``on_load``, then ``cache_blocks(id, h +
  e)``) and the request joins the running ones. An ``Abort`` of a loading request is
  deferred until its load completes (:meth:`Connector.defer_abort`).
* **Failed loads** (``load_failures``): a load that fails
  (:func:`properties.core.modes.load_fails`, by request and attempt) is not copied in;
  the scheduler sets the request's computed tokens back to 0, frees its blocks
  uncached and queues it again at the front.

Hooks: the scheduler calls the connector at three points of a request's life, *admit*
(:meth:`external_tokens`, then :meth:`load` or :meth:`start_load`; at the start of the
next step :meth:`take_loads` and :meth:`complete_load` finish an asynchronous one),
*free* (:meth:`release`, before ``engine.free``) and *output processed*
(:meth:`processed`, after a step's output), and :meth:`forget` when it forgets a request.
``on_offload`` and ``on_load`` observe the content that leaves and comes back (the
attention check copies it out of and back into its paged cache).

:class:`EngineTierConnector` serves the same modes for an engine whose host tier is its own
(``OwnsHostTier``): the engine says how many tokens its tier would load; nothing is
offloaded by the connector.

Worked example (one full group, bs 4): ``r0`` (12-token prompt, one output) finishes, so
:meth:`release` offloads its three full blocks (``len(host_tier) == 3``); after a
``ResetPrefixCache``, ``r1`` (the same 12 tokens and 4 more) finds no device hit,
:meth:`external_tokens` gives 12, and ``r1`` computes positions 12..15.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from properties.core.engine import BlockIds, KVCacheEngine, RequestInput
from properties.core.modes import ServingMode, load_fails
from reference.block_table import NULL_BLOCK_ID
from reference.host_tier import HostTier, num_detached_blocks
from reference.layout import KVCacheLayout


class RequestView(Protocol):
    """What the connector reads of the scheduler's request state."""

    input: RequestInput
    num_computed_tokens: int
    holds_blocks: bool

    @property
    def request_id(self) -> str: ...

    @property
    def token_ids(self) -> tuple[int, ...]: ...


#: Called when a block leaves the primary pool for the host tier:
#: (request, group, block index, block id it leaves).
OffloadObserver = Callable[[RequestView, int, int, int], None]
#: Called when the connector loads positions ``[start, end)`` of a request into its
#: blocks: (request, start, end).
LoadObserver = Callable[[RequestView, int, int], None]


class Connector:
    """A KV connector over a host tier (see the module docstring)."""

    def __init__(
        self,
        engine: KVCacheEngine,
        layout: KVCacheLayout,
        mode: ServingMode,
        host_tier: HostTier,
        on_offload: OffloadObserver | None = None,
        on_load: LoadObserver | None = None,
    ) -> None:
        self.engine = engine
        self.layout = layout
        #: loads complete at the start of the next step (``async_loads``)
        self.asynchronous = mode.async_loads
        #: a first load may fail (``load_failures``)
        self.failures = mode.load_failures
        self.on_offload = on_offload
        self.on_load = on_load
        self.host_tier = host_tier
        #: requests whose load completes at the start of the next step, in admission order
        self.loading: list[str] = []
        #: (device hit, external tokens) of a load not read by a step yet
        self.loaded: dict[str, tuple[int, int]] = {}
        #: loads started per request (``load_failures``: a retry never fails)
        self.num_load_attempts: dict[str, int] = {}
        #: per group, the leading blocks of a request already detached to the host tier
        self.detached: dict[str, list[int]] = {}
        #: loading requests aborted meanwhile (released once the load completes)
        self.aborted: set[str] = set()

    # -- admit ---------------------------------------------------------------------
    def external_tokens(self, state: RequestView, device_tokens: int) -> int:
        """The tokens the host tier holds beyond the device hit ``device_tokens``."""
        req = state.input
        return self.host_tier.num_external_tokens(
            req.cache_salt, req.lora_name, state.token_ids, device_tokens
        )

    def load(self, state: RequestView, start: int, end: int) -> None:
        """The connector loads positions ``[start, end)`` into the request's blocks."""
        if self.on_load is not None:
            self.on_load(state, start, end)

    def start_load(self, request_id: str, hit_tokens: int, external_tokens: int) -> None:
        """An asynchronous load of ``[hit_tokens, hit_tokens + external_tokens)`` starts;
        it completes at the start of the next step."""
        self.loading.append(request_id)
        self.loaded[request_id] = (hit_tokens, external_tokens)

    def take_loaded(self, request_id: str) -> tuple[int, int]:
        """(device hit, external tokens) of the request's completed load, once: the first
        step that schedules it reports them; ``(0, 0)`` without one."""
        return self.loaded.pop(request_id, (0, 0))

    def take_loads(self) -> list[str]:
        """The loads to complete now (the scheduler then calls :meth:`complete_load`)."""
        loads, self.loading = self.loading, []
        return loads

    def complete_load(self, state: RequestView) -> bool:
        """Complete the request's load: ``on_load`` for the loaded positions, then
        ``cache_blocks(id, h + e)``; False when the load failed (nothing copied in, no
        engine call: the scheduler resets and frees the request)."""
        rid = state.request_id
        attempt = self.num_load_attempts.get(rid, 0)
        self.num_load_attempts[rid] = attempt + 1
        if self.failures and load_fails(rid, attempt):
            self.loaded.pop(rid, None)
            return False
        self.load(state, self.loaded[rid][0], state.num_computed_tokens)
        self.engine.cache_blocks(rid, state.num_computed_tokens)
        return True

    def defer_abort(self, request_id: str) -> bool:
        """Whether an ``Abort`` of the request waits for its load (then recorded)."""
        if request_id not in self.loading:
            return False
        self.aborted.add(request_id)
        return True

    # -- free ------------------------------------------------------------------------
    def release(self, state: RequestView, processed: int) -> None:
        """Before the request's blocks are freed: every full block of its table within the
        ``processed`` tokens and not detached yet goes to the host tier."""
        rid = state.request_id
        if state.holds_blocks:
            detached = self.detached.get(rid)
            table = self.engine.get_block_ids(rid)
            for gid, row in enumerate(table):
                bs = self.layout.groups[gid].spec.block_size
                first = detached[gid] if detached else 0
                for k in range(first, min(len(row), processed // bs)):
                    self._offload(state, gid, k, row[k])
        self.detached.pop(rid, None)
        self.loaded.pop(rid, None)

    def forget(self, request_id: str) -> None:
        """The scheduler forgot the request: so does the connector."""
        self.num_load_attempts.pop(request_id, None)
        self.aborted.discard(request_id)
        self.loaded.pop(request_id, None)
        self.detached.pop(request_id, None)

    # -- output processed ----------------------------------------------------------------
    def processed(self, state: RequestView, processed: int) -> None:
        """Offload the sliding-window and chunked-local blocks that fell below their
        group's skip boundary at ``processed`` tokens since the last call
        (:func:`reference.host_tier.num_detached_blocks`; the engine releases them at the
        request's next allocation, so they still hold their content now)."""
        if not state.holds_blocks:
            return
        rid = state.request_id
        detached = self.detached.get(rid) or [0 for _ in self.layout.groups]
        self.detached[rid] = detached
        table: BlockIds | None = None
        for gid in range(len(self.layout.groups)):
            n = num_detached_blocks(self.layout, gid, processed)
            if n <= detached[gid]:
                continue
            if table is None:
                table = self.engine.get_block_ids(rid)
            row = table[gid]
            for k in range(detached[gid], min(n, len(row))):
                self._offload(state, gid, k, row[k])
            detached[gid] = n

    def _offload(self, state: RequestView, group_id: int, block_index: int, block: int) -> None:
        """One block leaves the primary pool for the host tier (null entries hold nothing)."""
        if block == NULL_BLOCK_ID:
            return
        req = state.input
        self.host_tier.offload(
            group_id, req.cache_salt, req.lora_name, state.token_ids, block_index
        )
        if self.on_offload is not None:
            self.on_offload(state, group_id, block_index, block)


class EngineTierConnector(Connector):
    """The KV connector of an engine that owns its host tier (``OwnsHostTier``: SGLang's
    HiCache). The engine decides what enters its tier and when (its own backups and host
    evictions, reported as copies the checks follow); the connector only asks it, at
    admission, how many tokens past the device hit its tier would load
    (``engine.host_hit``), and keeps the bookkeeping of asynchronous and failed loads
    exactly as :class:`Connector` does. It owns no :class:`HostTier` (``host_tier`` is
    None: the machine's reset-and-reload of a scheduler-owned tier does not apply, an
    engine's reset may drop its own tier) and offloads nothing.

    Example: a request of 26 tokens whose 24-token prefix SGLang backed up and then
    evicted from the device: device hit 0, ``external_tokens`` 24 (the engine's
    ``host_hit``), and ``allocate_slots(2, 0, hit, num_external_computed_tokens=24)``
    makes the engine load those 24 tokens itself."""

    def __init__(
        self,
        engine: KVCacheEngine,
        layout: KVCacheLayout,
        mode: ServingMode,
        on_load: LoadObserver | None = None,
    ) -> None:
        super().__init__(engine, layout, mode, None, None, on_load)  # type: ignore[arg-type]

    def external_tokens(self, state: RequestView, device_tokens: int) -> int:
        """What the engine's own tier would load past the device hit just looked up."""
        return self.engine.host_hit(state.request_id)  # type: ignore[attr-defined]

    def release(self, state: RequestView, processed: int) -> None:
        """Nothing to offload: the engine backs its blocks up itself."""
        self.loaded.pop(state.request_id, None)

    def processed(self, state: RequestView, processed: int) -> None:
        """Nothing to detach: the engine decides what enters its tier."""
