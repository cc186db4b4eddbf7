"""Chained block hashes: the cache key of a block identifies its whole prefix.

Rule: for hash block ``j`` covering tokens ``[j*H, (j+1)*H)``::

    hash_j = SHA256(pickle((parent, tuple(tokens of block j), extra_keys_j), protocol 5))
    parent = hash_{j-1}, or NONE_HASH for j = 0

``extra_keys_j`` is ``None`` when there are none, else a tuple of, in order: ``("lora",
name, name)`` on every block of a LoRA request, the keys of the multimodal items the block
overlaps (:mod:`reference.media`), ``("cache_salt", salt)`` on block 0 only (the salt
reaches later blocks through the chain), and the prompt embeddings' key of the block
(:mod:`reference.media`). ``NONE_HASH = SHA256(pickle("vllm-none-hash"))``. Only full
blocks are hashed. A coarser group (block size ``k*H``) uses, for its block ``i``, the
chained hash at its end boundary: ``hashes[(i+1)*k - 1]``. The cache key of a block in
group ``g`` is ``hash || g.to_bytes(4, "big")``.

Check values (spec 2.1): NONE_HASH = 066b1e89...1198; H=4 tokens [1,2,3,4] -> 52a7f141...361a.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

from reference.media import MultimodalItem, media_extra_keys

NONE_HASH_SEED = "vllm-none-hash"


def sha256_pickle(obj: object) -> bytes:
    """SHA-256 of the protocol-5 pickle of ``obj`` (token ids must be Python ints)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


NONE_HASH: bytes = sha256_pickle(NONE_HASH_SEED)


def block_extra_keys(
    start: int,
    end: int,
    cache_salt: str | None,
    lora_name: str | None,
    mm_items: Sequence[MultimodalItem] = (),
    prompt_embeds: Sequence[int] | None = None,
) -> tuple | None:
    """Extra keys of the hash block whose token window is ``[start, end)`` (the block and,
    with lookahead hashes, its lookahead tokens): LoRA on every block, the multimodal
    items it overlaps, the salt on block 0, the prompt embeddings' digest. Example: a
    salted request, window ``[0, 4)`` -> ``(("cache_salt", salt),)``; ``[4, 8)`` -> None."""
    items, embeds = media_extra_keys(start, end, mm_items, prompt_embeds)
    keys: list[tuple] = []
    if lora_name is not None:
        keys.append(("lora", lora_name, lora_name))
    keys += items
    if cache_salt is not None and start == 0:
        keys.append(("cache_salt", cache_salt))
    keys += embeds
    return tuple(keys) if keys else None


def hash_block_tokens(
    parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None
) -> bytes:
    """One link of the chain; a missing parent is NONE_HASH."""
    return sha256_pickle((parent or NONE_HASH, tuple(map(int, token_ids)), extra_keys))


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    hash_block_size: int,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    num_lookahead_tokens: int = 0,
    mm_items: Sequence[MultimodalItem] = (),
    prompt_embeds: Sequence[int] | None = None,
) -> None:
    """Append the hashes of every full hash block of ``token_ids`` not hashed yet.

    Lookahead hashes (``num_lookahead_tokens = L > 0``, EAGLE without the block
    drop): block ``j`` is hashed only once the ``L`` tokens after it exist, and its
    extra keys become ``(E, t_1, ..., t_L)`` (``E`` the block's own extra keys, the
    ``t`` the next tokens; ``E`` is taken over the block and those tokens). Example, H 4,
    L 1, tokens 1..8: block 0 -> extra keys ``(None, 5)``; block 1 waits for a ninth token.
    """
    h = hash_block_size
    j = len(hashes)
    while (j + 1) * h + num_lookahead_tokens <= len(token_ids):
        parent = hashes[-1] if hashes else None
        end = (j + 1) * h
        extra = block_extra_keys(
            j * h, end + num_lookahead_tokens, cache_salt, lora_name, mm_items, prompt_embeds
        )
        if num_lookahead_tokens:
            extra = (extra, *(int(t) for t in token_ids[end : end + num_lookahead_tokens]))
        hashes.append(hash_block_tokens(parent, token_ids[j * h : (j + 1) * h], extra))
        j += 1


def hashes_at_block_size(
    hashes: Sequence[bytes], hash_block_size: int, block_size: int
) -> Sequence[bytes]:
    """The chain seen at ``block_size`` (a multiple of ``hash_block_size``).

    Element ``i`` is the fine hash at the coarse block's end boundary. Example: H=16,
    target 32, fine hashes A, B, C, D -> coarse B, D.
    """
    k = block_size // hash_block_size
    if k == 1:
        return hashes
    return [hashes[(i + 1) * k - 1] for i in range(len(hashes) // k)]


def cache_key(block_hash: bytes, group_id: int) -> bytes:
    """The prefix-cache key of a block of group ``group_id``."""
    return block_hash + group_id.to_bytes(4, "big")
