"""The host tier: a second store, owned by the machine, that a KV connector loads from.

TensorRT-LLM offloads blocks that leave its primary pool (out-of-window blocks
detached by linear sliding-window writing, evicted cached blocks) to a secondary pool
in host memory; vLLM reaches the same kind of store through a KV connector, which
reports the tokens it can load as *external computed tokens* (``allocate_slots(...,
num_external_computed_tokens)``). This module states what such a store holds and what
a lookup returns; the engine under test only sees the number of external tokens.

Rules:

1. **What enters.** :meth:`HostTier.offload` receives the computed tokens of a request
   whose blocks leave the primary pool (the scheduler offloads a request when it is
   freed: finished, preempted or aborted). Every *full* block of that prefix is stored,
   keyed by the whole prefix it ends (``(salt, lora, tokens[0 : (i + 1) * bs])``: the
   chained key of the primary cache). A partial last block is not stored. Example
   (bs 4): offloading 10 computed tokens ``t0..t9`` stores the keys of ``t0..t3`` and
   ``t0..t7``.
2. **Capacity and eviction.** The tier holds at most ``capacity_blocks`` keys; storing
   one more evicts the least recently stored or served key. Example (capacity 2):
   storing ``A``, ``AB``, then ``X`` evicts ``A``; a later lookup of ``AB..`` finds
   nothing (its first block is gone, and a prefix is usable only block by block from
   the start).
3. **Lookup.** :meth:`HostTier.num_external_tokens` returns the external tokens a
   connector can load for a request whose device hit is ``device_tokens``: the longest
   stored prefix ``L`` (a multiple of ``bs``, every block from the first held, at most
   ``num_tokens - 1``: the last token is always computed, as for a device hit) minus
   the device hit, or 0 when ``L <= device_tokens``. Example (bs 4, ``t0..t7`` stored):
   a 12-token request with a device hit of 4 gets ``8 - 4 = 4`` external tokens; a
   9-token request with no device hit gets 8; an 8-token request gets 4 (``L <= 7``).
   The hit is served: its keys become the most recently used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from reference.errors import KVConformError

#: (cache salt, LoRA name, the token ids of the prefix a block ends)
HostKey = tuple[str | None, str | None, tuple[int, ...]]


class HostTier:
    """A block store keyed by prefix, least recently used first out (module docstring)."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1:
            raise KVConformError(f"HostTier: block_size must be >= 1, got {block_size}")
        if capacity_blocks < 0:
            raise KVConformError(f"HostTier: capacity_blocks must be >= 0, got {capacity_blocks}")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._keys: OrderedDict[HostKey, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def _key(self, salt: str | None, lora: str | None, tokens: Sequence[int], n: int) -> HostKey:
        return (salt, lora, tuple(tokens[:n]))

    def offload(
        self, salt: str | None, lora: str | None, token_ids: Sequence[int], num_computed: int
    ) -> None:
        """Rules 1 and 2: store every full block of ``token_ids[:num_computed]``."""
        bs = self.block_size
        for end in range(bs, min(num_computed, len(token_ids)) + 1, bs):
            key = self._key(salt, lora, token_ids, end)
            self._keys.pop(key, None)
            self._keys[key] = None
            while len(self._keys) > self.capacity_blocks:
                self._keys.popitem(last=False)

    def longest_prefix(self, salt: str | None, lora: str | None, token_ids: Sequence[int]) -> int:
        """Rule 3's ``L``: the longest stored prefix of ``token_ids``, block by block from
        the start, at most ``len(token_ids) - 1`` tokens."""
        bs = self.block_size
        held = 0
        for end in range(bs, len(token_ids), bs):
            if self._key(salt, lora, token_ids, end) not in self._keys:
                break
            held = end
        return held

    def num_external_tokens(
        self, salt: str | None, lora: str | None, token_ids: Sequence[int], device_tokens: int
    ) -> int:
        """Rule 3: the tokens beyond the device hit a connector loads from this tier."""
        held = self.longest_prefix(salt, lora, token_ids)
        if held <= device_tokens:
            return 0
        for end in range(self.block_size, held + 1, self.block_size):
            self._keys.move_to_end(self._key(salt, lora, token_ids, end))
        return held - device_tokens
