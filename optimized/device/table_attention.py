"""Paged attention that reads the block ids straight from the device block table.

Unlike :func:`paged.paged_attention.paged_attention` (rows handed over as host tuples), the
block ids here are gathered on the device: ``table[slot, c0 + j]`` for ``j < c1 - c0``,
where ``c0 = num_nulled_entries(spec, start)`` (the leading entries the nulling view drops)
and ``c1 = cdiv(start + count, bs)``. No table entry comes back to the host. Each query at
position ``p`` attends the keys ``[first_visible_key(spec, p), p]`` (the reference's rules,
evaluated on the host per request and per query position; the only host work).

Queries and outputs are flat ``[tokens, heads, head_size]`` in request order, the layout
the slot mapping and K/V writes use. Backends: ``"torch"`` (einsum + softmax), ``"sdpa"``
(``scaled_dot_product_attention`` with a boolean mask) and ``"flex"`` (FlexAttention with
the same mask as a score modifier; eager on CPU, compile it yourself on a GPU).

Worked example: bs 2, sliding window w = 3, slot 1 holds ``[0, 7, 9]`` (block 0 nulled),
one query at position 5: ``c0 = (5 - 3 + 1) // 2 = 1``, ``c1 = 3``, the gathered blocks are
7 and 9 (keys 2..5) and the query sees keys 3, 4, 5. With zero queries the output is the mean
of those three values.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from paged.paged_cache import PagedKVCache
from reference.attention import first_visible_key
from reference.block_table import num_nulled_entries
from reference.errors import KVConformError
from reference.specs import AttentionSpec, cdiv

BACKENDS = ("torch", "sdpa", "flex")


class TableAttentionError(KVConformError):
    """Inputs of a table attention call disagree (shapes, unknown backend, short table)."""


def table_attention(
    cache: PagedKVCache,
    spec: AttentionSpec,
    table: torch.Tensor,
    slots: Sequence[int],
    starts: Sequence[int],
    counts: Sequence[int],
    queries: torch.Tensor,
    *,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Outputs ``[sum(counts), heads, head_size]`` (the cache's dtype and device).

    ``table``: the group's device table ``[slots, blocks]`` (a view is fine);
    request ``i`` sits on ``slots[i]`` and schedules positions
    ``[starts[i], starts[i] + counts[i])`` whose queries are the next ``counts[i]`` rows of
    ``queries``.
    """
    if backend not in BACKENDS:
        raise TableAttentionError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not len(slots) == len(starts) == len(counts):
        raise TableAttentionError(
            f"slots, starts and counts differ in length: {len(slots)}, {len(starts)}, {len(counts)}"
        )
    device = cache.key.device
    heads, dim = cache.shape.num_kv_heads, cache.shape.head_size
    total = int(sum(counts))
    if tuple(queries.shape) != (total, heads, dim):
        raise TableAttentionError(
            f"queries must be [{total}, {heads}, {dim}], got {tuple(queries.shape)}"
        )
    live = [i for i, n in enumerate(counts) if n > 0]
    if not live:
        return torch.zeros((0, heads, dim), dtype=cache.key.dtype, device=device)
    bs = cache.block_size
    first_cols = [num_nulled_entries(spec, starts[i]) for i in live]
    end_cols = [cdiv(starts[i] + counts[i], bs) for i in live]
    if max(end_cols) > table.shape[1]:
        raise TableAttentionError(
            f"a request needs {max(end_cols)} block table entries, the table has {table.shape[1]}"
        )
    num_req = len(live)
    num_cols = max(e - f for f, e in zip(first_cols, end_cols))
    num_q = max(counts[i] for i in live)
    # two host -> device copies per call: per request (slot, c0, c1, count), per token
    # (position, first visible key)
    per_req = torch.tensor(
        [[slots[i] for i in live], first_cols, end_cols, [counts[i] for i in live]]
    ).to(device)
    slot_t, c0, c1, live_counts = per_req
    positions = [starts[i] + k for i in live for k in range(counts[i])]
    per_tok = torch.tensor([positions, [first_visible_key(spec, p) for p in positions]])
    tok_pos, tok_first = per_tok.to(device)
    col = c0[:, None] + torch.arange(num_cols, device=device)[None, :]
    inside = col < c1[:, None]
    blocks = table[slot_t[:, None], col.clamp(max=table.shape[1] - 1)].to(torch.int64)
    blocks = torch.where(inside, blocks, torch.zeros_like(blocks))  # padding reads null
    keys = cache.key[blocks].reshape(num_req, num_cols * bs, heads, dim)
    values = cache.value[blocks].reshape(num_req, num_cols * bs, heads, dim)
    key_pos = c0[:, None] * bs + torch.arange(num_cols * bs, device=device)[None, :]
    # per token: its request (among the live ones) and its offset in the request
    # (output_size given: no device -> host sync on CUDA)
    req_of = torch.repeat_interleave(
        torch.arange(num_req, device=device), live_counts, output_size=total
    )
    offset = torch.arange(total, device=device) - torch.repeat_interleave(
        torch.cumsum(live_counts, 0) - live_counts, live_counts, output_size=total
    )
    q_pos = torch.full((num_req, num_q), -1, dtype=torch.int64, device=device)
    q_pos[req_of, offset] = tok_pos
    q_first = torch.zeros((num_req, num_q), dtype=torch.int64, device=device)
    q_first[req_of, offset] = tok_first
    mask = (key_pos[:, None, :] <= q_pos[:, :, None]) & (key_pos[:, None, :] >= q_first[:, :, None])
    # keys no query sees (the head of the first block, padding, stale pages) are zeroed:
    # unwritten pages are NaN and NaN * 0 would leak through the product
    unused = ~mask.any(dim=1)[:, :, None, None]
    keys.masked_fill_(unused, 0)  # in place: the gather made fresh tensors
    values.masked_fill_(unused, 0)
    padded = torch.zeros((num_req, num_q, heads, dim), dtype=keys.dtype, device=device)
    padded[req_of, offset] = queries.to(device=device, dtype=keys.dtype)
    out = _attend(padded, keys, values, mask, backend)
    return out[req_of, offset]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, backend: str
) -> torch.Tensor:
    """``[R, Q, H, D]`` outputs of ``q`` over ``k``/``v`` ``[R, K, H, D]`` under
    ``mask [R, Q, K]`` (True = visible)."""
    if backend == "torch":
        scores = torch.einsum("rqhd,rkhd->rhqk", q, k) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~mask[:, None], -math.inf)
        return torch.einsum("rhqk,rkhd->rqhd", torch.softmax(scores, dim=-1), v)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if backend == "sdpa":
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask[:, None])
    else:
        from torch.nn.attention.flex_attention import flex_attention

        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.where(mask[b, q_idx, kv_idx], score, -math.inf)

        with warnings.catch_warnings():  # eager FlexAttention (no torch.compile) is intended
            warnings.filterwarnings("ignore", message="flex_attention called without")
            out = flex_attention(qt, kt, vt, score_mod=score_mod)
    return out.transpose(1, 2)
