"""The caching of a decode step's loud items inside the compiled pass (numba), when the
pool keeps its keys in arrays (:class:`~optimized.control.key_index.ArrayKeyIndex`).

:func:`~optimized.control.compiled_decode.loud_pass` calls :func:`cache_row` for each
item that completes a block to register, right after the item's pops (the reference's
order), which registers them group after group, exactly as ``cache_blocks`` does
(:meth:`~optimized.control.managers.base.SingleTypeKVCacheManager.cache_plan` and
:meth:`~optimized.control.block_pool.BlockPool.cache_block`): in each group the blocks
``[num_cached, num_full)`` of the row, ``num_full = min(cache limit, hashed tokens) //
bs``, those the group's retention mask keeps (:func:`keeps`), each under the chain's
hash at its end, a null skipped, a block whose key already covers as many tokens kept
(one with a shorter key promoted); then ``num_cached = num_full``.

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

Example: gpt-oss (full + window 128, bs 16, sparse), a request of a 1300-token prompt
decoding at 1343 computed tokens completes block 83: the full group registers it; the
window keeps only the ``need = 8`` blocks ending at its replay boundary's aligned block
``1299 // 16 * 16 // 16 = 81`` (blocks 73..80), so it registers nothing.
"""

from __future__ import annotations

import numpy as np

from optimized.control.jit import compiled
from optimized.control.key_index import insert_key, remove_key

#: per group, how its retention mask reads (the ``kind`` of :func:`keeps`)
EVERY_BLOCK, WINDOW_MASK, MAMBA_MASK = 0, 1, 2


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


def cache_row(
    row: int,
    limit: int,
    prompt: int,
    junction: int,
    words: np.ndarray,
    base: int,
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
    spans: np.ndarray,
) -> None:
    """Register what one decode item completes in ``row`` (module docstring), group
    after group: its cache limit ``limit`` (``min(cacheable tokens, hashed tokens)``),
    its prompt tokens and junction (the masks' boundaries); its chain's hash row ``r`` is
    ``words[base + r]`` (a group ``g``'s block ``j`` takes row ``(j + 1) * ratio[g] -
    1``). Per group: ``mask_kind``, ``alignment``, ``need`` and ``interval``
    (:func:`keeps`); ``tables[g]``, ``cached[g]`` its row arrays (a row store's stacks).
    The pool's ``block_group`` and ``cached_tokens`` and the key index's arrays are
    updated. Out: ``spans[g]``, a Mamba group's span ``[num_cached, num_full)`` (its
    hashed blocks' keys join the group's keys cached this step: the caller adds them),
    else ``(0, 0)``."""
    for g in range(block_size.shape[0]):
        spans[g, 0] = 0
        spans[g, 1] = 0
        bs = block_size[g]
        done = max(cached[g, row], 0)
        full = limit // bs
        if full <= done:
            continue
        for j in range(done, full):
            if not _keeps(
                mask_kind[g], j, bs, alignment[g], need[g], interval[g], prompt, junction
            ):
                continue
            block = tables[g, row, j]
            if block == 0:
                continue
            tokens = (j + 1) * bs
            if block_group[block] >= 0:  # a key already: kept if it covers as much
                if cached_tokens[block] >= tokens:
                    continue
                remove_key(key_heads, key_words, key_links, block_group, block, block_group[block])
            block_group[block] = g
            cached_tokens[block] = tokens
            insert_key(
                key_heads,
                key_words,
                key_links,
                block_group,
                words,
                base + (j + 1) * ratio[g] - 1,
                g,
                block,
            )
        if mask_kind[g] == MAMBA_MASK:
            spans[g, 0] = done
            spans[g, 1] = full
        cached[g, row] = full


#: :func:`cache_row` as the decode pass calls it: compiled where numba is on
row_caching = compiled(cache_row) or cache_row
