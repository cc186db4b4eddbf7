"""Invariants checked after every engine call (spec section 11).

Each check is named after what it guards; a failure raises
:class:`PropertyViolation` whose message names the request, the group and the block.

========================  ====================================================  =========
name                      guards                                                needs
========================  ====================================================  =========
pool_accounting           free + blocks in use == num_blocks - 1 (I1)           ref counts
free_queue_contents       queue = the non-null blocks with ref 0, no dups (I2)  free queue
ref_counts_match_owners   ref count == (request, group) lists holding it (I3)   ref counts
no_block_shared           no id twice in a list, none across a request's        —
                          groups (I5), no block held by two requests unless
                          both read it as the same prefix
exclusive_write           the blocks a step writes belong to that request only  —
window_liveness           every key a scheduled token reads is in a real block  —
                          holding that very token (W3, stale ids, early frees)
hit_bounds                hit <= num_tokens - 1 and a multiple of the           —
                          alignment (H1)
hit_soundness             the hit's blocks hold the request's prefix (H2)       —
hit_maximality            no longer aligned hit is servable (H3)                cached blocks
lookup_no_side_effects    get_computed_blocks changes nothing (H5)              —
failed_allocation         None changes no ref count of the hit (A1)             ref counts
freed_on_free             free() leaves the request without blocks              —
reset_prefix_cache        reset succeeds iff no request holds blocks            —
========================  ====================================================  =========
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from properties.engine import (
    BlockIds,
    CacheHit,
    ExposesCachedBlocks,
    ExposesFreeQueue,
    ExposesRefCounts,
    KVCacheEngine,
)
from properties.oracles import (
    ShadowCache,
    brute_force_longest_hit,
    missing_context,
    prefix_ids,
)
from reference.attention import first_visible_key
from reference.layout import KVCacheLayout
from reference.specs import MambaSpec, cdiv

UNIVERSAL_CHECKS = (
    "pool_accounting",
    "free_queue_contents",
    "ref_counts_match_owners",
    "no_block_shared",
    "exclusive_write",
    "window_liveness",
    "hit_bounds",
    "hit_soundness",
    "hit_maximality",
    "lookup_no_side_effects",
    "failed_allocation",
    "freed_on_free",
    "reset_prefix_cache",
)


class PropertyViolation(AssertionError):
    """An engine broke a property; ``name`` says which."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"[{name}] {message}")
        self.name = name
        self.message = message


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

    def refresh_ids(self) -> None:
        if len(self.ids) != len(self.token_ids):
            self.ids = prefix_ids(self.token_ids, self.cache_salt, self.lora_name)


