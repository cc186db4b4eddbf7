"""Every answer of the engine under test, validated before any check uses it (P1).

The lockstep engine (:mod:`properties.checks.lockstep`) puts the engine behind a
:class:`properties.checks.boundary.EngineBoundary`, which calls these functions on every
answer. A malformed answer raises :class:`AnswerError` (an
:class:`properties.core.engine.EngineError`: exit code 3) naming the call, the value
and what was expected; it never reaches a check, so it can neither crash the harness
nor pass. What is checked:

* a hit is a :class:`CacheHit` whose ``num_tokens`` is an integer ``>= 0`` and whose
  ``block_ids`` has one sequence per group of ids in ``[0, num_blocks)``;
* a table (``get_block_ids``) has one sequence per group of ids in ``[0, num_blocks)``;
  a full-attention group never holds the null block ``0`` (it keeps every block);
* ``allocate_slots`` returns ``None`` or one sequence per group of ids in
  ``[1, num_blocks)`` (a new block is never the null block), and those ids are the tail
  of the table the engine then reports (:func:`check_new_blocks_are_tail`);
* ``num_free_blocks`` is an integer; one outside ``[0, num_blocks - 1]`` (one shared
  pool) is a well-formed answer no pool can give: a failure of ``pool_accounting`` (exit
  1: the engine is wrong), not a protocol error (exit 3: the engine broke the protocol);
* ``reset_prefix_cache`` is a bool;
* the optional capabilities: ``ref_counts`` maps block ids in ``[1, num_blocks)`` to
  integers ``>= 0``; ``free_queue`` lists ids in ``[1, num_blocks)``;
  ``cached_blocks`` lists :class:`CachedBlock` with an id in ``[1, num_blocks)``, a group
  of the layout and ``num_tokens >= 1``; ``last_allocation_estimate`` is ``None`` or an
  integer ``>= 0``; ``host_hit`` an integer ``>= 0``, ``host_pools`` and
  ``take_host_transfers`` host pools and copies naming real groups and blocks;
  ``pending_block_copies`` and ``take_block_copies`` list pairs of distinct ids in ``[1,
  num_blocks)``.

Integers may be any ``int`` (numpy integers too), never ``bool``. Valid answers are
returned normalised (tuples of Python ints).

Worked example, a layout of 2 groups and 16 blocks: ``check_table("get_block_ids('r3')",
((1, 2), None), layout)`` raises ``AnswerError("get_block_ids('r3') returned None for
group 1, not a sequence of block ids")``; ``((1, 2), (16,))`` raises for block id 16
(the pool has ids 0..15).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

from properties.core.engine import (
    HOST_LOAD,
    HOST_TRANSFER_KINDS,
    HOST_WRITE,
    BlockIds,
    CachedBlock,
    CacheHit,
    EngineError,
    HostPoolUsage,
    HostTransfer,
    PoolUsage,
)
from reference.layout import KVCacheLayout
from reference.specs import FullAttentionSpec

#: The fast path of the validators: every value is exactly an ``int``.
_PLAIN_INT = frozenset({int})
#: Sequences taken without the abstract-class checks.
_PLAIN_SEQUENCES = (tuple, list)


class AnswerError(EngineError):
    """The engine answered a call with a value of the wrong type, shape or range.

    ``name`` is the registered check (:data:`properties.checks.registry.CHECKS`)."""

    name = "answers"


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def as_int(value: Any, what: str, where: str = "") -> int:
    """``value`` as a Python int: ints and numpy integers, never bool, float or str."""
    if isinstance(value, bool):
        raise AnswerError(f"{what} returned {value!r}{where}, not an integer")
    if isinstance(value, int):
        return int(value)
    try:
        return operator.index(value)
    except TypeError:
        raise AnswerError(
            f"{what} returned {_short(value)}{where}, not an integer ({type(value).__name__})"
        ) from None


def _block_id(value: Any, what: str, where: str, layout: KVCacheLayout, lowest: int) -> int:
    block = as_int(value, what, where)
    if not lowest <= block < layout.num_blocks:
        null = " (0 is the null block, never a new block)" if block == 0 and lowest == 1 else ""
        raise AnswerError(
            f"{what} returned block id {block}{where}, outside [{lowest}, {layout.num_blocks}) "
            f"(num_blocks {layout.num_blocks}){null}"
        )
    return block


def _ids(
    row: Sequence, what: str, where: str, layout: KVCacheLayout, lowest: int
) -> tuple[int, ...]:
    """A row of block ids, each checked by :func:`_block_id` (plain ints in range take a
    fast path: this runs on every answer)."""
    if set(map(type, row)) <= _PLAIN_INT and (
        not row or (min(row) >= lowest and max(row) < layout.num_blocks)
    ):
        return tuple(row)
    return tuple(_block_id(b, what, where, layout, lowest) for b in row)


def _sequence(value: Any) -> bool:
    """A sequence of values, not a string or a mapping (a plain tuple or list is one
    without the abstract-class checks: this runs on every answer)."""
    if type(value) in _PLAIN_SEQUENCES:
        return True
    return not isinstance(value, (str, bytes, Mapping)) and isinstance(value, Sequence)


def _rows(value: Any, what: str, layout: KVCacheLayout) -> Sequence:
    groups = len(layout.groups)
    if not _sequence(value):
        raise AnswerError(
            f"{what} returned {_short(value)}, not a sequence of {groups} block id lists "
            "(one per group)"
        )
    if len(value) != groups:
        raise AnswerError(
            f"{what} returned {len(value)} groups, the layout has {groups}: {_short(value)}"
        )
    return value


def _row(row: Any, what: str, gid: int) -> Sequence:
    if not _sequence(row):
        raise AnswerError(
            f"{what} returned {_short(row)} for group {gid}, not a sequence of block ids"
        )
    return row


def check_table(what: str, value: Any, layout: KVCacheLayout) -> BlockIds:
    """A request's block table: one row per group, ids in ``[0, num_blocks)``, no null in
    a full-attention group (R-SWA frees the gap behind its window: nulls there)."""
    out = []
    for gid, row in enumerate(_rows(value, what, layout)):
        ids = _ids(_row(row, what, gid), what, f" for group {gid}", layout, 0)
        spec = layout.groups[gid].spec
        if type(spec) is FullAttentionSpec and 0 in ids:
            raise AnswerError(
                f"{what} returned the null block 0 at position {ids.index(0)} of group {gid} "
                f"(full attention keeps a real block for every position): {_short(ids)}"
            )
        out.append(ids)
    return tuple(out)


def check_hit(what: str, value: Any, layout: KVCacheLayout) -> CacheHit:
    """A prefix hit: a :class:`CacheHit`, ``num_tokens >= 0``, one id list per group."""
    if not isinstance(value, CacheHit):
        raise AnswerError(f"{what} returned {_short(value)}, not a CacheHit")
    num_tokens = as_int(value.num_tokens, what, " as num_tokens")
    if num_tokens < 0:
        raise AnswerError(f"{what} returned a hit of {num_tokens} tokens (must be >= 0)")
    block_ids = tuple(
        _ids(_row(r, what, gid), what, f" in the hit for group {gid}", layout, 0)
        for gid, r in enumerate(_rows(value.block_ids, what, layout))
    )
    return CacheHit(block_ids, num_tokens)


def check_new_blocks(what: str, value: Any, layout: KVCacheLayout) -> BlockIds | None:
    """``allocate_slots``' answer: None, or one list per group of ids in ``[1, num_blocks)``."""
    if value is None:
        return None
    return tuple(
        _ids(_row(row, what, gid), what, f" for group {gid}", layout, 1)
        for gid, row in enumerate(_rows(value, what, layout))
    )


