"""SGLang's storage page hash without a JIT build: the fourth seam of :mod:`sglang_cpu`.

SGLang 0.5.23 keys every page of its storage tier (L3) by a chained SHA-256:
``sglang.srt.mem_cache.utils.get_hash_str`` -> ``cpp_utils.native_hash.get_native_hash``,
which turns the tokens into a buffer (``_native_hash_input``) and hands it to
``_load_native_hash_module().get_hash``. That module is a C++ extension
(``hicache_hash_cpp``) that SGLang builds on its first call with torch's
``cpp_extension.load``: ninja and a C++ compiler in a subprocess, under a file lock
that serialises every process of the machine, into a cache keyed by the build's
paths. Its first call is inside an engine call (a request's arrival hashes its
prefetch; an insert hashes its backup), so the build runs under the per-call deadline:
about 30 s of compiling on a two-core machine, while the calling thread sleeps in
``subprocess.communicate`` (the other property workers sleep in ``flock``). The
deadline interrupts it at 5 s and kills the compiler, so the extension is never built
and every deployment with a storage tier timed out at its first hash. An environment
reached through another path (a worktree's symlinked ``.engines``) rebuilds too.

:func:`load_page_hasher` is installed as ``_load_native_hash_module``: it returns a
:class:`PageHasher`, whose ``get_hash`` computes the same digests in Python (hashlib),
at once, with no build, subprocess or lock. SGLang's own code around it
(``get_storage_hash_str``'s namespace seed, ``_native_hash_input``) still runs.

The rules ``get_hash(raw_tokens, logical_len, unit_width, is_bigram, prior_digest,
page_size=None)`` follows (the extension's, restated):

1. ``raw_tokens`` is a one-dimensional buffer of unsigned 4- or 8-byte integers. It
   holds ``logical_len`` units; unit ``i`` is ``raw[i*w:(i+1)*w]`` (``w`` =
   ``unit_width``), or with ``is_bigram`` the pair ``(raw[i], raw[i+1])``.
2. ``page_size`` None: one digest over all units; ``page_size`` p: one digest per p
   units (the last page may be shorter), each chained on the digest before it.
3. A digest is the SHA-256 of the previous digest (32 bytes; ``prior_digest`` for the
   first, nothing when that is None), then the page's integers (its units', in order)
   as little-endian uint32. A page with an integer that does not fit 32 bits is
   *wide*: the byte ``0xff``, then its integers as little-endian uint64.
4. Digests are lowercase hex: one string (no ``page_size``) or a list of strings.

Errors as the extension raises them (pybind11's translation): ``ValueError`` for a
buffer that is not one-dimensional, has another item size or is shorter than its units,
a ``prior_digest`` of another length than 32 and a ``page_size`` below 1;
``IndexError`` for an 8-byte integer above 2**63 - 1.

Worked example: ``raw = array("q", [1, 2, 3])``, ``logical_len=3, unit_width=1,
page_size=2``, no prior digest: page 1 is ``d1 = sha256(01000000 02000000)``, page 2
``d2 = sha256(d1 + 03000000)`` (bytes in hex); the answer is ``[d1.hex(), d2.hex()]``.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

#: bytes of a SHA-256 digest (the length ``prior_digest`` must have)
DIGEST_BYTES = 32
#: the largest integer a page hashes as uint32; above it the page is wide (rule 3)
U32_MAX = 0xFFFF_FFFF
#: the largest 8-byte integer the extension accepts (its int64 range)
I64_MAX = 0x7FFF_FFFF_FFFF_FFFF
#: the byte that starts a wide page's hashed bytes (rule 3)
WIDE_TAG = b"\xff"


def _needed(logical_len: int, unit_width: int, is_bigram: bool) -> int:
    """How many integers ``logical_len`` units use (rule 1): ``logical_len * unit_width``,
    or ``logical_len + 1`` bigram units (none for none)."""
    return logical_len + 1 if is_bigram and logical_len > 0 else logical_len * unit_width


def _integers(raw_tokens: Any, logical_len: int, unit_width: int, is_bigram: bool) -> list[int]:
    """The buffer's integers as unsigned values, checked against the units it must hold
    (rule 1); the list is as long as the buffer. Their range is checked later
    (:func:`_check_range`), as the extension checks the digest and page size first."""
    view = memoryview(raw_tokens)
    if view.ndim != 1:
        raise ValueError("raw_tokens must be a one-dimensional buffer")
    if view.itemsize not in (4, 8):
        raise ValueError("raw_tokens itemsize must be 4 or 8 bytes")
    if len(view) < _needed(logical_len, unit_width, is_bigram):
        raise ValueError("raw_tokens is shorter than logical_len")
    return view.cast("B").cast("I" if view.itemsize == 4 else "Q").tolist()


def _check_range(raw_tokens: Any, values: list[int], need: int) -> None:
    """An 8-byte buffer's integers the units use must be int64 values (errors above)."""
    if memoryview(raw_tokens).itemsize == 8 and any(v > I64_MAX for v in values[:need]):
        raise IndexError("token id must be a non-negative int64")


def _unit_integers(
    values: list[int], start: int, count: int, unit_width: int, is_bigram: bool
) -> list[int]:
    """The integers of units ``start`` to ``start + count`` in order (rule 1)."""
    if is_bigram:
        out: list[int] = []
        for i in range(start, start + count):
            out += (values[i], values[i + 1])
        return out
    return values[start * unit_width : (start + count) * unit_width]


def _digest(prior: bytes | None, integers: list[int]) -> bytes:
    """Rule 3: the digest of one page's integers chained on ``prior``."""
    sha = hashlib.sha256()
    if prior is not None:
        sha.update(prior)
    if any(v > U32_MAX for v in integers):
        sha.update(WIDE_TAG)
        sha.update(struct.pack(f"<{len(integers)}Q", *integers))
    else:
        sha.update(struct.pack(f"<{len(integers)}I", *integers))
    return sha.digest()


class PageHasher:
    """What ``_load_native_hash_module`` returns once installed: an object with the
    extension's one function, ``get_hash`` (module docstring)."""

    @staticmethod
    def get_hash(
        raw_tokens: Any,
        logical_len: int,
        unit_width: int,
        is_bigram: bool,
        prior_digest: bytes | None,
        page_size: int | None = None,
    ) -> str | list[str]:
        """The digest of all units (``page_size`` None) or of each page (rules 1-4)."""
        values = _integers(raw_tokens, logical_len, unit_width, is_bigram)
        if prior_digest is not None and len(prior_digest) != DIGEST_BYTES:
            raise ValueError("prior_digest must be exactly 32 bytes")
        if page_size is not None and page_size < 1:
            raise ValueError("page_size must be positive")
        _check_range(raw_tokens, values, _needed(logical_len, unit_width, is_bigram))
        if page_size is None:
            units = _unit_integers(values, 0, logical_len, unit_width, is_bigram)
            return _digest(prior_digest, units).hex()
        out: list[str] = []
        prior = prior_digest
        for start in range(0, logical_len, page_size):
            count = min(page_size, logical_len - start)
            prior = _digest(prior, _unit_integers(values, start, count, unit_width, is_bigram))
            out.append(prior.hex())
        return out


_HASHER = PageHasher()


def load_page_hasher() -> PageHasher:
    """The replacement of SGLang's ``native_hash._load_native_hash_module``: the Python
    hasher, never a build."""
    return _HASHER
