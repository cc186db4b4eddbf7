"""Mamba state, in vLLM 0.33's two caching modes.

**Mode "none"** (prefix caching off): the plain rules of
:class:`reference.managers.base.SingleTypeKVCacheManager` over ``num_tokens + k * bs``
slots (``k`` speculative blocks): the first allocation takes every block, blocks before
``(n - 1) // bs`` are freed as the request advances. Example, bs 64, k 2, a prompt of
10: ``cdiv(10 + 128, 64) = 3`` blocks, kept until the request is freed.

**Mode "align"**. Block ``i`` of a request's row holds the recurrent state at boundary
``(i+1)*bs`` once the tokens up to there are computed. The row is position indexed:
an allocation for a chunk ending at ``main`` (draft tokens included, lookahead slots
ignored) needs ``required = cdiv(main, bs) + k`` columns. Columns before the running
state's ``cdiv(main, bs) - 1`` that the row does not have yet are filled with nulls
(except a column reserved for a prefill checkpoint,
:mod:`reference.managers.mamba_checkpoints`); then, for a request allocated before,
its last ``k`` columns (its speculative blocks, which this step leaves behind) that now
lie before the running state are **relocated**: each is appended to the row and its
column becomes null (no block is taken for them); then fresh blocks fill the row up to
``required``. The call returns the relocated and fresh blocks. At most ``1 + checkpoint
(+ k on the first allocation)`` blocks are taken per step; a row already as long as
``required`` takes nothing (unless a checkpoint is reserved, or a draft rollback left
its running-state column null: then it takes one block there). The previous running
state column (``len - 1 - k`` before the step, or ``len - 1`` for a hit's state) is
remembered; ``remove_skipped_blocks(n)`` frees every real block before column
``(n - 1) // bs`` (skipping null gaps, never revisiting retired columns) and also that
remembered state once it is older than column ``cdiv(n, bs) - 1``.

The estimate for a step is ``required - len(hit) - len(row)`` new blocks, capped at the
blocks the step may take, **never below 0**, plus the evictable hit state. vLLM 0.33
leaves it negative when the row is longer than ``required``: a draft step took columns
for drafts the model rejected and the next step schedules fewer tokens; the negative
figure then hides another group's need from the pool check
(``findings/vllm/mamba-negative-estimate-after-rollback.md``).

Example, bs 4, k 0: prefill 10 tokens -> row [0, 0, s]; at 12 computed tokens ``s``
holds the state at 12 and is cached under the 12-token prefix; the step that computes
token 13 appends a new block at column 3, and the step after frees ``s``.
Example, bs 4, k 2: prefill 8 -> row [0, s, x, y] (``x``, ``y`` speculative); the
next chunk ends at 20 -> x and y are relocated and one block taken: [0, s, 0, 0, x, y, n].

Hit rule: the rightmost cached state at an aligned boundary ``(i+1)*bs <= max``:
``[null] * i + [state]``, hit ``(i + 1) * bs``. A hit on a state cached during the
current step is refused (``allocate_slots`` returns None) until ``new_step_starts``:
the state is only written when the step runs.

Which states are registered: :func:`reference.retention.mamba_block_mask` (every one
under dense retention; under sparse retention only the state on the prompt's replay
boundary and on a shared-prefix junction), a kept checkpoint under the chained hash at
its position, and the prompt's own checkpoint on the hash grid when a call caches exactly
up to it (with lookahead hashes or the EAGLE drop it may lie below the replay boundary).

EAGLE: a Mamba hit never drops its last state (the coordinator does not look past the
candidate for it); the drop moves its checkpoints one unit down.
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.block_pool import KVCacheBlock
from reference.errors import KVConformError
from reference.managers.base import Block, BlockList, Lookup, SingleTypeKVCacheManager
from reference.managers.mamba_checkpoints import (
    checkpoint_kept,
    checkpoint_position,
    needs_checkpoint,
    reserved_column,
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
    aligned -> state 1: ``[null, s1]`` per group, hit 8.
    """
    assert isinstance(spec, MambaSpec)
    bs = spec.block_size
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