def check_batch(what: str, value: Any, num_items: int, layout: KVCacheLayout) -> list:
    """``schedule_step``'s answer: a list of one :func:`check_new_blocks` answer per item,
    in order, stopping right after the first ``None`` (later items are not applied)."""
    if not isinstance(value, list) or not value or len(value) > num_items:
        raise AnswerError(
            f"{what} returned {_short(value)}, not a list of 1 to {num_items} results"
        )
    if any(r is None for r in value[:-1]) or (len(value) < num_items and value[-1] is not None):
        raise AnswerError(
            f"{what} returned {_short(value)}: one result per item, stopping only after a None"
        )
    return [check_new_blocks(f"{what} (item {i})", r, layout) for i, r in enumerate(value)]


def check_new_blocks_are_tail(
    what: str, new: BlockIds, table: BlockIds, before: BlockIds | None = None
) -> None:
    """The ids ``allocate_slots`` returned are, group by group and in order, first the ids
    that fill a column the table held as the null block before the call (``before``; the
    Mamba running state after a draft rollback,
    :meth:`reference.managers.mamba.MambaManager.allocate_new_blocks`), then the last real
    (non-null) entries of the request's table (a Mamba row may hold null padding between
    them: a copy-on-write block stands at a partial hit's last column, the new state block
    at the last column).

    Example: new ``((7,),)`` and table ``((3, 7),)`` is fine; table ``((7, 3),)`` raises;
    new ``((5, 8),)`` and table ``((0, 5, 0, 8),)`` is fine. Before ``((0, 3),)``, new
    ``((5, 7),)`` and table ``((5, 3, 7),)`` is fine.
    """
    for gid, (ids, row) in enumerate(zip(new, table)):
        if not ids:
            continue
        old = before[gid] if before is not None and gid < len(before) else ()
        filled = tuple(
            row[i] for i in range(min(len(old), len(row))) if old[i] == 0 and row[i] != 0
        )
        tail = tuple(ids[len(filled) :])
        real = [b for b in row if b != 0]
        if tuple(ids[: len(filled)]) == filled and _ends_with(real, tail):
            continue
        raise AnswerError(
            f"{what} returned new blocks {list(ids)} for group {gid}, but the engine's "
            f"table of that group then ends with {real[-len(ids) :]} (null entries "
            f"left out; get_block_ids: {list(row)})"
        )


