"""The invariants of an engine's own host tier (``OwnsHostTier``: SGLang's HiCache).

Such an engine decides itself what it backs up to host memory, when it drops a host copy
and what it loads back; it reports its host pools and every copy between the tiers
(:class:`properties.core.engine.HostTransfer`). The checker follows each copy in the
shadow of block contents (:attr:`properties.checks.state.CheckState.host_shadow`): a
``write`` stores what the device block holds then, a ``load`` puts that back into a
device block. What must hold for any such engine (labels of ``docs/spec.md``):

* **X3** (:func:`host_hit_content`): a hit served from the host is a prefix that was
  computed and written back: after ``allocate_slots(..., num_external_computed_tokens=e)``
  every block the table gives the loaded positions ``[local, local + e)`` holds the
  request's own prefix there (never content another prefix, or nobody, produced).
* **X4** (:func:`host_pool_accounting`): no block is lost between the tiers: in every host
  pool, the free blocks plus the blocks that hold a copy equal its capacity, each held
  block once, every held block one a ``write`` filled (or one a queued write will fill:
  in flight), and every block a transfer in flight reads or writes still held (the
  capacity is respected on the way).
* **X5** (:func:`host_transfers_pinned`, :func:`backed_up_blocks_not_free`): a device
  block being backed up to the host is not handed to a request as a new block before
  the engine has acknowledged the copy (the copy would read the new owner's KV), nor
  counted free or reclaimable meanwhile.
* **X6** (:func:`host_load_source`): a load (or a store into the storage tier) reads a
  host block that a ``write`` or a ``fetch`` filled.
* **X7** (:func:`storage_fetch_source`): a fetch from the storage tier (L3) reads a key
  that a ``store`` filled.

Worked example (one full group, bs 2): ``write(0, device 5, host 1)`` after block 5
held positions 0-1 of prefix ``a``; then ``load(0, host 1, device 9)``: block 9 now holds
``a``'s positions 0-1, so a request ``a...`` served those two tokens from the host passes
X3; had the load named host block 2 (never written), X6 fails.
"""

from __future__ import annotations

from properties.checks.invariants import held_per_pool
from properties.checks.oracles import missing_context
from properties.checks.state import (
    AllocateEvent,
    CheckState,
    ExternalLoadEvent,
    HostTransferEvent,
    PoolEvent,
)
from properties.core.engine import HOST_FETCH, HOST_LOAD, HOST_STORE, HOST_WRITE


def host_load_source(state: CheckState, event: HostTransferEvent) -> str | None:
    """X6: a ``load`` reads a host block that a ``write`` (or a ``fetch`` from storage)
    filled, and a ``store`` reads one too (module docstring)."""
    t = event.transfer
    if t.kind in (HOST_LOAD, HOST_STORE) and (t.group_id, t.host_block) not in state.host_shadow:
        into = (
            f"into device block {t.device_block}"
            if t.kind == HOST_LOAD
            else f"into storage key {t.storage_key!r}"
        )
        return (
            f"the engine copied host block {t.host_block} of group {t.group_id} {into}, "
            "but nothing ever filled that host block"
        )
    return None


def storage_fetch_source(state: CheckState, event: HostTransferEvent) -> str | None:
    """X7: a ``fetch`` from the storage tier reads a key that a ``store`` filled. Example:
    ``fetch(0, key "ab12" -> host 5)`` with no earlier ``store`` of ``"ab12"``: the page
    the engine brings back is not one it wrote."""
    t = event.transfer
    if t.kind == HOST_FETCH and (t.group_id, t.storage_key) not in state.storage_shadow:
        return (
            f"the engine fetched storage key {t.storage_key!r} of group {t.group_id} into "
            f"host block {t.host_block}, but no store ever wrote that key"
        )
    return None


