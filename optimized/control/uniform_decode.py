"""The decode step of a batch whose items are all alike, as one item's plan applied to every
row (:func:`optimized.control.batched_decode.apply_decode_items` tries it first).

Items are alike when they have the same computed count and, per group, the same row
length, leading-null count and cached count: a batch prefilled together, at its first
decode steps (the step in which every window drops most of its blocks at once is the
costly one). Then what one item frees, pops and caches in a group, every item does at the
same columns of its row, and the step is a few 2-D array operations whatever the number
of items, instead of the general pass's per-item bookkeeping (item and call indices,
bincounts, cumulative sums). Any case it does not cover (a block held twice, a null
inside a freed span, runs of unequal lengths, pops past an item's own run, pops that
would not fit) is left, with nothing changed, to the general pass.

Example: 64 requests of 2048 tokens on gpt-oss (SWA w 128 + full, bs 16) at their first
decode step: every row frees columns 0..119 of its window row and pops one block per
group.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from optimized.control.block_pool import NULL_BLOCK_ID
from optimized.control.uniformity import row_index, same_everywhere


class UniformGroupPlan(NamedTuple):
    """What every item of a uniform step does in one group (:func:`uniform_plan`)."""

    pops: int  # blocks popped (0 or 1)
    held: int  # the row length before the step
    first_freed: int  # the freed span ``[first_freed, last_freed)`` (empty: none freed)
    last_freed: int
    cached: int  # the cached-block count (-1: the reference has no entry for the row)


def _runs_alike(front: np.ndarray) -> bool:
    """Does every row of ``front`` (item x freed block: goes to the front) count as many
    front blocks as the first? One bytes comparison when every row is the same mask (the
    common case: items alike hash the same columns), else a count per row. Example:
    ``[[1, 0], [0, 1]]`` -> True; ``[[1, 1], [0, 1]]`` -> False."""
    if same_everywhere(front):
        return True
    return same_everywhere(front.sum(axis=1, dtype=np.int64))


def uniform_plan(
    managers, rows: np.ndarray, total: int, slots: int
) -> list[UniformGroupPlan] | None:
    """Per group, the plan of every item of a step whose items have all computed
    ``total`` tokens (``slots`` after the step) and hold ``rows``, or None when the rows
    differ in a group's counts, when an item would pop more than one block in a group, or
    when the general pass would refuse (a row the reference has no entry for whose pops
    differ from its need). The rules are the general pass's, on one item's ints: pops
    ``max(cdiv(slots, bs) - held, 0)``; a dropping group frees ``[leading, max(min(
    skipped // bs, held), leading))``. Example: full (bs 16), rows of 128 blocks, total
    2048 -> ``pops 1, held 128``, nothing freed."""
    at = row_index(rows)
    plan: list[UniformGroupPlan] = []
    for mg in managers:
        held = mg.row_len[at]
        cached = mg.num_cached_block[at]
        if not (same_everywhere(held) and same_everywhere(cached)):
            return None
        h = held.item(0)
        blocks_needed = -(-slots // mg.block_size)
        pops = max(blocks_needed - h, 0)
        if pops > 1:
            return None
        lo = hi = skipped_blocks = 0
        skipped = mg._skipped_tokens(np.array([total]))
        if skipped is not None:
            lead = mg.num_leading_null[at]
            if not same_everywhere(lead):
                return None
            skipped_blocks = skipped.item(0) // mg.block_size
            lo = lead.item(0)
            hi = max(min(skipped_blocks, h), lo)
        if cached.item(0) < 0 and max(blocks_needed - max(skipped_blocks, h), 0) != pops:
            return None
        plan.append(UniformGroupPlan(pops, h, lo, hi, cached.item(0)))
    return plan


def uniform_caches_nothing(
    managers, plan: list[UniformGroupPlan], cache_tokens: np.ndarray
) -> bool:
    """Does no item of a uniform step register a block? True when every item caches the
    same ``c`` tokens and every group has the hash block size ``h`` and ``c // h`` blocks
    cached already (then ``min(c, hashed) // h`` cannot exceed them: the general pass's
    ``_caching_items`` rule). Example: ``c`` 2049, ``h`` 16, 128 blocks cached in every
    group -> True."""
    h = managers[0].block_pool.hash_block_size
    c = cache_tokens.item(0)
    return same_everywhere(cache_tokens) and all(
        mg.block_size == h and c // h <= max(p.cached, 0) for mg, p in zip(managers, plan)
    )


def apply_uniform(
    managers, pool, rows: np.ndarray, plan: list[UniformGroupPlan]
) -> list[list[list[int]]] | None:
    """The frees, pops and table writes of a uniform step (:func:`uniform_plan`); the new
    block ids per item and group, or None (nothing changed) when a case below fails.

    The freed blocks form a matrix, one row per item: groups in order, each span tail
    first, as the reference frees them. Every one must be held once (so it reaches 0).
    Hashed ones go to the back in that order. Unhashed ones go to the front: per item its
    *run*, the freeing groups reversed (each free call prepends before the earlier
    ones), the later items' runs before the earlier ones'. With pops, each item pops the
    first ``p`` of its own run (it freed them just before popping) when every run has the
    same length ``k >= p``; with no unhashed block freed, the pops take the queue's front
    in item order (every item's pops must fit what is free at its turn). Example: one
    window group, 2 rows ``[1, 2, 3]`` and ``[4, 5, 6]``, all unhashed, each dropping its
    first 2 blocks and popping 1: runs ``[2, 1]`` and ``[5, 4]``, pops ``2`` and ``5``,
    front ``[4, 1, ...]``.
    """
    m = rows.size
    at = row_index(rows)
    num_pops = sum(p.pops for p in plan)
    spans = [(g, p.first_freed, p.last_freed) for g, p in enumerate(plan)]
    spans = [(g, lo, hi) for g, lo, hi in spans if hi > lo]
    popped: np.ndarray | None = None
    if spans:
        freed = np.empty((m, sum(hi - lo for _, lo, hi in spans)), dtype=np.int64)
        if len(spans) == 1:
            g, lo, hi = spans[0]
            freed[:] = managers[g].table[at, lo:hi][:, ::-1]
        else:
            parts = [managers[g].table[at, lo:hi][:, ::-1] for g, lo, hi in spans]
            np.concatenate(parts, axis=1, out=freed)
        flat = freed.reshape(-1)
        if np.count_nonzero(flat) != flat.size or not pool.all_held_once(flat):
            return None  # a null inside a span, or a block held twice
        unhashed = (pool.block_group.take(flat) < 0).reshape(m, -1)
        num_front = np.count_nonzero(unhashed)
        run_blocks, run_front = freed, unhashed
        if len(spans) > 1 and num_front:  # runs: the freeing groups reversed
            widths = [hi - lo for _, lo, hi in spans]
            starts = np.cumsum(widths) - widths
            order = np.concatenate([np.arange(a, a + w) for a, w in zip(starts, widths)][::-1])
            run_blocks, run_front = freed[:, order], unhashed[:, order]
        if num_front and num_pops:
            k = num_front // m
            if k * m != num_front or k < num_pops or not _runs_alike(run_front):
                return None  # runs of unequal lengths, or pops past an item's own run
            if k == run_blocks.shape[1]:
                runs = run_blocks
            else:
                runs = run_blocks.reshape(-1).compress(run_front.reshape(-1)).reshape(m, k)
            popped, left = runs[:, :num_pops], runs[::-1, num_pops:].reshape(-1)
        elif num_pops:
            # free at item i's turn: before + (i + 1) * freed_each - i * pops, linear in i:
            # the last item's turn is the tightest unless freed_each >= pops (then none is)
            freed_each = flat.size // m
            if pool.get_num_free_blocks() + m * freed_each - (m - 1) * num_pops < num_pops:
                return None  # the last item's pops would not fit at its turn
        # -- apply ---------------------------------------------------------------------
        pool.ref_cnt[flat] = 0
        for g, lo, hi in spans:
            mg = managers[g]
            mg.table[at, lo:hi] = NULL_BLOCK_ID
            mg.num_leading_null[at] = hi
            mg.dirty_rows[at] = True
        queue = pool.free_block_queue
        if popped is not None:
            if left.size:
                queue.prepend_n(left)
            pool.ref_cnt[popped] = 1
        elif num_front:
            queue.prepend_n(run_blocks[::-1].reshape(-1).compress(run_front[::-1].reshape(-1)))
        if num_front < flat.size:
            queue.append_n(flat.compress(~unhashed.reshape(-1)))
    elif num_pops and pool.get_num_free_blocks() < m * num_pops:
        return None
    if popped is None:
        popped = np.asarray(pool.get_new_blocks(m * num_pops), dtype=np.int64)
        popped = popped.reshape(m, num_pops)
    return _append_uniform(managers, at, plan, popped)


def _append_uniform(
    managers, at: np.ndarray | slice, plan: list[UniformGroupPlan], popped: np.ndarray
) -> list[list[list[int]]]:
    """Each popping group's column of ``popped`` (item x popping group, groups in order)
    appended to every row at the shared length; the new ids per item and group.
    Example: groups popping ``[1, 0, 1]``, popped ``[[4, 5], [6, 7]]`` -> ``[[[4], [],
    [5]], [[6], [], [7]]]``."""
    m = popped.shape[0]
    columns: list[list[list[int]]] = []
    j = 0
    for mg, p in zip(managers, plan):
        if not p.pops:
            columns.append([[] for _ in range(m)])
            continue
        ids = popped[:, j]
        j += 1
        mg.table[at, p.held] = ids
        mg.row_len[at] = p.held + 1
        mg.dirty_rows[at] = True
        columns.append([[b] for b in ids.tolist()])
    return [list(cells) for cells in zip(*columns)]
