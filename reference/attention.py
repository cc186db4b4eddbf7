"""Dense attention in float64, straight from the content model (docs/spec.md §8).

Visible keys of the query at position ``p``:

* full attention: ``[0, p]``;
* sliding window ``w``: ``[max(0, p - w + 1), p]``;
* chunked local ``C``: ``[floor(p / C) * C, p]``.

One rule, one place: the first visible key is ``spec.num_skipped_tokens(p)`` (the tokens dead
once the next token is ``p``), which states exactly these three starts (0 for full). Worked
example, ``SlidingWindowSpec(w=4)``: query 7 sees ``[4, 7]``; ``ChunkedLocalAttentionSpec(C=8)``:
query 13 sees ``[8, 13]``, query 16 sees ``[16, 16]``.

The output of one head is ``sum_j softmax_j(q . k_j / sqrt(d)) * v_j`` over the visible keys,
with the usual max-subtraction for a stable softmax. Pure Python: fine for the tiny head sizes
the checker uses. Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from reference.content import ContentModel, HeadVectors
from reference.errors import InvalidSpecError
from reference.specs import AttentionSpec, KVCacheSpec


def first_visible_key(spec: KVCacheSpec, pos: int) -> int:
    """First key position the query at ``pos`` sees: ``spec.num_skipped_tokens(pos)``.

    SWA w=4: 7 -> 4, 2 -> 0. Chunked C=8: 13 -> 8, 16 -> 16. Full: always 0.
    """
    if not isinstance(spec, AttentionSpec):
        raise InvalidSpecError(f"attention needs an attention spec, got {type(spec).__name__}")
    if pos < 0:
        raise InvalidSpecError(f"query position must be >= 0, got {pos}")
    return spec.num_skipped_tokens(pos)


def visible_keys(spec: KVCacheSpec, pos: int) -> range:
    """Key positions the query at ``pos`` attends to: ``range(first_visible_key, pos + 1)``."""
    return range(first_visible_key(spec, pos), pos + 1)


def attend(
    query: HeadVectors, keys: Sequence[HeadVectors], values: Sequence[HeadVectors]
) -> HeadVectors:
    """Softmax attention of one query over ``keys``/``values`` (all ``[heads][head_size]``)."""
    out = []
    for h, q in enumerate(query):
        scale = 1.0 / math.sqrt(len(q))
        scores = [sum(a * b for a, b in zip(q, k[h])) * scale for k in keys]
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        total = math.fsum(weights)
        d = len(q)
        acc = [math.fsum(w * v[h][i] for w, v in zip(weights, values)) for i in range(d)]
        out.append(tuple(a / total for a in acc))
    return tuple(out)


def dense_attention(
    content: ContentModel,
    spec: KVCacheSpec,
    hashes: Sequence[int],
    positions: Sequence[int],
    layer: int,
) -> list[HeadVectors]:
    """Outputs of the queries at ``positions`` of one request (``hashes`` from the content
    model's ``prefix_hashes``), in float64, with the exact mask of ``spec``."""
    out = []
    for p in positions:
        if p + 1 >= len(hashes):
            raise InvalidSpecError(
                f"query position {p} is past the request's {len(hashes) - 1} tokens"
            )
        keys_at = visible_keys(spec, p)
        keys = [content.key(hashes, j, layer) for j in keys_at]
        values = [content.value(hashes, j, layer) for j in keys_at]
        out.append(attend(content.query(hashes, p, layer), keys, values))
    return out
