"""The caching of a decode step's loud items in one compiled call (numba), when the pool
keeps its keys in arrays (:class:`~optimized.control.key_index.ArrayKeyIndex`).

:func:`~optimized.control.compiled_decode.loud_pass` flags the items that complete a
block to register; :func:`cache_items` then registers them, item after item and group
after group, exactly as ``cache_blocks`` does
(:meth:`~optimized.control.managers.base.SingleTypeKVCacheManager.cache_plan` and
:meth:`~optimized.control.block_pool.BlockPool.cache_block`): in each group the blocks
``[num_cached, num_full)`` of the row, ``num_full = min(cache limit, hashed tokens) //
bs``, those the group's retention mask keeps (:func:`keeps`), each under the chain's
hash at its end, a null skipped, a block whose key already covers as many tokens kept
(one with a shorter key promoted); then ``num_cached = num_full``. Registering a held
block and evicting a popped one commute, so the step's pops may all come first.

The masks, per block ``i`` of a group of block size ``bs``, alignment ``A`` and
retention interval ``R`` (-1: dense), with the request's reachable boundaries (its
replay boundary ``P - 1`` and its junction, if any: the engine has no EAGLE group):

* full attention and chunked local attention: every block;
* a sliding window needing ``need`` blocks (:func:`reference.retention.
  sliding_window_block_mask`): every block when ``A % bs``; the segment tails (segment
  ``A`` when dense, ``R`` when positive: every block when ``need >= segment // bs``);
  under ``R >= 0`` the ``need`` blocks ending at each boundary's aligned block;
* Mamba (:func:`reference.retention.mamba_block_mask`): every block when dense or when
  ``R // bs <= 1``; the last block of each ``R``-token segment; under ``R >= 0`` the
  block ending at each boundary's aligned position.

Example: gpt-oss (full + window 128, bs 16, sparse), an item completing block 80 of a
1300-token prompt's request: the full group registers block 80; the window's kept
blocks end at ``1299 // 16 * 16 // 16 = 81``... only ``[73, 81)`` (``need`` 8), so it
registers block 80 too.
"""

from __future__ import annotations

import numpy as np

from optimized.control.jit import compiled
from optimized.control.key_index import insert_key, remove_key

#: per group, how its retention mask reads (the ``kind`` of :func:`keeps`)
EVERY_BLOCK, WINDOW_MASK, MAMBA_MASK = 0, 1, 2
#: ``items`` columns: row, cache limit (``min(cacheable tokens, hashed tokens)``), prompt
#: tokens, junction (0: none), the item's first row in ``words``, the chain row there
ROW, LIMIT, PROMPT, JUNCTION, SLAB, SLAB_ROW = 0, 1, 2, 3, 4, 5


def keeps(
    kind: int,
    i: int,
    block_size: int,
    alignment: int,
    need: int,
    interval: int,
    prompt: int,
    junction: int,
) -> bool:
    """Does the group's retention mask keep block ``i`` (module docstring)? Example:
    window, bs 2, A 4, need 1, sparse, P 11 (boundary 10 -> aligned 8 -> block 3): block
    3 only."""
    if kind == EVERY_BLOCK:
        return True
    if kind == WINDOW_MASK:
        if alignment % block_size:
            return True
        segment = alignment if interval < 0 else interval
        if segment > 0:
            per_segment = segment // block_size
            if need >= per_segment:
                return True
            if i % per_segment >= per_segment - need:
                return True
        if interval < 0:
            return False
        end = (prompt - 1) // alignment * alignment // block_size
        if end - need <= i < end:
            return True
        if junction:
            end = junction // alignment * alignment // block_size
            if end - need <= i < end:
                return True
        return False
    # MAMBA_MASK
    if interval < 0:
        return True
    if interval > 0:
        per_segment = interval // block_size
        if per_segment <= 1 or (i + 1) % per_segment == 0:
            return True
    if i == (prompt - 1) // alignment * alignment // block_size - 1:
        return True
    return junction > 0 and i == junction // alignment * alignment // block_size - 1


_keeps = compiled(keeps) or keeps


def cache_items(
    items: np.ndarray,
    words: np.ndarray,
    block_size: np.ndarray,
    ratio: np.ndarray,
    mask_kind: np.ndarray,
    alignment: np.ndarray,
    need: np.ndarray,
    interval: np.ndarray,
    tables: np.ndarray,
    cached: np.ndarray,
    block_group: np.ndarray,
    cached_tokens: np.ndarray,
    key_heads: np.ndarray,
    key_words: np.ndarray,
    key_links: np.ndarray,
    mamba_spans: np.ndarray,
) -> None:
    """Register the blocks each item of ``items`` completes (module docstring), in item
    order. Item ``f``'s hashes at the hash block size are the rows of ``words`` from
    ``items[f, SLAB]`` on, the first being chain row ``items[f, SLAB_ROW]``; a group
    ``g``'s block ``j`` takes chain row ``(j + 1) * ratio[g] - 1``. Per group:
    ``mask_kind``, ``alignment``, ``need`` and ``interval`` (:func:`keeps`);
    ``tables[g]``, ``cached[g]`` its row arrays (a row store's stacks). The pool's
    ``block_group`` and ``cached_tokens`` and the key index's arrays are updated. Out:
    ``mamba_spans[f, g]``, a Mamba group's span ``[num_cached, num_full)`` (its hashed
    blocks' keys join the group's keys cached this step: the caller adds them), else
    ``(0, 0)``."""
    num_groups = block_size.shape[0]
    for f in range(items.shape[0]):
        row = items[f, ROW]
        limit = items[f, LIMIT]
        slab = items[f, SLAB] - items[f, SLAB_ROW]  # words row of chain row 0
        for g in range(num_groups):
            mamba_spans[f, g, 0] = 0
            mamba_spans[f, g, 1] = 0
            bs = block_size[g]
            done = max(cached[g, row], 0)
            full = limit // bs
            if full <= done:
                continue
            for j in range(done, full):
                if not _keeps(
                    mask_kind[g],
                    j,
                    bs,
                    alignment[g],
                    need[g],
                    interval[g],
                    items[f, PROMPT],
                    items[f, JUNCTION],
                ):
                    continue
                block = tables[g, row, j]
                if block == 0:
                    continue
                tokens = (j + 1) * bs
                if block_group[block] >= 0:  # a key already: kept if it covers as much
                    if cached_tokens[block] >= tokens:
                        continue
                    remove_key(
                        key_heads, key_words, key_links, block_group, block, block_group[block]
                    )
                block_group[block] = g
                cached_tokens[block] = tokens
                insert_key(
                    key_heads,
                    key_words,
                    key_links,
                    block_group,
                    words,
                    slab + (j + 1) * ratio[g] - 1,
                    g,
                    block,
                )
            if mask_kind[g] == MAMBA_MASK:
                mamba_spans[f, g, 0] = done
                mamba_spans[f, g, 1] = full
            cached[g, row] = full


#: the compiled :func:`cache_items` (None: numba missing or turned off)
compiled_cache_items = compiled(cache_items)
