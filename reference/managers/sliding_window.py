"""Sliding window ``w``: a hit at ``L`` needs the ``w - 1`` tokens before ``L``.

Since hits are block aligned, those tokens fill the ``need = cdiv(w - 1, bs)``
blocks that end at ``L``. Hit rule (scan from the right, at the group's block size):

    for i = M-1 down to 0 (M = max_length // bs):
        block i cached in every group?
          no  -> run = 0
          yes -> if run == 0 and bs != A and (i+1)*bs % A != 0: skip it (a run must END
                 on an aligned boundary); else take it, run += 1;
                 run >= need -> hit = (i + run) * bs, done
    no run long enough: a run that reaches block 0 is still a hit (nothing before it
    is needed); pop blocks until the length is aligned.

Blocks before the run are null in the result. Example (bs 4, w 8, blocks 2 and 3
cached, M = 4): need 2 -> result [null, null, b2, b3], hit 16. With ``w = 1``,
``need = 0`` but the scan still takes one cached block, so a hit ends on a cached
block (vLLM 0.33 behaviour; see ``cacheable_block_mask``: such a group caches none).

Not downward closed: a hit at ``L`` says nothing about shorter lengths. Only hashed
blocks are scanned (with lookahead hashes the last blocks of a prompt have no hash
yet; vLLM 0.33 indexes past the list there, see findings/vllm).

EAGLE drop: the run needs one block more (``need + 1``), a run may start only where
it ends aligned *after* the drop (``i * bs % A == 0``), and the last block of the
result is dropped (then re-aligned). The cache mask keeps ``need + 1`` blocks per
tail, shifted one block up.

Which blocks are cached: :func:`reference.retention.sliding_window_block_mask`.
Dense retention (alignment ``A`` a multiple of ``bs``): only the ``need`` tail blocks
of every ``A``-token segment, since a hit can only end on an aligned boundary: block
``i`` iff ``i % (A/bs) >= A/bs - need``; every block when ``need >= A/bs``. Example:
bs 2, A 8, w 3 -> need 1 -> blocks 3, 7, 11, ... Sparse retention keeps only the
tails ending on the prompt's replay boundary and its shared-prefix junction.
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.managers.base import Block, Lookup, SingleTypeKVCacheManager
from reference.retention import sliding_window_block_mask
from reference.specs import KVCacheSpec, SlidingWindowSpec, cdiv


def blocks_needed_for_hit(spec: SlidingWindowSpec) -> int:
    """``cdiv(w - 1, bs)``: the blocks holding the ``w - 1`` tokens before a hit."""
    return cdiv(spec.sliding_window - 1, spec.block_size)


def sliding_window_hit(
    hashes: Sequence[bytes],
    max_length: int,
    num_groups: int,
    spec: KVCacheSpec,
    alignment: int,
    lookup: Lookup,
    null_block: Block,
    drop_eagle: bool = False,
) -> tuple[list[list[Block]], int]:
    """The sliding-window hit rule of the module docstring over ``hashes`` (the chain at
    ``bs``; only hashed blocks are scanned: ``min(max_length // bs, len(hashes))``).

    Example: bs 4, w 8, A 4, blocks 2 and 3 cached, max 16 -> ``[null, null, b2, b3]``
    per group, hit 16.
    """
    assert isinstance(spec, SlidingWindowSpec)
    bs = spec.block_size
    need = blocks_needed_for_hit(spec) + (1 if drop_eagle else 0)
    num_blocks = min(max_length // bs, len(hashes))
    out: list[list[Block]] = [[null_block] * num_blocks for _ in range(num_groups)]
    run = 0
    found_run = False
    for i in range(num_blocks - 1, -1, -1):
        cached = lookup(hashes[i])
        if cached is None:
            run = 0
            continue
        end = i if drop_eagle else i + 1
        if run == 0 and bs != alignment and (end * bs) % alignment != 0:
            continue
        for lst, block in zip(out, cached):
            lst[i] = block
        run += 1
        if run >= need:
            out = [lst[: i + run] for lst in out]
            found_run = True
            break
    if not found_run:
        out = [lst[:run] for lst in out]
        # a run starts only where the block end its hit would keep is aligned (above):
        # [0, run) is aligned without the EAGLE drop; with it, trim back to the alignment
        while bs != alignment and (len(out[0]) * bs) % alignment != 0:
            out = [lst[:-1] for lst in out]
    if drop_eagle and out[0]:
        out = [lst[:-1] for lst in out]
        while bs != alignment and (len(out[0]) * bs) % alignment != 0:
            out = [lst[:-1] for lst in out]
    return out, len(out[0]) * bs


def window_cache_mask(manager, request, start: int, end: int) -> list[bool] | None:
    """Which blocks ``[start, end)`` of ``request`` a sliding-window ``manager`` registers:
    :func:`reference.retention.sliding_window_block_mask` with the manager's alignment,
    ``need`` (one more and shifted one block under EAGLE), retention interval and the
    request's reachable boundaries. The ``cacheable_block_mask`` of both engines'
    sliding-window managers (``manager`` needs ``spec``, ``block_size``,
    ``cache_hit_alignment``, ``use_eagle``, ``retention_interval`` and
    ``reachable_boundaries``). Example: bs 2, A 2, w 3, sparse, P 11 -> only block 4."""
    eagle = 1 if manager.use_eagle else 0
    return sliding_window_block_mask(
        start,
        end,
        manager.cache_hit_alignment,
        manager.block_size,
        blocks_needed_for_hit(manager.spec) + eagle,
        manager.retention_interval,
        manager.reachable_boundaries(request),
        shift=eagle,
    )


class SlidingWindowManager(SingleTypeKVCacheManager):
    scan = staticmethod(sliding_window_hit)

    cacheable_block_mask = window_cache_mask
