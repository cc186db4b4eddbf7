"""What a request brings besides its token ids: multimodal items and prompt embeddings.

Multimodal items (images, audio): an item occupies the prompt positions ``[offset, offset
+ length)`` (its placeholder tokens) and is known by its ``identifier`` (the hash of its
content, so the same image has the same identifier and the same number of placeholder
tokens). Prompt embeddings: the request gives, for every prompt position, the embedding
the model reads there instead of the token's own; an embedding is named here by an integer
id (two positions with the same id read the same vector).

Both enter the hash chain as extra keys of every hash block they touch (vLLM 0.33,
``generate_block_hash_extra_keys``), in this order after the LoRA key and before the salt:

* ``("mm", identifier, offset - block_start)`` for each item overlapping the block, in
  offset order (an item straddling blocks is named in each, with its offset relative to
  each block's start, negative in the later ones);
* after the salt, ``("prompt_embeds", digest)``: the digest of the block's slice of the
  embeddings (positions past the prompt have none, so a block of outputs gets the digest of
  an empty slice).

With lookahead hashes (``L`` tokens after the block are part of its hash) both are taken
over the block and its lookahead tokens, ``[start, end + L)``.

Worked example (:func:`media_extra_keys`, H 16): image ``"aaa"`` at offset 11, length 10
and ``"bbb"`` at 30, length 18: block 0 ``[0, 16)`` -> ``(("mm", "aaa", 11),)``; block 1
``[16, 32)`` -> ``(("mm", "aaa", -5), ("mm", "bbb", 14))``; block 2 ``[32, 48)`` ->
``(("mm", "bbb", -2),)``; block 3 none.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import NamedTuple

from reference.errors import KVConformError


class MultimodalItem(NamedTuple):
    """One multimodal input of a prompt: positions ``[offset, offset + length)``."""

    identifier: str
    offset: int
    length: int


def validate_media(
    error: type[KVConformError],
    owner: str,
    num_prompt_tokens: int,
    mm_items: object,
    prompt_embeds: object,
) -> tuple[tuple[MultimodalItem, ...], tuple[int, ...] | None]:
    """The items as :class:`MultimodalItem`s and the embeddings as a tuple, checked: each
    item an ``(identifier, offset, length)`` with a non-empty identifier, ``length >= 1``,
    inside the prompt; items in offset order, not overlapping; the embeddings ``None`` or
    one integer ``>= 0`` per prompt position. Example: ``(("img", 3, 4),)`` for a
    6-token prompt raises (positions 3..6 run past it)."""
    if not isinstance(mm_items, (tuple, list)):
        raise error(
            f"{owner}.mm_items must be a tuple of (identifier, offset, length), got {mm_items!r}"
        )
    items: list[MultimodalItem] = []
    end = 0
    for item in mm_items:
        if not isinstance(item, (tuple, list)) or len(item) != 3:
            raise error(f"{owner}.mm_items: {item!r} is not (identifier, offset, length)")
        identifier, offset, length = item
        ok = (
            isinstance(identifier, str)
            and identifier
            and all(type(v) is int for v in (offset, length))
            and offset >= end
            and length >= 1
            and offset + length <= num_prompt_tokens
        )
        if not ok:
            raise error(
                f"{owner}.mm_items: {tuple(item)!r} must name a non-empty identifier and "
                f"positions [offset, offset + length) inside the {num_prompt_tokens}-token "
                "prompt, after the previous item"
            )
        items.append(MultimodalItem(identifier, offset, length))
        end = offset + length
    if prompt_embeds is None:
        return tuple(items), None
    if not isinstance(prompt_embeds, (tuple, list)) or len(prompt_embeds) != num_prompt_tokens:
        raise error(
            f"{owner}.prompt_embeds must be None or one embedding id per prompt position "
            f"({num_prompt_tokens}), got {prompt_embeds!r}"
        )
    if not all(type(e) is int and e >= 0 for e in prompt_embeds):
        raise error(f"{owner}.prompt_embeds must hold integers >= 0, got {prompt_embeds!r}")
    return tuple(items), tuple(prompt_embeds)


def embeds_digest(prompt_embeds: Sequence[int], start: int, end: int) -> bytes:
    """The digest of the embeddings of positions ``[start, end)`` (those past the prompt
    have none: an empty slice has a digest too). Equal slices, equal digests."""
    return hashlib.sha256(pickle.dumps(tuple(prompt_embeds[start:end]), protocol=5)).digest()


def media_extra_keys(
    start: int,
    end: int,
    mm_items: Sequence[MultimodalItem],
    prompt_embeds: Sequence[int] | None,
) -> tuple[list[tuple], list[tuple]]:
    """The extra keys of the token window ``[start, end)`` (module docstring): the items'
    keys (they come before the salt) and the embeddings' key (after it)."""
    items = [
        ("mm", item.identifier, item.offset - start)
        for item in mm_items
        if item.offset < end and start < item.offset + item.length
    ]
    if prompt_embeds is None:
        return items, []
    return items, [("prompt_embeds", embeds_digest(prompt_embeds, start, end))]


def input_identities(
    token_ids: Sequence[int],
    mm_items: Sequence[MultimodalItem] = (),
    prompt_embeds: Sequence[int] | None = None,
) -> list[int]:
    """What each position feeds the model, as one integer: its token id, or, at a position
    an item covers or with prompt embeddings, a 62-bit digest of ``(token, identifier,
    index within the item, embedding id)`` above every token id. Two prefixes read the same
    inputs exactly when these agree (the content models of :mod:`reference.content` and of
    the checks hash these instead of the bare tokens). Example: ``([5, 9], (("img", 1,
    1),))`` -> ``[5, d]`` with ``d >= 2**62``; without media, the tokens themselves."""
    if not mm_items and prompt_embeds is None:
        return list(token_ids)
    covered: dict[int, tuple[str, int]] = {}
    for item in mm_items:
        for p in range(item.offset, item.offset + item.length):
            covered[p] = (item.identifier, p - item.offset)
    out = []
    for p, token in enumerate(token_ids):
        media = covered.get(p)
        embed = prompt_embeds[p] if prompt_embeds is not None and p < len(prompt_embeds) else None
        if media is None and embed is None:
            out.append(int(token))
            continue
        digest = hashlib.blake2b(repr((int(token), media, embed)).encode(), digest_size=8)
        out.append((1 << 62) | int.from_bytes(digest.digest(), "little") >> 2)
    return out