class Checker:
    """Runs the invariants against one engine; ``disabled`` names checks to skip."""

    def __init__(
        self, engine: KVCacheEngine, layout: KVCacheLayout, disabled: Iterable[str] = ()
    ) -> None:
        self.engine = engine
        self.layout = layout
        self.disabled = set(disabled)
        self.shared_pool = not getattr(engine, "separate_group_pools", False)
        self.shadow = ShadowCache(layout, self.shared_pool)
        self.requests: dict[str, TrackedRequest] = {}
        self.pending_states: dict[str, list[tuple[int, int, int]]] = {}
        self.has_ref_counts = isinstance(engine, ExposesRefCounts)
        self.has_free_queue = isinstance(engine, ExposesFreeQueue)
        self.has_cached = isinstance(engine, ExposesCachedBlocks)
        self.alignment = (
            layout.groups[0].spec.block_size
            if len(layout.groups) == 1
            else layout.scheduler_block_size
        )

    def enabled(self, name: str) -> bool:
        return name not in self.disabled

    def fail(self, name: str, message: str) -> None:
        raise PropertyViolation(name, message)

    # -- snapshots ----------------------------------------------------------------
    def tables(self) -> dict[str, BlockIds]:
        return {
            rid: tuple(tuple(g) for g in self.engine.get_block_ids(rid))
            for rid, r in self.requests.items()
            if r.holds_blocks
        }

    def snapshot(self) -> tuple:
        return (
            self.engine.num_free_blocks(),
            dict(self.engine.ref_counts()) if self.has_ref_counts else None,
            list(self.engine.free_queue()) if self.has_free_queue else None,
        )

    # -- events ---------------------------------------------------------------------
    def on_add(
        self, request_id: str, token_ids: Sequence[int], salt: str | None, lora: str | None
    ) -> None:
        self.requests[request_id] = TrackedRequest(request_id, list(token_ids), salt, lora)

    def on_lookup(self, request_id: str, hit: CacheHit, before: tuple) -> None:
        req = self.requests[request_id]
        if self.enabled("lookup_no_side_effects") and self.snapshot() != before:
            self.fail(
                "lookup_no_side_effects",
                f"get_computed_blocks({request_id!r}) changed the free count, ref counts "
                f"or free queue: before {before[0]} free, after "
                f"{self.engine.num_free_blocks()}",
            )
        if self.enabled("hit_bounds"):
            cap = len(req.token_ids) - 1
            if hit.num_tokens > cap or hit.num_tokens < 0 or hit.num_tokens % self.alignment:
                self.fail(
                    "hit_bounds",
                    f"request {request_id!r}: hit of {hit.num_tokens} tokens is not a "
                    f"multiple of {self.alignment} in [0, {cap}]",
                )
        if len(hit.block_ids) != len(self.layout.groups):
            self.fail(
                "hit_soundness",
                f"request {request_id!r}: hit has "
                f"{len(hit.block_ids)} groups, the layout {len(self.layout.groups)}",
            )
        req.refresh_ids()
        if self.enabled("hit_soundness") and hit.num_tokens > 0:
            for gid, table in enumerate(hit.block_ids):
                spec = self.layout.groups[gid].spec
                why = missing_context(
                    self.layout,
                    self.shadow,
                    gid,
                    table,
                    req.ids,
                    spec.hit_context_start(hit.num_tokens),
                    hit.num_tokens,
                )
                if why is not None and self._state_pending(gid, table, req.ids, hit.num_tokens):
                    # a state cached earlier in this step: the engine must refuse the
                    # allocation (checked there by window_liveness), the lookup may offer it
                    why = None
                if why is not None:
                    self.fail(
                        "hit_soundness",
                        f"request {request_id!r} hit {hit.num_tokens} tokens but group "
                        f"{gid} ({spec.type_name}) cannot serve it: {why}",
                    )
        if self.enabled("hit_maximality") and self.has_cached:
            best = brute_force_longest_hit(
                self.layout,
                self.shadow,
                self.engine.cached_blocks(),
                req.ids,
                len(req.token_ids) - 1,
                self.alignment,
            )
            if best > hit.num_tokens:
                self.fail(
                    "hit_maximality",
                    f"request {request_id!r}: engine hit {hit.num_tokens} tokens, but every "
                    f"group can serve {best} from its cached blocks",
                )

    def _state_pending(self, gid: int, table, ids: Sequence[int], length: int) -> bool:
        spec = self.layout.groups[gid].spec
        if not isinstance(spec, MambaSpec) or length == 0:
            return False
        col = cdiv(length, spec.block_size) - 1
        if col >= len(table):
            return False
        return any(
            g == gid and b == table[col] and state == ids[length - 1]
            for writes in self.pending_states.values()
            for g, b, state in writes
        )

    def on_allocate(
        self,
        request_id: str,
        num_new_tokens: int,
        hit: CacheHit | None,
        result: BlockIds | None,
        before: tuple,
        tables_before: BlockIds | None,
        num_lookahead_tokens: int,
    ) -> None:
        req = self.requests[request_id]
        hit_tokens = hit.num_tokens if hit is not None else 0
        if result is None:
            self._check_failed_allocation(request_id, hit, before, tables_before)
            self.check_pool()
            return
        req.holds_blocks = True
        start = req.num_computed_tokens + hit_tokens
        end = start + num_new_tokens
        req.refresh_ids()
        table = self.engine.get_block_ids(request_id)
        if len(table) != len(self.layout.groups):
            self.fail(
                "window_liveness",
                f"request {request_id!r}: get_block_ids returned "
                f"{len(table)} groups, the layout has {len(self.layout.groups)}",
            )
        self._check_reads_and_write(req, table, start, end)
        self.check_pool()

    def on_set_computed(self, request_id: str, num_computed_tokens: int) -> None:
        """The step ran: attention KV was written when the slots were allocated (a later
        request of the same step may read it), Mamba states only now."""
        self.requests[request_id].num_computed_tokens = num_computed_tokens
        for gid, block, state in self.pending_states.pop(request_id, ()):
            if num_computed_tokens > 0:
                self.shadow.write(gid, block, -1, state)

    def on_append(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.requests[request_id].token_ids.extend(int(t) for t in token_ids)

    def on_free(self, request_id: str) -> None:
        req = self.requests[request_id]
        if self.enabled("freed_on_free"):
            try:
                table = self.engine.get_block_ids(request_id)
            except Exception:  # noqa: BLE001 - an engine may forget freed requests
                table = ()
            held = [b for g in table for b in g if b != 0]
            if held:
                self.fail("freed_on_free", f"free({request_id!r}) left blocks {held} in its table")
        req.holds_blocks = False
        self.check_pool()

    def on_remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def on_reset(self, ok: bool) -> None:
        if not self.enabled("reset_prefix_cache") or not self.shared_pool:
            return
        holders = [rid for rid, r in self.requests.items() if r.holds_blocks]
        if ok and holders:
            self.fail(
                "reset_prefix_cache", f"reset_prefix_cache succeeded while {holders} hold blocks"
            )
        if not ok and not holders:
            self.fail(
                "reset_prefix_cache", "reset_prefix_cache failed with no request holding blocks"
            )
        if ok and self.has_cached and self.engine.cached_blocks():
            self.fail("reset_prefix_cache", "blocks are still cached after a successful reset")

    # -- checks ---------------------------------------------------------------------
    def _check_failed_allocation(
        self, request_id: str, hit: CacheHit | None, before: tuple, tables_before: BlockIds | None
    ) -> None:
        if not self.enabled("failed_allocation"):
            return
        after_tables = self.engine.get_block_ids(request_id) if tables_before else None
        if tables_before and after_tables:
            for gid, (old, new) in enumerate(zip(tables_before, after_tables)):
                added = {b for b in new if b != 0} - set(old)
                if added:
                    self.fail(
                        "failed_allocation",
                        f"allocate_slots({request_id!r}) returned None but group {gid} "
                        f"gained blocks {sorted(added)}",
                    )
        if hit is not None and self.has_ref_counts and before[1] is not None:
            refs = self.engine.ref_counts()
            for gid, table in enumerate(hit.block_ids):
                for b in table:
                    if b != 0 and refs.get(b) != before[1].get(b):
                        self.fail(
                            "failed_allocation",
                            f"allocate_slots({request_id!r}) returned None but the ref "
                            f"count of hit block {b} (group {gid}) changed "
                            f"{before[1].get(b)} -> {refs.get(b)}",
                        )

    def _check_reads_and_write(
        self, req: TrackedRequest, table: BlockIds, start: int, end: int
    ) -> None:
        rid = req.request_id
        others = {o: t for o, t in self.tables().items() if o != rid}
        for gid, row in enumerate(table):
            spec = self.layout.groups[gid].spec
            bs = spec.block_size
            if isinstance(spec, MambaSpec):
                if self.enabled("window_liveness") and start > 0:
                    why = missing_context(self.layout, self.shadow, gid, row, req.ids, 0, start)
                    if why is not None:
                        self.fail(
                            "window_liveness",
                            f"request {rid!r} resumes at {start} in group {gid} (mamba): {why}",
                        )
                write_cols = [cdiv(end, bs) - 1] if end > 0 else []
            else:
                if self.enabled("window_liveness"):
                    why = missing_context(
                        self.layout,
                        self.shadow,
                        gid,
                        row,
                        req.ids,
                        first_visible_key(spec, start),
                        start,
                    )
                    if why is not None:
                        self.fail(
                            "window_liveness",
                            f"request {rid!r} scheduled [{start}, {end}) reads keys from "
                            f"{first_visible_key(spec, start)} in group {gid} ({spec.type_name}):"
                            f" {why}",
                        )
                write_cols = sorted({p // bs for p in range(start, end)})
            for col in write_cols:
                if col >= len(row) or row[col] == 0:
                    self.fail(
                        "window_liveness",
                        f"request {rid!r} writes positions [{start}, {end}) but group "
                        f"{gid} has no real block at index {col} (table {list(row)})",
                    )
                block = row[col]
                if self.enabled("exclusive_write"):
                    for other, otable in others.items():
                        groups = range(len(otable)) if self.shared_pool else [gid]
                        if any(block in otable[g] for g in groups):
                            self.fail(
                                "exclusive_write",
                                f"request {rid!r} writes block {block} (group {gid}, "
                                f"index {col}) that request {other!r} also holds",
                            )
            if isinstance(spec, MambaSpec):
                if end > 0:  # the state exists once the step has run (on_set_computed)
                    self.pending_states.setdefault(rid, []).append(
                        (gid, row[cdiv(end, bs) - 1], req.ids[end - 1])
                    )
            else:
                for p in range(start, end):
                    self.shadow.write(gid, row[p // bs], p % bs, req.ids[p])
        if self.enabled("no_block_shared"):
            self._check_no_shared(rid, table)

    def _check_no_shared(self, rid: str, table: BlockIds) -> None:
        seen: dict[int, int] = {}
        for gid, row in enumerate(table):
            for b in row:
                if b == 0:
                    continue
                if b in seen and (self.shared_pool or seen[b] == gid):
                    self.fail(
                        "no_block_shared",
                        f"request {rid!r} holds block {b} twice (groups {seen[b]} and "
                        f"{gid}): {[list(r) for r in table]}",
                    )
                seen[b] = gid

    def check_pool(self) -> None:
        tables = self.tables()
        free = self.engine.num_free_blocks()
        n = self.layout.num_blocks
        if self.has_ref_counts and self.shared_pool:
            refs = self.engine.ref_counts()
            if self.enabled("pool_accounting"):
                used = sum(1 for c in refs.values() if c > 0)
                if free + used != n - 1:
                    self.fail(
                        "pool_accounting",
                        f"{free} free + {used} in use != {n - 1} blocks (null block excluded)",
                    )
            if self.enabled("ref_counts_match_owners"):
                owners: dict[int, int] = {}
                for table in tables.values():
                    for row in table:
                        for b in row:
                            if b != 0:
                                owners[b] = owners.get(b, 0) + 1
                for b, c in refs.items():
                    if c != owners.get(b, 0):
                        holders = [
                            (rid, g)
                            for rid, t in tables.items()
                            for g, row in enumerate(t)
                            if b in row
                        ]
                        self.fail(
                            "ref_counts_match_owners",
                            f"block {b} has ref count {c} but is held by {holders}",
                        )
            if self.has_free_queue and self.enabled("free_queue_contents"):
                queue = self.engine.free_queue()
                zero = {b for b, c in refs.items() if c == 0}
                if (
                    len(queue) != len(set(queue))
                    or 0 in queue
                    or set(queue) != zero
                    or len(queue) != free
                ):
                    dups = sorted({b for b in queue if queue.count(b) > 1})
                    self.fail(
                        "free_queue_contents",
                        f"free queue (len {len(queue)}, duplicates {dups}) differs from the "
                        f"{len(zero)} blocks with ref count 0 (free count {free}): missing "
                        f"{sorted(zero - set(queue))[:8]}, extra "
                        f"{sorted(set(queue) - zero)[:8]}",
                    )
        elif self.shared_pool and self.enabled("pool_accounting"):
            held = {b for t in tables.values() for row in t for b in row if b != 0}
            if free + len(held) > n - 1:
                self.fail(
                    "pool_accounting",
                    f"{free} free + {len(held)} held by requests > {n - 1} blocks",
                )
