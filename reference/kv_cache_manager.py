"""The request-level API a scheduler calls: lookups, allocation, freeing.

``allocate_slots`` follows this order (spec 6.3; token layout
``| computed | new hit | new | lookahead |``):

1. nothing to do (no new token, no hit, no external token) -> error;
2. ``total = min(num_computed + num_new_computed + external, max_model_len)``;
3. admission gate (``full_sequence_must_fit``): the blocks the whole sequence
   (``min(num_tokens, max_model_len)``) needs, each sliding-window or chunked group
   capped at its ``max_admission_blocks``; more than free -> return ``None``;
4. ``main = total + num_new_tokens``; ``slots = min(main + lookahead, max_model_len)``;
5. out-of-window blocks are freed **first**, on the *processed* basis
   ``remove_skipped_blocks(max(0, total - num_in_flight_tokens))`` (a token still in
   flight reads its window), even if the allocation then fails;
6. ``need = sum over groups of blocks to allocate`` (evictable hit blocks count);
   ``need > free`` -> return ``None``: no ref count of a hit changed;
7. adopt the hit (touch, every group), then allocate blocks for the external
   tokens (every group), then the new blocks; unless ``delay_cache_blocks``, cache
   every full block of ``[0, min(total + num_new_tokens, num_tokens))`` (drafts past
   ``num_tokens`` never; hybrid: rounded down to the LCM).

Worked example (SWA w 4, bs 2, async): a request computed 8 tokens, 2 of them still
in flight; the next step frees on ``8 - 2 = 6`` processed tokens: skipped
``6 - 4 + 1 = 3`` -> block 0 only (tokens 0, 1), not blocks 0 and 1 (skipped 5 at 8).

``get_computed_blocks`` looks up at most ``num_tokens - 1`` tokens (the last prompt
token is always recomputed for its logits) and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from reference.block_pool import KVCacheBlock
from reference.coordinator import make_coordinator
from reference.errors import InvalidLayoutError, InvalidRequestError
from reference.layout import KVCacheLayout
from reference.request import Request, RequestStatus
from reference.validation import require_bool, require_instance, require_int, require_token_ids

BlockIdLists = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ComputedBlocks:
    """A prefix hit: blocks per group (nulls where a group no longer needs tokens)."""

    blocks: tuple[tuple[KVCacheBlock, ...], ...]

    def block_ids(self) -> BlockIdLists:
        return tuple(tuple(b.block_id for b in group) for group in self.blocks)


@dataclass
class PrefixCacheStats:
    """Counted when a request is admitted: requests, queried tokens, hit tokens."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False


def check_prompt_length(request_id: str, num_prompt_tokens: int, max_model_len: int) -> None:
    """A prompt longer than ``max_model_len`` is refused (InvalidRequestError). Example:
    ``check_prompt_length("r1", 129, 128)`` raises."""
    if num_prompt_tokens > max_model_len:
        raise InvalidRequestError(
            f"request {request_id!r}: prompt of {num_prompt_tokens} tokens is longer "
            f"than max_model_len {max_model_len}"
        )


def junction(hit: int, uncached: int) -> int:
    """A lookup's ``shared_prefix_boundary``: ``hit + uncached`` when some group caches
    ``uncached > 0`` tokens more than the reconciled hit, else 0. Example: hit 8,
    uncached 8 -> 16; hit 8, uncached 0 -> 0."""
    return hit + uncached if uncached else 0


