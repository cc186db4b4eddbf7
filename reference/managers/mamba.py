"""Mamba state in "align" mode: one state per block boundary, only the newest needed.

Block ``i`` of a request's row holds the recurrent state at boundary ``(i+1)*bs``
once the tokens up to there are computed. The row is position indexed: before an
allocation that needs column ``c = cdiv(main_tokens, bs) - 1``, columns ``[len, c)``
are filled with nulls and one new block is appended at ``c``; at most one physical
block is taken per step. The previous state stays until a later step has read it:
``remove_skipped_blocks(n)`` frees every real block before column
``(n - 1) // bs`` (skipping null gaps, never revisiting retired columns) and also
the previous step's state once it is older than column ``cdiv(n, bs) - 1``.

Example, bs 4: prefill 10 tokens -> row [0, 0, s]; at 12 computed tokens ``s``
holds the state at 12 and is cached under the 12-token prefix; the step that
computes token 13 appends a new block at column 3, and the step after frees ``s``.

Hit rule: the rightmost cached state at an aligned boundary ``(i+1)*bs <= max``:
``[null] * i + [state]``, hit ``(i + 1) * bs``. A hit on a state cached during the
current step is refused (``allocate_slots`` returns None) until ``new_step_starts``:
the state is only written when the step runs.

Which states are registered: :func:`reference.retention.mamba_block_mask` (every one
under dense retention; under sparse retention only the state on the prompt's replay
boundary and on a shared-prefix junction).

Partial (sub-block) hits (the layout's Mamba group is coarser than the hash block size
``H``: :attr:`reference.layout.KVCacheLayout.partial_hits_enabled`; hits are multiples of
``H``):

* the prompt's *partial tail*: when a step caches exactly ``T =``
  :func:`prefill_checkpoint_position` ``(P, H)`` tokens (the last hash boundary before
  the prompt's last token: the scheduler ends a prefill chunk there) and ``T`` ends
  inside the state block of column ``cdiv(T, bs) - 1``, that block gets the key of the
  ``T``-token prefix (:meth:`reference.block_pool.BlockPool.cache_partial_block`), and
  the request keeps writing it: its next allocation takes one more block, moves every
  key of the state block to it (:meth:`reference.block_pool.BlockPool.move_keys`) and
  queues the copy ``state -> new block`` (the new block, held by no row, is released to
  the free queue when the copy is handed over; the state block keeps one reference more
  until then). A key registered or moved in a step is refused to hits until the next
  step, as any state cached in the step;
* the hit rule at ``H``: the rightmost hash ``j < min(max // H, hashed)`` whose prefix a
  state block holds: ``[null] * (j // (bs / H)) + [state]``, hit ``(j + 1) * H``;
* a hit ending inside a block is copied on write (:mod:`reference.managers.base`): the
  new request's row gets a fresh block at that column, the copy ``state -> fresh`` is
  queued.

Example, bs 8, H 4, P 14 (:func:`prefill_checkpoint_position` ``(14, 4) = 12``): chunks
``[0, 8)``, ``[8, 12)``, ``[12, 14)``; at 12 the state block ``s1`` (column 1) is keyed
by the 12-token prefix; the step ``[12, 14)`` takes ``c``, moves the key to ``c`` and
queues ``s1 -> c``; ``c`` goes to the free queue once the copy is handed over. A resend of
the prompt hits ``[null, c]`` (12 tokens), gets a fresh ``d`` in place of ``c`` and the
copy ``c -> d``.
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.block_pool import KVCacheBlock
from reference.managers.base import (
    Block,
    BlockList,
    Lookup,
    SingleTypeKVCacheManager,
    has_partial_local_hit,
    is_fine_grained,
)
from reference.request import Request
from reference.retention import mamba_block_mask
from reference.specs import KVCacheSpec, MambaSpec, cdiv


def mamba_hit(
    hashes: Sequence[bytes],
    max_length: int,
    num_groups: int,
    spec: KVCacheSpec,
    alignment: int,
    lookup: Lookup,
    null_block: Block,
    drop_eagle: bool = False,
) -> tuple[list[list[Block]], int]:
    """The Mamba hit rule of the module docstring over ``hashes`` (the chain at ``bs``;
    only hashed states: ``i < min(max_length // bs, len(hashes))``). ``drop_eagle`` is
    unused (a Mamba group never drops).

    Example: bs 4, A 8, states 1 and 2 cached, max 15 -> state 2 ends at 12, not
    aligned -> state 1: ``[null, s1]`` per group, hit 8. Fine-grained
    (:func:`reference.managers.base.is_fine_grained`: ``hashes`` is the chain at ``A =
    H``): bs 8, H 4, the 12-token prefix cached on ``c``, max 13 -> ``[null, c]``, 12.
    """
    assert isinstance(spec, MambaSpec)
    bs = spec.block_size
    if is_fine_grained(bs, alignment):
        per_block = bs // alignment
        for j in range(min(max_length // alignment, len(hashes)) - 1, -1, -1):
            cached = lookup(hashes[j])
            if cached is not None:
                i = j // per_block
                return [[null_block] * i + [block] for block in cached], (j + 1) * alignment
        return [[] for _ in range(num_groups)], 0
    for i in range(min(max_length // bs, len(hashes)) - 1, -1, -1):
        cached = lookup(hashes[i])
        if cached is None:
            continue
        if bs != alignment and ((i + 1) * bs) % alignment != 0:
            continue
        return [[null_block] * i + [block] for block in cached], (i + 1) * bs
    return [[] for _ in range(num_groups)], 0


def mamba_cache_mask(manager, request, start: int, end: int) -> list[bool] | None:
    """Which states ``[start, end)`` of ``request`` a Mamba ``manager`` registers:
    :func:`reference.retention.mamba_block_mask` with the manager's alignment, block
    size, retention interval and the request's reachable boundaries (the
    ``cacheable_block_mask`` of both engines' Mamba managers). Example: bs 2, A 2,
    sparse, P 11 -> only the state ending at 10 (block 4)."""
    return mamba_block_mask(
        start,
        end,
        manager.cache_hit_alignment,
        manager.block_size,
        manager.retention_interval,
        manager.reachable_boundaries(request),
    )


def prefill_checkpoint_position(
    num_tokens: int, unit: int, drop_eagle: bool = False, num_lookahead_tokens: int = 0
) -> int:
    """The last boundary (a multiple of ``unit``) whose state a prefill of ``num_tokens``
    tokens can leave for later requests: it leaves the last token to recompute (and the
    lookahead tokens its hash needs), or, under EAGLE's block drop, one ``unit`` below the
    boundary: ``floor((N - max(1, L)) / u) * u``, EAGLE ``floor(N / u) * u - u``, never
    below 0. Examples: ``(14, 4) -> 12``; ``(16, 4) -> 12``; ``(14, 4, drop_eagle=True) ->
    8``; ``(14, 4, num_lookahead_tokens=3) -> 8``; ``(3, 4) -> 0``."""
    limit = num_tokens if drop_eagle else num_tokens - max(1, num_lookahead_tokens)
    position = limit // unit * unit
    if drop_eagle:
        position -= unit
    return max(position, 0)


class MambaManager(SingleTypeKVCacheManager):
    scan = staticmethod(mamba_hit)
    fine_grained_lookup = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cached_keys_this_step: set[bytes] = set()
        self.last_state_block_index: dict[str, int] = {}
        self.num_retired_blocks: dict[str, int] = {}
        self.allocated_requests: set[str] = set()

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main: int,
        apply_admission_cap: bool = False,
        num_local_computed_tokens: int = 0,
    ) -> int:
        if new_computed_blocks and new_computed_blocks[-1].cache_key in self.cached_keys_this_step:
            return self.block_pool.num_blocks + 1
        required = cdiv(num_tokens_main, self.block_size)
        num_new = required - len(new_computed_blocks) - len(self.req_to_blocks.get(request_id, ()))
        copies = (
            has_partial_local_hit(new_computed_blocks, num_local_computed_tokens, self.block_size)
            or request_id in self.partial_hits
        )
        if copies:
            num_new = max(num_new, 0) + 1
        if num_new > 0:
            num_new = min(num_new, 1 + int(copies))
        evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + evictable

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main: int
    ) -> BlockList:
        blocks = self.blocks_of(request_id)
        required = cdiv(num_tokens_main, self.block_size)
        partial = self.partial_hits.pop(request_id, None)
        if required <= len(blocks) and partial is None:
            self.allocated_requests.add(request_id)
            return []
        running = request_id in self.allocated_requests
        if blocks:
            self.last_state_block_index[request_id] = len(blocks) - 1
        blocks.extend([self.null_block] * max(0, required - 1 - len(blocks)))
        num_new = max(required - len(blocks), 0) + (0 if partial is None else 1)
        new_blocks = self.block_pool.get_new_blocks(num_new)
        copies: BlockList = []
        if partial is not None:
            index, source = partial
            copy, new_blocks = new_blocks[0], new_blocks[1:]
            if running:
                self.keep_partial_tail(source, copy)
            else:
                self.copy_on_write(request_id, index, source, copy)
                copies.append(copy)
        blocks.extend(new_blocks)
        self.allocated_requests.add(request_id)
        return copies + new_blocks

    def keep_partial_tail(self, source: KVCacheBlock, copy: KVCacheBlock) -> None:
        """A running request keeps writing ``source``, the state block its partial tail
        is keyed on (module docstring): every key moves to ``copy``, the copy ``source ->
        copy`` is queued, ``source`` takes one reference more until it is handed over, and
        the moved key is refused to hits in this step."""
        self.block_pool.move_keys(source, copy)
        self.pending_copies.append((source, copy))
        source.ref_cnt += 1
        if copy.cache_key is not None:  # pragma: no branch - the tail's key moved to it
            self.cached_keys_this_step.add(copy.cache_key)

    cacheable_block_mask = mamba_cache_mask

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        before = self.num_cached_block.get(request.request_id, 0)
        super().cache_blocks(request, num_tokens)
        after = self.num_cached_block.get(request.request_id, 0)
        tail_key = self.cache_partial_tail(request, num_tokens)
        if tail_key is not None:
            self.cached_keys_this_step.add(tail_key)
        blocks = self.blocks_of(request.request_id)
        for block in blocks[before:after]:
            if not block.is_null and block.cache_key is not None:
                self.cached_keys_this_step.add(block.cache_key)

    def cache_partial_tail(self, request: Request, num_tokens: int) -> bytes | None:
        """The prompt's partial tail (module docstring): when ``num_tokens`` is the
        prompt's :func:`prefill_checkpoint_position` at ``H`` and its state block (column
        ``cdiv(T, bs) - 1``) is real and not already keyed at exactly ``T``, key it by the
        ``T``-token prefix; a ``T`` inside the block also makes the next allocation copy
        it (:meth:`keep_partial_tail`) and counts the blocks before it as the cached ones.
        Returns the key registered (None: nothing). Example: bs 8, H 4, P 14, 12 tokens
        cached -> column 1 keyed by the 12-token prefix."""
        h = request.hash_block_size
        if num_tokens <= 0 or num_tokens % h:
            return None
        tail = prefill_checkpoint_position(
            request.num_prompt_tokens, h, self.eagle_replay, request.num_hash_lookahead_tokens
        )
        if num_tokens != tail:
            return None
        blocks = self.blocks_of(request.request_id)
        index = cdiv(num_tokens, self.block_size) - 1
        if index >= len(blocks) or blocks[index].is_null:
            return None
        source = blocks[index]
        if source.cache_key is not None and source.num_cached_tokens == num_tokens:
            return None
        key = self.block_pool.cache_partial_block(
            source, request.block_hashes[num_tokens // h - 1], self.group_id, num_tokens
        )
        if num_tokens % self.block_size:
            self.partial_hits[request.request_id] = (index, source)
            self.num_cached_block[request.request_id] = index
        return key

    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        super().remove_skipped_blocks(request_id, num_computed_tokens)
        last = self.last_state_block_index.get(request_id)
        # unreachable while num_skipped_tokens(n) is n - 1: super() already freed every
        # column before (n - 1) // bs == cdiv(n, bs) - 1 (kept as vLLM states the rule)
        stale = last is not None and last < cdiv(num_computed_tokens, self.block_size) - 1
        if stale:  # pragma: no cover
            blocks = self.blocks_of(request_id)
            if not blocks[last].is_null:
                self.block_pool.free_blocks([blocks[last]])
                blocks[last] = self.null_block

    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        blocks = self.req_to_blocks.get(request_id, [])
        first = max(first, self.num_retired_blocks.get(request_id, 0))
        last = min(last, len(blocks))
        if first >= last:
            return
        freed: BlockList = []
        for i in range(last - 1, first - 1, -1):
            if blocks[i].is_null:
                continue
            freed.append(blocks[i])
            blocks[i] = self.null_block
        if freed:
            self.block_pool.free_blocks(freed)
        self.num_retired_blocks[request_id] = last

    def pop_blocks_for_free(self, request_id: str) -> BlockList:
        self.allocated_requests.discard(request_id)
        self.last_state_block_index.pop(request_id, None)
        self.num_retired_blocks.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def new_step_starts(self) -> None:
        self.cached_keys_this_step.clear()
