"""A new request's admission in one compiled call (numba): its hit adopted, its new
blocks popped and placed, its completed blocks registered, its row's decode threshold.

:meth:`optimized.control.kv_cache_manager.KVCacheManager.allocate_slots` of a request
with no row yet (a fresh row) is, group by group in group order
(:meth:`~optimized.control.coordinator.KVCacheCoordinator.count_hit_admission`,
``adopt_hit``, ``allocate_new_block_arrays``, ``cache_new_blocks``):

* the count: per group ``max(cdiv(slots, bs) - max(skipped, len(hit)), 0)`` (``skipped``
  the hit blocks the spec skips at ``total`` computed tokens) plus the hit blocks past
  them that sit free (ref count 0, not null), all counted before anything changes;
  ``need > free`` refuses and nothing changes;
* the adoption: the real hit blocks past the skipped ones touched (a free one leaves
  the queue, each occurrence counts a reference), each group's row ``[null] * skipped +
  kept``, counted as cached, its leading nulls up to its first real block;
* the allocation: per group ``max(cdiv(slots, bs) - len(row), 0)`` blocks popped from
  the front of the queue for all groups at once (group 0's first; a popped block loses
  its key), appended;
* the caching: :func:`~optimized.control.compiled_caching.cache_row` over the request's
  chain (blocks ``[num_cached, num_full)`` under their masks);
* the threshold: :func:`~optimized.control.compiled_rows.row_threshold`.

:func:`admit` runs exactly that on the arrays, for layouts the decode pass knows with
no Mamba group and the keys in arrays (:class:`~optimized.control.compiled_decode.
LoudPass` checks both). Example: gpt-oss (full + window 128, bs 16), a 1100-token prompt
hitting the 64 blocks of a cached 1024-token system prompt, 76 tokens to compute: the
full group adopts the 64 blocks and pops 5, the window adopts its last 8 (skipping 56)
and pops 5; blocks 64..67 are registered in the full group, the window's replay blocks
(``1099 // 16 = 68``: blocks 60..67) that are new among them too.
"""

from __future__ import annotations

import numpy as np

from optimized.control.compiled_caching import row_caching
from optimized.control.compiled_pool import front_pop
from optimized.control.compiled_rows import CHUNK, WINDOW, threshold_of
from optimized.control.jit import compiled
from optimized.control.key_index import remove_key

#: :func:`admit`'s answers besides a count: the pool cannot hold the request
REFUSED = -1


