"""Chained block hashes over whole token arrays (the rule of :mod:`reference.hashing`).

Reference rule: block ``j`` of ``H`` tokens is keyed by a cryptographic hash of its parent's
hash, its tokens and its extra keys (LoRA name on every block, cache salt on block 0 only),
so two blocks share a hash exactly when their whole prefixes and extra keys are equal.

This module keeps that rule and its collision resistance but skips the pickling: each link
is ``SHA-256(parent || tokens as little-endian int64 || extra)`` where ``extra`` is a
length-prefixed encoding of the LoRA name and (block 0) the salt. Every field has a fixed
width or a length prefix, so the encoding is injective and a hit here is a hit in the
reference (the digests themselves differ from the reference's).

Example: ``H = 2``, tokens ``[1, 2, 3, 4, 5]`` -> two hashes, the second chained on the first;
the trailing token 5 is not hashed until a sixth token completes its block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

#: The parent of block 0.
ROOT_HASH: bytes = hashlib.sha256(b"kvconform-optimized-root").digest()

TOKEN_DTYPE = np.dtype("<i8")


def _field(tag: bytes, text: str) -> bytes:
    raw = text.encode("utf-8")
    return tag + len(raw).to_bytes(8, "little") + raw


def extra_key_bytes(block_index: int, cache_salt: str | None, lora_name: str | None) -> bytes:
    """Extra keys of block ``block_index``: LoRA on every block, salt on block 0 only."""
    out = b""
    if lora_name is not None:
        out += _field(b"L", lora_name)
    if cache_salt is not None and block_index == 0:
        out += _field(b"S", cache_salt)
    return out


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: np.ndarray,
    num_tokens: int,
    hash_block_size: int,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> None:
    """Append the hash of every full block of ``token_ids[:num_tokens]`` not hashed yet.

    Implements :func:`reference.hashing.extend_block_hashes` (same blocks, same chaining),
    one :func:`chain_link` per block.
    """
    h = hash_block_size
    j = len(hashes)
    end = num_tokens // h
    if j >= end:
        return
    raw = token_ids[j * h : end * h].astype(TOKEN_DTYPE, copy=False).tobytes()
    width = h * TOKEN_DTYPE.itemsize
    parent = hashes[-1] if hashes else ROOT_HASH
    lora = extra_key_bytes(1, None, lora_name)
    for k in range(end - j):
        extra = extra_key_bytes(0, cache_salt, lora_name) if j + k == 0 else lora
        parent = chain_link(parent, raw[k * width : (k + 1) * width], extra)
        hashes.append(parent)


def hashes_at_block_size(
    hashes: Sequence[bytes], hash_block_size: int, block_size: int
) -> Sequence[bytes]:
    """The chain at ``block_size``: element ``i`` is ``hashes[(i + 1) * k - 1]``, ``k`` the
    ratio (:func:`reference.hashing.hashes_at_block_size`)."""
    k = block_size // hash_block_size
    if k == 1:
        return hashes
    return hashes[k - 1 :: k]


def chain_link(parent: bytes, block: bytes, extra: bytes) -> bytes:
    """One link of the chain: the hash of a block whose parent hash is ``parent``, whose
    ``H`` tokens are ``block`` (little-endian int64) and whose extra keys are ``extra``
    (:func:`extra_key_bytes`); :func:`extend_block_hashes` gives that block the same value.

    Example: ``chain_link(ROOT_HASH, raw, b"")``, ``raw`` the bytes of tokens ``[1, 2]``, is
    the first hash ``extend_block_hashes`` gives ``[1, 2]`` at ``H = 2``. The digest's
    Python ``hash()`` is computed here once (a bytes object keeps it), ready for the
    block pool's cache map when the block is cached.
    """
    digest = hashlib.sha256(parent + block + extra).digest()
    hash(digest)
    return digest
