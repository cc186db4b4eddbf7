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
from typing import NamedTuple

import numpy as np

from optimized.batched_decode import apply_decode_items
from optimized.coordinator import DEFAULT_MAX_NUM_REQS, make_coordinator
from optimized.managers.full import partial_tail_boundary
from optimized.request import Request
from reference.errors import InvalidRequestError
from reference.kv_cache_manager import PrefixCacheStats
from reference.layout import KVCacheLayout
from reference.request import RequestStatus

BlockIdLists = tuple[tuple[int, ...], ...]


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


class KVCacheManager:
    """The optimized hybrid KV cache manager (same policy as the reference)."""

    def __init__(self, layout: KVCacheLayout, max_num_reqs: int = DEFAULT_MAX_NUM_REQS) -> None:
        self.layout = layout
        self.max_model_len = layout.max_model_len
        self.enable_caching = layout.enable_caching
        self.coordinator = make_coordinator(layout, max_num_reqs)
        self.block_pool = self.coordinator.block_pool
        self.num_groups = len(layout.groups)
        self.stats = PrefixCacheStats()
        self._known: set[str] = set()
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
        if len(prompt_token_ids) > self.max_model_len:
            raise InvalidRequestError(
                f"request {request_id!r}: prompt of {len(prompt_token_ids)} tokens is longer "
                f"than max_model_len {self.max_model_len}"
            )
        return Request(
            request_id, prompt_token_ids, self.layout.hash_block_size, cache_salt, lora_name
        )

    # -- lookup ----------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[ComputedBlocks, int]:
        """Longest prefix hit ``<= num_tokens - 1`` every group can serve; no side effects."""
        if not self.enable_caching:
            return self._empty, 0
        blocks, hit = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        return ComputedBlocks(tuple(tuple(b) for b in blocks)), hit

    def empty_computed_blocks(self) -> ComputedBlocks:
        return self._empty

    def record_prefix_cache_stats(
        self, request: Request, num_hit_tokens: int, preempted: bool = False
    ) -> None:
        if preempted:
            self.stats.preempted_requests += 1
            self.stats.preempted_queries += request.num_tokens
            self.stats.preempted_hits += num_hit_tokens
        else:
            self.stats.requests += 1
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

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
        hits = (new_computed_blocks or self._empty).blocks
        self._validate(request, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, hits)
        rid = request.request_id
        self._known.add(rid)
        coordinator = self.coordinator
        row = coordinator.row(rid)
        local = request.num_computed_tokens + num_new_computed_tokens
        total = min(local, self.max_model_len)
        main = total + num_new_tokens
        slots = min(main + num_lookahead_tokens, self.max_model_len)

        coordinator.remove_skipped_blocks(row, total)
        need = coordinator.get_num_blocks_to_allocate(row, slots, hits, local, main)
        if need > self.block_pool.get_num_free_blocks():
            return None
        if new_computed_blocks is not None and any(hits):
            coordinator.allocate_new_computed_blocks(row, hits, local)
        new_blocks = coordinator.allocate_new_blocks(row, slots, main)
        coordinator.cache_blocks(request, row, min(total + num_new_tokens, request.num_tokens))
        if request.status is not RequestStatus.FINISHED:
            request.status = RequestStatus.RUNNING
        return new_blocks

    def schedule_step(self, items: Sequence[StepItem]) -> list[list[list[int]] | None]:
        """``allocate_slots(*item)`` for each item in order, decode case vectorised.

        An item that gets no block reads :attr:`no_new_blocks` (empty tuples, shared);
        the others get lists as ``allocate_slots`` returns them.

        Stops after the first ``None`` (the scheduler preempts before going on): the
        returned list then ends with that ``None`` and the later items are not applied.
        Every item is validated first (a bad item raises before anything changes); a
        request may appear at most once per call.
        """
        n = len(items)
        results: list[list[list[int]] | None] = []
        fast_idx: list[int] = []
        rows: list[int] = []
        seen: set[str] = set()
        row_of = self.coordinator.row_of
        for i, item in enumerate(items):
            request = item.request
            hits = (item.new_computed_blocks or self._empty).blocks
            self._validate(
                request,
                item.num_new_tokens,
                item.num_new_computed_tokens,
                item.num_lookahead_tokens,
                hits,
            )
            if request.request_id in seen:
                raise InvalidRequestError(
                    f"schedule_step: request {request.request_id!r} appears twice in one step"
                )
            seen.add(request.request_id)
            row = row_of.get(request.request_id)
            if row is not None and item.num_new_computed_tokens == 0 and not any(hits):
                fast_idx.append(i)
                rows.append(row)
        idle = np.zeros(n, dtype=bool)
        if fast_idx:
            fast_items = [items[i] for i in fast_idx]
            row_arr = np.asarray(rows, dtype=np.int64)
            work, total, slots, raw_cache_tokens = self._pending_work(fast_items, row_arr)
            idle[fast_idx] = ~work
            if len(fast_idx) == n and work.any():
                busy = np.flatnonzero(work)
                applied = apply_decode_items(
                    self,
                    [fast_items[i].request for i in busy.tolist()],
                    row_arr[busy],
                    total[busy],
                    slots[busy],
                    raw_cache_tokens[busy],
                )
                if applied is not None:
                    out: list = [self.no_new_blocks] * n
                    for i, new_blocks in zip(busy.tolist(), applied):
                        out[i] = new_blocks
                    for i in np.flatnonzero(~work).tolist():
                        self._settle_idle(items[i].request)
                    return out
        for i, item in enumerate(items):
            if idle[i]:
                self._settle_idle(item.request)
                results.append(self.no_new_blocks)
                continue
            new_blocks = self.allocate_slots(
                item.request,
                item.num_new_tokens,
                item.num_new_computed_tokens,
                item.new_computed_blocks,
                item.num_lookahead_tokens,
            )
            results.append(new_blocks)
            if new_blocks is None:
                break
        return results

    def _settle_idle(self, request: Request) -> None:
        """What ``allocate_slots`` does to an item with nothing to free, allocate or cache."""
        self._known.add(request.request_id)
        if request.status is not RequestStatus.FINISHED:
            request.status = RequestStatus.RUNNING

    def _pending_work(self, items: Sequence[StepItem], rows: np.ndarray):
        """Per item (no hit, has a row): would ``allocate_slots`` change any group? Also
        returns the items' ``total``, ``slots`` and (unrounded) tokens to cache."""
        m = len(items)
        computed = np.empty(m, dtype=np.int64)
        new = np.empty(m, dtype=np.int64)
        lookahead = np.empty(m, dtype=np.int64)
        num_tokens = np.empty(m, dtype=np.int64)
        num_hashed = np.empty(m, dtype=np.int64)
        boundary = np.empty(m, dtype=np.int64)
        h = self.layout.hash_block_size
        for k, item in enumerate(items):
            req = item.request
            computed[k] = req.num_computed_tokens
            new[k] = item.num_new_tokens
            lookahead[k] = item.num_lookahead_tokens
            num_tokens[k] = req.num_tokens
            num_hashed[k] = len(req.block_hashes)
            boundary[k] = partial_tail_boundary(req.num_prompt_tokens, num_hashed[k], h)
        num_hashed *= h
        mml = self.max_model_len
        total = np.minimum(computed, mml)
        main = total + new
        slots = np.minimum(main + lookahead, mml)
        cache_tokens = raw_cache_tokens = np.minimum(total + new, num_tokens)
        if self.enable_caching and self.num_groups > 1:
            lcm = self.layout.scheduler_block_size
            cache_tokens = cache_tokens // lcm * lcm  # HybridCoordinator.num_cacheable_tokens
        work = np.zeros(m, dtype=bool)
        for manager in self.coordinator.managers:
            work |= manager.pending_work(
                rows, total, main, slots, cache_tokens, num_hashed, boundary
            )
        return work, total, slots, raw_cache_tokens

    # -- freeing ---------------------------------------------------------------
    def free(self, request: Request) -> None:
        if request.request_id not in self._known:
            raise InvalidRequestError(
                f"free: unknown request {request.request_id!r} (never allocated or freed twice)"
            )
        self._known.discard(request.request_id)
        self.coordinator.free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.stats.reset = True
        return ok

    def new_step_starts(self) -> None:
        self.coordinator.new_step_starts()

    # -- views -----------------------------------------------------------------
    def get_blocks(self, request_id: str) -> list[list[int]]:
        return self.coordinator.get_blocks(request_id)

    def get_block_ids(self, request_id: str) -> BlockIdLists:
        """The request's table per group; null entries read 0."""
        return tuple(tuple(g) for g in self.coordinator.get_blocks(request_id))

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()
