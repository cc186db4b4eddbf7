"""The request-level API of the optimized manager, and the batched scheduler step.

Per-request calls follow :mod:`reference.kv_cache_manager` rule for rule (``allocate_slots``:
validate, ``total = min(computed + hit, max_model_len)``, free out-of-window blocks first,
``need > free`` -> None, adopt the hit, allocate, cache). Blocks are plain ids (0 = null).

:meth:`KVCacheManager.schedule_step` plans a whole step: it takes ``(request,
num_new_tokens, hit, lookahead)`` items and returns exactly what ``allocate_slots`` called
on each item in order would return, leaving the same state. The common decode case is
vectorised: for every item with no hit on a request that already has a row, each group's
``pending_work`` test (numpy over all such rows at once) tells whether the call would free,
allocate or cache anything; most decode items do nothing in a given step (one in
``block_size`` crosses a block boundary) and are settled without touching the pool. The
other items go through ``allocate_slots`` in order. This is exact because skipping an item
with no work changes nothing, and an item's work can only make later items' tests stricter
(rows are private; a shared block's key can only grow while it is held).

Example: 4 decode items, bs 16, computed tokens 31, 40, 47, 100 (one new token each, full
attention, rows covering 32, 48, 48, 112 slots): only the first needs a block -> one
``allocate_slots`` call; the others get ``[[]]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from optimized.control.batched_decode import apply_decode_item, apply_decode_items
from optimized.control.coordinator import DEFAULT_MAX_NUM_REQS, make_coordinator
from optimized.control.managers.mamba import MambaManager
from optimized.control.request import Request
from reference.errors import InvalidRequestError
from reference.kv_cache_manager import (
    ManagerBookkeeping,
    PrefixCacheStats,
    check_prompt_length,
    junction,
)
from reference.layout import KVCacheLayout
from reference.request import RequestStatus

BlockIdLists = tuple[tuple[int, ...], ...]

_REQUEST_ID = attrgetter("request_id")
_REQUEST_STATUS = attrgetter("status")


#: computed, tokens and prompt tokens of a request, for ``_gather`` (one column each: no
#: per-request tuple)
_REQUEST_INTS = tuple(
    attrgetter(name) for name in ("num_computed_tokens", "num_tokens", "num_prompt_tokens")
)
_REQUEST_HASHES = attrgetter("block_hashes")


@dataclass(frozen=True)
class ComputedBlocks:
    """A prefix hit: block ids per group (0 where a group no longer needs the tokens)."""

    blocks: BlockIdLists

    def block_ids(self) -> BlockIdLists:
        return self.blocks


class StepItem(NamedTuple):
    """One request's share of a scheduler step (the arguments of ``allocate_slots``)."""

    request: Request
    num_new_tokens: int
    num_new_computed_tokens: int = 0
    new_computed_blocks: ComputedBlocks | None = None
    num_lookahead_tokens: int = 0


class StepBatch(Sequence):
    """The items of a step with no prefix hits, held as columns (what
    :meth:`KVCacheManager.schedule_columns` takes): item ``i`` is ``StepItem(requests[i],
    num_new_tokens[i], 0, None, num_lookahead_tokens[i])``, built only when asked for, so a
    large decode step allocates no per-item object. Example: ``StepBatch([a, b], [1, 1],
    [0, 0])[1] == StepItem(b, 1)``."""

    __slots__ = ("requests", "num_new_tokens", "num_lookahead_tokens")

    def __init__(
        self,
        requests: Sequence[Request],
        num_new_tokens: Sequence[int],
        num_lookahead_tokens: Sequence[int],
    ) -> None:
        if not len(requests) == len(num_new_tokens) == len(num_lookahead_tokens):
            raise InvalidRequestError(
                f"StepBatch: columns of unequal lengths {len(requests)}, "
                f"{len(num_new_tokens)}, {len(num_lookahead_tokens)}"
            )
        self.requests = requests
        self.num_new_tokens = num_new_tokens
        self.num_lookahead_tokens = num_lookahead_tokens

    def __len__(self) -> int:
        return len(self.requests)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return StepItem(
            self.requests[i], self.num_new_tokens[i], 0, None, self.num_lookahead_tokens[i]
        )


