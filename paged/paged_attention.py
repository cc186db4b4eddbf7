"""Attention for every scheduled token of a step, read through a group's block table.

For each request the keys ``[c0 * bs, seq_len)`` are gathered from the paged cache through the
request's row, where ``c0`` is the number of leading entries the nulling view replaced with 0
(``reference.block_table.num_nulled_entries``). Every query then attends the keys of its own
mask (``reference.attention.first_visible_key`` up to itself). Worked example, SWA ``w = 4``,
``bs = 4``, row ``[0, 5, 6]``, queries 8 and 9 (``first_pos = 8``): ``c0 = (8 - 3) // 4 = 1``,
keys 4..9 are gathered from blocks 5 and 6, query 8 sees keys ``[5, 8]``, query 9 ``[6, 9]``.

NaN safety: pages are NaN until written, so a gathered key that no scheduled query can see
(the head of the first gathered block, stale pages) is zeroed before the product, and masked
scores are selected away with ``torch.where``; a NaN therefore shows in an output only when a
query really needs that key.

Backends: ``"torch"`` (explicit einsum + softmax, the baseline) and ``"sdpa"``
(``torch.nn.functional.scaled_dot_product_attention`` over the gathered pages with a boolean
mask). Both run on whatever device the cache lives on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paged.paged_cache import PagedKVCache
from reference.attention import first_visible_key
from reference.block_table import num_nulled_entries
from reference.errors import KVConformError
from reference.specs import AttentionSpec

BACKENDS = ("torch", "sdpa")


class PagedAttentionError(KVConformError):
    """Inputs of a paged attention call disagree (shapes, unknown backend, short row)."""


@dataclass(frozen=True)
class RequestQueries:
    """The scheduled queries of one request in one step.

    ``row``: the request's block table row (the engine's, before the nulling view);
    ``positions``: the scheduled positions, ascending and contiguous;
    ``queries``: ``[len(positions), heads, head_size]``.
    """

    row: tuple[int, ...]
    positions: tuple[int, ...]
    queries: torch.Tensor


def paged_attention(
    cache: PagedKVCache,
    spec: AttentionSpec,
    requests: Sequence[RequestQueries],
    *,
    backend: str = "torch",
) -> list[torch.Tensor]:
    """Outputs ``[len(positions), heads, head_size]`` per request (cache dtype and device).

    All requests go through one padded batch: ``R`` requests, ``Q`` queries and ``K`` gathered
    keys at most per request; padded keys read the null page and are masked and zeroed.
    """
    if backend not in BACKENDS:
        raise PagedAttentionError(f"backend must be one of {BACKENDS}, got {backend!r}")
    live = [r for r in requests if r.positions]
    if not live:
        return [_empty(cache, r) for r in requests]
    bs = cache.block_size
    device = cache.key.device
    heads, dim = cache.shape.num_kv_heads, cache.shape.head_size
    first_cols, col_lists = [], []
    for r in live:
        c0 = num_nulled_entries(spec, r.positions[0])
        c1 = -(-(r.positions[-1] + 1) // bs)
        if c1 > len(r.row):
            raise PagedAttentionError(
                f"position {r.positions[-1]} needs {c1} block table entries, the row has "
                f"{len(r.row)}"
            )
        first_cols.append(c0)
        col_lists.append(r.row[c0:c1])
    num_cols = max(len(c) for c in col_lists)
    num_q = max(len(r.positions) for r in live)
    cols = torch.tensor([list(c) + [0] * (num_cols - len(c)) for c in col_lists], device=device)
    keys = cache.key[cols].reshape(len(live), num_cols * bs, heads, dim)
    values = cache.value[cols].reshape(len(live), num_cols * bs, heads, dim)
    start = torch.tensor(first_cols, device=device)[:, None] * bs
    key_pos = start + torch.arange(num_cols * bs, device=device)[None, :]
    q_pos = torch.tensor([_pad(r.positions, num_q, -1) for r in live], device=device)
    q_first = torch.tensor(
        [_pad([first_visible_key(spec, p) for p in r.positions], num_q, 0) for r in live],
        device=device,
    )
    mask = (key_pos[:, None, :] <= q_pos[:, :, None]) & (key_pos[:, None, :] >= q_first[:, :, None])
    used = mask.any(dim=1)[:, :, None, None]
    zero = torch.zeros((), dtype=keys.dtype, device=device)
    keys = torch.where(used, keys, zero)
    values = torch.where(used, values, zero)
    queries = torch.zeros((len(live), num_q, heads, dim), dtype=keys.dtype, device=device)
    for i, r in enumerate(live):
        queries[i, : len(r.positions)] = r.queries.to(device=device, dtype=keys.dtype)
    if backend == "sdpa":
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None],
        ).transpose(1, 2)
    else:
        scores = torch.einsum("rqhd,rkhd->rhqk", queries, keys) / math.sqrt(dim)
        scores = torch.where(mask[:, None], scores, torch.tensor(-math.inf, device=device))
        out = torch.einsum("rhqk,rkhd->rqhd", torch.softmax(scores, dim=-1), values)
    outputs = iter(out[i, : len(r.positions)] for i, r in enumerate(live))
    return [next(outputs) if r.positions else _empty(cache, r) for r in requests]


def _pad(values: Sequence[int], n: int, fill: int) -> list[int]:
    return list(values) + [fill] * (n - len(values))


def _empty(cache: PagedKVCache, req: RequestQueries) -> torch.Tensor:
    shape = (0, cache.shape.num_kv_heads, cache.shape.head_size)
    return torch.zeros(shape, dtype=cache.key.dtype, device=cache.key.device)