def host_hit_content(state: CheckState, event: ExternalLoadEvent) -> str | None:
    """X3: after a load from the engine's own host tier, every block the table gives the
    loaded positions ``[start, end)`` holds the request's own prefix there (null entries,
    below a sliding window, are not loaded). Example (bs 2): a request ``t0..t9`` served
    ``[0, 8)`` from the host whose table's block 2 holds ``u2..u3`` of another prompt:
    ``request 'r1': block 7 slot 0 (position 2) holds ...``."""
    if not state.has_host_tier:
        return None
    req = event.request
    for gid, row in enumerate(event.table):
        bs = state.layout.groups[gid].spec.block_size
        for col in range(event.start // bs, min(-(-event.end // bs), len(row))):
            if row[col] == 0:
                continue
            first, last = max(event.start, col * bs), min(event.end, (col + 1) * bs)
            why = missing_context(state.layout, state.shadow, gid, row, req.ids, first, last)
            if why is not None:
                return (
                    f"request {req.request_id!r} loaded positions [{event.start}, "
                    f"{event.end}) from the host tier, group {gid}: {why}"
                )
    return None


def host_pool_accounting(state: CheckState, event: PoolEvent) -> str | None:
    """X4: per host pool, ``num_free + len(held) + len(staging) == num_blocks``, no block
    held twice or both held and staging, every held block filled by a ``write`` or a
    ``fetch`` or in flight, every block of a transfer in flight held or staging.
    Example: a pool of 8 blocks with 3 free and held ``(1, 2, 2, 5)``: block 2 twice;
    held ``(1, 2, 5)``: 3 + 3 != 8, two blocks lost; the same with ``staging=(6, 7)``:
    3 + 3 + 2 == 8."""
    for pool in state.host_pools():
        held, staging = set(pool.held), set(pool.staging)
        if len(held) != len(pool.held) or len(staging) != len(pool.staging):
            twice = sorted(
                b for b in held | staging if pool.held.count(b) + pool.staging.count(b) > 1
            )
            return f"host pool {pool.name!r}: blocks {twice} are held twice"
        if held & staging:
            return (
                f"host pool {pool.name!r}: blocks {sorted(held & staging)[:8]} are both held "
                "and staging"
            )
        lost = pool.num_blocks - pool.num_free - len(held) - len(staging)
        if lost:
            return (
                f"host pool {pool.name!r}: {pool.num_free} free + {len(held)} held + "
                f"{len(staging)} staging != {pool.num_blocks} blocks ({lost} blocks neither "
                "free nor holding a copy)"
            )
        gid = pool.group_ids[0]
        flying = set(pool.in_flight)
        unwritten = sorted(b for b in held - flying if (gid, b) not in state.host_shadow)
        if unwritten:
            return (
                f"host pool {pool.name!r}: blocks {unwritten[:8]} hold a copy that no "
                "write ever filled"
            )
        dropped = sorted(set(pool.in_flight) - held - staging)
        if dropped:
            return (
                f"host pool {pool.name!r}: blocks {dropped[:8]} were dropped while a copy "
                "in flight still reads or writes them"
            )
    return None


def host_transfers_pinned(state: CheckState, event: AllocateEvent) -> str | None:
    """X5: the new blocks of an allocation (past its computed and adopted blocks) are none
    that a backup in flight reads.
    Example: device block 7 is being backed up (not acknowledged yet) and an allocation
    returns it as a new block of request ``r2``: the copy would read ``r2``'s KV."""
    before = event.tables_before or tuple(() for _ in event.table)
    for pool in state.host_pools():
        flying = set(pool.in_flight_device)
        for gid in pool.group_ids:
            row = event.table[gid]
            first = max(len(before[gid]), event.start // state.layout.groups[gid].spec.block_size)
            for col in range(first, len(row)):
                if row[col] in flying:
                    return (
                        f"request {event.request.request_id!r} got block {row[col]} (group "
                        f"{gid}, index {col}) while a backup to the host tier that the "
                        "engine has not acknowledged still reads it"
                    )
    return None


def backed_up_blocks_not_free(state: CheckState, event: PoolEvent) -> str | None:
    """X5 per device pool (separate pools): a block a backup in flight reads is neither
    free nor reclaimable, so the pool's free count plus the distinct blocks the requests
    hold or such backups read never exceeds its capacity. Example: a pool of 16 blocks, 12
    free, 3 held by requests, a queued backup reading block 9 that no request holds, the
    engine counting block 9 reclaimable too: 12 + 4 = 16 is fine, 13 + 4 is not."""
    held = held_per_pool(state, event.tables)
    flying: dict[int, set[int]] = {}
    for host in state.host_pools():
        for gid in host.group_ids:
            flying.setdefault(gid, set()).update(host.in_flight_device)
    for pool in state.pools():
        backups = set().union(*(flying.get(g, set()) for g in pool.group_ids))
        blocks = held[pool.name] | backups
        if backups and pool.num_free + len(blocks) > pool.num_blocks:
            return (
                f"pool {pool.name!r}: {pool.num_free} free or reclaimable + {len(blocks)} "
                f"held by requests or read by backups in flight {sorted(backups)[:8]} > "
                f"its {pool.num_blocks} blocks: a block being backed up is counted free"
            )
    return None


__all__ = [
    "HOST_LOAD",
    "backed_up_blocks_not_free",
    "HOST_WRITE",
    "host_hit_content",
    "host_load_source",
    "host_pool_accounting",
    "host_transfers_pinned",
    "storage_fetch_source",
]
