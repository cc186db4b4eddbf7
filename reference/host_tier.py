"""The host tier: a second store, owned by the machine, that a KV connector loads from.

TensorRT-LLM offloads blocks that leave its primary pool (out-of-window blocks
detached by linear sliding-window writing, released and evicted cached blocks) to a
secondary pool in host memory, one per window size; vLLM reaches the same kind of
store through a KV connector, which reports the tokens it can load as *external
computed tokens* (``allocate_slots(..., num_external_computed_tokens)``). This module
states which blocks such a store holds and what a lookup returns; the engine under test
only sees the number of external tokens. The machine scheduler's KV connector
(:mod:`properties.runner.connector`) decides *when* blocks leave the primary pool and
calls :meth:`HostTier.offload`.

Rules:

1. **Keys.** A tier block is keyed per KV cache group by the whole prefix it ends:
   ``(group, salt, LoRA, tokens[0 : (k + 1) * bs])`` for block ``k`` of a group with
   block size ``bs`` (the chained key of the primary cache, looked up per group as
   TensorRT-LLM looks up per window size). Example (bs 4): block 1 of group 0 of
   ``t0..t9`` is keyed by ``(0, salt, lora, t0..t7)``.
2. **What enters** (the scheduler's calls, :meth:`HostTier.offload` one block at a
   time): a block **detached** by a sliding-window or chunked-local group, once all its
   tokens are below that group's skip boundary ``num_skipped_tokens(processed)``
   (:func:`num_detached_blocks`; the engine releases it at its next allocation), and
   every full, computed, non-null block of a request's table when the request
   **releases** its blocks (finished, preempted, aborted). A released cached block stays
   findable on the device until it is evicted, and its content cannot change before
   that, so storing it at release holds exactly what an eviction-time copy would hold
   (write-back at release). A partial last block is never stored.
3. **Capacity and eviction.** The tier holds at most ``capacity_blocks`` keys over all
   groups; storing one more evicts the least recently stored or served key. Example
   (capacity 2): storing ``A``, ``AB``, then ``X`` (group 0) evicts ``A``.
4. **Lookup: every group must serve the combined hit.** For a request whose device hit
   is ``h`` tokens, a length ``L`` (a multiple of the layout's hit alignment, ``h < L <=
   num_tokens - 1``: the last token is always computed) is servable when every group
   holds, in the tier, each of its blocks that intersects ``[max(h, s), L)`` with ``s =
   num_skipped_tokens(L)`` of that group (the keys computing from ``L`` still reads;
   blocks below ``h`` come from the device hit, blocks below ``s`` are not read). The
   tier serves the largest servable ``L`` (any, not only the first: a sliding window
   needs only its last blocks), ``L - h`` external tokens, or 0 when none is
   servable. The served keys become the most recently used. Example (one full group bs
   4, keys of ``t0..t3`` and ``t0..t7`` held): a 12-token request with device hit 4 gets
   ``8 - 4 = 4`` external tokens; a 9-token request with no device hit gets 8; an
   8-token request gets 4 (``L <= 7``). With a sliding window ``w = 4`` beside it (bs
   4), the window group needs only block 1 (``[4, 8)``) for ``L = 8``: if the tier
   holds that group's key of ``t0..t7`` only, 8 is still servable.

Mamba groups are not modelled (a loaded recurrent state is not a block of tokens):
:class:`HostTier` refuses layouts with one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from reference.errors import KVConformError
from reference.layout import KVCacheLayout
from reference.specs import MambaSpec, cdiv

#: (group, cache salt, LoRA name, the token ids of the prefix a block ends)
HostKey = tuple[int, str | None, str | None, tuple[int, ...]]


def num_detached_blocks(layout: KVCacheLayout, group_id: int, num_processed_tokens: int) -> int:
    """Rule 2: the leading blocks of group ``group_id`` whose tokens are all below its
    skip boundary once ``num_processed_tokens`` are processed (0 for full attention).
    Example: sliding window ``w = 4``, bs 2, 9 processed -> skipped ``9 - 4 + 1 = 6``
    tokens -> 3 blocks."""
    spec = layout.groups[group_id].spec
    return spec.num_skipped_tokens(num_processed_tokens) // spec.block_size


class HostTier:
    """A block store keyed by group and prefix, least recently used first out (module
    docstring)."""

    def __init__(self, layout: KVCacheLayout, capacity_blocks: int) -> None:
        if any(isinstance(s, MambaSpec) for s in layout.specs):
            raise KVConformError(
                "HostTier: layouts with a Mamba group are not modelled (a loaded recurrent "
                "state is not a block of tokens)"
            )
        if capacity_blocks < 0:
            raise KVConformError(f"HostTier: capacity_blocks must be >= 0, got {capacity_blocks}")
        self.layout = layout
        self.capacity_blocks = capacity_blocks
        self._keys: OrderedDict[HostKey, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def clear(self) -> None:
        """Forget every stored block (a connector's cache reset: vLLM's
        ``reset_prefix_cache(reset_connector=True)``). Example: 3 blocks stored ->
        ``len(tier) == 0``, every later lookup finds nothing until blocks are offloaded
        again."""
        self._keys.clear()

    def key(
        self,
        group_id: int,
        salt: str | None,
        lora: str | None,
        token_ids: Sequence[int],
        block_index: int,
    ) -> HostKey:
        """Rule 1: the key of block ``block_index`` of group ``group_id``."""
        end = (block_index + 1) * self.layout.groups[group_id].spec.block_size
        if end > len(token_ids):
            raise KVConformError(
                f"HostTier: block {block_index} of group {group_id} ends at token {end}, "
                f"past the {len(token_ids)} known tokens (only full blocks are stored)"
            )
        return (group_id, salt, lora, tuple(token_ids[:end]))

    def offload(
        self,
        group_id: int,
        salt: str | None,
        lora: str | None,
        token_ids: Sequence[int],
        block_index: int,
    ) -> None:
        """Rules 2 and 3: store one block (most recently used), evicting the oldest."""
        key = self.key(group_id, salt, lora, token_ids, block_index)
        self._keys.pop(key, None)
        self._keys[key] = None
        while len(self._keys) > self.capacity_blocks:
            self._keys.popitem(last=False)

    def holds(
        self,
        group_id: int,
        salt: str | None,
        lora: str | None,
        token_ids: Sequence[int],
        block_index: int,
    ) -> bool:
        """Whether the tier holds block ``block_index`` of group ``group_id``."""
        return self.key(group_id, salt, lora, token_ids, block_index) in self._keys

    def needed_blocks(self, group_id: int, device_tokens: int, end: int) -> range:
        """Rule 4: the blocks of group ``group_id`` a combined hit of ``end`` tokens needs
        from the tier beyond a device hit of ``device_tokens``. Example: sliding window
        ``w = 4``, bs 4, device 0, end 8 -> skip ``5`` -> block 1 only."""
        spec = self.layout.groups[group_id].spec
        first = max(device_tokens, spec.num_skipped_tokens(end))
        return range(first // spec.block_size, cdiv(end, spec.block_size))

    def servable(
        self,
        salt: str | None,
        lora: str | None,
        token_ids: Sequence[int],
        device_tokens: int,
        end: int,
    ) -> bool:
        """Rule 4: every group holds every block a hit of ``end`` tokens needs."""
        return all(
            self.holds(gid, salt, lora, token_ids, k)
            for gid in range(len(self.layout.groups))
            for k in self.needed_blocks(gid, device_tokens, end)
        )

    def longest_prefix(
        self, salt: str | None, lora: str | None, token_ids: Sequence[int], device_tokens: int
    ) -> int:
        """Rule 4's ``L``: the largest servable length, or ``device_tokens`` if none."""
        step = self.layout.cache_hit_alignment
        for end in range((len(token_ids) - 1) // step * step, device_tokens, -step):
            if self.servable(salt, lora, token_ids, device_tokens, end):
                return end
        return device_tokens

    def num_external_tokens(
        self, salt: str | None, lora: str | None, token_ids: Sequence[int], device_tokens: int
    ) -> int:
        """Rule 4: the tokens beyond the device hit a connector loads from this tier (the
        served keys become the most recently used)."""
        end = self.longest_prefix(salt, lora, token_ids, device_tokens)
        for gid in range(len(self.layout.groups)):
            for k in self.needed_blocks(gid, device_tokens, end):
                self._keys.move_to_end(self.key(gid, salt, lora, token_ids, k))
        return end - device_tokens
