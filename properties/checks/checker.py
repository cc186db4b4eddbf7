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
    FailedAllocationEvent,
    FreeEvent,
    GroupWriteEvent,
    LookupEvent,
    PoolEvent,
    ResetEvent,
    Snapshot,
    TrackedRequest,
)
from properties.core.engine import BlockIds, CacheHit, KVCacheEngine
from reference.layout import KVCacheLayout
from reference.specs import MambaSpec, cdiv


class Checker:
    """Runs the invariants against one engine (see the module docstring)."""

    def __init__(
        self, engine: KVCacheEngine, layout: KVCacheLayout, disabled: Iterable[str] = ()
    ) -> None:
        validate_disabled(disabled)
        self.state = CheckState(engine, layout)
        self.disabled = frozenset(disabled)
        capabilities = self.state.capabilities()
        self._by_event: dict[str, tuple[CheckInfo, ...]] = {
            event: tuple(
                c
                for c in checks_on(event)
                if c.name not in self.disabled and c.runs_with(capabilities)
            )
            for event in EVENTS
        }

    @property
    def requests(self) -> dict[str, TrackedRequest]:
        return self.state.requests

    def active_checks(self) -> list[str]:
        """The invariants that run for this engine, in registration order."""
        active = {c.name for checks in self._by_event.values() for c in checks}
        return [name for name in CHECKS if name in active]

    def snapshot(self) -> Snapshot:
        return self.state.snapshot()

    def _run(self, event_name: str, event: object) -> None:
        for check in self._by_event[event_name]:
            message = check.fn(self.state, event)
            if message is not None:
                raise PropertyViolation(check.name, message)

    # -- events ---------------------------------------------------------------------
    def on_add(
        self, request_id: str, token_ids: Sequence[int], salt: str | None, lora: str | None
    ) -> None:
        self.state.requests[request_id] = TrackedRequest(request_id, list(token_ids), salt, lora)

    def on_lookup(self, request_id: str, hit: CacheHit, before: Snapshot) -> None:
        req = self.state.requests[request_id]
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
    ) -> None:
        if result is None:
            tracked = self.state.requests.get(request_id)
            computed = tracked.num_computed_tokens if tracked is not None else 0
            hit_tokens = hit.num_tokens if hit is not None else 0
            slots = min(
                computed + hit_tokens + num_new_tokens + num_lookahead_tokens,
                self.state.layout.max_model_len,
            )
            failed = FailedAllocationEvent(request_id, hit, before, tables_before, slots)
            self._run("failed_allocation", failed)
            self.check_pool()
            return
        req = self.state.requests[request_id]
        req.holds_blocks = True
        start = req.num_computed_tokens + (hit.num_tokens if hit is not None else 0)
        end = start + num_new_tokens
        req.refresh_ids()
        table = self.state.table_of(request_id)
        allocated = AllocateEvent(req, table)
        self._run("table", allocated)
        others = {o: t for o, t in self.state.tables().items() if o != request_id}
        for gid, row in enumerate(table):
            self._run("group_write", GroupWriteEvent(req, gid, row, start, end, others))
            self._record_writes(req, gid, row, start, end)
        self._run("allocate", allocated)
        self.check_pool()

    def _record_writes(
        self, req: TrackedRequest, gid: int, row: Sequence[int], start: int, end: int
    ) -> None:
        """The shadow learns what the step writes: attention KV now (a later request of
        the same step may read it), Mamba states once the step runs (on_set_computed)."""
        spec = self.state.layout.groups[gid].spec
        bs = spec.block_size
        if isinstance(spec, MambaSpec):
            if end > 0 and cdiv(end, bs) <= len(row):
                self.state.pending_states.setdefault(req.request_id, []).append(
                    (gid, row[cdiv(end, bs) - 1], req.ids[end - 1])
                )
            return
        for p in range(start, min(end, len(row) * bs)):
            self.state.shadow.write(gid, row[p // bs], p % bs, req.ids[p])

    def on_set_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """The step ran: Mamba states it computed now exist (unless it was preempted)."""
        self.state.requests[request_id].num_computed_tokens = num_computed_tokens
        for gid, block, prefix in self.state.pending_states.pop(request_id, ()):
            if num_computed_tokens > 0:
                self.state.shadow.write(gid, block, -1, prefix)

    def on_append(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.state.requests[request_id].token_ids.extend(int(t) for t in token_ids)

    def on_free(self, request_id: str) -> None:
        self._run("free", FreeEvent(request_id))
        self.state.requests[request_id].holds_blocks = False
        self.check_pool()

    def on_remove(self, request_id: str) -> None:
        self.state.requests.pop(request_id, None)

    def on_reset(self, ok: bool) -> None:
        self._run("reset", ResetEvent(ok))

    def check_pool(self) -> None:
        if not self._by_event["pool"]:
            return
        self._run("pool", PoolEvent(self.state.tables(), self.state.num_free()))
