"""A deterministic content model: the K, V, Q vectors and Mamba states a model would produce.

Rule: everything about the token at position ``p`` is a function of the whole prefix
``tokens[0..p]`` (plus the request's cache salt and LoRA name), the layer and the seed. So two
requests whose last tokens agree but whose earlier tokens differ get different vectors, and a
cache hit on a block with the right tokens but the wrong prefix reads the wrong K/V.

Construction (cheap for long sequences):

1. a rolling prefix hash: ``B(0) = start(seed, salt, lora)``, ``B(L+1) = mix(B(L), tokens[L])``,
   so ``B(L)`` summarises ``tokens[0..L)``;
2. a counter-based generator: element ``i`` of a vector of kind ``kind`` (key, value, query,
   state) in layer ``l`` is ``uniform(mix64(B ^ tag(kind, l) + i))``.

The K, V and Q vectors of token ``p`` come from ``B(p + 1)``; the Mamba state at boundary
``L`` (after tokens ``[0, L)``) comes from ``B(L)``. Example: with tokens ``(5, 9)`` and
``(6, 9)`` the position-1 keys differ (``B(2)`` differs) though both last tokens are 9.

Every element is ``k / 2**23 - 1`` for an integer ``k`` in ``[0, 2**24)``: a value in
``[-1, 1)`` that float32 (and float64) store exactly, so a float32 paged cache holds the very
numbers the float64 reference uses and only the arithmetic differs.

Standard library only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from reference.errors import require_positive

_MASK64 = (1 << 64) - 1
Vector = tuple[float, ...]
HeadVectors = tuple[Vector, ...]  # [num_heads][head_size]

KIND_KEY = 1
KIND_VALUE = 2
KIND_QUERY = 3
KIND_STATE = 4


def mix64(x: int) -> int:
    """The splitmix64 finaliser: a bijection of 64-bit ints with good avalanche."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _uniform(bits: int) -> float:
    """Top 24 bits -> ``k / 2**23 - 1`` in ``[-1, 1)``, exact in float32."""
    return (bits >> 40) / float(1 << 23) - 1.0


@dataclass(frozen=True)
class ContentModel:
    """Deterministic K/V/Q vectors and Mamba states for token sequences.

    ``num_kv_heads`` heads of ``head_size`` for K, V and Q (one query head per KV head);
    ``state_size`` floats per Mamba state.
    """

    seed: int = 0
    num_kv_heads: int = 1
    head_size: int = 8
    state_size: int = 8
    _memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        require_positive("ContentModel", "num_kv_heads", self.num_kv_heads)
        require_positive("ContentModel", "head_size", self.head_size)
        require_positive("ContentModel", "state_size", self.state_size)

    # -- prefix hashes ------------------------------------------------------------------
    def start_hash(self, cache_salt: str | None = None, lora_name: str | None = None) -> int:
        """``B(0)``: a function of the seed, the salt and the LoRA name only."""
        text = f"{self.seed}\x00{cache_salt!r}\x00{lora_name!r}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")

    def prefix_hashes(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """``[B(0), B(1), ..., B(len)]``; ``B(L)`` summarises ``token_ids[0:L]``."""
        return self.extend_hashes([self.start_hash(cache_salt, lora_name)], token_ids)

    @staticmethod
    def extend_hashes(hashes: Sequence[int], new_tokens: Sequence[int]) -> list[int]:
        """``hashes`` (``B(0..L)``) followed by ``B(L+1..L+n)`` for ``n`` more tokens."""
        out = list(hashes)
        h = out[-1]
        for t in new_tokens:
            h = mix64(h * 0x9E3779B97F4A7C15 + mix64(t & _MASK64) + 1)
            out.append(h)
        return out

    # -- vectors ------------------------------------------------------------------------
    def _vector(self, prefix_hash: int, layer: int, kind: int, n: int) -> Vector:
        base = mix64(prefix_hash ^ mix64((layer << 8) | kind))
        return tuple(_uniform(mix64(base + i)) for i in range(n))

    def _heads(self, prefix_hash: int, layer: int, kind: int) -> HeadVectors:
        key = (prefix_hash, layer, kind)
        got = self._memo.get(key)
        if got is None:
            flat = self._vector(prefix_hash, layer, kind, self.num_kv_heads * self.head_size)
            d = self.head_size
            got = tuple(flat[h * d : (h + 1) * d] for h in range(self.num_kv_heads))
            if len(self._memo) > 1_000_000:
                self._memo.clear()
            self._memo[key] = got
        return got

    def key(self, hashes: Sequence[int], pos: int, layer: int) -> HeadVectors:
        """K of the token at ``pos`` given ``hashes = prefix_hashes(...)``: uses ``B(pos+1)``."""
        return self._heads(hashes[pos + 1], layer, KIND_KEY)

    def value(self, hashes: Sequence[int], pos: int, layer: int) -> HeadVectors:
        """V of the token at ``pos``: uses ``B(pos+1)``."""
        return self._heads(hashes[pos + 1], layer, KIND_VALUE)

    def query(self, hashes: Sequence[int], pos: int, layer: int) -> HeadVectors:
        """Q of the token at ``pos``: uses ``B(pos+1)``."""
        return self._heads(hashes[pos + 1], layer, KIND_QUERY)

    def state(self, hashes: Sequence[int], boundary: int, layer: int) -> Vector:
        """Mamba state after tokens ``[0, boundary)``: uses ``B(boundary)``."""
        return _state(self.state_size, hashes[boundary], layer)


@lru_cache(maxsize=65536)
def _state(state_size: int, prefix_hash: int, layer: int) -> Vector:
    base = mix64(prefix_hash ^ mix64((layer << 8) | KIND_STATE))
    return tuple(_uniform(mix64(base + i)) for i in range(state_size))