def admit(
    row: int,
    total: int,
    slots: int,
    limit: int,
    prompt: int,
    junction: int,
    adopt: bool,
    hits: np.ndarray,
    hit_ends: np.ndarray,
    words: np.ndarray,
    twin_of: np.ndarray,
    block_size: np.ndarray,
    skip_kind: np.ndarray,
    skip_param: np.ndarray,
    ratio: np.ndarray,
    mask_kind: np.ndarray,
    alignment: np.ndarray,
    need_blocks: np.ndarray,
    interval: np.ndarray,
    caching: bool,
    tables: np.ndarray,
    row_lens: np.ndarray,
    leading: np.ndarray,
    cached: np.ndarray,
    dirty: np.ndarray,
    retired: np.ndarray,
    ref_cnt: np.ndarray,
    block_group: np.ndarray,
    cached_tokens: np.ndarray,
    prev_free: np.ndarray,
    next_free: np.ndarray,
    key_heads: np.ndarray,
    key_words: np.ndarray,
    key_links: np.ndarray,
    head: int,
    num_free: int,
    popped: np.ndarray,
    pops: np.ndarray,
    spans: np.ndarray,
) -> tuple[int, int, int]:
    """Admit the request on the fresh ``row`` (module docstring): ``total`` computed
    tokens (its hit included), ``slots`` to cover, cache limit ``limit`` (``min(
    cacheable tokens, hashed tokens)``; -1: no caching), prompt tokens and junction (the
    masks' boundaries); ``adopt``: a hit is adopted (every group's row then holds its
    skipped nulls and kept blocks, even an empty hit's), else the rows start empty;
    group ``g``'s hit is ``hits[hit_ends[g - 1]:hit_ends[g]]``; the request's chain of
    hashes is ``words``. The layout's constants and the state's arrays
    as :func:`~optimized.control.compiled_decode.loud_pass` takes them; ``head``,
    ``num_free``: the free queue's head sentinel and free count. Returns ``(need, free
    blocks after, threshold)``; ``need > free`` refuses (the free count unchanged, the
    threshold 0). Out: ``popped[:n]`` the new blocks in group order, ``pops[g]`` each
    group's, ``spans``: :func:`~optimized.control.compiled_caching.cache_row`'s."""
    num_groups = twin_of.shape[0]
    # -- the count, before anything changes ------------------------------------------------
    need = 0
    start = 0
    for g in range(num_groups):
        bs = block_size[g]
        end = hit_ends[g]
        skipped = skipped_blocks(skip_kind[g], skip_param[g], total, bs)
        need += max((slots + bs - 1) // bs - max(skipped, end - start), 0)
        for k in range(start + skipped, end):
            block = hits[k]
            if block != 0 and ref_cnt[block] == 0:
                need += 1
        start = end
    if need > num_free:
        return need, num_free, 0
    # -- the adoption: touch the kept real blocks, write the rows -------------------------
    start = 0
    for g in range(num_groups if adopt else 0):
        end = hit_ends[g]
        skipped = skipped_blocks(skip_kind[g], skip_param[g], total, block_size[g])
        length = max(skipped, end - start)  # the skipped nulls, then the kept blocks
        lead = -1
        for column in range(length):
            block = hits[start + column] if column >= skipped else 0
            tables[g, row, column] = block
            if block == 0:
                continue
            if lead < 0:
                lead = column
            if ref_cnt[block] == 0:  # a free cached block leaves the queue
                before = prev_free[block]
                after = next_free[block]
                next_free[before] = after
                prev_free[after] = before
                prev_free[block] = -1
                next_free[block] = -1
                num_free -= 1
            ref_cnt[block] += 1
        row_lens[g, row] = length
        cached[g, row] = length
        leading[g, row] = length if lead < 0 else lead
        dirty[g, row] = True
        start = end
    # -- the allocation: every group's new blocks popped at once, placed in group order ---
    total_pops = 0
    for g in range(num_groups):
        pops[g] = max((slots + block_size[g] - 1) // block_size[g] - row_lens[g, row], 0)
        total_pops += pops[g]
    if total_pops:
        front_pop(next_free, prev_free, head, total_pops, popped)
        num_free -= total_pops
        k = 0
        for g in range(num_groups):
            n = row_lens[g, row]
            for j in range(pops[g]):
                block = popped[k]
                if caching and block_group[block] >= 0:  # its key is dropped
                    remove_key(
                        key_heads, key_words, key_links, block_group, block, block_group[block]
                    )
                    block_group[block] = -1
                    cached_tokens[block] = 0
                ref_cnt[block] = 1
                tables[g, row, n + j] = block
                k += 1
            if pops[g]:
                row_lens[g, row] = n + pops[g]
                dirty[g, row] = True
    # -- the caching, then the threshold -------------------------------------------------
    if caching and limit >= 0:
        row_caching(
            row,
            limit,
            prompt,
            junction,
            words,
            0,
            block_size,
            ratio,
            mask_kind,
            alignment,
            need_blocks,
            interval,
            tables,
            cached,
            block_group,
            cached_tokens,
            key_heads,
            key_words,
            key_links,
            spans,
        )
    threshold = threshold_of(
        row,
        -1,
        caching,
        twin_of,
        block_size,
        skip_kind,
        skip_param,
        row_lens,
        leading,
        cached,
        retired,
    )
    return need, num_free, threshold


def _skipped_blocks(kind: int, param: int, total: int, block_size: int) -> int:
    """The blocks a group's spec skips at ``total`` computed tokens
    (``num_skipped_tokens(total) // bs``): a window ``w`` skips ``max(total - w + 1,
    0)`` tokens, a chunk ``C`` ``total // C * C``, full attention none. Example: w 128,
    bs 16, total 1088 -> 961 tokens -> 60 blocks."""
    if kind == WINDOW:
        return max(total - param + 1, 0) // block_size
    if kind == CHUNK:
        return total // param * param // block_size
    return 0


skipped_blocks = compiled(_skipped_blocks) or _skipped_blocks

#: the compiled :func:`admit` (None: numba missing or turned off)
compiled_admit = compiled(admit)