def align_step_cap(allocated: bool, checkpoint: bool, num_speculative_blocks: int) -> int:
    """The most blocks one align-mode step takes: the running state, a checkpoint block,
    and on a request's first allocation its ``k`` speculative blocks. Example: a new
    request, a checkpoint, k 2 -> 4; a running one without checkpoint -> 1."""
    return 1 + int(checkpoint) + (0 if allocated else num_speculative_blocks)


class MambaManager(SingleTypeKVCacheManager):
    scan = staticmethod(mamba_hit)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        assert isinstance(self.spec, MambaSpec)
        self.align = self.spec.is_align
        #: draft slots: ``k`` speculative blocks past the running state
        self.num_speculative_blocks = self.spec.num_speculative_blocks
        #: the EAGLE drop moves the checkpoints one unit down (set by the coordinator)
        self.drop_eagle_checkpoint = False
        #: the pool's lookahead hash tokens (a checkpoint leaves them to recompute)
        self.num_hash_lookahead_tokens = 0
        self.cached_keys_this_step: set[bytes] = set()
        self.last_state_block_index: dict[str, int] = {}
        self.num_retired_blocks: dict[str, int] = {}
        self.allocated_requests: set[str] = set()
        #: request -> (checkpoint position, reserved column) of its last estimate
        self.checkpoints: dict[str, tuple[int, int]] = {}

    # -- allocation --------------------------------------------------------------
    def _draft_slots(self) -> int:
        """Mode "none": the slots of the speculative blocks, ``k * bs``."""
        return self.num_speculative_blocks * self.block_size

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        if new_computed_blocks and new_computed_blocks[-1].cache_key in self.cached_keys_this_step:
            return self.block_pool.num_blocks + 1
        if not self.align:
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens + self._draft_slots(),
                new_computed_blocks,
                total_computed_tokens,
                num_tokens_main,
                apply_admission_cap,
            )
        row = self.req_to_blocks.get(request_id, [])
        required = cdiv(num_tokens_main, self.block_size) + self.num_speculative_blocks
        num_new = required - len(new_computed_blocks) - len(row)
        position = checkpoint_position(
            num_tokens_main,
            self.cache_hit_alignment,
            self.drop_eagle_checkpoint,
            self.num_hash_lookahead_tokens,
        )
        if not needs_checkpoint(
            self.spec,
            row,
            request_id in self.allocated_requests,
            total_computed_tokens,
            num_tokens_main,
            position,
            prefill_end,
            self.block_pool.hash_block_size,
        ):
            position = 0
        if not apply_admission_cap:
            if position > 0:
                column = reserved_column(num_tokens_main, self.block_size)
                self.checkpoints[request_id] = (position, column)
            else:
                self.checkpoints.pop(request_id, None)
        if num_new > 0:
            num_new = min(
                num_new,
                align_step_cap(
                    request_id in self.allocated_requests,
                    position > 0,
                    self.num_speculative_blocks,
                ),
            )
        else:  # a row as long as required: at most the null running column's block
            num_new = int(position == 0 and self._null_running_column(row, required) is not None)
        evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return max(num_new, 0) + evictable

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main: int
    ) -> BlockList:
        if not self.align:
            return super().allocate_new_blocks(
                request_id, num_tokens + self._draft_slots(), num_tokens_main
            )
        k = self.num_speculative_blocks
        blocks = self.blocks_of(request_id)
        required = cdiv(num_tokens_main, self.block_size) + k
        reserved = int(request_id in self.checkpoints)
        if required <= len(blocks) and not reserved:
            self.allocated_requests.add(request_id)
            column = self._null_running_column(blocks, required)
            if column is None:
                return []
            (fresh,) = self.block_pool.get_new_blocks(1)
            blocks[column] = fresh
            return [fresh]
        held = len(blocks)
        allocated = request_id in self.allocated_requests
        if allocated:
            self.last_state_block_index[request_id] = held - 1 - k
        elif held > 0:
            self.last_state_block_index[request_id] = held - 1
        running_column = required - k - 1
        blocks.extend([self.null_block] * max(0, running_column - reserved - held))
        if allocated:
            for column in range(held - k, held):
                if column >= running_column - reserved:
                    break
                self._relocate(blocks, column)
        moved = [b for b in blocks[held:] if not b.is_null]
        new_blocks = self.block_pool.get_new_blocks(max(required - len(blocks), 0))
        blocks.extend(new_blocks)
        self.allocated_requests.add(request_id)
        return moved + new_blocks

    def _null_running_column(self, row: Sequence[KVCacheBlock], required: int) -> int | None:
        """The running-state column ``required - k - 1`` of a row at least as long as
        ``required`` when it is null, else None. A draft rollback leaves it null: the
        step writes the state at ``cdiv(main, bs) - 1``, a column the draft step left
        behind, and takes one fresh block there. Example, bs 1, k 2: a draft step to 25
        leaves ``[.., 0, s, x, y]`` (columns 23-26); the drafts are rejected and the next
        step ends at 24 (``required`` 26): column 23 is null and gets a new block ``n``:
        ``[.., n, s, x, y]``."""
        column = required - self.num_speculative_blocks - 1
        return column if 0 <= column < len(row) and row[column].is_null else None

    def _relocate(self, blocks: BlockList, column: int) -> None:
        """Move the speculative block at ``column`` to the end of the row (its column
        becomes null). It must be the request's own unhashed block."""
        block = blocks[column]
        if block.is_null or block.ref_cnt != 1 or block.cache_key is not None:  # pragma: no cover
            # an internal consistency guard: a speculative column holds the request's own
            # fresh block (allocate_new_blocks appends them; nothing hashes or shares one)
            raise KVConformError(
                f"Mamba group {self.group_id}: speculative block {block.block_id} at column "
                f"{column} is shared, hashed or null and cannot be relocated"
            )
        blocks.append(block)
        blocks[column] = self.null_block

    # -- caching -----------------------------------------------------------------
    cacheable_block_mask = mamba_cache_mask

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        before = self.num_cached_block.get(request.request_id, 0)
        super().cache_blocks(request, num_tokens)
        after = self.num_cached_block.get(request.request_id, 0)
        if request.request_id in self.checkpoints:
            key = self._cache_checkpoint(request)
        else:
            key = self._cache_prompt_tail(request, num_tokens)
        if key is not None:
            self.cached_keys_this_step.add(key)
        blocks = self.blocks_of(request.request_id)
        for block in blocks[before:after]:
            if not block.is_null and block.cache_key is not None:
                self.cached_keys_this_step.add(block.cache_key)

    def _cache_prompt_tail(self, request: Request, num_tokens: int) -> bytes | None:
        """A call caching exactly up to the prompt's own checkpoint at the hash grid
        (:func:`reference.managers.mamba_checkpoints.checkpoint_position` of the prompt
        over the hash block size) keys the state block of that boundary there, when the
        retention mask left it out (a block keyed for fewer tokens is re-keyed); the new
        key, else None. Example: lookahead hashes ``L = 2``, bs 4, sparse retention, a
        9-token prompt: its replay boundary keeps the state at 8, but a chunk ending at
        ``(9 - 2) // 4 * 4 = 4`` keys the state at 4 too."""
        pool = self.block_pool
        if num_tokens <= 0 or num_tokens % pool.hash_block_size:
            return None
        tail = checkpoint_position(
            request.num_prompt_tokens,
            pool.hash_block_size,
            self.drop_eagle_checkpoint,
            self.num_hash_lookahead_tokens,
        )
        blocks = self.blocks_of(request.request_id)
        column = cdiv(num_tokens, self.block_size) - 1
        if num_tokens != tail or column >= len(blocks) or blocks[column].is_null:
            return None
        block = blocks[column]
        if block.cache_key is not None and block.num_cached_tokens >= num_tokens:
            return None
        if num_tokens % self.block_size:  # pragma: no cover - partial hits are refused
            raise KVConformError(
                f"Mamba group {self.group_id}: a prompt tail at {num_tokens} tokens inside "
                "a block (partial hits) is not modelled"
            )
        pool.evict_blocks([block.block_id])
        pool.cache_block(
            block, request.block_hashes[tail // pool.hash_block_size - 1], self.group_id, num_tokens
        )
        return block.cache_key

    def _cache_checkpoint(self, request: Request) -> bytes | None:
        """Key the block reserved for the request's last checkpoint at the checkpoint
        (the chained hash of its prefix, any earlier key dropped), or drop its keys when
        :func:`reference.managers.mamba_checkpoints.checkpoint_kept` says no, or when the
        checkpoint lies past the request's hashed tokens; the new key, None when nothing
        was keyed (dropped, or already keyed there). Called for a request with a checkpoint.

        Example: bs 2, hash block 2, a 2-token prompt decoding one token and 2 drafts
        (tokens ``[2, 5)``): the checkpoint at 4 is reserved, but only 3 tokens are
        known (one hash): the block is not keyed. (vLLM 0.33 asserts there:
        ``findings/vllm/mamba-checkpoint-inside-drafts.md``.)"""
        position, column = self.checkpoints[request.request_id]  # the caller checked
        block = self.blocks_of(request.request_id)[column]
        prompt_checkpoint = checkpoint_position(
            request.num_prompt_tokens,
            self.cache_hit_alignment,
            self.drop_eagle_checkpoint,
            self.num_hash_lookahead_tokens,
        )
        retained = False
        # always true here: a checkpoint lies on the hit alignment, a multiple of every
        # group's block size (vLLM's test, kept for exactness; partial hits break that)
        if position % self.block_size == 0:  # pragma: no branch
            state = position // self.block_size - 1
            mask = mamba_block_mask(
                state,
                state + 1,
                self.cache_hit_alignment,
                self.block_size,
                self.retention_interval,
                [],
            )
            retained = mask is None or mask[0]
        hashed = len(request.block_hashes) * self.block_pool.hash_block_size
        if position > hashed or not checkpoint_kept(
            position, prompt_checkpoint, retained, request.shared_prefix_boundary
        ):
            # a checkpoint inside the drafts (a decode chunk of drafts crossing a hash
            # boundary) has no hash yet: its state is transient, like one not kept
            self.block_pool.evict_blocks([block.block_id])
            return None
        if block.cache_key is not None and block.num_cached_tokens == position:
            return None
        pool = self.block_pool
        pool.evict_blocks([block.block_id])
        block_hash = request.block_hashes[position // pool.hash_block_size - 1]
        pool.cache_block(block, block_hash, self.group_id, position)
        return block.cache_key

    # -- freeing -----------------------------------------------------------------
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        super().remove_skipped_blocks(request_id, num_computed_tokens)
        if not self.align:
            return
        last = self.last_state_block_index.get(request_id)
        if last is not None and last < cdiv(num_computed_tokens, self.block_size) - 1:
            blocks = self.blocks_of(request_id)
            # vLLM's guard, kept for exactness: the range freed above (Mamba skips n - 1
            # tokens, so it reaches column cdiv(n, bs) - 2) or an earlier retirement has
            # already nulled this column, and nothing refills a retired column
            if not blocks[last].is_null:  # pragma: no cover
                self.block_pool.free_blocks([blocks[last]])
                blocks[last] = self.null_block

    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        if not self.align:
            super()._remove_blocks_in_range(request_id, first, last)
            return
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
        self.checkpoints.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def new_step_starts(self) -> None:
        self.cached_keys_this_step.clear()
