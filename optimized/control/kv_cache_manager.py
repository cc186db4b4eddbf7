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
from optimized.control.compiled_decode import LoudPass, compiled_pass
from optimized.control.coordinator import DEFAULT_MAX_NUM_REQS, make_coordinator
from optimized.control.managers.mamba import MambaManager
from optimized.control.request import Request
from optimized.control.uniformity import row_index
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
_REQUEST_COMPUTED = attrgetter("num_computed_tokens")
_REQUEST_TOKENS = attrgetter("num_tokens")
#: :meth:`KVCacheManager._admit_compiled`'s answer when the Python paths must decide
_NOT_ADMITTED = object()
#: the methods whose rules the compiled pass applies in their place
_LOUD_RULES = ("_apply_loud", "_apply_loud_batch", "_refresh_thresholds", "_least_thresholds")


def _overrides_loud_rules(cls: type) -> bool:
    """Does ``cls`` (a :class:`KVCacheManager`) change a rule of the loud items? Then the
    compiled pass stays off and its Python methods run."""
    return any(getattr(cls, name) is not getattr(KVCacheManager, name) for name in _LOUD_RULES)


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

    ``compiled``: where numba is installed, the loud items of a decode step (and a
    running request's chunk among them) go through the compiled pass of
    :mod:`optimized.control.compiled_decode` when every group is of a kind it knows
    (Mamba included; then ``min_batched_apply`` only matters for other steps), a new
    request's admission (no Mamba group) through :mod:`optimized.control.
    compiled_admission`, the pool keeps its keys in arrays
    (:mod:`optimized.control.key_index`), pops and frees rows through
    :mod:`optimized.control.compiled_pool`; False keeps the numpy paths and dicts (tests
    of those paths).
    """

    #: Fewer working items than this go through ``allocate_slots`` (see the class docstring).
    min_batched_apply: int = 8

    def __init__(
        self,
        layout: KVCacheLayout,
        max_num_reqs: int = DEFAULT_MAX_NUM_REQS,
        compiled: bool = True,
    ) -> None:
        self.layout = layout
        self.max_model_len = layout.max_model_len
        self.enable_caching = layout.enable_caching
        self.coordinator = make_coordinator(layout, max_num_reqs, compiled)
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
        #: the first group of each class of twins (``_twin_of[g] == g``)
        self._class_reps = [g for g, t in enumerate(self._twin_of) if t == g]
        #: set by ``_gather`` for the step being planned: its request ids, and whether all
        #: of its requests were already running
        self._step_ids: list[str] = []
        self._all_running = False
        #: per row, the decode threshold (:meth:`_refresh_thresholds`; 0: test the row);
        #: a list: read and written an int at a time
        self._next_work: list[int] = [0] * max_num_reqs
        self._all_groups = tuple(range(self.num_groups))
        #: the loud items' compiled pass (:mod:`optimized.control.compiled_decode`), or None:
        #: numba missing, a group it does not know, or a subclass changing the rules it
        #: compiles (the Python paths apply them)
        self._compiled = (
            LoudPass(self)
            if compiled and compiled_pass is not None and not _overrides_loud_rules(type(self))
            else None
        )
        #: the rows of the step :meth:`_loud_items` last looked at
        self._step_rows: list[int] = []
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
        return ComputedBlocks(tuple(map(tuple, blocks))), hit

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
        took_row = row is None  # (a row taken here gets its decode threshold at the end)
        if took_row and self._compiled is not None and self._compiled.admits():
            admitted = self._admit_compiled(
                request, new_computed_blocks, hits, local, total, slots, num_new_tokens
            )
            if admitted is not _NOT_ADMITTED:
                return admitted
        # a fresh row, empty or holding an adopted hit: its new blocks are cached from a list
        fresh = False
        if row is None and coordinator.plain_counts and not any(hits):
            # a request with no blocks and no hit: nothing to remove, the count needs no
            # row, and a refusal (the pool cannot hold it) takes none
            need = coordinator.num_blocks_for_new_request(slots, local)
            self.last_num_blocks_to_allocate = need
            if need > self.block_pool.get_num_free_blocks():
                return None
            row = self._take_row(rid)
            fresh = True
        elif row is None and coordinator.plain_hits and new_computed_blocks is not None:
            # a new request adopting a hit: counted and prepared at once, adopted on a
            # fresh row (the row is taken first, as below)
            row = self._take_row(rid)
            need, admission = coordinator.count_hit_admission(hits, slots, local)
            self.last_num_blocks_to_allocate = need
            if need > self.block_pool.get_num_free_blocks():
                return None
            coordinator.adopt_hit(row, admission)
            new_computed_blocks = None  # adopted
            fresh = True
        else:
            if row is None:  # a fresh row holds nothing to remove
                row = self._take_row(rid)
            else:
                coordinator.remove_skipped_blocks(row, total)
            need = coordinator.get_num_blocks_to_allocate(row, slots, hits, local, main)
            self.last_num_blocks_to_allocate = need
            if need > self.block_pool.get_num_free_blocks():
                return None
        if new_computed_blocks is not None and any(hits):
            coordinator.allocate_new_computed_blocks(row, hits, local)
        new_blocks, new_arrays = coordinator.allocate_new_block_arrays(row, slots, main)
        if fresh:  # the row: cached hit blocks (if any), then the new ones
            coordinator.cache_new_blocks(
                request,
                row,
                min(total + num_new_tokens, request.num_tokens),
                new_blocks,
                new_arrays,
            )
        elif self._compiled is not None and self._compiled.caches():  # one compiled call
            self._compiled.cache(request, row, min(total + num_new_tokens, request.num_tokens))
        else:
            coordinator.cache_blocks(request, row, min(total + num_new_tokens, request.num_tokens))
        if request.status is not RequestStatus.FINISHED:
            request.status = RequestStatus.RUNNING
        if took_row:  # its first decode item is then tested against the row's counts
            self._next_work[row] = self._row_threshold(row)
        return new_blocks

    def _admit_compiled(
        self,
        request: Request,
        new_computed_blocks: ComputedBlocks | None,
        hits: BlockIdLists,
        local: int,
        total: int,
        slots: int,
        num_new_tokens: int,
    ):
        """``allocate_slots`` of a request with no row through the compiled admission
        (:meth:`~optimized.control.compiled_decode.LoudPass.admit`): a new request with
        nothing computed and no hit (counted before a row is taken: a refusal takes none,
        as below), or one adopting a hit (the row taken first); else
        :data:`_NOT_ADMITTED` (the Python paths below). The same counts, queue, rows,
        keys and answer as those paths."""
        coordinator = self.coordinator
        adopt = new_computed_blocks is not None and any(hits)
        if adopt:
            if not coordinator.plain_hits:
                return _NOT_ADMITTED
            row = self._take_row(request.request_id)
        elif local == 0 and coordinator.plain_counts:
            need = coordinator.num_blocks_for_new_request(slots, local)
            self.last_num_blocks_to_allocate = need
            if need > self.block_pool.get_num_free_blocks():
                return None
            row = self._take_row(request.request_id)
        else:
            return _NOT_ADMITTED
        limit = -1
        if self.enable_caching:
            cacheable = coordinator.num_cacheable_tokens(
                min(total + num_new_tokens, request.num_tokens)
            )
            limit = min(cacheable, len(request.block_hashes) * request.hash_block_size)
        assert self._compiled is not None
        need, new_blocks = self._compiled.admit(request, row, hits, total, slots, limit, adopt)
        self.last_num_blocks_to_allocate = need
        if new_blocks is None:
            return None
        if request.status is not RequestStatus.FINISHED:
            request.status = RequestStatus.RUNNING
        return new_blocks

    def _take_row(self, request_id: str) -> int:
        """The coordinator's new row for the request, its decode threshold zeroed (the row
        may have changed hands: its items are tested until a step refreshes it)."""
        row = self.coordinator.row(request_id)
        next_work = self._next_work
        if row >= len(next_work):
            next_work.extend([0] * (self.coordinator.max_num_reqs - len(next_work)))
        next_work[row] = 0
        return row

    def _row_threshold(self, row: int) -> int:
        """The row's decode threshold: the least over the classes of twins of
        :meth:`~optimized.control.managers.base.SingleTypeKVCacheManager.
        decode_work_threshold_of`. Example: full group 48 (its next block), window group
        40 (its next drop) -> 40."""
        managers = self.coordinator.managers
        return min([managers[g].decode_work_threshold_of(row) for g in self._class_reps])

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

        A step of one-token decode items (:class:`StepBatch`) first sets aside its *quiet*
        items (:meth:`_loud_items`): a running request whose computed count is below its
        row's decode threshold (:meth:`_refresh_thresholds`) has nothing to free,
        allocate or cache, so it is settled without any per-group test; the loud ones are
        applied one by one (:meth:`_apply_loud`) or, when many, vectorised
        (:meth:`_apply_loud_batch`), and their rows' thresholds are refreshed. With the
        compiled pass, a step mixing one-token decode items with others (a prefill chunk,
        lookahead) goes through :meth:`_schedule_mixed`. Any other step goes through
        :meth:`_schedule_items`. Example: 27 decode items on gemma3 of which 3 reach a
        block boundary: the 24 others are settled in one pass.
        """
        self.last_num_blocks_to_allocate = None  # batched items report none
        loud = self._loud_items(items) if isinstance(items, StepBatch) else None
        if loud is None:
            mixed = (
                self._mixed_items(items)
                if isinstance(items, StepBatch)
                and self._compiled is not None
                and self._compiled.usable()
                else None
            )
            if mixed is None:
                return self._schedule_items(items)
            return self._schedule_mixed(items, *mixed)
        n = len(items)
        step_ids, rows = self._step_ids, self._step_rows
        if not loud:
            self._known.update(step_ids)  # all running: settling records the ids
            return [self.no_new_blocks] * n
        requests = items.requests
        m = len(loud)
        loud_rows = [rows[i] for i in loud]
        if self._compiled is not None and self._compiled.usable():
            sub = self._compiled.apply(requests, loud, loud_rows)
        elif m < self.min_batched_apply:
            sub = self._apply_loud(requests, loud, loud_rows)
        else:
            picked = [requests[i] for i in loud]
            at = np.array(loud_rows, dtype=np.int64)
            sub = self._apply_loud_batch(picked, at)
            if sub is None:  # refused (nothing changed): one by one
                sub = self._apply_loud(requests, loud, loud_rows)
            else:
                self._refresh_thresholds(at)
        if len(sub) == n:  # every item loud and applied (the first step of a batch)
            self._known.update(step_ids)
            return sub
        results: list[list[list[int]] | None] = [self.no_new_blocks] * n
        for i, new_blocks in zip(loud, sub):
            results[i] = new_blocks
        stop = loud[len(sub) - 1] + 1 if sub and sub[-1] is None else n
        self._known.update(step_ids[:stop])
        return results if stop == n else results[:stop]

    def _loud_items(self, items: StepBatch) -> list[int] | None:
        """The items of a step of one-token decode items on running requests that hold
        rows whose computed count reaches their row's threshold (the others are quiet), or
        None when the step is not such a step or some item is invalid
        (:meth:`_schedule_items` then decides, and raises the error). One pass in Python
        over the items (no array is built). Sets ``_step_ids`` and ``_step_rows``.
        Example: computed ``[30, 47]``, thresholds ``[47, 47]`` -> ``[1]``.
        """
        if not self._per_group_apply and not (
            self._compiled is not None and self._compiled.usable()
        ):
            return None  # Mamba: only the compiled pass applies its loud items
        requests = items.requests
        n = len(requests)
        new, ahead = items.num_new_tokens, items.num_lookahead_tokens
        if not (n and isinstance(new, list) and isinstance(ahead, list)):
            return None
        if new.count(1) != n or ahead.count(0) != n:
            return None
        if list(map(_REQUEST_STATUS, requests)).count(RequestStatus.RUNNING) != n:
            return None
        rids = list(map(_REQUEST_ID, requests))
        rows = list(map(self.coordinator.row_of.get, rids))
        if None in rows or len(set(rows)) != n:  # (distinct ids hold distinct rows)
            return None
        next_work = self._next_work
        if len(next_work) < self.coordinator.max_num_reqs:
            next_work.extend([0] * (self.coordinator.max_num_reqs - len(next_work)))
        mml = self.max_model_len
        loud: list[int] = []
        for i, request, row in zip(range(n), requests, rows):
            computed = request.num_computed_tokens
            num_tokens = request.num_tokens
            if computed >= num_tokens or num_tokens > mml:
                return None  # an invalid item: the general path raises its error
            if computed >= next_work[row]:
                loud.append(i)
        self._step_ids, self._step_rows = rids, rows
        return loud

    def _mixed_items(self, items: StepBatch) -> tuple[list[int], list[int]] | None:
        """A step's items as ``(loud, other)``: the items of running requests holding rows
        that the compiled pass applies (a one-token decode item that reaches its row's
        threshold, as :meth:`_loud_items`: the rest of those are quiet; a prefill chunk or
        an item with lookahead, always), and every other item (a request with no row or
        not running), in order; or None when some item is invalid or a request repeats
        (:meth:`_schedule_items` then raises the first error before anything changes).
        Sets ``_step_ids`` and ``_step_rows``. Example: a new request's chunk, a running
        request's chunk of 512 tokens, then decode items at computed ``[30, 47]`` with
        thresholds ``[47, 47]`` -> ``([1, 3], [0])``."""
        requests = items.requests
        n = len(requests)
        new, ahead = items.num_new_tokens, items.num_lookahead_tokens
        if not (n and isinstance(new, list) and isinstance(ahead, list)):
            return None
        rids = list(map(_REQUEST_ID, requests))
        if len(set(rids)) != n:
            return None
        rows = list(map(self.coordinator.row_of.get, rids))
        next_work = self._next_work
        if len(next_work) < self.coordinator.max_num_reqs:
            next_work.extend([0] * (self.coordinator.max_num_reqs - len(next_work)))
        mml = self.max_model_len
        running, finished = RequestStatus.RUNNING, RequestStatus.FINISHED
        loud: list[int] = []
        other: list[int] = []
        for i, request, k, la, row in zip(range(n), requests, new, ahead, rows):
            status = request.status
            computed = request.num_computed_tokens
            num_tokens = request.num_tokens
            if (
                status is finished
                or k < 1
                or la < 0
                or computed + k > num_tokens
                or num_tokens > mml
            ):
                return None  # an invalid item: the general path raises its error
            if row is None or status is not running:
                other.append(i)
            elif k != 1 or la != 0 or computed >= next_work[row]:
                loud.append(i)
        self._step_ids, self._step_rows = rids, rows
        return loud, other

    def _schedule_mixed(
        self, items: StepBatch, loud: list[int], other: list[int]
    ) -> list[list[list[int]] | None]:
        """:meth:`schedule_step` of a step that :meth:`_mixed_items` split: the items in
        order, each run of loud items between two others through the compiled pass in
        one call (a chunk among them: the pass applies any running request's item), each
        other item through ``allocate_slots``, the quiet ones settled; stops after the
        first None. Exact: a quiet item changes nothing wherever it stands, and the
        others keep their places among the loud ones. Example: loud ``[1, 2]``, other
        ``[0, 3]`` -> ``allocate_slots`` of 0, the pass on 1 and 2, ``allocate_slots``
        of 3."""
        n = len(items)
        requests, new, ahead = items.requests, items.num_new_tokens, items.num_lookahead_tokens
        rows = self._step_rows
        step_ids = self._step_ids
        assert self._compiled is not None
        pass_apply = self._compiled.apply

        def apply(requests, batch, batch_rows):
            return pass_apply(requests, batch, batch_rows, new, ahead)

        results: list[list[list[int]] | None] = [self.no_new_blocks] * n
        stop = n
        batch: list[int] = []
        others = iter(other)
        after = next(others, n)  # the next other item
        for i in [*loud, n]:
            while after < i:  # the loud items before it, then it
                if batch:
                    sub = apply(requests, batch, [rows[k] for k in batch])
                    for k, new_blocks in zip(batch, sub):
                        results[k] = new_blocks
                    if sub and sub[-1] is None:
                        stop = batch[len(sub) - 1] + 1
                        break
                    batch = []
                new_blocks = self.allocate_slots(requests[after], new[after], 0, None, ahead[after])
                results[after] = new_blocks
                if new_blocks is None:
                    stop = after + 1
                    break
                after = next(others, n)
            if stop < n:
                break
            if i < n:
                batch.append(i)
        if stop == n and batch:
            sub = apply(requests, batch, [rows[k] for k in batch])
            for k, new_blocks in zip(batch, sub):
                results[k] = new_blocks
            if sub and sub[-1] is None:
                stop = batch[len(sub) - 1] + 1
        self.last_num_blocks_to_allocate = None
        self._known.update(step_ids[:stop])
        return results if stop == n else results[:stop]

    def _apply_loud(
        self, requests: Sequence[Request], picked: list[int], rows: list[int]
    ) -> list[list[list[int]] | None]:
        """A few loud items (validated by :meth:`_loud_items`: one new token, no hit, a
        row) applied one by one in order through :func:`apply_decode_item` on every group
        (a group with nothing to do frees, allocates and caches nothing there), or, with a
        Mamba group (its own rules), through ``allocate_slots``, stopping after the first
        None; each row's threshold is refreshed after its item, one int per class of
        twins. Example: 2 loud items, the first crossing a block boundary in a full pool
        -> ``[None]``."""
        groups = self._all_groups
        next_work = self._next_work
        mml = self.max_model_len
        cacheable = self.coordinator.num_cacheable_tokens
        out: list[list[list[int]] | None] = []
        for i, row in zip(picked, rows):
            request = requests[i]
            if self._per_group_apply:
                total = request.num_computed_tokens
                main = total + 1
                cache_tokens = cacheable(min(main, request.num_tokens))
                new_blocks = apply_decode_item(
                    self, request, row, total, main, min(main, mml), cache_tokens, groups
                )
            else:  # a Mamba group (its own rules): allocate_slots itself
                new_blocks = self.allocate_slots(request, 1)
            next_work[row] = self._row_threshold(row)
            out.append(new_blocks)
            if new_blocks is None:
                break
        return out

    def _apply_loud_batch(
        self, requests: list[Request], rows: np.ndarray
    ) -> list[list[list[int]]] | None:
        """Many loud items (validated by :meth:`_loud_items`) through
        :func:`apply_decode_items` directly, with no per-group test first (an item with
        nothing to do frees, allocates and caches nothing there), or None when its
        conditions fail (nothing changed). Example: the first decode step of 64 requests
        prefilled together, every window dropping its blocks at once."""
        m = len(requests)
        computed = np.fromiter(map(_REQUEST_COMPUTED, requests), np.int64, m)
        num_tokens = np.fromiter(map(_REQUEST_TOKENS, requests), np.int64, m)
        main = computed + 1
        return apply_decode_items(
            self,
            requests,
            rows,
            computed,
            np.minimum(main, self.max_model_len),
            np.minimum(main, num_tokens),
        )

    def _refresh_thresholds(self, rows: np.ndarray) -> None:
        """Each row's decode threshold (:meth:`_least_thresholds`). It stays a lower bound
        while the row's request holds it (counts only grow); ``allocate_slots`` zeroes it
        (a row may change hands there)."""
        least = self._least_thresholds(rows)
        next_work = self._next_work
        at = row_index(rows)
        if isinstance(at, slice):  # (a batch prefilled together holds consecutive rows)
            next_work[at] = least.tolist()
            return
        for row, value in zip(rows.tolist(), least.tolist()):
            next_work[row] = value

    def _least_thresholds(self, rows: np.ndarray) -> np.ndarray:
        """Per row, the least over its groups' classes of :meth:`~optimized.control.
        managers.base.SingleTypeKVCacheManager.decode_work_threshold`: the first count at
        which some group has work. Example: full group 48 (its next block), window group
        40 (its next drop) -> 40."""
        managers = self.coordinator.managers
        least = None
        for g in self._class_reps:
            t = managers[g].decode_work_threshold(rows)
            least = t if least is None else np.minimum(least, t)
        return least

    def _schedule_items(self, items: Sequence[StepItem]) -> list[list[list[int]] | None]:
        """:meth:`schedule_step` without the quiet items' shortcut.

        An item that gets no block reads :attr:`no_new_blocks` (empty tuples, shared);
        the others get lists as ``allocate_slots`` returns them.

        Stops after the first ``None`` (the scheduler preempts before going on): the
        returned list then ends with that ``None`` and the later items are not applied.
        Every item is validated first (a bad item raises before anything changes); a
        request may appear at most once per call.
        """
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
        after the ones before it are freed, as the successive calls would (the ids are
        checked at once; only a batch with a bad id goes id by id). Example:
        ``free_requests([a, b])`` leaves the state of ``free(a); free(b)``."""
        ids = list(map(_REQUEST_ID, requests))
        known = self._known
        if len(set(ids)) == len(ids) and known.issuperset(ids):
            known.difference_update(ids)
            self.coordinator.free_many(ids)
            return
        freed: list[str] = []
        try:
            for request_id in ids:
                self._forget(request_id)
                freed.append(request_id)
        finally:
            self.coordinator.free_many(freed)

    # -- views -----------------------------------------------------------------
    def get_blocks(self, request_id: str) -> list[list[int]]:
        return self.coordinator.get_blocks(request_id)

    def get_block_ids(self, request_id: str) -> BlockIdLists:
        """The request's table per group; null entries read 0."""
        return tuple(tuple(g) for g in self.coordinator.get_blocks(request_id))
