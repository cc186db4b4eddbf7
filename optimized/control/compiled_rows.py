"""Per-row rules the compiled loops share (numba): each group's kind of block dropping,
and a row's decode threshold.

Example: gemma3's groups are ``[NO_SKIP, WINDOW, WINDOW, ...]``; a row of the full group
holding 3 blocks of 16 and windows of 1024 holding 3 with 1 leading null has threshold
``min(48, 2 * 16 + 1023) = 48`` with no caching.
"""

from __future__ import annotations

import numpy as np

from optimized.control.jit import compiled

#: per group, how its rows drop blocks: never, a sliding window, a chunk; or a Mamba
#: group (columns retired, one state block per step at most)
NO_SKIP, WINDOW, CHUNK, MAMBA = 0, 1, 2, 3


def row_threshold(
    row: int,
    limit: int,
    caching: bool,
    twin_of: np.ndarray,
    block_size: np.ndarray,
    skip_kind: np.ndarray,
    skip_param: np.ndarray,
    row_lens: np.ndarray,
    leading: np.ndarray,
    cached: np.ndarray,
    retired: np.ndarray,
) -> int:
    """A row's decode threshold (the least over its classes of twins of
    :meth:`~optimized.control.managers.base.SingleTypeKVCacheManager._threshold`, Mamba's
    :meth:`~optimized.control.managers.mamba.MambaManager._threshold` for a Mamba class)
    from its counts, its cached blocks taken as at least ``limit // bs`` (a decode item
    about to cache up to its cache limit ``limit``; -1: none). Example: full bs 16 held 3,
    window w 32 held 3 leading 1, cached 2, no limit -> min(48, 63, 47) = 47."""
    least = -1
    for g in range(twin_of.shape[0]):
        if twin_of[g] != g:
            continue
        bs = block_size[g]
        held = row_lens[g, row]
        lead = leading[g, row]
        done = max(cached[g, row], limit // bs)
        at = held * bs  # the next block
        kind = skip_kind[g]
        if kind == MAMBA:  # the next retirement
            at = min(at, (retired[g, row] + 1) * bs + 1)
        elif kind != NO_SKIP and held > lead:  # the next drop
            tokens = (lead + 1) * bs
            if kind == WINDOW:
                at = min(at, tokens + skip_param[g] - 1)
            else:
                at = min(at, (tokens + skip_param[g] - 1) // skip_param[g] * skip_param[g])
        if caching:  # the next completed block
            at = min(at, max(done, 0) * bs + bs - 1)
        if least < 0 or at < least:
            least = at
    return least


#: :func:`row_threshold` as the compiled loops call it
threshold_of = compiled(row_threshold) or row_threshold
