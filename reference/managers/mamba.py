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

Partial (sub-block) hits (the layout's Mamba group is coarser than the hash block size
``H``: :attr:`reference.layout.KVCacheLayout.partial_hits_enabled`; hits are multiples of
``H``):

* the prompt's *partial tail*: the prompt's own checkpoint on the hash grid ``T =``
  :func:`reference.managers.mamba_checkpoints.checkpoint_position` ``(P, H)`` (the last
  hash boundary before the prompt's last token: the scheduler ends a prefill chunk
  there) may end inside the state block of column ``cdiv(T, bs) - 1``; that block gets
  the key of the ``T``-token prefix
  (:meth:`reference.block_pool.BlockPool.cache_partial_block`), and the request keeps
  writing it: its next allocation takes one more block, moves every key of the state
  block to it (:meth:`reference.block_pool.BlockPool.move_keys`) and queues the copy
  ``state -> new block`` (the new block, held by no row, is released to the free queue
  when the copy is handed over; the state block keeps one reference more until then). A
  key registered or moved in a step is refused to hits until the next step, as any
  state cached in the step;
* the hit rule at ``H``: the rightmost hash ``j < min(max // H, hashed)`` whose prefix a
  state block holds: ``[null] * (j // (bs / H)) + [state]``, hit ``(j + 1) * H``;
* a hit ending inside a block is copied on write (:mod:`reference.managers.base`): the
  new request's row gets a fresh block at that column, the copy ``state -> fresh`` is
  queued. A step with a copy may take one block more than :func:`align_step_cap` says
  otherwise.

Example, bs 8, H 4, P 14 (``checkpoint_position(14, 4) = 12``): chunks ``[0, 8)``,
``[8, 12)``, ``[12, 14)``; at 12 the state block ``s1`` (column 1) is keyed by the
12-token prefix; the step ``[12, 14)`` takes ``c``, moves the key to ``c`` and queues
``s1 -> c``; ``c`` goes to the free queue once the copy is handed over. A resend of the
prompt hits ``[null, c]`` (12 tokens), gets a fresh ``d`` in place of ``c`` and the copy
``c -> d``.
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.block_pool import KVCacheBlock
from reference.errors import KVConformError
from reference.managers.base import (
    Block,
    BlockList,
    Lookup,
    SingleTypeKVCacheManager,
    has_partial_local_hit,
    is_fine_grained,
)
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


def align_step_cap(
    allocated: bool, checkpoint: bool, num_speculative_blocks: int, copies: bool = False
) -> int:
    """The most blocks one align-mode step takes: the running state, a checkpoint block,
    the copy of a partial hit or of the prompt's partial tail (``copies``), and on a
    request's first allocation its ``k`` speculative blocks. Example: a new request, a
    checkpoint, k 2 -> 4; a running one without checkpoint -> 1; with a copy -> 2."""
    return 1 + int(checkpoint) + int(copies) + (0 if allocated else num_speculative_blocks)


class MambaManager(SingleTypeKVCacheManager):
    scan = staticmethod(mamba_hit)
    fine_grained_lookup = True

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
        num_local_computed_tokens: int = 0,
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
                num_local_computed_tokens=num_local_computed_tokens,
            )
        row = self.req_to_blocks.get(request_id, [])
        required = cdiv(num_tokens_main, self.block_size) + self.num_speculative_blocks
        num_new = required - len(new_computed_blocks) - len(row)
        copies = (
            has_partial_local_hit(new_computed_blocks, num_local_computed_tokens, self.block_size)
            or request_id in self.partial_hits
        )
        if copies:
            num_new = max(num_new, 0) + 1
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
                    copies,
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
        partial = self.partial_hits.pop(request_id, None)
        if required <= len(blocks) and not reserved and partial is None:
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
        num_new = max(required - len(blocks), 0) + (0 if partial is None else 1)
        new_blocks = self.block_pool.get_new_blocks(num_new)
        copies: BlockList = []
        if partial is not None:
            index, source = partial
            copy, new_blocks = new_blocks[0], new_blocks[1:]
            if allocated:
                self.keep_partial_tail(source, copy)
            else:
                self.copy_on_write(request_id, index, source, copy)
                copies.append(copy)
        blocks.extend(new_blocks)
        self.allocated_requests.add(request_id)
        return copies + moved + new_blocks

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
        """The prompt's own checkpoint on the hash grid, ``T =``
        :func:`reference.managers.mamba_checkpoints.checkpoint_position` of the prompt over
        the hash block size ``H``: a call caching exactly ``T`` tokens keys the state block
        of column ``cdiv(T, bs) - 1`` (real, not already keyed at exactly ``T``) by the
        ``T``-token prefix (:meth:`reference.block_pool.BlockPool.cache_partial_block`: a
        block keyed for fewer tokens loses those keys, one keyed for more keeps its key).
        A ``T`` inside the block (partial hits) also makes the next allocation copy it
        (:meth:`keep_partial_tail`) and counts the blocks before it as the cached ones.
        Returns the key registered (None: nothing). Examples: lookahead hashes ``L = 2``,
        bs 4, sparse retention, a 9-token prompt: its replay boundary keeps the state at 8,
        but a chunk ending at ``(9 - 2) // 4 * 4 = 4`` keys the state at 4 too; bs 8, H 4,
        P 14, 12 tokens cached -> column 1 keyed by the 12-token prefix, copied next step."""
        pool = self.block_pool
        h = pool.hash_block_size
        if num_tokens <= 0 or num_tokens % h:
            return None
        tail = checkpoint_position(
            request.num_prompt_tokens,
            h,
            self.drop_eagle_checkpoint,
            self.num_hash_lookahead_tokens,
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
        key = pool.cache_partial_block(
            source, request.block_hashes[num_tokens // h - 1], self.group_id, num_tokens
        )
        if num_tokens % self.block_size:
            self.partial_hits[request.request_id] = (index, source)
            self.num_cached_block[request.request_id] = index
        return key

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
        # false only with partial hits: a checkpoint off the Mamba block grid
        if position % self.block_size == 0:
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
        block_hash = request.block_hashes[position // pool.hash_block_size - 1]
        return pool.cache_partial_block(
            block, block_hash, self.group_id, position, replace_existing=True
        )

    # -- freeing -----------------------------------------------------------------
    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
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
