"""Paged KV caches in torch: one per KV cache group, written through the slot mapping.

* :class:`PagedKVCache` (attention groups): ``key`` and ``value`` tensors of shape
  ``[num_blocks, block_size, num_kv_heads, head_size]``. The token with slot ``s`` lives at
  ``[s // block_size, s % block_size]``. Slots ``-1`` (``PAD_SLOT_ID``) are skipped.
* :class:`PagedStateCache` (Mamba groups): one state vector per block, ``[num_blocks,
  state_size]``; a table entry is a state index.

Every page starts as NaN, and the null block 0 stays NaN: a read of the null block, or of a
page nobody wrote, shows up as NaN in the attention output. Example: ``bs = 4``, slots
``[9, -1]`` write token 0's K/V into block 2, offset 1, and ignore token 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference.errors import KVConformError, require_positive

PAD_SLOT_ID = -1
NULL_BLOCK_ID = 0


class PagedCacheError(KVConformError):
    """A write targets a slot outside the cache or the null block, or shapes disagree."""


@dataclass(frozen=True)
class CacheShape:
    """Sizes of one attention group's paged cache."""

    num_blocks: int
    block_size: int
    num_kv_heads: int = 1
    head_size: int = 8

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_size"):
            require_positive("CacheShape", name, getattr(self, name))


class PagedKVCache:
    """K and V pages of one attention group (see the module docstring)."""

    def __init__(
        self,
        shape: CacheShape,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.shape = shape
        dims = (shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_size)
        self.key = torch.full(dims, float("nan"), dtype=dtype, device=device)
        self.value = torch.full(dims, float("nan"), dtype=dtype, device=device)

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    def write(self, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key[i]``/``value[i]`` (``[n, heads, head_size]``) at ``slot_mapping[i]``.

        Slots ``-1`` are padding and skipped; a slot in the null block or past the cache raises.
        """
        slots = slot_mapping.to(device=self.key.device, dtype=torch.int64)
        if key.shape != value.shape or key.shape[0] != slots.shape[0]:
            raise PagedCacheError(
                f"write needs one K and V row per slot, got slots {tuple(slots.shape)}, "
                f"key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
        keep = slots != PAD_SLOT_ID
        slots = slots[keep]
        self.check_slots(slots)
        flat_k = self.key.view(-1, self.shape.num_kv_heads, self.shape.head_size)
        flat_v = self.value.view(-1, self.shape.num_kv_heads, self.shape.head_size)
        flat_k[slots] = key[keep].to(flat_k)
        flat_v[slots] = value[keep].to(flat_v)

    def check_slots(self, slots: torch.Tensor) -> None:
        """Raise unless every slot (padding removed) is past the null block and in the cache."""
        bs = self.shape.block_size
        limit = self.shape.num_blocks * bs
        bad = (slots < bs) | (slots >= limit)
        if bool(bad.any()):
            raise PagedCacheError(
                f"slot {int(slots[bad][0])} is in the null block or past the cache of "
                f"{self.shape.num_blocks} blocks of {bs}"
            )


class PagedStateCache:
    """Mamba states of one group: ``state[block_id]`` is a vector of ``state_size`` floats."""

    def __init__(
        self,
        num_blocks: int,
        state_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        require_positive("PagedStateCache", "num_blocks", num_blocks)
        require_positive("PagedStateCache", "state_size", state_size)
        self.num_blocks = num_blocks
        self.state = torch.full((num_blocks, state_size), float("nan"), dtype=dtype, device=device)

    def read(self, block_id: int) -> torch.Tensor:
        """The state stored at ``block_id`` (NaN for the null block or an unwritten block)."""
        self._check(block_id)
        return self.state[block_id]

    def write(self, block_id: int, state: torch.Tensor) -> None:
        """Store ``state`` at ``block_id``; the null block 0 is refused."""
        self._check(block_id)
        if block_id == NULL_BLOCK_ID:
            raise PagedCacheError("a Mamba state cannot be written into the null block 0")
        self.state[block_id] = state.to(self.state)

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise PagedCacheError(f"block id must be in [0, {self.num_blocks}), got {block_id}")
