"""Oracles: what a correct engine must return, computed by brute force.

Content model (symbolic): the KV of token ``p`` of a request is identified by
``prefix_id(p)``, a 64-bit rolling hash of ``(salt, lora, tokens[0..p])``, so two
requests share it exactly when their prefixes (and extra keys) agree. The shadow
cache remembers which ``prefix_id`` each slot of each block holds (written when an
allocation is made for the tokens of a step) and which prefix each Mamba state
block summarises. From it:

* **liveness**: a request scheduled for ``[start, start + n)`` reads, in each
  attention group, keys ``[first_visible_key(start), start)``: every one must sit in a real
  block of its table holding exactly its own ``prefix_id``; the blocks it writes must
  be real; a Mamba group must read the state of exactly ``tokens[0:start)``.
* **hit soundness**: a hit of ``L`` tokens gives, per group, blocks holding every
  token in ``[hit_context_start(L), L)`` (Mamba: the state at exactly ``L``).
* **hit maximality** (engines exposing their cached blocks): the brute force tries
  every aligned ``L`` from the cap downwards and returns the largest that every
  group can serve from cached blocks with the right content.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from properties.core.diff import token_range
from properties.core.engine import CachedBlock
from reference.layout import KVCacheLayout
from reference.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)

_MASK = (1 << 64) - 1
_MULT = 0x100000001B3


def prefix_seed(cache_salt: str | None, lora_name: str | None) -> int:
    """The rolling hash's start value: distinct per (salt, LoRA)."""
    digest = hashlib.blake2b(repr((cache_salt, lora_name)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def prefix_ids(
    token_ids: Sequence[int], cache_salt: str | None = None, lora_name: str | None = None
) -> list[int]:
    """``ids[p]`` identifies ``tokens[0..p]`` (inclusive) with the extra keys."""
    return extend_prefix_ids([], token_ids, cache_salt, lora_name)


def extend_prefix_ids(
    ids: list[int],
    token_ids: Sequence[int],
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> list[int]:
    """``ids`` (the prefix ids of ``token_ids[:len(ids)]``) extended to all of
    ``token_ids``: the rolling hash continues from ``ids[-1]``; returns a new list."""
    h = ids[-1] if ids else prefix_seed(cache_salt, lora_name)
    out = list(ids)
    for t in token_ids[len(ids) :]:
        h = ((h ^ (int(t) + 0x9E3779B97F4A7C15)) * _MULT) & _MASK
        h ^= h >> 29
        out.append(h)
    return out


#: The prefix id of a slot a rejected draft (or a step whose tokens were rolled back)
#: wrote: the KV of a token that is not the request's, so no prefix ever matches it.
OVERWRITTEN = -1


@dataclass(frozen=True)
class SlotContent:
    group_id: int
    prefix_id: int


class ShadowCache:
    """What every block holds, per the writes the engine's tables directed.

    With one shared pool a block id names one physical block whatever its group;
    with separate pools (``shared_pool=False``) blocks are keyed by (group, id).

    A block's slots are kept as two lists indexed by offset, the prefix id and the group
    of each slot (``None``: never written), so that a run of slots is compared with a
    request's prefix ids in one list comparison (:meth:`holds_run`); a Mamba state
    (offset -1) is kept apart. Example: after ``write(0, 7, 0, h0)`` and ``write(0, 7, 1,
    h1)``, ``holds_run(0, 7, 0, [h0, h1], 0, 2)`` is True, ``holds_run(1, 7, 0, [h0, h1],
    0, 2)`` False (group 1 never wrote block 7).
    """

    def __init__(self, layout: KVCacheLayout, shared_pool: bool) -> None:
        self.layout = layout
        self.shared_pool = shared_pool
        #: block key -> the prefix id of each slot, by offset (None: never written)
        self._prefixes: dict[object, list[int | None]] = {}
        #: block key -> the group that wrote each slot, by offset (None: never written)
        self._groups: dict[object, list[int | None]] = {}
        #: block key -> its Mamba state (slot -1)
        self._states: dict[object, SlotContent] = {}
        #: ``(group, prefix id)`` -> the blocks whose last slot (a Mamba state: slot -1)
        #: holds that group's KV of that prefix: the blocks that may end a hit there
        self._ends: dict[tuple[int, int], set[int]] = {}
        self._last = [
            -1 if isinstance(g.spec, MambaSpec) else g.spec.block_size - 1 for g in layout.groups
        ]
        #: the distinct last offsets of attention groups (a run of writes can end a block
        #: of any of them)
        self._last_offsets = tuple(sorted({o for o in self._last if o >= 0}))

    def _key(self, group_id: int, block_id: int) -> object:
        return block_id if self.shared_pool else (group_id, block_id)

    def write(self, group_id: int, block_id: int, offset: int, prefix_id: int) -> None:
        key = self._key(group_id, block_id)
        if offset < 0:
            old = self._states.get(key)
            if old is not None and offset == self._last[old.group_id]:
                self._ends.get((old.group_id, old.prefix_id), set()).discard(block_id)
            self._states[key] = SlotContent(group_id, prefix_id)
        else:
            prefixes, groups = self._slots_of(key, offset + 1)
            old_group = groups[offset]
            if old_group is not None and offset == self._last[old_group]:
                self._ends.get((old_group, prefixes[offset]), set()).discard(block_id)
            prefixes[offset] = prefix_id
            groups[offset] = group_id
        if offset == self._last[group_id]:
            self._ends.setdefault((group_id, prefix_id), set()).add(block_id)

    def write_run(
        self, group_id: int, block_id: int, offset: int, prefix_ids: Sequence[int]
    ) -> None:
        """``write(group_id, block_id, offset + i, prefix_ids[i])`` for every ``i``, in one
        pass (attention slots of one block: ``offset >= 0``). Example: ``write_run(0, 7,
        2, [h2, h3])`` is ``write(0, 7, 2, h2)`` then ``write(0, 7, 3, h3)``."""
        n = len(prefix_ids)
        if n == 0:
            return
        key = self._key(group_id, block_id)
        end = offset + n
        prefixes, groups = self._slots_of(key, end)
        new_last = self._last[group_id]
        for last in self._last_offsets:  # the slots that may end a block, in order
            if not offset <= last < end:
                continue
            old_group = groups[last]
            if old_group is not None and last == self._last[old_group]:
                self._ends.get((old_group, prefixes[last]), set()).discard(block_id)
            if last == new_last:
                new_prefix = prefix_ids[last - offset]
                self._ends.setdefault((group_id, new_prefix), set()).add(block_id)
        prefixes[offset:end] = prefix_ids
        groups[offset:end] = [group_id] * n

    def _slots_of(self, key: object, size: int) -> tuple[list, list]:
        """The slot lists of block ``key``, grown to at least ``size`` slots."""
        prefixes = self._prefixes.get(key)
        if prefixes is None:
            prefixes = self._prefixes[key] = []
            groups = self._groups[key] = []
        else:
            groups = self._groups[key]
        if len(prefixes) < size:
            grow = [None] * (size - len(prefixes))
            prefixes.extend(grow)
            groups.extend(grow)
        return prefixes, groups

    def copy(self, source: int, destination: int, group_id: int | None = None) -> None:
        """A block copy (copy-on-write): ``destination`` now holds exactly what ``source``
        holds, slot by slot (a Mamba state too). With one shared pool a block id is the
        key; with separate pools the copy is within ``group_id``'s pool (None: nothing is
        known to be copied, the destination is forgotten in every pool). Example: after
        ``write(0, 4, 1, h)`` and ``copy(4, 9)``, ``holds(0, 9, 1, h)``; slots 9 had that
        4 has not are forgotten."""
        if self.shared_pool or group_id is not None:
            forgotten = [0 if group_id is None else group_id]
        else:
            forgotten = list(range(len(self.layout.groups)))  # every pool's block
        for gid in forgotten:
            for offset, old in self.block(gid, destination).items():
                if offset == self._last[old.group_id]:
                    self._ends.get((old.group_id, old.prefix_id), set()).discard(destination)
            for slots in (self._prefixes, self._groups, self._states):
                slots.pop(self._key(gid, destination), None)
        if group_id is None and not self.shared_pool:
            return
        gid = 0 if group_id is None else group_id
        for offset, content in self.block(gid, source).items():
            self.write(content.group_id, destination, offset, content.prefix_id)

    def block(self, group_id: int, block_id: int) -> dict[int, SlotContent]:
        """A copy of every written slot of a block (offset -> content; Mamba: -1).
        Example: after ``write(0, 7, 1, h)``, ``block(0, 7) == {1: SlotContent(0, h)}``."""
        key = self._key(group_id, block_id)
        out: dict[int, SlotContent] = {}
        groups = self._groups.get(key)
        if groups is not None:
            prefixes = self._prefixes[key]
            for offset, gid in enumerate(groups):
                if gid is not None:
                    out[offset] = SlotContent(gid, prefixes[offset])
        state = self._states.get(key)
        if state is not None:
            out[-1] = state
        return out

    def blocks_ending(self, group_id: int, prefix_id: int) -> set[int]:
        """The blocks whose last slot holds group ``group_id``'s KV of the prefix
        ``prefix_id`` (Mamba: whose state is that prefix's). Example: after
        ``write(0, 7, 3, h)`` in a bs-4 group, ``blocks_ending(0, h) == {7}``."""
        return self._ends.get((group_id, prefix_id), set())

    def read(self, group_id: int, block_id: int, offset: int) -> SlotContent | None:
        key = self._key(group_id, block_id)
        if offset < 0:
            return self._states.get(key)
        groups = self._groups.get(key)
        if groups is None or offset >= len(groups) or groups[offset] is None:
            return None
        return SlotContent(groups[offset], self._prefixes[key][offset])

    def holds(self, group_id: int, block_id: int, offset: int, prefix_id: int) -> bool:
        return self.read(group_id, block_id, offset) == SlotContent(group_id, prefix_id)

    def holds_run(
        self,
        group_id: int,
        block_id: int,
        offset: int,
        ids: Sequence[int],
        start: int,
        stop: int,
    ) -> bool:
        """Whether slots ``offset ..`` of the block hold group ``group_id``'s KV of
        ``ids[start:stop]``: ``holds(group_id, block_id, offset + i, ids[start + i])``
        for every ``i``, as one comparison of lists. Example: after ``write_run(0, 7, 0,
        ids[4:8])``, ``holds_run(0, 7, 1, ids, 5, 8)`` is True."""
        if stop > len(ids) or offset < 0:  # the slot by slot form (it reads ids[stop - 1])
            return all(
                self.holds(group_id, block_id, offset + i, ids[p])
                for i, p in enumerate(range(start, stop))
            )
        n = stop - start
        if n <= 0:
            return True
        key = self._key(group_id, block_id)
        prefixes = self._prefixes.get(key)
        if prefixes is None or len(prefixes) < offset + n:
            return False
        wanted = ids[start:stop]
        if type(wanted) is not list:
            wanted = list(wanted)
        return (
            prefixes[offset : offset + n] == wanted
            and self._groups[key][offset : offset + n] == [group_id] * n
        )


def missing_context(
    layout: KVCacheLayout,
    shadow: ShadowCache,
    group_id: int,
    table: Sequence[int],
    ids: Sequence[int],
    start: int,
    end: int,
) -> str | None:
    """Why ``table`` cannot serve positions ``[start, end)`` of the prefix ``ids``
    for group ``group_id`` (attention: every slot; Mamba: the state at ``end``);
    None when it can."""
    spec = layout.groups[group_id].spec
    bs = spec.block_size
    if isinstance(spec, MambaSpec):
        if end == 0:
            return None
        col = cdiv(end, bs) - 1
        if col >= len(table) or table[col] == 0:
            return f"state column {col} (prefix of {end} tokens) is null or missing"
        if not shadow.holds(group_id, table[col], -1, ids[end - 1]):
            got = describe_content(shadow.read(group_id, table[col], -1), group_id, ids)
            return (
                f"block {table[col]} (column {col}) does not hold the state of "
                f"{token_range(end)} of this request (it holds {got})"
            )
        return None
    p = start
    while p < end:  # block by block: one comparison of lists per block
        idx = p // bs
        if idx >= len(table) or table[idx] == 0:
            return f"position {p} (block index {idx}) is null or missing in the table"
        stop = min(end, (idx + 1) * bs)
        if not shadow.holds_run(group_id, table[idx], p % bs, ids, p, stop):
            for q in range(p, stop):  # the first slot that differs
                if not shadow.holds(group_id, table[idx], q % bs, ids[q]):
                    got = describe_content(shadow.read(group_id, table[idx], q % bs), group_id, ids)
                    return (
                        f"block {table[idx]} slot {q % bs} (position {q}) holds {got}, not "
                        f"the KV of this request's {token_range(q + 1)}"
                    )
        p = stop
    return None


def describe_content(content: SlotContent | None, group_id: int, ids: Sequence[int]) -> str:
    """What a slot holds, as a token range, never a hash: relative to the request being
    checked (``ids``: its prefix ids). Example: a slot written with ``ids[5]`` of the
    same request, group 0 -> ``"the KV of this request's tokens [0, 6)"``."""
    if content is None:
        return "nothing (never written)"
    if content.prefix_id == OVERWRITTEN:
        return "the KV of a rejected draft token (rolled back)"
    where = "" if content.group_id == group_id else f" of group {content.group_id}"
    try:
        p = list(ids).index(content.prefix_id)
    except ValueError:
        return f"the KV{where} of a prefix this request does not share"
    return f"the KV{where} of this request's {token_range(p + 1)}"


def blocks_needed_for_hit(spec: KVCacheSpec, length: int) -> range:
    """Block indices whose cached blocks a hit of ``length`` (a multiple of bs) needs.

    Full: every block before ``length``. Chunked: from the block holding the current
    chunk's start. Mamba: the state block ending at ``length``. Sliding window: the
    ``max(1, cdiv(w - 1, bs))`` blocks ending at ``length`` (fewer when that reaches
    block 0): vLLM 0.33 ends every sliding-window hit on a cached block, so even
    ``w = 1`` needs one. Example: w 5, bs 2, L 8 -> blocks 2, 3.
    """
    bs = spec.block_size
    end = length // bs
    if isinstance(spec, SlidingWindowSpec):
        need = max(1, cdiv(spec.sliding_window - 1, bs))
        return range(max(0, end - need), end)
    if isinstance(spec, MambaSpec):
        return range(end - 1, end)
    return range(spec.hit_context_start(length) // bs, end)


def brute_force_longest_hit(
    layout: KVCacheLayout,
    shadow: ShadowCache,
    cached: Iterable[CachedBlock],
    ids: Sequence[int],
    max_length: int,
    alignment: int,
) -> int:
    """Largest aligned ``L <= max_length`` every group can serve from cached blocks.

    A group serves ``L`` when each index of :func:`blocks_needed_for_hit` has a cached
    block of that group, registered for the prefix ending at the block's end, whose
    slots hold this request's prefix (Mamba: the state of ``tokens[0:L)``). With partial
    hits a full-attention or Mamba group also serves an ``L`` inside a block through a
    partial entry (:func:`_serves_inside_a_block`).
    """
    by_group: dict[tuple[int, int], list[int]] = {}
    for cb in cached:
        by_group.setdefault((cb.group_id, cb.num_tokens), []).append(cb.block_id)
    return _longest(
        layout, shadow, lambda gid, end: by_group.get((gid, end), ()), ids, max_length, alignment
    )


def content_bound_longest_hit(
    layout: KVCacheLayout, shadow: ShadowCache, ids: Sequence[int], max_length: int, alignment: int
) -> int:
    """An upper bound of :func:`brute_force_longest_hit` that reads no cached block:
    the same search over every block whose content could serve (its last slot holds
    the prefix ending there, :meth:`ShadowCache.blocks_ending`), cached or not. A
    cached block that serves a hit holds that prefix, so the bound is never below the
    longest servable hit; a hit at least this long needs no read of the cached blocks.
    Example: nothing written yet gives 0 for any request."""

    def candidates(gid: int, end: int) -> set[int]:
        return shadow.blocks_ending(gid, ids[end - 1])

    return _longest(layout, shadow, candidates, ids, max_length, alignment)


def _longest(
    layout: KVCacheLayout,
    shadow: ShadowCache,
    candidates: Callable[[int, int], Iterable[int]],
    ids: Sequence[int],
    max_length: int,
    alignment: int,
) -> int:
    """The longest aligned hit every group serves, each block index's candidate blocks
    given by ``candidates(group, end of the block in tokens)``."""
    partial = layout.partial_hits_enabled
    cacheable = [gid for gid, g in enumerate(layout.groups) if g.spec.prefix_cacheable]
    for length in range(max_length // alignment * alignment, 0, -alignment):
        if all(
            _group_serves(layout.groups[gid].spec, shadow, candidates, gid, ids, length, partial)
            for gid in cacheable
        ):
            return length
    return 0


def _group_serves(
    spec: KVCacheSpec,
    shadow: ShadowCache,
    candidates_of: Callable[[int, int], Iterable[int]],
    gid: int,
    ids: Sequence[int],
    length: int,
    partial: bool = False,
) -> bool:
    bs = spec.block_size
    if length % bs:
        if not partial or not isinstance(spec, (FullAttentionSpec, MambaSpec)):
            return False
        return _serves_inside_a_block(spec, shadow, candidates_of, gid, ids, length)
    for i in blocks_needed_for_hit(spec, length):
        candidates = candidates_of(gid, (i + 1) * bs)
        if isinstance(spec, MambaSpec):
            ok = any(shadow.holds(gid, b, -1, ids[length - 1]) for b in candidates)
        else:
            ok = any(shadow.holds_run(gid, b, 0, ids, i * bs, (i + 1) * bs) for b in candidates)
        if not ok:
            return False
    return True


def _serves_inside_a_block(
    spec: KVCacheSpec,
    shadow: ShadowCache,
    candidates_of: Callable[[int, int], Iterable[int]],
    gid: int,
    ids: Sequence[int],
    length: int,
) -> bool:
    """A full-attention or Mamba group serving a hit that ends inside a block (partial
    hits): the block holding ``length`` must be cached for exactly ``length`` tokens (a
    partial entry) and hold the request's prefix there (Mamba: the state of ``length``
    tokens; full attention: its slots before ``length``, every earlier block cached in
    full as usual). Example: full bs 8, L 12: block 0 cached for 8 tokens, a block cached
    for 12 tokens whose slots 0..3 hold positions 8..11."""
    bs = spec.block_size
    last = length // bs
    candidates = candidates_of(gid, length)
    if isinstance(spec, MambaSpec):
        return any(shadow.holds(gid, b, -1, ids[length - 1]) for b in candidates)
    if not any(
        all(shadow.holds(gid, b, p % bs, ids[p]) for p in range(last * bs, length))
        for b in candidates
    ):
        return False
    return all(
        any(
            all(shadow.holds(gid, b, p % bs, ids[p]) for p in range(i * bs, (i + 1) * bs))
            for b in candidates_of(gid, (i + 1) * bs)
        )
        for i in range(last)
    )
