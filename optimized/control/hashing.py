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

from reference.errors import KVConformError

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
    new = []
    for k in range(end - j):
        extra = extra_key_bytes(0, cache_salt, lora_name) if j + k == 0 else lora
        parent = chain_link(parent, raw[k * width : (k + 1) * width], extra)
        new.append(parent)
    hashes.extend(new)  # (one write of a HashChain's buffer)


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


#: bytes of a block hash, and the int64 words the key index keeps of one
KEY_BYTES = 32
KEY_WORDS = KEY_BYTES // 8


def key_words(keys: Sequence[bytes]) -> np.ndarray:
    """``keys`` as an ``(n, 4)`` int64 array: each 32-byte hash as four little-endian
    words (the form :mod:`optimized.control.key_index` keeps). Keys whose lengths do not
    add up to 32 each raise :class:`KVConformError` (lengths are not checked one by one:
    the engine's keys are its own SHA-256 digests). Example: ``key_words([bytes(32)])``
    is ``[[0, 0, 0, 0]]``."""
    raw = b"".join(keys)
    if len(raw) != KEY_BYTES * len(keys):
        bad = next(k for k in keys if len(k) != KEY_BYTES)
        raise KVConformError(
            f"key index: a block hash must be {KEY_BYTES} bytes, got {len(bad)}: {bad[:40]!r}"
        )
    return np.frombuffer(raw, dtype=np.int64).reshape(-1, KEY_WORDS).copy()


#: the hashes a :class:`HashChain` has room for past those it is grown for (16 blocks of
#: decoded tokens)
HASH_HEADROOM = 16


class HashChain(list):
    """A request's block hashes: a list of 32-byte digests, appended to as blocks complete
    (never changed otherwise), each also written end to end into a buffer (:attr:`raw`,
    grown by doubling) that :meth:`words` reads as int64 words with no conversion (the
    form :mod:`optimized.control.key_index` keeps). Example: a chain of 3 hashes ->
    ``words()`` has shape ``(3, 4)``; an append writes the new hash's 32 bytes, and
    ``words()`` then has 4 rows."""

    __slots__ = ("raw", "_all_words")

    def __init__(self, hashes: Sequence[bytes] = ()) -> None:
        super().__init__(hashes)
        #: the hashes end to end (its capacity may exceed them: read ``len(self)`` rows)
        self.raw = bytearray()
        self._all_words = np.zeros((0, KEY_WORDS), dtype=np.int64)
        self._room(len(self))
        if len(self):
            self._write(0, self)

    def _room(self, n: int) -> None:
        """Capacity for ``n`` hashes at least, and :data:`HASH_HEADROOM` more (a new
        buffer, the old content copied: a buffer read by an array cannot be resized in
        place), so that a prompt's chain takes the hashes of its first decoded blocks
        with no copy."""
        if len(self.raw) >= KEY_BYTES * n:
            return
        raw = bytearray(KEY_BYTES * max(n + HASH_HEADROOM, 2 * (len(self.raw) // KEY_BYTES)))
        raw[: len(self.raw)] = self.raw
        self.raw = raw
        self._all_words = np.frombuffer(raw, dtype=np.int64).reshape(-1, KEY_WORDS)

    def _write(self, at: int, hashes: Sequence[bytes]) -> None:
        data = b"".join(hashes)
        if len(data) != KEY_BYTES * len(hashes):
            raise KVConformError(f"HashChain: block hashes must be {KEY_BYTES} bytes each")
        self.raw[KEY_BYTES * at : KEY_BYTES * at + len(data)] = data

    def append(self, block_hash: bytes) -> None:
        n = len(self)
        self._room(n + 1)
        self._write(n, (block_hash,))
        super().append(block_hash)

    def extend(self, hashes) -> None:
        hashes = list(hashes)
        n = len(self)
        self._room(n + len(hashes))
        self._write(n, hashes)
        super().extend(hashes)

    def words(self) -> np.ndarray:
        """Every hash as four little-endian int64 words (:func:`key_words`' form), a view
        of :attr:`raw`."""
        return self._all_words[: len(self)]


def chain_words(
    hashes: Sequence[bytes], block_size: int = 1, hash_block_size: int = 1
) -> np.ndarray:
    """The words of :func:`hashes_at_block_size` of ``hashes`` (the chain at
    ``block_size``): a :class:`HashChain`'s kept words (every ``k``-th row, as a copy,
    when ``k = block_size // hash_block_size`` is above 1), else converted. Example: a
    chain of 4 hashes at ``k = 2`` -> rows 1 and 3."""
    k = block_size // hash_block_size
    if isinstance(hashes, HashChain):
        words = hashes.words()
        return words if k == 1 else np.ascontiguousarray(words[k - 1 :: k])
    return key_words(hashes_at_block_size(hashes, hash_block_size, block_size))