class KVCacheManager(ManagerBookkeeping):
    """The optimized hybrid KV cache manager (same policy as the reference).

    ``min_batched_apply``: a decode step whose working items (those
    ``pending_work`` flags) number fewer than this applies them one by one through
    ``allocate_slots`` (exact by definition) instead of :func:`apply_decode_items`, whose
    fixed cost of some dozens of numpy calls per group only pays off for many items.
    Example: 30 decode items on 6 groups, bs 16: about 2 cross a block boundary in a
    step, so two ``allocate_slots`` calls beat one vectorised pass.
    """

    #: Fewer working items than this go through ``allocate_slots`` (see the class docstring).
    min_batched_apply: int = 8

    def __init__(self, layout: KVCacheLayout, max_num_reqs: int = DEFAULT_MAX_NUM_REQS) -> None:
        self.layout = layout
        self.max_model_len = layout.max_model_len
        self.enable_caching = layout.enable_caching
        self.coordinator = make_coordinator(layout, max_num_reqs)
        self.block_pool = self.coordinator.block_pool
        self.num_groups = len(layout.groups)
        self.stats = PrefixCacheStats()
        self._scheduler_block_size = layout.scheduler_block_size
        #: Working decode items may go through ``apply_decode_item`` (no Mamba group).
        self._per_group_apply = not any(
            isinstance(m, MambaManager) for m in self.coordinator.managers
        )
        self._known: set[str] = set()
        #: per group, the first group of the same manager class and spec. Such groups get
        #: the same calls with the same counts (hit lengths, allocations, frees, caching
        #: masks depend on the spec only), so their rows hold the same lengths, leading
        #: nulls and cached counts, and ``pending_work`` is computed once for them. Example:
        #: gemma3 (full + 5 identical windows) -> ``[0, 1, 1, 1, 1, 1]``.
        managers = self.coordinator.managers
        self._twin_of: tuple[int, ...] = tuple(
            next(
                k
                for k in range(g + 1)
                if type(managers[k]) is type(m) and managers[k].spec == m.spec
            )
            for g, m in enumerate(managers)
        )
        #: set by ``_gather`` for the step being planned: its request ids, and whether all
        #: of its requests were already running
        self._step_ids: list[str] = []
        self._all_running = False
        #: the blocks the last ``allocate_slots`` estimated it needed (None: it returned
        #: before estimating; not a per-item figure after a batched ``schedule_step``)
        self.last_num_blocks_to_allocate: int | None = None
        self._empty = ComputedBlocks(tuple(() for _ in range(self.num_groups)))
        #: ``schedule_step``'s result for an item that gets no new block (shared, immutable).
        self.no_new_blocks: tuple[tuple[int, ...], ...] = tuple(() for _ in layout.groups)

    # -- requests --------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt_token_ids,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> Request:
        check_prompt_length(request_id, len(prompt_token_ids), self.max_model_len)
        return Request(
            request_id, prompt_token_ids, self.layout.hash_block_size, cache_salt, lora_name
        )

    # -- lookup ----------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[ComputedBlocks, int]:
        """Longest prefix hit ``<= num_tokens - 1`` every group can serve; the pool is
        untouched. Records the junction on the request as the reference does
        (:meth:`reference.kv_cache_manager.KVCacheManager.get_computed_blocks`):
        ``shared_prefix_boundary = hit + uncached`` when some group caches more, else 0."""
        if not self.enable_caching:
            request.shared_prefix_boundary = 0
            return self._empty, 0
        blocks, hit, uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        request.shared_prefix_boundary = junction(hit, uncached)
        if not hit and not any(blocks):  # a miss: the shared empty hit
            return self._empty, 0
        return ComputedBlocks(tuple(tuple(b) for b in blocks)), hit

    def empty_computed_blocks(self) -> ComputedBlocks:
        return self._empty

    # -- allocation ------------------------------------------------------------
    def _validate(
        self, request: Request, new: int, hit_tokens: int, lookahead: int, hits: BlockIdLists
    ) -> None:
        rid = request.request_id
        if request.is_finished:
            raise InvalidRequestError(f"allocate_slots: request {rid!r} is finished")
        if new < 0 or hit_tokens < 0 or lookahead < 0:
            raise InvalidRequestError(
                f"allocate_slots({rid!r}): token counts must be >= 0, got num_new_tokens="
                f"{new}, num_new_computed_tokens={hit_tokens}, "
                f"num_lookahead_tokens={lookahead}"
            )
        if new == 0 and hit_tokens == 0:
            raise InvalidRequestError(
                f"allocate_slots({rid!r}): num_new_tokens must be > 0 when there is no "
                f"prefix hit to adopt, got {new}"
            )
        if (
            request.num_computed_tokens + hit_tokens + new > request.num_tokens
            or request.num_tokens > self.max_model_len
        ):
            raise InvalidRequestError(
                f"allocate_slots({rid!r}): computed {request.num_computed_tokens} + hit "
                f"{hit_tokens} + new {new} exceeds the request's "
                f"{request.num_tokens} tokens (max_model_len {self.max_model_len})"
            )
        if len(hits) != self.num_groups:
            raise InvalidRequestError(
                f"allocate_slots({rid!r}): new_computed_blocks has {len(hits)} groups, "
                f"the layout has {self.num_groups}"
            )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[list[int]] | None:
        """:meth:`reference.kv_cache_manager.KVCacheManager.allocate_slots` on block ids."""
        self.last_num_blocks_to_allocate = None
        hits = (new_computed_blocks or self._empty).blocks
        self._validate(request, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, hits)
        rid = request.request_id
        self._known.add(rid)
        coordinator = self.coordinator
        local = request.num_computed_tokens + num_new_computed_tokens
        total = min(local, self.max_model_len)
        main = total + num_new_tokens
        slots = min(main + num_lookahead_tokens, self.max_model_len)

        row = coordinator.row_of.get(rid)
        if row is None and coordinator.plain_counts and not any(hits):
            # a request with no blocks and no hit: nothing to remove, the count needs no
            # row, and a refusal (the pool cannot hold it) takes none
            need = coordinator.num_blocks_for_new_request(slots, local)
            self.last_num_blocks_to_allocate = need
            if need > self.block_pool.get_num_free_blocks():
                return None
            row = coordinator.row(rid)
        else:
            if row is None:  # a fresh row holds nothing to remove
                row = coordinator.row(rid)
            else:
                coordinator.remove_skipped_blocks(row, total)
            need = coordinator.get_num_blocks_to_allocate(row, slots, hits, local, main)
            self.last_num_blocks_to_allocate = need
            if need > self.block_pool.get_num_free_blocks():
                return None
        if new_computed_blocks is not None and any(hits):
            coordinator.allocate_new_computed_blocks(row, hits, local)
        new_blocks = coordinator.allocate_new_blocks(row, slots, main)
        coordinator.cache_blocks(request, row, min(total + num_new_tokens, request.num_tokens))
        if request.status is not RequestStatus.FINISHED:
            request.status = RequestStatus.RUNNING
        return new_blocks

    def schedule_columns(
        self,
        requests: Sequence[Request],
        num_new_tokens: Sequence[int],
        num_lookahead_tokens: Sequence[int],
    ) -> list[list[list[int]] | None]:
        """:meth:`schedule_step` of the hit-free items given as columns (:class:`StepBatch`):
        the scheduler's running requests, with no per-item tuple built."""
        return self.schedule_step(StepBatch(requests, num_new_tokens, num_lookahead_tokens))

    def schedule_step(self, items: Sequence[StepItem]) -> list[list[list[int]] | None]:
        """``allocate_slots(*item)`` for each item in order, decode case vectorised.

        An item that gets no block reads :attr:`no_new_blocks` (empty tuples, shared);
        the others get lists as ``allocate_slots`` returns them.

        Stops after the first ``None`` (the scheduler preempts before going on): the
        returned list then ends with that ``None`` and the later items are not applied.
        Every item is validated first (a bad item raises before anything changes); a
        request may appear at most once per call.
        """
        self.last_num_blocks_to_allocate = None  # batched items report none
        n = len(items)
        fast_idx, gathered, requests = self._gather(items)
        idle = np.zeros(n, dtype=bool)
        single: dict[int, tuple] = {}
        if fast_idx:
            row_arr = gathered[0]
            flags, total, main, slots, cache_tokens, raw_cache_tokens = self._pending_work(gathered)
            work = flags.any(axis=0)
            busy = np.flatnonzero(work)
            if len(fast_idx) == n and not busy.size:
                self._settle_idle_all(requests)
                return [self.no_new_blocks] * n
            idle[fast_idx if len(fast_idx) < n else slice(None)] = ~work
            if len(fast_idx) == n and busy.size >= self.min_batched_apply:
                applied = apply_decode_items(
                    self,
                    [requests[fast_idx[i]] for i in busy.tolist()],
                    row_arr[busy],
                    total[busy],
                    slots[busy],
                    raw_cache_tokens[busy],
                )
                if applied is not None:
                    out: list = [self.no_new_blocks] * n
                    for i, new_blocks in zip(busy.tolist(), applied):
                        out[i] = new_blocks
                    self._settle_idle_all([requests[i] for i in np.flatnonzero(~work).tolist()])
                    return out
            if self._per_group_apply:
                for k in busy.tolist():
                    single[fast_idx[k]] = (
                        int(row_arr[k]),
                        int(total[k]),
                        int(main[k]),
                        int(slots[k]),
                        int(cache_tokens[k]),
                        np.flatnonzero(flags[:, k]).tolist(),
                    )
        # working items in order (each allocate_slots' effect is its own; an idle item's
        # settling touches only its request), the idle ones before the first None together
        results: list[list[list[int]] | None] = [self.no_new_blocks] * n
        stop = n
        for i in np.flatnonzero(~idle).tolist():
            item = items[i]
            args = single.get(i)
            if args is not None:
                new_blocks = apply_decode_item(self, item.request, *args)
            else:
                new_blocks = self.allocate_slots(
                    item.request,
                    item.num_new_tokens,
                    item.num_new_computed_tokens,
                    item.new_computed_blocks,
                    item.num_lookahead_tokens,
                )
            results[i] = new_blocks
            if new_blocks is None:
                stop = i + 1
                break
        settled = np.flatnonzero(idle[:stop]).tolist()
        if settled:
            self._settle_idle_all([requests[i] for i in settled])
        return results if stop == n else results[:stop]

    def _gather(self, items: Sequence[StepItem]):
        """Validate every item (``_validate``'s rules) and gather, for the items with no hit
        on a request that has a row, the per-item numbers ``_pending_work`` needs, as int64
        arrays ``(rows, computed, new, lookahead, num_tokens, hashed tokens, boundary)``.

        Column-wise: each field of every item is read in one pass (``zip`` / ``map``) and
        tested with array ops; only when some item fails the inline test (or an id repeats)
        does :meth:`_check_items` walk the items in order for the first error (a hit passes
        ``_validate`` and is simply not gathered). Example: 3 decode items of rows 4, 0, 7
        with 1 new token each -> ``fast_idx [0, 1, 2]``, ``rows [4, 0, 7]``.
        """
        n = len(items)
        if n == 0:
            return [], tuple(np.zeros(0, dtype=np.int64) for _ in range(7)), ()
        if isinstance(items, StepBatch):
            requests, n_new, n_ahead = (
                items.requests,
                items.num_new_tokens,
                items.num_lookahead_tokens,
            )
            n_hit, hit_blocks = repeat(0, n), repeat(None, n)
        else:
            requests, n_new, n_hit, hit_blocks, n_ahead = zip(*items)
        rids = list(map(_REQUEST_ID, requests))
        computed, num_tokens, num_prompt = (
            np.fromiter(map(getter, requests), dtype=np.int64, count=n) for getter in _REQUEST_INTS
        )
        num_hashes = np.fromiter(map(len, map(_REQUEST_HASHES, requests)), np.int64, count=n)
        new = np.fromiter(n_new, dtype=np.int64, count=n)
        ahead = np.fromiter(n_ahead, dtype=np.int64, count=n)
        flagged = (
            (new < 1)
            | (ahead < 0)
            | (computed + new > num_tokens)
            | (num_tokens > self.max_model_len)
        )
        # statuses compared by identity (a set of enum members would hash each in Python)
        statuses = list(map(_REQUEST_STATUS, requests))
        if RequestStatus.FINISHED in statuses:
            flagged |= np.fromiter(
                (s is RequestStatus.FINISHED for s in statuses), dtype=bool, count=n
            )
        self._all_running = statuses.count(RequestStatus.RUNNING) == n
        self._step_ids = rids
        slow = flagged.copy()
        if not isinstance(items, StepBatch):
            flagged |= np.fromiter(n_hit, dtype=np.int64, count=n) != 0
            slow = flagged.copy()
            num_groups = self.num_groups
            for i, blocks in enumerate(hit_blocks):
                if blocks is not None:
                    if len(blocks.blocks) != num_groups:
                        flagged[i] = True
                    slow[i] |= any(blocks.blocks)
        if flagged.any() or len(set(rids)) != n:
            self._check_items(items)
        rows = np.array(list(map(self.coordinator.row_of.get, rids, repeat(-1))), dtype=np.int64)
        fast = ~slow & (rows >= 0)
        h = self.layout.hash_block_size
        boundary = np.minimum((num_prompt - 1) // h, num_hashes) * h
        columns = (rows, computed, new, ahead, num_tokens, num_hashes * h, boundary)
        if fast.all():
            return list(range(n)), columns, requests
        return np.flatnonzero(fast).tolist(), tuple(c[fast] for c in columns), requests

    def _check_items(self, items: Sequence[StepItem]) -> None:
        """Raise the first error of ``items`` in item order: an invalid item
        (:meth:`_validate`) or a request appearing a second time."""
        empty = self._empty
        seen: set[str] = set()
        for request, n_new, n_hit, hit_blocks, n_ahead in items:
            self._validate(request, n_new, n_hit, n_ahead, (hit_blocks or empty).blocks)
            rid = request.request_id
            if rid in seen:
                raise InvalidRequestError(
                    f"schedule_step: request {rid!r} appears twice in one step"
                )
            seen.add(rid)

    def _settle_idle_all(self, requests: Sequence[Request]) -> None:
        """What ``allocate_slots`` does to items with nothing to free, allocate or cache:
        record each request as known and mark it running (validated: none is finished).
        When the whole step's requests are already running (``_gather`` saw their
        statuses), only the ids are recorded."""
        running = RequestStatus.RUNNING
        if self._all_running and len(requests) == len(self._step_ids):
            self._known.update(self._step_ids)
            return
        self._known.update(map(_REQUEST_ID, requests))
        for request in requests:
            request.status = running

    def _pending_work(self, gathered: tuple[np.ndarray, ...]):
        """Per group and gathered item (no hit, has a row): would ``allocate_slots`` change
        that group (``flags[g, k]``)? Also returns the items' ``total``, ``main``,
        ``slots`` and tokens to cache (rounded as the coordinator rounds them, and raw)."""
        rows, computed, new, lookahead, num_tokens, num_hashed, boundary = gathered
        mml = self.max_model_len
        total = np.minimum(computed, mml)
        main = total + new
        slots = np.minimum(main + lookahead, mml)
        cache_tokens = raw_cache_tokens = np.minimum(main, num_tokens)
        if self.enable_caching and self.num_groups > 1:
            lcm = self._scheduler_block_size
            cache_tokens = cache_tokens // lcm * lcm  # HybridCoordinator.num_cacheable_tokens
        managers = self.coordinator.managers
        flags = np.empty((len(managers), len(rows)), dtype=bool)
        for g, twin in enumerate(self._twin_of):
            if twin < g:  # a group of the same class and spec: the same counts, the same test
                flags[g] = flags[twin]
                continue
            flags[g] = managers[g].pending_work(
                rows, total, main, slots, cache_tokens, num_hashed, boundary
            )
        return flags, total, main, slots, cache_tokens, raw_cache_tokens

    # -- freeing ---------------------------------------------------------------
    def free(self, request: Request) -> None:
        self._forget(request.request_id)
        self.coordinator.free(request.request_id)

    def free_requests(self, requests: Sequence[Request]) -> None:
        """:meth:`free` of each request in order, in one pass
        (:meth:`KVCacheCoordinator.free_many`). A request that may not be freed raises
        after the ones before it are freed, as the successive calls would. Example:
        ``free_requests([a, b])`` leaves the state of ``free(a); free(b)``."""
        ids: list[str] = []
        try:
            for request in requests:
                self._forget(request.request_id)
                ids.append(request.request_id)
        finally:
            self.coordinator.free_many(ids)

    # -- views -----------------------------------------------------------------
    def get_blocks(self, request_id: str) -> list[list[int]]:
        return self.coordinator.get_blocks(request_id)

    def get_block_ids(self, request_id: str) -> BlockIdLists:
        """The request's table per group; null entries read 0."""
        return tuple(tuple(g) for g in self.coordinator.get_blocks(request_id))
