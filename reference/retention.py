"""Prefix-cache retention: which sliding-window and Mamba blocks get registered.

A full-attention block can serve every later hit, so it is always cached. A
sliding-window block only serves hits that end within ``need`` blocks after it,
and a Mamba state only serves a hit ending exactly on its boundary. The
*retention interval* (``KVCacheLayout.prefix_cache_retention_interval``) says
which of those blocks are worth registering:

* ``None`` (dense, what a hand-built vLLM ``KVCacheConfig`` gives): every block a
  hit at any aligned boundary could use;
* ``0`` (sparse, vLLM's production default): only the blocks a *replay* of the
  same prompt (or a longer prompt sharing it) can hit, plus those of a detected
  shared-prefix junction;
* ``k > 0`` (a multiple of the scheduler block size): one tail per ``k``-token
  segment, plus the replay and junction tails of ``0``.

Full attention and chunked local attention ignore the interval.

Replay boundaries (token positions a later request can resume at, without EAGLE):
``(P - 1,)`` for a prompt of ``P`` tokens: a resend of the identical prompt is
capped at ``num_tokens - 1`` and a longer prompt hits the same aligned block. A
junction is ``request.shared_prefix_boundary``: the lookup of that request found
some group caching a longer prefix than the reconciled hit
(``hit + uncached``); its tail is kept so siblings sharing that prefix hit it.

Worked example (SWA ``w = 3``, ``bs = 2``, one group so ``A = 2``, ``need = 1``):
a prompt of 11 tokens caches blocks 0..4 under dense retention; under sparse
retention only block ``floor(10 / 2) * 2 / 2 - 1 = 4`` (the block ending at the
replay boundary 10); with ``k = 4`` the segment tails 1 and 3 plus block 4.
"""

from __future__ import annotations

from reference.errors import InvalidLayoutError


def validate_retention_interval(
    retention_interval: int | None, scheduler_block_size: int, has_sparse_group: bool
) -> None:
    """vLLM 0.33's rule: ``None`` always; ``0`` always; ``k > 0`` only when the layout
    has a sliding-window or Mamba group and ``k % scheduler_block_size == 0``.

    Example: full bs 4 + SWA bs 2 (``S = 4``): ``8`` is valid, ``6`` is not; a
    full-attention-only layout accepts ``None`` and ``0`` only.
    """
    if retention_interval is None:
        return
    if isinstance(retention_interval, bool) or not isinstance(retention_interval, int):
        raise InvalidLayoutError(
            "KVCacheLayout.prefix_cache_retention_interval must be None or an int >= 0, "
            f"got {retention_interval!r}"
        )
    if not has_sparse_group:
        if retention_interval == 0:
            return
        raise InvalidLayoutError(
            "KVCacheLayout.prefix_cache_retention_interval is "
            f"{retention_interval} but the layout has no sliding-window or Mamba group "
            "(retention only applies to them); use None or 0"
        )
    if retention_interval < 0 or retention_interval % scheduler_block_size != 0:
        raise InvalidLayoutError(
            "KVCacheLayout.prefix_cache_retention_interval must be >= 0 and a multiple of "
            f"the scheduler block size {scheduler_block_size}, got {retention_interval}"
        )


def replay_boundaries(
    num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool = False
) -> tuple[int, ...]:
    """Token positions a later request replaying this prompt can resume at.

    Without EAGLE: ``(P - 1,)``. With EAGLE (the last matched block is dropped) the
    resend lands one block below ``floor((P - 1) / S) * S`` and a longer sibling one
    block below ``floor(P / S) * S``: ``{max(those - S, 0)}``, sorted.

    Examples: ``P = 11, S = 4`` -> ``(10,)``; with EAGLE ``(4,)`` (resend 8 - 4,
    extension 8 - 4); ``P = 12, S = 4`` with EAGLE -> ``(4, 8)``.
    """
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    s = scheduler_block_size
    resend = (num_prompt_tokens - 1) // s * s
    extension = num_prompt_tokens // s * s
    return tuple(sorted({max(resend - s, 0), max(extension - s, 0)}))


