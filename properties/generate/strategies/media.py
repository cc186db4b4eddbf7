"""Multimodal items and prompt embeddings of arrivals (engines declaring the
``multimodal`` production setting; :mod:`reference.media`).

Images come from a small catalogue (:data:`IMAGES`): an image's identifier fixes its number
of placeholder tokens (in units of the hash block size ``H``: ``H + 1``, ``2H - 1``, ``3``),
as in a real model, where the same picture always takes the same tokens. They are placed
at or next to a hash block boundary, so that most straddle one: a resend with the same
images hits through the blocks they cover, and one with another image at the same place
(same tokens) must not. Prompt embeddings give position ``p`` the id ``2 * token_p +
variant`` (``variant`` 0 or 1 per request): equal prompts with the same variant hit, with the
other variant they share nothing.

Example (:func:`media_of`, ``H`` 4, a 12-token prompt, seed 5): ``(("img-b", 4, 7),)``: the
image covers positions 4..10, straddling the block boundary at 8.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from properties.core.trace import Arrive
from reference.layout import KVCacheLayout

#: identifier -> placeholder tokens as ``(k, d)``: ``k * H + d`` (at least 1)
IMAGES: dict[str, tuple[int, int]] = {"img-a": (1, 1), "img-b": (2, -1), "img-c": (0, 3)}


def image_length(identifier: str, hash_block_size: int) -> int:
    """The placeholder tokens of catalogue image ``identifier``: ``img-a`` ``H + 1``,
    ``img-b`` ``2H - 1``, ``img-c`` 3 (never below 1). Example: H 4 -> 5, 7, 3."""
    k, d = IMAGES[identifier]
    return max(1, k * hash_block_size + d)


def media_of(
    layout: KVCacheLayout, num_prompt_tokens: int, seed: int, kind: str
) -> dict[str, object]:
    """The media of a prompt from ``seed`` (deterministic): ``kind`` ``images`` gives up to
    three catalogue images, each at or one token off a hash block boundary after the
    previous one, as many as fit; ``embeds`` gives embedding ids ``2 * token + variant`` (the
    caller fills them: :func:`with_embeds`); anything else nothing. Returns the ``Arrive``
    fields to set."""
    if kind != "images":
        return {}
    rng = random.Random(seed)
    h = layout.hash_block_size
    items: list[tuple[str, int, int]] = []
    start = 0
    for _ in range(rng.randrange(1, 4)):
        identifier = rng.choice(sorted(IMAGES))
        length = image_length(identifier, h)
        first = -(-start // h) * h + rng.choice((-1, 0, 0, 1))
        first = max(start, first)
        if first + length > num_prompt_tokens:
            break
        items.append((identifier, first, length))
        start = first + length + rng.randrange(0, h + 1)
    return {"mm_items": tuple(items)}


def with_embeds(op: Arrive, variant: int) -> Arrive:
    """``op`` with prompt embeddings ``2 * token + variant`` at every prompt position."""
    return Arrive(
        op.request_id,
        op.prompt,
        op.output,
        op.cache_salt,
        op.lora_name,
        op.mm_items,
        tuple(2 * t + variant for t in op.prompt),
    )


def carry_media(old: Arrive, prompt: Sequence[int]) -> dict[str, object]:
    """The media an arrival built from ``old`` keeps for its ``prompt`` (``old``'s prompt,
    cut or extended): the items that still lie inside it, and, when ``old`` has prompt
    embeddings, ids for every position by the same rule (``2 * token + variant``). Example:
    ``old`` with an image at 4..10 cut to 8 tokens keeps none."""
    out: dict[str, object] = {}
    items = tuple(item for item in old.mm_items if item[1] + item[2] <= len(prompt))
    if items:
        out["mm_items"] = items
    if old.prompt_embeds is not None:
        variant = old.prompt_embeds[0] - 2 * old.prompt[0]
        out["prompt_embeds"] = tuple(2 * t + variant for t in prompt)
    return out


def bulk_media(layout: KVCacheLayout, ops: Sequence) -> tuple:
    """The large tiers' arrivals with media (deterministic, nothing drawn): an arrival whose
    prompt digest is 0 or 1 modulo 5 gets images (:func:`media_of` seeded by the digest),
    2 gets prompt embeddings (variant: the digest's parity); equal prompts get equal media,
    so a batch of requests alike still shares its blocks. Other operations pass unchanged."""
    out = []
    for op in ops:
        if not isinstance(op, Arrive):
            out.append(op)
            continue
        digest = int.from_bytes(hashlib.sha256(repr(op.prompt).encode()).digest()[:4], "big")
        pick = digest % 5
        if pick == 2:
            out.append(with_embeds(op, (digest >> 3) & 1))
        elif pick < 2:
            media = media_of(layout, len(op.prompt), digest, "images")
            out.append(
                Arrive(op.request_id, op.prompt, op.output, op.cache_salt, op.lora_name, **media)
            )
        else:
            out.append(op)
    return tuple(out)