class ManagerBookkeeping:
    """What every request-level manager (both engines) does the same way around its
    coordinator: prefix-cache statistics, reset, step starts, forgetting a freed request,
    views. Needs ``stats``, ``block_pool``, ``coordinator`` and ``_known`` (the ids that
    may be freed)."""

    stats: PrefixCacheStats
    _known: set[str]

    def record_prefix_cache_stats(  # pragma: no cover - metrics, not an engine call
        self, request, num_hit_tokens: int, preempted: bool = False
    ) -> None:
        if preempted:
            self.stats.preempted_requests += 1
            self.stats.preempted_queries += request.num_tokens
            self.stats.preempted_hits += num_hit_tokens
        else:
            self.stats.requests += 1
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens

    def make_prefix_cache_stats(self) -> PrefixCacheStats:  # pragma: no cover - metrics
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

    def _forget(self, request_id: str) -> None:
        """``free``'s rule: only a request allocated and not freed since may be freed."""
        if request_id not in self._known:
            raise InvalidRequestError(
                f"free: unknown request {request_id!r} (never allocated or freed twice)"
            )
        self._known.discard(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (and nothing changes) while blocks are held."""
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.stats.reset = True
        return ok

    def new_step_starts(self) -> None:
        self.coordinator.new_step_starts()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:  # pragma: no cover - a metric, not an engine call
        return self.block_pool.get_usage()


class KVCacheManager(ManagerBookkeeping):
    """The reference hybrid KV cache manager (vLLM 0.33 policy, core scope)."""

    def __init__(self, layout: KVCacheLayout) -> None:
        require_instance(InvalidLayoutError, "KVCacheManager", "layout", layout, KVCacheLayout)
        self.layout = layout
        self.max_model_len = layout.max_model_len
        self.enable_caching = layout.enable_caching
        self.coordinator = make_coordinator(layout)
        self.block_pool = self.coordinator.block_pool
        self.num_groups = len(layout.groups)
        self.stats = PrefixCacheStats()
        self._known: set[str] = set()
        #: request id -> the request that holds blocks under it (one request per id)
        self._holders: dict[str, Request] = {}
        #: the blocks the last ``allocate_slots`` estimated it needed (step 6 of the
        #: module docstring; None when it returned before that estimate)
        self.last_num_blocks_to_allocate: int | None = None

    # -- requests --------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt_token_ids,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> Request:
        """A request whose hashes use this layout's hash block size. An id may not be
        reused while a request holding blocks under it is not freed (the two would share
        one block table)."""
        if request_id in self._holders:
            raise InvalidRequestError(
                f"make_request: request id {request_id!r} is used twice (the request holding "
                "blocks under it has not been freed)"
            )
        # (checked before its length is read: None is a clear error, never a TypeError)
        require_token_ids(InvalidRequestError, "make_request", "prompt_token_ids", prompt_token_ids)
        check_prompt_length(request_id, len(prompt_token_ids), self.max_model_len)
        return Request(
            request_id,
            prompt_token_ids,
            self.layout.hash_block_size,
            cache_salt,
            lora_name,
            self.layout.num_hash_lookahead_tokens,
        )

    # -- lookup ----------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[ComputedBlocks, int]:
        """Longest prefix hit (``<= num_tokens - 1``) every group can serve.

        The pool is untouched. The lookup records the junction on the request (vLLM's
        scheduler stores it right after each lookup): ``shared_prefix_boundary =
        hit + uncached`` when some group caches ``uncached > 0`` tokens more than
        the reconciled hit, else 0. Sparse retention keeps that junction's tail.
        Example: full attention caches 16 tokens, SWA only 8 -> hit 8, junction 16.
        """
        if not self.enable_caching:
            request.shared_prefix_boundary = 0
            return self.empty_computed_blocks(), 0
        blocks, hit, uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        request.shared_prefix_boundary = junction(hit, uncached)
        return ComputedBlocks(tuple(tuple(b) for b in blocks)), hit

    def empty_computed_blocks(self) -> ComputedBlocks:
        return ComputedBlocks(tuple(() for _ in range(self.num_groups)))

    # -- allocation ------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
    ) -> list[list[KVCacheBlock]] | None:
        """Give ``request`` slots for its next tokens; the new blocks per group, or None.

        ``num_external_computed_tokens`` follow the local hit (a KV connector loads
        them: blocks are allocated, nothing is touched); ``delay_cache_blocks`` skips
        caching (the load is still in flight); ``full_sequence_must_fit`` first
        refuses the request unless its whole sequence fits (the admission gate).
        """
        self.last_num_blocks_to_allocate = None
        _check_allocate_args(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            full_sequence_must_fit,
        )
        rid = request.request_id
        holder = self._holders.get(rid)
        if holder is not None and holder is not request:
            raise InvalidRequestError(
                f"allocate_slots: request id {rid!r} is used twice (another request holds "
                "blocks under it)"
            )
        if request.is_finished:
            raise InvalidRequestError(f"allocate_slots: request {rid!r} is finished")
        counts = {
            "num_new_tokens": num_new_tokens,
            "num_new_computed_tokens": num_new_computed_tokens,
            "num_lookahead_tokens": num_lookahead_tokens,
            "num_external_computed_tokens": num_external_computed_tokens,
        }
        if any(v < 0 for v in counts.values()):
            raise InvalidRequestError(
                f"allocate_slots({rid!r}): token counts must be >= 0, got "
                + ", ".join(f"{k}={v}" for k, v in counts.items())
            )
        if (
            num_new_tokens == 0
            and num_new_computed_tokens == 0
            and num_external_computed_tokens == 0
        ):
            raise InvalidRequestError(
                f"allocate_slots({rid!r}): num_new_tokens must be > 0 when there is no "
                f"prefix hit to adopt, got {num_new_tokens}"
            )
        local = request.num_computed_tokens + num_new_computed_tokens
        reach = local + num_external_computed_tokens + num_new_tokens
        if reach > request.num_tokens_with_pending or request.num_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"allocate_slots({rid!r}): computed {request.num_computed_tokens} + hit "
                f"{num_new_computed_tokens} + external {num_external_computed_tokens} + new "
                f"{num_new_tokens} exceeds the request's {request.num_tokens} tokens (+ "
                f"{request.num_tokens_with_pending - request.num_tokens} in flight or draft; "
                f"max_model_len {self.max_model_len})"
            )
        hits = (new_computed_blocks or self.empty_computed_blocks()).blocks
        if len(hits) != self.num_groups:
            raise InvalidRequestError(
                f"allocate_slots({rid!r}): new_computed_blocks has {len(hits)} groups, "
                f"the layout has {self.num_groups}"
            )
        self._known.add(rid)
        self._holders[rid] = request
        total = min(local + num_external_computed_tokens, self.max_model_len)
        # where the prefill ends (a resumed request replays its outputs): Mamba's
        # prefill checkpoints under sparse retention are taken on the chunk reaching it
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if full_sequence_must_fit:
            whole = min(request.num_tokens, self.max_model_len)
            need = self.coordinator.get_num_blocks_to_allocate(
                rid, whole, hits, total, whole, apply_admission_cap=True, prefill_end=prefill_end
            )
            if need > self.block_pool.get_num_free_blocks():
                return None
        main = total + num_new_tokens
        slots = min(main + num_lookahead_tokens, self.max_model_len)

        self.coordinator.remove_skipped_blocks(rid, max(0, total - request.num_in_flight_tokens))
        need = self.coordinator.get_num_blocks_to_allocate(
            rid, slots, hits, total, main, prefill_end=prefill_end
        )
        self.last_num_blocks_to_allocate = need
        if need > self.block_pool.get_num_free_blocks():
            return None
        if (new_computed_blocks is not None and any(hits)) or num_external_computed_tokens > 0:
            self.coordinator.allocate_new_computed_blocks(
                rid, hits, local, num_external_computed_tokens
            )
        new_blocks = self.coordinator.allocate_new_blocks(rid, slots, main)
        # delay_cache_blocks: a connector's load is in flight; cached once it completes
        if not delay_cache_blocks:
            self.cache_blocks(request, min(total + num_new_tokens, request.num_tokens))
        if request.status is not RequestStatus.FINISHED:  # pragma: no branch - checked above
            request.status = RequestStatus.RUNNING
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the full blocks of ``[0, num_tokens)`` (hybrid: rounded down to the
        scheduler block size). The scheduler also calls it when a step's output is
        processed under async scheduling or drafts, with ``num_computed -
        num_in_flight`` tokens (rejected drafts already rolled back)."""
        self.coordinator.cache_blocks(request, num_tokens)

    # -- freeing ---------------------------------------------------------------
    def free(self, request: Request) -> None:
        """Free every block of ``request``, tail first per group (leading nulls dropped)."""
        if not isinstance(request, Request):
            raise InvalidRequestError(f"free: request must be a Request, got {request!r}")
        self._forget(request.request_id)
        self._holders.pop(request.request_id, None)
        self.coordinator.free(request.request_id)

    def pop_blocks_for_free(  # pragma: no cover - the scheduler level's deferred frees
        self, request: Request
    ) -> list[KVCacheBlock]:
        """A *deferred* free, first half: ``request`` gives up its blocks without
        returning them to the pool, as vLLM 0.33's scheduler does with a consumer KV
        connector under asynchronous scheduling while a step in flight may still write
        them. The result is every group's table in group order, each without its leading
        nulls (a window's skipped prefix), in one list; :meth:`free_popped_blocks`
        returns them later. The request is forgotten at once (as by :meth:`free`)."""
        if not isinstance(request, Request):
            raise InvalidRequestError(
                f"pop_blocks_for_free: request must be a Request, got {request!r}"
            )
        self._forget(request.request_id)
        self._holders.pop(request.request_id, None)
        blocks: list[KVCacheBlock] = []
        for manager in self.coordinator.managers:
            blocks.extend(manager.pop_blocks_for_free(request.request_id))
        return blocks

    def free_popped_blocks(  # pragma: no cover - the scheduler level's deferred frees
        self, blocks: list[KVCacheBlock]
    ) -> None:
        """A deferred free, second half: the blocks :meth:`pop_blocks_for_free` took go
        back to the pool in one ``free_blocks`` call, tail first over the *whole* list
        (the last group's tail first), not group by group as :meth:`free` does, so
        cached blocks reach the back of the free queue in another order.

        Worked example: group 0 holds (1, 2), group 1 holds (3, 4), all cached, free
        queue (5,). ``free``: group 0 appends 2, 1, then group 1 appends 4, 3: queue
        (5, 2, 1, 4, 3). Popped then freed: one call with 4, 3, 2, 1: queue
        (5, 4, 3, 2, 1). Uncached blocks go to the front in the same order both ways:
        (4, 3, 2, 1, 5)."""
        self.block_pool.free_blocks(reversed(blocks))

    # -- views -----------------------------------------------------------------
    def get_blocks(self, request_id: str) -> list[list[KVCacheBlock]]:
        return self.coordinator.get_blocks(request_id)

    def get_block_ids(self, request_id: str) -> BlockIdLists:
        """The request's table per group; null entries read 0."""
        return tuple(tuple(b.block_id for b in group) for group in self.get_blocks(request_id))


def _check_allocate_args(
    request: object,
    num_new_tokens: object,
    num_new_computed_tokens: object,
    new_computed_blocks: object,
    num_lookahead_tokens: object,
    num_external_computed_tokens: object = 0,
    delay_cache_blocks: object = False,
    full_sequence_must_fit: object = False,
) -> None:
    """Types of ``allocate_slots``' arguments (ranges are checked by the call itself)."""
    if not isinstance(request, Request):
        raise InvalidRequestError(f"allocate_slots: request must be a Request, got {request!r}")
    for field, value in (
        ("num_new_tokens", num_new_tokens),
        ("num_new_computed_tokens", num_new_computed_tokens),
        ("num_lookahead_tokens", num_lookahead_tokens),
        ("num_external_computed_tokens", num_external_computed_tokens),
    ):
        require_int(InvalidRequestError, "allocate_slots", field, value)
    for field, value in (
        ("delay_cache_blocks", delay_cache_blocks),
        ("full_sequence_must_fit", full_sequence_must_fit),
    ):
        require_bool(InvalidRequestError, "allocate_slots", field, value)
    if new_computed_blocks is not None and not isinstance(new_computed_blocks, ComputedBlocks):
        raise InvalidRequestError(
            "allocate_slots.new_computed_blocks must be ComputedBlocks or None, got "
            f"{new_computed_blocks!r}"
        )
