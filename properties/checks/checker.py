"""The checker: turns the calls it sees into state and events, and runs the registered
invariants of :mod:`properties.checks.registry` on each event.

The lockstep engine (:mod:`properties.checks.lockstep`) calls ``on_*`` after every
engine call. The checker keeps :class:`properties.checks.state.CheckState` up to date
(requests, the shadow content of every block, Mamba states pending until the step runs)
and raises :class:`properties.checks.registry.PropertyViolation` naming the first
check that fails. ``disabled`` names invariants to skip; a check whose capabilities the
engine does not offer is skipped too (:meth:`Checker.active_checks` lists what runs).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from properties.checks.invariants import read_ranges
from properties.checks.mamba_states import settle_copy, step_state_writes
from properties.checks.oracles import OVERWRITTEN, SlotContent
from properties.checks.registry import (
    CHECKS,
    EVENTS,
    CheckInfo,
    PropertyViolation,
    checks_on,
    validate_disabled,
)
from properties.checks.state import (
    AllocateEvent,
    CheckState,
    CommitEvent,
    ExternalLoadEvent,
    FailedAllocationEvent,
    FreeEvent,
    GroupWriteEvent,
    HostTransferEvent,
    LookupEvent,
    OtherTables,
    PoolEvent,
    ResetEvent,
    Snapshot,
    TrackedRequest,
)
from properties.core.engine import (
    HOST_FETCH,
    HOST_LOAD,
    HOST_STORE,
    HOST_WRITE,
    BlockIds,
    CacheHit,
    HostTransfer,
    KVCacheEngine,
)
from reference.host_tier import HostTier
from reference.layout import KVCacheLayout
from reference.specs import MambaSpec, RSWASpec, cdiv

#: The checks that compare the ref counts or free queue before a call with after it
#: (H5, A1): the only readers of a full snapshot.
_SNAPSHOT_READERS = frozenset({"lookup_no_side_effects", "failed_allocation"})


def copy_group(hit: CacheHit | None, table: BlockIds, source: int, destination: int) -> int | None:
    """The group of a copy-on-write with separate pools (block ids are per pool, so a
    pair alone does not say which pool it is in): the group whose hit row has ``source``
    at the column where the request's row now has ``destination``; None when no group
    does (the copy is then not one of this allocation's hit). Example: hit rows
    ``((1, 43), (1,))``, table ``((1, 43, 44), (3,))``, copy ``(1, 3)`` -> group 1 (the
    full group keeps block 1 at column 0)."""
    if hit is None:
        return None
    for gid, row in enumerate(hit.block_ids):
        if gid >= len(table):
            break
        for col, block in enumerate(row):
            if block == source and col < len(table[gid]) and table[gid][col] == destination:
                return gid
    return None


class Checker:
    """Runs the invariants against one engine (see the module docstring)."""

    def __init__(
        self,
        engine: KVCacheEngine,
        layout: KVCacheLayout,
        disabled: Iterable[str] = (),
        host_tier: HostTier | None = None,
    ) -> None:
        """``host_tier``: the machine's host tier external hits are bounded by (X1)."""
        validate_disabled(disabled)
        self.state = CheckState(engine, layout, host_tier)
        self._pool_stale = False
        #: the commits whose checks wait for the step boundary (large tiers)
        self._commits: list[CommitEvent] = []
        self.disabled = frozenset(disabled)
        #: request id -> slots written before their token was known (group, block,
        #: offset or -1 for a Mamba state, position)
        self.deferred_writes: dict[str, list[tuple[int, int, int, int]]] = {}
        capabilities = self.state.capabilities()
        self._by_event: dict[str, tuple[CheckInfo, ...]] = {
            event: tuple(
                c
                for c in checks_on(event)
                if c.name not in self.disabled and c.runs_with(capabilities)
            )
            for event in EVENTS
        }
        active = self.active_checks()
        #: the shadow of block contents is kept only for the invariants that read it
        self._shadowed = bool(active)
        self.state.index_holders = bool(active)
        #: the checks that compare ref counts or the free queue before and after a call
        self._full_snapshots = any(name in _SNAPSHOT_READERS for name in active)
        self.check_every_call = True

    @property
    def check_every_call(self) -> bool:
        """Run the O(pool) checks and reads after every call (True: the small tier, as
        always). Off at the large tiers: the pool checks and the commit checks run at
        step boundaries (:meth:`on_step_boundary`), a call's snapshot holds the free counts only
        (:meth:`snapshot`) and only the tables a call names are read again
        (:meth:`properties.checks.state.CheckState.invalidate`)."""
        return self.state.per_call_reads

    @check_every_call.setter
    def check_every_call(self, value: bool) -> None:
        self.state.per_call_reads = value

    @property
    def requests(self) -> dict[str, TrackedRequest]:
        return self.state.requests

    def active_checks(self) -> list[str]:
        """The invariants that run for this engine, in registration order."""
        active = {c.name for checks in self._by_event.values() for c in checks}
        return [name for name in CHECKS if name in active]

    def snapshot(self) -> Snapshot:
        """The engine before a call: the ref counts and free queue (O(pool)) only when
        they are read every call and a running check compares them (H5, A1); else the
        free counts alone. Example: a lockstep-only replay (every invariant disabled)
        snapshots ``(num_free, None, None, None)`` for a one-pool engine."""
        return self.state.snapshot(full=self._full_snapshots and self.check_every_call)

    def _run(self, event_name: str, event: object) -> None:
        for check in self._by_event[event_name]:
            message = check.fn(self.state, event)
            if message is not None:
                raise PropertyViolation(check.name, message)

    # -- events ---------------------------------------------------------------------
    def on_add(
        self,
        request_id: str,
        token_ids: Sequence[int],
        salt: str | None,
        lora: str | None,
        mm_items: tuple = (),
        prompt_embeds: tuple[int, ...] | None = None,
    ) -> None:
        self.state.requests[request_id] = TrackedRequest(
            request_id,
            list(token_ids),
            salt,
            lora,
            mm_items=tuple(mm_items),
            prompt_embeds=prompt_embeds,
            num_prompt_tokens=len(token_ids),
        )

    def on_lookup(self, request_id: str, hit: CacheHit, before: Snapshot) -> None:
        req = self.state.requests[request_id]
        if self._shadowed:  # the prefix ids are the shadow's keys
            req.refresh_ids()
        self._run("lookup", LookupEvent(req, hit, before))

    def on_allocate(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: CacheHit | None,
        result: BlockIds | None,
        before: Snapshot,
        tables_before: BlockIds | None,
        num_lookahead_tokens: int,
        full_sequence_must_fit: bool = False,
        num_external_computed_tokens: int = 0,
        estimate: int | None = None,
    ) -> None:
        """``estimate``: the engine's ``last_allocation_estimate()`` read right after the
        call (None when it reports none, or for an item of a batched step)."""
        external = num_external_computed_tokens
        if result is None:
            tracked = self.state.requests.get(request_id)
            computed = tracked.num_computed_tokens if tracked is not None else 0
            hit_tokens = hit.num_tokens if hit is not None else 0
            slots = computed + hit_tokens + external + num_new_tokens + num_lookahead_tokens
            if full_sequence_must_fit and tracked is not None:
                # the admission gate asks for the whole sequence first
                slots = max(slots, len(tracked.token_ids))
            capped = min(slots, self.state.layout.max_model_len)
            failed = FailedAllocationEvent(request_id, hit, before, tables_before, capped, slots)
            self._run("failed_allocation", failed)
            self.check_pool()
            return
        req = self.state.requests[request_id]
        req.holds_blocks = True
        local = req.num_computed_tokens + (hit.num_tokens if hit is not None else 0)
        start = local + external
        end = start + num_new_tokens
        if self._shadowed:
            req.refresh_ids()
        table = self.state.table_of(request_id)
        copies, held = self._learn_copies(hit, table)
        mml = self.state.layout.max_model_len
        main = min(start, mml) + num_new_tokens
        allocated = AllocateEvent(
            req,
            table,
            tables_before,
            main + num_lookahead_tokens,
            main,
            estimate,
            mml,
            start,
            copies,
            held,
        )
        self._run("table", allocated)
        others = OtherTables(self.state, request_id)
        if external:
            self._run("external_load", ExternalLoadEvent(req, table, local, start, others))
            if self._shadowed and not self.state.has_host_tier:
                # the scheduler's connector loads the prefix; an engine's own tier
                # reported its loads as copies (on_host_transfers)
                self._record_load(req, table, local, start)
        for gid, row in enumerate(table):
            self._run("group_write", GroupWriteEvent(req, gid, row, start, end, others))
            if self._shadowed:
                self._record_writes(req, gid, row, start, end)
        if self._shadowed:
            # what the tokens read, worked out only if a step of them goes in flight
            self.state.last_reads[request_id] = (table, start, end, req.num_prompt_tokens)
        self._run("allocate", allocated)
        self.check_pool()

    def _learn_copies(
        self, hit: CacheHit | None = None, table: BlockIds = ()
    ) -> tuple[tuple[tuple[int, int], ...], frozenset[int]]:
        """The block copies the allocation just made queued (an engine with
        :class:`properties.core.engine.CopiesBlocks`): the pending ones the checks did not
        know, and the blocks the earlier ones held. The shadow copies each block now,
        before the step's writes (the engine's copy runs before the step does); with
        separate pools in the group :func:`copy_group` names (``hit``: the allocation's
        hit, ``table``: the request's table after it)."""
        if not self.state.has_copies:
            return (), frozenset()
        held = frozenset(self.state.copy_holds())
        known = set(self.state.pending_block_copies)
        new = tuple(p for p in self.state.engine.pending_block_copies() if p not in known)
        for source, destination in new:
            self.state.pending_block_copies.append((source, destination))
            group = None
            if not self.state.shared_pool:
                group = copy_group(hit, table, source, destination)
                self.state.copy_groups[(source, destination)] = group
            if self._shadowed:
                self.state.shadow.copy(source, destination, group)
        return new, held

    def on_copies_taken(self, copies: Sequence[tuple[int, int]]) -> None:
        """``take_block_copies`` returned: the copies ran (the shadow made them when they
        were queued) and the engine released what it held for them."""
        self.state.pending_block_copies.clear()
        self.check_pool()

    def _record_writes(
        self, req: TrackedRequest, gid: int, row: Sequence[int], start: int, end: int
    ) -> None:
        """The shadow learns what the step writes: attention KV now (a later request of
        the same step may read it), Mamba states once the step runs (on_set_computed).
        Under asynchronous scheduling a step may write the position of a token sampled
        but not appended yet: that slot is written once the token is known
        (:meth:`on_append`)."""
        spec = self.state.layout.groups[gid].spec
        bs = spec.block_size
        if not spec.uses_slot_mapping:
            return  # a circular buffer's ring: no content by position
        if isinstance(spec, MambaSpec):
            drafts = req.num_drafts
            layout = self.state.layout
            for w in step_state_writes(layout, spec, row, start, end, drafts):
                prefix = req.ids[w.position - 1] if w.position - 1 < len(req.ids) else -1
                self.state.pending_states.setdefault(req.request_id, []).append(
                    (gid, w.block, prefix, w.position)
                )
            if drafts:
                req.draft_rows[gid] = (tuple(row), end - drafts, cdiv(end, bs) - 1)
                copies = self.state.pending_copies.setdefault(req.request_id, [])
                for accepted in range(drafts + 1):
                    copy = settle_copy(spec, row, end - drafts, end - drafts + accepted)
                    if copy is not None:
                        p = copy.position
                        prefix = req.ids[p - 1] if p - 1 < len(req.ids) else -1
                        copies.append((gid, copy.block, prefix, p))
            else:
                req.draft_rows.pop(gid, None)
                req.mamba_running.pop(gid, None)
            return
        stop = min(end, len(row) * bs)
        known = min(stop, len(req.ids))
        p = start
        while p < known:  # block by block
            idx = p // bs
            run_end = min(known, (idx + 1) * bs)
            self.state.shadow.write_run(gid, row[idx], p % bs, req.ids[p:run_end])
            p = run_end
        for p in range(max(start, known), stop):
            self.deferred_writes.setdefault(req.request_id, []).append(
                (gid, row[p // bs], p % bs, p)
            )

    def _record_load(self, req: TrackedRequest, table: BlockIds, start: int, end: int) -> None:
        """A KV connector loads positions ``[start, end)`` (external computed tokens) into
        the request's blocks: the shadow learns each loaded slot holds the content of
        its prefix (slots in null entries, below a sliding window, are not loaded)."""
        for gid, row in enumerate(table):
            spec = self.state.layout.groups[gid].spec
            if not spec.uses_slot_mapping:
                continue  # a circular buffer's ring
            bs = spec.block_size
            stop = min(end, len(row) * bs)
            p = start
            while p < stop:  # block by block
                idx = p // bs
                run_end = min(stop, (idx + 1) * bs)
                if row[idx] != 0:
                    self.state.shadow.write_run(gid, row[idx], p % bs, req.ids[p:run_end])
                p = run_end

    def on_host_transfers(self, transfers: Sequence[HostTransfer]) -> None:
        """An engine with its own host tier made these copies in its last call, in
        order: X6 and X7 run on each, then the shadow follows it (a ``write`` keeps what
        the device block holds now under its host block; a ``store`` keeps a host
        block's content under its storage key, a ``fetch`` puts it into a host block; a
        ``load`` puts a host block's content into the device block, every slot it lacks
        marked overwritten)."""
        state = self.state
        state.loaded_now = {(t.group_id, t.device_block) for t in transfers if t.kind == HOST_LOAD}
        for t in transfers:
            self._run("host_transfer", HostTransferEvent(t))
            if not self._shadowed:
                continue
            key = (t.group_id, t.host_block)
            if t.kind == HOST_WRITE:
                state.host_shadow[key] = state.shadow.block(t.group_id, t.device_block)
                continue
            if t.kind == HOST_STORE:
                state.storage_shadow[(t.group_id, t.storage_key)] = dict(
                    state.host_shadow.get(key, {})
                )
                continue
            if t.kind == HOST_FETCH:
                stored = state.storage_shadow.get((t.group_id, t.storage_key), {})
                state.host_shadow[key] = dict(stored)
                continue
            copy = state.host_shadow.get(key, {})
            bs = state.layout.groups[t.group_id].spec.block_size
            for offset in range(bs):
                content = copy.get(offset, SlotContent(t.group_id, OVERWRITTEN))
                state.shadow.write(t.group_id, t.device_block, offset, content.prefix_id)

    def _reads(
        self, table: BlockIds, start: int, end: int, num_prompt_tokens: int
    ) -> frozenset[tuple[int, int, int]]:
        """The ``(group, index, block)`` entries the tokens ``[start, end)`` read: from
        the first key of ``start``'s window (Mamba: the state before ``start``) to the
        block of ``end - 1`` (R-SWA: the prompt's blocks and the window's from ``start``'s
        first key, :func:`properties.checks.invariants.read_ranges`); null entries
        excluded."""
        out = set()
        for gid, row in enumerate(table):
            spec = self.state.layout.groups[gid].spec
            bs = spec.block_size
            if not spec.uses_slot_mapping:
                ranges = [(0, 1)]  # the ring
            elif isinstance(spec, MambaSpec):
                ranges = [(max(0, cdiv(start, bs) - 1), cdiv(end, bs))]
            elif isinstance(spec, RSWASpec):
                (p0, p1), (w0, _) = read_ranges(spec, start, num_prompt_tokens)
                ranges = [(p0 // bs, cdiv(p1, bs)), (w0 // bs, cdiv(end, bs))]
            else:
                ranges = [(spec.hit_context_start(start) // bs, cdiv(end, bs))]
            for first, last in ranges:
                for i in range(first, min(last, len(row))):
                    if row[i] != 0:
                        out.add((gid, i, row[i]))
        return frozenset(out)

    def on_in_flight(
        self, request_id: str, num_in_flight_tokens: int, num_pending_tokens: int = 0
    ) -> None:
        """Asynchronous scheduling: a planned step's tokens join the flight (they read
        what the request's last allocation gave them), processed steps leave it
        (oldest first). Pending tokens with none in flight are a synchronous step's
        drafts (the Mamba states they write, :mod:`properties.checks.mamba_states`)."""
        req = self.state.requests.get(request_id)
        if req is not None:
            req.num_drafts = num_pending_tokens if num_in_flight_tokens == 0 else 0
        chunks = self.state.in_flight_reads.setdefault(request_id, [])
        total = sum(n for n, _ in chunks)
        if num_in_flight_tokens > total:
            last = self.state.last_reads.get(request_id)
            reads = self._reads(*last) if last is not None else frozenset()
            chunks.append((num_in_flight_tokens - total, reads))
        while chunks and total > num_in_flight_tokens:
            total -= chunks.pop(0)[0]
        if not chunks:
            self.state.in_flight_reads.pop(request_id, None)

    def on_set_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """The step ran: Mamba states it computed now exist (unless it was preempted)."""
        req = self.state.requests[request_id]
        req.num_computed_tokens = num_computed_tokens
        if request_id in self.deferred_writes:
            # positions at or past the computed count are recomputed later (rejected
            # drafts roll back; a preemption starts over): their pending writes lapse,
            # and the slots hold the KV of tokens that are not the request's
            kept = []
            for w in self.deferred_writes[request_id]:
                if w[3] < num_computed_tokens:
                    kept.append(w)
                else:
                    self.state.shadow.write(w[0], w[1], w[2], OVERWRITTEN)
            self.deferred_writes[request_id] = kept
        self.state.pending_copies.pop(request_id, None)
        for gid, block, _, end in self.state.pending_states.pop(request_id, ()):
            if num_computed_tokens > 0:
                if end > num_computed_tokens:  # a rejected draft's state
                    self.state.shadow.write(gid, block, -1, OVERWRITTEN)
                else:
                    self._write_state(req, gid, block, end)
        self._settle_drafts(req, num_computed_tokens)

    def _write_state(self, req: TrackedRequest, gid: int, block: int, position: int) -> None:
        """``block`` of group ``gid`` holds the request's state at ``position`` tokens (a
        token not appended yet: once it is, :meth:`on_append`)."""
        if position - 1 < len(req.ids):
            self.state.shadow.write(gid, block, -1, req.ids[position - 1])
        else:
            self.deferred_writes.setdefault(req.request_id, []).append(
                (gid, block, -1, position - 1)
            )

    def _settle_drafts(self, req: TrackedRequest, num_computed_tokens: int) -> None:
        """A Mamba group's draft step settled: the accepted draft's column holds the
        running state, and the boundary passed gets its state copied
        (:func:`properties.checks.mamba_states.settle_copy`); a preemption forgets both."""
        if num_computed_tokens == 0:
            req.draft_rows.clear()
            req.mamba_running.clear()
            return
        for gid, (row, running_end, column) in req.draft_rows.items():
            spec = self.state.layout.groups[gid].spec
            assert isinstance(spec, MambaSpec)
            at = column + num_computed_tokens - running_end
            if running_end <= num_computed_tokens and at < len(row) and row[at] != 0:
                req.mamba_running[gid] = row[at]
            copy = settle_copy(spec, row, running_end, num_computed_tokens)
            if copy is not None and self._shadowed:
                self._write_state(req, gid, copy.block, copy.position)
        req.draft_rows.clear()

    def on_append(self, request_id: str, token_ids: Sequence[int]) -> None:
        req = self.state.requests[request_id]
        req.token_ids.extend(int(t) for t in token_ids)
        deferred = self.deferred_writes.get(request_id)
        if deferred:
            req.refresh_ids()
            for gid, block, offset, position in [w for w in deferred if w[3] < len(req.ids)]:
                self.state.shadow.write(gid, block, offset, req.ids[position])
            self.deferred_writes[request_id] = [w for w in deferred if w[3] >= len(req.ids)]

    def on_commit(self, request_id: str, num_tokens: int) -> None:
        """``cache_blocks(request_id, num_tokens)`` returned. The commit checks read every
        cached block (O(pool)): at the large tiers (``check_every_call`` off) they run at
        the step boundary, once for all of the step's commits, each on the table and
        token count its request had at its commit."""
        if not self._by_event["commit"]:
            return
        req = self.state.requests[request_id]
        if self.check_every_call:
            self._run("commit", CommitEvent(req, num_tokens))
        elif req.holds_blocks:
            table = self.state.table_of(request_id)
            self._commits.append(CommitEvent(req, num_tokens, table, len(req.token_ids)))

    def on_free(self, request_id: str) -> None:
        self.deferred_writes.pop(request_id, None)
        req = self.state.requests.get(request_id)
        if req is not None:
            req.draft_rows.clear()
            req.mamba_running.clear()
        self._run("free", FreeEvent(request_id))
        self.state.requests[request_id].holds_blocks = False
        self.check_pool()

    def on_remove(self, request_id: str) -> None:
        self.state.forget(request_id)
        self.state.requests.pop(request_id, None)
        self.deferred_writes.pop(request_id, None)
        self.state.last_reads.pop(request_id, None)

    def on_reset(self, ok: bool) -> None:
        self._run("reset", ResetEvent(ok))

    def check_pool(self) -> None:
        """The pool checks (O(pool)): now, or at the next step boundary when
        ``check_every_call`` is off."""
        if not self._by_event["pool"]:
            return
        if not self.check_every_call:
            self._pool_stale = True
            return
        self._run("pool", PoolEvent(self.state.tables(), self.state.num_free()))

    def on_step_boundary(self) -> None:
        """A step starts (or a trace ends): the commit checks deferred since the last
        boundary run (in the order of the commits), then the pool checks once, on the
        state now."""
        commits, self._commits = self._commits, []
        for event in commits:
            self._run("commit", event)
        if not self._pool_stale:
            return
        self._pool_stale = False
        self.state.reread_tables()
        self._run("pool", PoolEvent(self.state.tables(), self.state.num_free()))