def reachable_boundaries(
    num_prompt_tokens: int,
    shared_prefix_boundary: int,
    scheduler_block_size: int,
    block_size: int,
    use_eagle: bool = False,
    eagle_replay: bool | None = None,
) -> list[int]:
    """Replay boundaries plus the junction (and, for an EAGLE group, the junction
    minus ``bs``). ``eagle_replay``: whether the replay boundaries are EAGLE's (any
    group of the layout drops; defaults to ``use_eagle``, this group's flag).

    Example: ``P = 11, S = 4``, junction 8, no EAGLE -> ``[10, 8]``.
    """
    replay_eagle = use_eagle if eagle_replay is None else eagle_replay
    out = list(replay_boundaries(num_prompt_tokens, scheduler_block_size, replay_eagle))
    if shared_prefix_boundary:
        out.append(shared_prefix_boundary)
        if use_eagle:
            out.append(shared_prefix_boundary - block_size)
    return out


def sliding_window_block_mask(
    start_block: int,
    end_block: int,
    alignment: int,
    block_size: int,
    need: int,
    retention_interval: int | None,
    boundaries: list[int],
    shift: int = 0,
) -> list[bool] | None:
    """Which blocks ``[start_block, end_block)`` a sliding-window group registers.

    ``need`` = contiguous blocks a hit ends with (``cdiv(w - 1, bs)``, +1 under
    EAGLE); ``shift`` = 1 under EAGLE (the run ends one block past the boundary).
    ``None`` means every block.

    1. ``alignment % block_size != 0`` -> None.
    2. Segment tails, segment = ``alignment`` (dense), none (``0``) or the interval:
       ``per_segment = segment // bs``; ``need >= per_segment`` -> None; else block
       ``i`` iff ``i >= shift`` and ``(i - shift) % per_segment >= per_segment - need``.
    3. Not dense: for each boundary ``B``, ``end = floor(B / A) * A // bs + shift``;
       blocks ``[end - need, end)`` are registered.

    Examples (bs 2, A 4, need 1): dense, blocks 0..5 -> ``[F, T, F, T, F, T]``;
    sparse with boundary 10 -> end 4 -> only block 3; interval 8 (per segment 4)
    with boundary 10 -> blocks 3 (segment tail) and 3 (replay) -> only block 3.
    """
    if alignment % block_size != 0:
        return None
    mask = [False] * (end_block - start_block)
    if retention_interval is None:
        segment: int | None = alignment
    elif retention_interval == 0:
        segment = None
    else:
        segment = retention_interval
    if segment is not None:
        per_segment = segment // block_size
        if need >= per_segment:
            return None
        for i in range(start_block, end_block):
            if i >= shift and (i - shift) % per_segment >= per_segment - need:
                mask[i - start_block] = True
    if retention_interval is not None:
        for boundary in boundaries:
            run = boundary_blocks(boundary, alignment, block_size, need, shift)
            for j in range(max(start_block, run.start), min(end_block, run.stop)):
                mask[j - start_block] = True
    return mask


def boundary_blocks(
    boundary: int, alignment: int, block_size: int, need: int, shift: int = 0
) -> range:
    """The blocks a sliding-window group keeps for a hit ending at ``boundary`` (rule 3 of
    :func:`sliding_window_block_mask`): ``[end - need, end)``, ``end = floor(B / A) * A //
    bs + shift`` (its start may be below 0: callers clip). Example: B 10, A 4, bs 2, need
    1 -> ``range(3, 4)``."""
    end = boundary // alignment * alignment // block_size + shift
    return range(end - need, end)


def mamba_block_mask(
    start_block: int,
    end_block: int,
    alignment: int,
    block_size: int,
    retention_interval: int | None,
    boundaries: list[int],
) -> list[bool] | None:
    """Which Mamba states ``[start_block, end_block)`` are registered (block ``i`` holds
    the state at ``(i + 1) * bs``). ``None`` means every block.

    * dense (``None``) -> None;
    * ``k > 0``: ``per_segment = k // bs``; ``<= 1`` -> None; else every block ``i``
      with ``(i + 1) % per_segment == 0``;
    * ``0`` or ``k > 0``: for each boundary ``B``, the block
      ``floor(B / A) * A // bs - 1`` (if in range).

    Example (bs 4, A 4): sparse, boundary 19 -> block 3 (state at 16) only;
    interval 8 -> blocks 1, 3 (and 3 again for the replay).
    """
    if retention_interval is None:
        return None
    mask = [False] * (end_block - start_block)
    if retention_interval > 0:
        per_segment = retention_interval // block_size
        if per_segment <= 1:
            return None
        first = (start_block + per_segment) // per_segment * per_segment - 1
        for i in range(first - start_block, len(mask), per_segment):
            mask[i] = True
    for boundary in boundaries:
        block = boundary // alignment * alignment // block_size - 1
        if start_block <= block < end_block:
            mask[block - start_block] = True
    return mask
