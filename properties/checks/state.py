"""What the checks know: the engine under test, the layout, the shadow of every block's
content, the requests as the calls described them, and the events the checks look at.

:class:`CheckState` is filled by :class:`properties.checks.checker.Checker` from the
calls it sees; the check functions of :mod:`properties.checks.invariants` read it and
never change it. One event dataclass per moment a check can run:

* :class:`LookupEvent`: after ``get_computed_blocks`` returned ``hit``;
* :class:`GroupWriteEvent`: after a successful ``allocate_slots``, once per group,
  before that group's writes enter the shadow (so reads see the content before the step);
* :class:`AllocateEvent`: after a successful ``allocate_slots``, once per request;
* :class:`FailedAllocationEvent`: after ``allocate_slots`` returned ``None``;
* :class:`CommitEvent`: after ``cache_blocks`` (the scheduler commits processed tokens);
* :class:`FreeEvent`, :class:`ResetEvent`: after ``free`` and ``reset_prefix_cache``;
* :class:`PoolEvent`: after every allocation and free, the pool as a whole;
* :class:`HostTransferEvent`: after any call of an engine with its own host tier
  (``OwnsHostTier``), each copy it made between the tiers, before the shadow follows it.

The shadow follows the content of every block through an engine's own host tier:
:attr:`CheckState.host_shadow` holds, per ``(group, host block)``, what a ``write`` copied
there (the device block's slots then); a ``load`` copies it back into the device block.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from properties.checks.oracles import ShadowCache, SlotContent, extend_prefix_ids
from properties.core.engine import (
    BlockIds,
    CacheHit,
    CopiesBlocks,
    ExposesCachedBlocks,
    ExposesFreeQueue,
    ExposesRefCounts,
    HostPoolUsage,
    HostTransfer,
    KVCacheEngine,
    OwnsHostTier,
    PoolUsage,
    ReportsAllocationEstimate,
    ReportsPools,
)
from reference.host_tier import HostTier
from reference.layout import KVCacheLayout
from reference.media import MultimodalItem, input_identities


@dataclass
class TrackedRequest:
    """What the checker knows of a request from the calls it saw."""

    request_id: str
    token_ids: list[int]
    cache_salt: str | None
    lora_name: str | None
    num_computed_tokens: int = 0
    holds_blocks: bool = False
    ids: list[int] = field(default_factory=list)
    #: draft tokens of the step being scheduled (synchronous drafts: tokens pending with
    #: none in flight, ``set_in_flight(id, 0, d)``)
    num_drafts: int = 0
    #: Mamba group -> (its row, the running state's end, the running column) of a draft
    #: step not settled yet (:mod:`properties.checks.mamba_states`)
    draft_rows: dict[int, tuple[tuple[int, ...], int, int]] = field(default_factory=dict)
    #: Mamba group -> the block holding the request's state after a draft step (an
    #: accepted draft's column), until its next step without drafts
    mamba_running: dict[int, int] = field(default_factory=dict)
    #: its multimodal items and prompt embeddings (:mod:`reference.media`)
    mm_items: tuple = ()
    prompt_embeds: tuple[int, ...] | None = None
    #: its prompt's length (R-SWA keeps the prompt visible)
    num_prompt_tokens: int = 0

    def refresh_ids(self) -> None:
        """Extend ``ids`` over tokens appended since (decodes add one token a step); a
        request with media hashes what each position feeds the model
        (:func:`reference.media.input_identities`)."""
        if len(self.ids) < len(self.token_ids):
            inputs = self.token_ids
            if self.mm_items or self.prompt_embeds is not None:
                items = [MultimodalItem(*item) for item in self.mm_items]
                inputs = input_identities(self.token_ids, items, self.prompt_embeds)
            self.ids = extend_prefix_ids(self.ids, inputs, self.cache_salt, self.lora_name)


#: ``(num_free_blocks, ref counts or None, free queue or None, free count per pool or
#: None)`` at one moment (the last for engines that report separate pools).
Snapshot = tuple[int, "dict[int, int] | None", "list[int] | None", "dict[str, int] | None"]


class CheckState:
    """The engine, the layout and everything the checks derive from the calls."""

    def __init__(
        self, engine: KVCacheEngine, layout: KVCacheLayout, host_tier: HostTier | None = None
    ) -> None:
        self.engine = engine
        self.layout = layout
        self.shared_pool = not getattr(engine, "separate_group_pools", False)
        #: False: the engine gives lookahead slots only to a step that reaches the
        #: request's last known token (A5 asks none of a non-final prefill chunk)
        self.lookahead_on_prefill_chunks = bool(
            getattr(engine, "lookahead_on_prefill_chunks", True)
        )
        self.shadow = ShadowCache(layout, self.shared_pool)
        self.requests: dict[str, TrackedRequest] = {}
        #: request id -> Mamba states its step will write: (group, block, prefix id or
        #: -1 while the last token is not known yet, end position).
        self.pending_states: dict[str, list[tuple[int, int, int, int]]] = {}
        #: request id -> Mamba states a draft step may copy to a block boundary once its
        #: drafts are judged (one per possible acceptance; same form): written by the
        #: settle, pending for the checks until then
        self.pending_copies: dict[str, list[tuple[int, int, int, int]]] = {}
        #: request id -> its steps still in flight (asynchronous scheduling), oldest
        #: first: (tokens, the (group, index, block) entries of its table they read).
        self.in_flight_reads: dict[str, list[tuple[int, frozenset[tuple[int, int, int]]]]] = {}
        #: request id -> its last successful allocation: its table, the positions
        #: ``[start, end)`` it scheduled and its prompt's length (what they read:
        #: ``Checker._reads``; R-SWA reads the prompt).
        self.last_reads: dict[str, tuple[BlockIds, int, int, int]] = {}
        self.has_ref_counts = isinstance(engine, ExposesRefCounts)
        self.has_free_queue = isinstance(engine, ExposesFreeQueue)
        self.has_cached = isinstance(engine, ExposesCachedBlocks)
        self.has_estimate = isinstance(engine, ReportsAllocationEstimate)
        self.has_pools = isinstance(engine, ReportsPools)
        self.has_host_tier = isinstance(engine, OwnsHostTier)
        #: an engine's own host tier: ``(group, host block)`` -> the slots a ``write`` copied
        #: there (offset -> content), as the device block held them then
        self.host_shadow: dict[tuple[int, int], dict[int, SlotContent]] = {}
        #: its storage tier (L3): ``(group, storage key)`` -> what a ``store`` copied there
        self.storage_shadow: dict[tuple[int, str], dict[int, SlotContent]] = {}
        #: ``(group, device block)`` of every ``load`` the engine's last call made
        self.loaded_now: set[tuple[int, int]] = set()
        self.has_copies = isinstance(engine, CopiesBlocks)
        #: the block copies queued in this step and not handed over yet, as the checks
        #: learnt them after each allocation (:meth:`Checker.on_allocate`), in that order
        #: (not :attr:`pending_copies`, the Mamba state writes of a draft step's copies)
        self.pending_block_copies: list[tuple[int, int]] = []
        #: with separate pools, the group of each copy learnt (None: unknown), kept after
        #: the hand-over for the attention property (:func:`properties.checks.checker.copy_group`)
        self.copy_groups: dict[tuple[int, int], int | None] = {}
        self.alignment = layout.cache_hit_alignment
        #: the free count of the fresh engine: every block free or reclaimable
        self.initial_free = engine.num_free_blocks()
        #: the fresh engine's pools (engines that report separate pools), by name
        self.initial_pools: dict[str, PoolUsage] = (
            {p.name: p for p in engine.pool_usage()} if self.has_pools else {}
        )
        #: external hits: the host tier the machine's connector loads from (X1)
        self.host_tier = host_tier
        self._reads: dict[str, object] = {}
        self._tables: dict[str, BlockIds] = {}
        #: the index of block holders (:meth:`holder`): every request's table as last
        #: read, and index key -> the requests whose last read table has it
        self._known: dict[str, BlockIds] = {}
        self._holders: dict[tuple[int, int], dict[str, None]] = {}
        #: keep that index (off when no check asks :meth:`holder`: a lockstep-only run)
        self.index_holders = True
        #: read every table again after every call (the small tier); off at the large
        #: tiers (:meth:`invalidate`), set through ``Checker.check_every_call``
        self.per_call_reads = True

    def capabilities(self) -> frozenset[str]:
        """The optional capabilities the engine offers (names as in the registry)."""
        names = (
            ("ref_counts", self.has_ref_counts),
            ("free_queue", self.has_free_queue),
            ("cached_blocks", self.has_cached),
            ("allocation_estimate", self.has_estimate),
            ("shared_pool", self.shared_pool),
            ("pools", self.has_pools),
            ("host_tier", self.has_host_tier),
            ("block_copies", self.has_copies),
        )
        return frozenset(name for name, present in names if present)

    # -- reads of the engine, once per engine call ------------------------------------
    def invalidate(self, request_ids: Iterable[str] | None = None) -> None:
        """The engine was called: everything read from it may have changed. Until the
        next call, each read below asks the engine once (the checks of one event, the
        lockstep comparison and the next call's snapshot share it).

        Block tables: with ``per_call_reads`` on (the small tier) every table is read
        again; off (the large tiers) only the tables of ``request_ids``, the requests
        the call names (``None``: every table), are: a call changes its own request's
        table only, and the step boundary reads every table again
        (:meth:`reread_tables`) before the pool checks, which would see another
        request's table changed behind a call. Example: at the production tier an
        ``allocate_slots('r7', ...)`` among 4096 running requests reads one table, not
        4096."""
        self._reads.clear()
        if self.per_call_reads or request_ids is None:
            self._tables.clear()
            return
        for rid in request_ids:
            self._tables.pop(rid, None)

    def reread_tables(self) -> None:
        """Forget every table read (a step boundary at the large tiers)."""
        self._tables.clear()

    def _read(self, what: str, fn):
        if what not in self._reads:
            self._reads[what] = fn()
        return self._reads[what]

    def num_free(self) -> int:
        return self._read("num_free", self.engine.num_free_blocks)

    def ref_counts(self) -> dict[int, int]:
        return self._read("ref_counts", lambda: dict(self.engine.ref_counts()))

    def free_queue(self) -> list[int]:
        return self._read("free_queue", lambda: list(self.engine.free_queue()))

    def cached_blocks(self) -> list:
        return self._read("cached_blocks", lambda: list(self.engine.cached_blocks()))

    def cached_by_block(self) -> dict[tuple[int, int], list]:
        """:meth:`cached_blocks` by ``(group_id, block_id)``, each key's entries in its
        order (a block may be cached under two keys: a partial hit's secondary key), read
        once like it. Example: ``[CachedBlock(7, 0, 4), CachedBlock(7, 0, 6)]`` ->
        ``{(0, 7): [both]}``."""

        def index() -> dict[tuple[int, int], list]:
            by_block: dict[tuple[int, int], list] = {}
            for cb in self.cached_blocks():
                by_block.setdefault((cb.group_id, cb.block_id), []).append(cb)
            return by_block

        return self._read("cached_by_block", index)

    def pools(self) -> tuple[PoolUsage, ...]:
        return self._read("pools", lambda: tuple(self.engine.pool_usage()))

    def host_pools(self) -> tuple[HostPoolUsage, ...]:
        return self._read("host_pools", lambda: tuple(self.engine.host_pools()))

    def table_of(self, request_id: str) -> BlockIds:
        table = self._tables.get(request_id)
        if table is None:
            table = tuple(tuple(g) for g in self.engine.get_block_ids(request_id))
            self._tables[request_id] = table
            if self.index_holders:
                self._index(request_id, table)
        return table

    def _keys(self, table: BlockIds) -> set[tuple[int, int]]:
        """The index keys of a table's entries: ``(-1, block)`` with one shared pool (an
        id names one block whatever the group), ``(group, block)`` with separate pools."""
        return {(-1 if self.shared_pool else g, b) for g, row in enumerate(table) for b in row}

    def _index(self, request_id: str, table: BlockIds) -> None:
        """Record the table just read in the index of block holders (a table read
        unchanged costs one comparison)."""
        old = self._known.get(request_id)
        if old == table:
            return
        if old is not None:
            for key in self._keys(old):
                self._holders.get(key, {}).pop(request_id, None)
        for key in self._keys(table):
            self._holders.setdefault(key, {})[request_id] = None
        self._known[request_id] = table

    def holder(self, group_id: int, block_id: int, other_than: str) -> str | None:
        """A request other than ``other_than`` that holds blocks and whose table, as last
        read, has ``block_id`` (in group ``group_id`` with separate pools), or None.
        Example: ``a`` read as ``((3, 4),)`` and holding blocks: ``holder(0, 4, "b")
        == "a"``, ``holder(0, 4, "a") is None``. With per-call reads (the small tier)
        every table is read again first; at the large tiers the index holds each table
        as the last call naming its request left it (:meth:`invalidate`)."""
        if self.per_call_reads:
            self.tables()
        key = (-1 if self.shared_pool else group_id, block_id)
        for rid in self._holders.get(key, ()):
            tracked = self.requests.get(rid)
            if rid != other_than and tracked is not None and tracked.holds_blocks:
                return rid
        return None

    def pending_writes(self) -> Iterator[tuple[int, int, int, int]]:
        """Every Mamba state write not done yet (:attr:`pending_states` and
        :attr:`pending_copies`), as ``(group, block, prefix id or -1, position)``."""
        for pending in (self.pending_states, self.pending_copies):
            for writes in pending.values():
                yield from writes

    def copy_holds(self) -> dict[int, int]:
        """Block id -> the references the pending block copies hold on it (one per pair it
        is the source or the destination of): vLLM keeps both ends of a copy-on-write
        referenced until the copy is handed over. Example: pending ``[(4, 9)]`` ->
        ``{4: 1, 9: 1}``."""
        holds: dict[int, int] = {}
        for pair in self.pending_block_copies:
            for block in pair:
                holds[block] = holds.get(block, 0) + 1
        return holds

    def forget(self, request_id: str) -> None:
        """The request is gone: out of the table reads and the index."""
        self._tables.pop(request_id, None)
        old = self._known.pop(request_id, None)
        for key in self._keys(old) if old is not None else ():
            self._holders.get(key, {}).pop(request_id, None)

    def tables(self) -> dict[str, BlockIds]:
        """The block table of every request that holds blocks."""
        return {rid: self.table_of(rid) for rid, r in self.requests.items() if r.holds_blocks}

    def snapshot(self, full: bool = True) -> Snapshot:
        """The free count, ref counts, free queue and per-pool free counts now; with
        ``full`` off the two O(pool) reads (ref counts, free queue) are left ``None``."""
        return (
            self.num_free(),
            self.ref_counts() if full and self.has_ref_counts else None,
            self.free_queue() if full and self.has_free_queue else None,
            {p.name: p.num_free for p in self.pools()} if self.has_pools else None,
        )

    def snapshot_like(self, before: Snapshot) -> Snapshot:
        """A snapshot now with the parts ``before`` has (a light one stays light), so
        the two compare. Example: ``before == (12, None, None, None)`` gives
        ``(num_free, None, None, None)`` without reading the ref counts or queue."""
        return self.snapshot(full=before[1] is not None or before[2] is not None)


class OtherTables(Mapping[str, BlockIds]):
    """The tables of the requests other than ``request_id`` that hold blocks (request
    id -> table), read only when a check iterates them, and :meth:`holder`, which
    answers from the state's index of block holders (:meth:`CheckState.holder`).

    Example: with ``b`` holding ``((3, 4),)`` and the allocating request ``a``,
    ``OtherTables(state, "a").holder(0, 4) == "b"``."""

    def __init__(self, state: CheckState, request_id: str) -> None:
        self._state = state
        self._request_id = request_id
        self._tables: dict[str, BlockIds] | None = None

    def _read(self) -> dict[str, BlockIds]:
        if self._tables is None:
            self._tables = {o: t for o, t in self._state.tables().items() if o != self._request_id}
        return self._tables

    def __getitem__(self, request_id: str) -> BlockIds:
        return self._read()[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())

    def holder(self, group_id: int, block_id: int) -> str | None:
        """Another request holding ``block_id`` (any group of its table with one shared
        pool, group ``group_id`` with separate pools), or None."""
        return self._state.holder(group_id, block_id, self._request_id)


@dataclass(frozen=True)
class LookupEvent:
    request: TrackedRequest
    hit: CacheHit
    before: Snapshot


@dataclass(frozen=True)
class GroupWriteEvent:
    """Group ``group_id`` of ``request`` computes positions ``[start, end)`` with ``row``."""

    request: TrackedRequest
    group_id: int
    row: tuple[int, ...]
    start: int
    end: int
    others: OtherTables


@dataclass(frozen=True)
class ExternalLoadEvent:
    """A KV connector loads positions ``[start, end)`` (external computed tokens) of
    ``request`` into ``table``, after its local hit of ``start`` tokens."""

    request: TrackedRequest
    table: BlockIds
    start: int
    end: int
    others: OtherTables


@dataclass(frozen=True)
class AllocateEvent:
    """A successful ``allocate_slots`` of ``request``, whose table is now ``table``.

    ``tables_before``: its table before the call (None: it held no blocks);
    ``num_slots``: the slots the call asked for, ``computed + hit + external + new +
    lookahead``; ``max_model_len``: the layout's (vLLM caps the slots there);
    ``num_main``: the slots without lookahead (what a Mamba group allocates for);
    ``estimate``: the engine's ``last_allocation_estimate()`` (None: not reported, or a
    batched ``schedule_step`` item); ``copies``: the block copies the call queued
    (:class:`properties.core.engine.CopiesBlocks`); ``held_by_copies``: the blocks the
    copies queued before the call kept referenced."""

    request: TrackedRequest
    table: BlockIds
    tables_before: BlockIds | None = None
    num_slots: int = 0
    num_main: int = 0
    estimate: int | None = None
    max_model_len: int = 0
    #: the first position the step computes (``computed + hit + external``): the table's
    #: entries before its block are the request's computed or adopted blocks
    start: int = 0
    copies: tuple[tuple[int, int], ...] = ()
    held_by_copies: frozenset[int] = frozenset()


@dataclass(frozen=True)
class FailedAllocationEvent:
    """``allocate_slots`` returned None; ``num_slots`` is the slot count it asked for
    (computed + hit + new + lookahead tokens, at most ``max_model_len``)."""

    request_id: str
    hit: CacheHit | None
    before: Snapshot
    tables_before: BlockIds | None
    num_slots: int = 0
    #: the slot count before the ``max_model_len`` cap (engines such as SGLang give
    #: lookahead slots past it)
    num_slots_uncapped: int = 0


@dataclass(frozen=True)
class CommitEvent:
    """``cache_blocks(request, num_tokens)``: the scheduler committed processed tokens.

    Checked at the step boundary (the large tiers), it carries what the check reads of
    the moment of the call: the request's ``table`` then and its ``num_request_tokens``
    (None: checked at once, reading both now)."""

    request: TrackedRequest
    num_tokens: int
    table: BlockIds | None = None
    num_request_tokens: int | None = None


@dataclass(frozen=True)
class FreeEvent:
    request_id: str


@dataclass(frozen=True)
class ResetEvent:
    ok: bool


@dataclass(frozen=True)
class HostTransferEvent:
    """One copy an engine made between a device block and its own host tier
    (``OwnsHostTier``), seen before the shadow follows it."""

    transfer: HostTransfer


@dataclass(frozen=True)
class PoolEvent:
    tables: dict[str, BlockIds]
    num_free: int