def _ends_with(row: tuple[int, ...] | list[int], tail: tuple[int, ...]) -> bool:
    return not tail or tuple(row[len(row) - len(tail) :]) == tail


def check_block_copies(what: str, value: Any, layout: KVCacheLayout) -> list[tuple[int, int]]:
    """``pending_block_copies`` / ``take_block_copies``: a list of ``(source, destination)``
    pairs of distinct block ids in ``[1, num_blocks)``. Example: ``[(4, 9)]`` is kept;
    ``[(4, 4)]`` and ``[(0, 9)]`` raise."""
    if not isinstance(value, (list, tuple)):
        raise AnswerError(f"{what} returned {_short(value)}, not a list of (source, copy) pairs")
    out = []
    for pair in value:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise AnswerError(f"{what} returned {_short(value)}: {pair!r} is not a pair")
        source, copy = (as_int(b, what) for b in pair)
        if not (0 < source < layout.num_blocks and 0 < copy < layout.num_blocks) or (
            source == copy
        ):
            raise AnswerError(
                f"{what} returned the copy {source} -> {copy}: two distinct block ids in "
                f"[1, {layout.num_blocks}) expected"
            )
        out.append((source, copy))
    return out


def check_free_count(what: str, value: Any, layout: KVCacheLayout, shared_pool: bool) -> int:
    """``num_free_blocks``: an int (else :class:`AnswerError`) in ``[0, num_blocks - 1]``
    (the null block is never free; engines with one pool per group may count up to
    ``groups * (num_blocks - 1)``), else a ``pool_accounting`` violation. Example: 17 on a
    pool of 16 blocks fails ``pool_accounting``; ``"17"`` is an :class:`AnswerError`."""
    count = as_int(value, what)
    most = (layout.num_blocks - 1) * (1 if shared_pool else len(layout.groups))
    if not 0 <= count <= most:
        # a well-formed count no pool can have: the engine is wrong, not off the protocol
        from properties.checks.registry import PropertyViolation

        raise PropertyViolation(
            "pool_accounting",
            f"{what} returned {count} free blocks, outside [0, {most}]: the pool has "
            f"{layout.num_blocks - 1} blocks besides the null block",
        )
    return count


def check_estimate(what: str, value: Any) -> int | None:
    """``last_allocation_estimate``: ``None`` (no per-step estimate) or an int ``>= 0``.
    Example: ``-1`` raises ``AnswerError("... returned -1, not a block count >= 0")``."""
    if value is None:
        return None
    count = as_int(value, what)
    if count < 0:
        raise AnswerError(f"{what} returned {count}, not a block count >= 0")
    return count


def check_bool(what: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise AnswerError(f"{what} returned {_short(value)}, not a bool")
    return value


def check_ref_counts(what: str, value: Any, layout: KVCacheLayout) -> dict[int, int]:
    """Block id in ``[1, num_blocks)`` -> ref count ``>= 0``."""
    if not isinstance(value, Mapping):
        raise AnswerError(f"{what} returned {_short(value)}, not a mapping block id -> count")
    keys, counts = value.keys(), value.values()
    if (
        set(map(type, keys)) <= _PLAIN_INT
        and set(map(type, counts)) <= _PLAIN_INT
        and (not value or (min(keys) >= 1 and max(keys) < layout.num_blocks and min(counts) >= 0))
    ):
        return dict(value)
    out = {}
    for block, count in value.items():
        block = _block_id(block, what, " as a key", layout, 1)
        count = as_int(count, what, f" as the ref count of block {block}")
        if count < 0:
            raise AnswerError(f"{what} returned ref count {count} for block {block}")
        out[block] = count
    return out


def check_free_queue(what: str, value: Any, layout: KVCacheLayout) -> list[int]:
    """Free block ids, front first, each in ``[1, num_blocks)``."""
    if not _sequence(value):
        raise AnswerError(f"{what} returned {_short(value)}, not a sequence of block ids")
    if set(map(type, value)) <= _PLAIN_INT and (
        not value or (min(value) >= 1 and max(value) < layout.num_blocks)
    ):
        return list(value)
    return [_block_id(b, what, f" at position {i}", layout, 1) for i, b in enumerate(value)]


def check_cached_blocks(what: str, value: Any, layout: KVCacheLayout) -> list[CachedBlock]:
    """Every cached block: a :class:`CachedBlock` naming a real block and a group."""
    if not _sequence(value):
        raise AnswerError(f"{what} returned {_short(value)}, not a sequence of CachedBlock")
    if _plain_cached_blocks(value, layout):
        return list(value)  # already normalised (the entries are frozen)
    out = []
    for i, c in enumerate(value):
        if not isinstance(c, CachedBlock):
            raise AnswerError(f"{what} returned {_short(c)} at position {i}, not a CachedBlock")
        block = _block_id(c.block_id, what, f" at position {i}", layout, 1)
        gid = as_int(c.group_id, what, f" as the group of position {i}")
        tokens = as_int(c.num_tokens, what, f" as num_tokens of position {i}")
        if not 0 <= gid < len(layout.groups) or tokens < 1:
            raise AnswerError(
                f"{what} returned {c!r} at position {i}: group must be in "
                f"[0, {len(layout.groups)}) and num_tokens >= 1"
            )
        out.append(CachedBlock(block, gid, tokens))
    return out


def _plain_cached_blocks(value: Sequence, layout: KVCacheLayout) -> bool:
    """The fast path of :func:`check_cached_blocks` (it runs on every lookup and commit
    at the small tier): every entry is exactly a :class:`CachedBlock` of plain ints with
    a block id in ``[1, num_blocks)``, a group of the layout and ``num_tokens >= 1``, so
    the entries are returned as they are. Anything else (a subclass, a numpy integer, a
    value out of range) takes the entry-by-entry path, which normalises or names it."""
    if not value:
        return True
    if not all(type(c) is CachedBlock for c in value):
        return False
    blocks = [c.block_id for c in value]
    groups = [c.group_id for c in value]
    tokens = [c.num_tokens for c in value]
    return (
        set(map(type, blocks)) <= _PLAIN_INT
        and set(map(type, groups)) <= _PLAIN_INT
        and set(map(type, tokens)) <= _PLAIN_INT
        and min(blocks) >= 1
        and max(blocks) < layout.num_blocks
        and min(groups) >= 0
        and max(groups) < len(layout.groups)
        and min(tokens) >= 1
    )


def check_pool_usage(what: str, value: Any, layout: KVCacheLayout) -> tuple[PoolUsage, ...]:
    """``pool_usage()``: a non-empty sequence of :class:`PoolUsage` with distinct names,
    whose ``group_ids`` partition the layout's groups, ``0 <= num_free <= num_blocks``.

    Example: two groups and ``(PoolUsage("full", (0,), 16, 3),)`` raises (group 1 is in
    no pool); ``PoolUsage("swa", (1,), 16, 17)`` raises (more free than the pool holds).
    """
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or not value:
        raise AnswerError(f"{what} returned {_short(value)}, not a non-empty sequence of PoolUsage")
    out: list[PoolUsage] = []
    seen_groups: list[int] = []
    for i, p in enumerate(value):
        if not isinstance(p, PoolUsage):
            raise AnswerError(f"{what} returned {_short(p)} at position {i}, not a PoolUsage")
        if not isinstance(p.name, str) or any(p.name == q.name for q in out):
            raise AnswerError(f"{what}: pool {i} has name {p.name!r}, not a new string")
        if isinstance(p.group_ids, (str, bytes)) or not isinstance(p.group_ids, Sequence):
            raise AnswerError(f"{what}: pool {p.name!r} has group_ids {_short(p.group_ids)}")
        where = f" in the group_ids of pool {p.name!r}"
        groups = tuple(as_int(g, what, where) for g in p.group_ids)
        blocks = as_int(p.num_blocks, what, f" as num_blocks of pool {p.name!r}")
        free = as_int(p.num_free, what, f" as num_free of pool {p.name!r}")
        if not 0 <= free <= blocks:
            raise AnswerError(
                f"{what}: pool {p.name!r} has {free} free of {blocks} blocks "
                "(needs 0 <= num_free <= num_blocks)"
            )
        seen_groups.extend(groups)
        out.append(PoolUsage(p.name, groups, blocks, free))
    if sorted(seen_groups) != list(range(len(layout.groups))):
        raise AnswerError(
            f"{what}: the pools' group_ids {sorted(seen_groups)} do not partition the "
            f"{len(layout.groups)} groups of the layout"
        )
    return tuple(out)


def check_host_hit(what: str, value: Any) -> int:
    """``host_hit(id)``: an integer ``>= 0``."""
    tokens = as_int(value, what)
    if tokens < 0:
        raise AnswerError(f"{what} returned {tokens}, not a token count >= 0")
    return tokens


def _host_ids(what: str, values: Any, where: str, lowest: int, end: int) -> tuple[int, ...]:
    """A sequence of integer ids in ``[lowest, end)`` (``where`` names the field)."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise AnswerError(f"{what} returned {_short(values)}{where}, not a sequence of ids")
    out = tuple(as_int(v, what, where) for v in values)
    bad = [v for v in out if not lowest <= v < end]
    if bad:
        raise AnswerError(f"{what} returned id {bad[0]}{where}, outside [{lowest}, {end})")
    return out


def check_host_pools(what: str, value: Any, layout: KVCacheLayout) -> tuple[HostPoolUsage, ...]:
    """``host_pools()``: a sequence of :class:`HostPoolUsage` with distinct names, each
    group of the layout in at most one of them, ``0 <= num_free <= num_blocks``, held,
    in-flight and staging host blocks in ``[1, num_blocks]``, in-flight device blocks in
    ``[1, layout.num_blocks)``.

    Example: ``HostPoolUsage("full", (0,), 8, 9, ())`` raises (more free than the pool
    holds); ``HostPoolUsage("full", (0,), 8, 2, (9,))`` raises (host block 9 of 8)."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise AnswerError(f"{what} returned {_short(value)}, not a sequence of HostPoolUsage")
    out: list[HostPoolUsage] = []
    seen: list[int] = []
    for i, p in enumerate(value):
        if not isinstance(p, HostPoolUsage):
            raise AnswerError(f"{what} returned {_short(p)} at position {i}, not a HostPoolUsage")
        if not isinstance(p.name, str) or any(p.name == q.name for q in out):
            raise AnswerError(f"{what}: host pool {i} has name {p.name!r}, not a new string")
        name = f" of host pool {p.name!r}"
        groups = _host_ids(what, p.group_ids, f" in the group_ids{name}", 0, len(layout.groups))
        if not groups or set(groups) & set(seen):
            raise AnswerError(f"{what}: host pool {p.name!r} has groups {groups}, none or taken")
        seen.extend(groups)
        blocks = as_int(p.num_blocks, what, f" as num_blocks{name}")
        free = as_int(p.num_free, what, f" as num_free{name}")
        if not 0 <= free <= blocks:
            raise AnswerError(
                f"{what}: host pool {p.name!r} has {free} free of {blocks} blocks "
                "(needs 0 <= num_free <= num_blocks)"
            )
        held = _host_ids(what, p.held, f" in held{name}", 1, blocks + 1)
        flying = _host_ids(what, p.in_flight, f" in in_flight{name}", 1, blocks + 1)
        device = _host_ids(
            what, p.in_flight_device, f" in in_flight_device{name}", 1, layout.num_blocks
        )
        pinned = as_int(p.num_pinned_device, what, f" as num_pinned_device{name}")
        if pinned < 0:
            raise AnswerError(f"{what}: host pool {p.name!r} pins {pinned} device blocks")
        staging = _host_ids(what, p.staging, f" in staging{name}", 1, blocks + 1)
        out.append(
            HostPoolUsage(p.name, groups, blocks, free, held, flying, device, pinned, staging)
        )
    return tuple(out)


def check_host_transfers(what: str, value: Any, layout: KVCacheLayout) -> list[HostTransfer]:
    """``take_host_transfers()``: a sequence of :class:`HostTransfer` whose ``kind`` is
    one of ``HOST_TRANSFER_KINDS``, ``group_id`` a group of the layout, ``host_block >=
    1``; a ``write`` or ``load`` names a ``device_block`` in ``[1, num_blocks)``, a
    ``store`` or ``fetch`` device block 0 and a non-empty string ``storage_key``."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise AnswerError(f"{what} returned {_short(value)}, not a sequence of HostTransfer")
    out: list[HostTransfer] = []
    for i, t in enumerate(value):
        if not isinstance(t, HostTransfer) or t.kind not in HOST_TRANSFER_KINDS:
            raise AnswerError(f"{what} returned {_short(t)} at position {i}, not a HostTransfer")
        where = f" in transfer {i}"
        gid = as_int(t.group_id, what, where)
        if not 0 <= gid < len(layout.groups):
            raise AnswerError(f"{what}: transfer {i} names group {gid} of {len(layout.groups)}")
        host = as_int(t.host_block, what, where)
        if host < 1:
            raise AnswerError(f"{what}: transfer {i} names host block {host} (ids start at 1)")
        if t.kind in (HOST_WRITE, HOST_LOAD):
            device = _block_id(t.device_block, what, where, layout, 1)
            out.append(HostTransfer(t.kind, gid, device, host))
            continue
        if as_int(t.device_block, what, where) != 0:
            raise AnswerError(f"{what}: storage transfer {i} names device block {t.device_block}")
        if not isinstance(t.storage_key, str) or not t.storage_key:
            raise AnswerError(f"{what}: storage transfer {i} has key {t.storage_key!r}")
        out.append(HostTransfer(t.kind, gid, 0, host, t.storage_key))
    return out
