"""Mutants of the block pool: the reference with ONE bug in
:class:`reference.block_pool.BlockPool` (the free queue, touching, freeing, the reset).

Worked example, ``evict_in_use``: ``touch`` revives a cached free block (ref count 0 ->
1) but leaves it in the free queue; the next allocation that evicts from the front
can hand out the block the request still holds: ``pool_accounting`` and
``free_queue_contents`` report it.
"""

from __future__ import annotations

from collections.abc import Sequence

from properties.core.modes import PRODUCTION_SETTINGS
from properties.core.proxy import EngineProxy
from properties.mutants.assembly import MutantEngine, mutant_engine
from properties.mutants.registry import REFERENCE_CATALOGUE, Registry
from reference.block_pool import BlockPool, KVCacheBlock
from reference.layout import KVCacheLayout

REGISTRY = Registry(REFERENCE_CATALOGUE, production_settings=PRODUCTION_SETTINGS)


class EvictInUsePool(BlockPool):
    """``touch`` revives a cached free block without taking it out of the free queue, so a
    later allocation can evict and hand out a block a request is still using."""

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            if not block.is_null:
                block.ref_cnt += 1  # BUG: a block with ref 0 stays in the free queue


@REGISTRY.mutant(
    "universal",
    ["pool_accounting", "free_queue_contents"],
    "a revived cached block stays in the free queue (evictable while in use)",
)
def make_evict_in_use(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("evict_in_use", layout, pool_cls=EvictInUsePool)


class NullBlockInQueuePool(BlockPool):
    """Builds the free queue with the null block still in it (at the back), so the last
    free "block" an allocation takes is block 0."""

    def __init__(self, num_blocks: int, enable_caching: bool, hash_block_size: int) -> None:
        super().__init__(num_blocks, enable_caching, hash_block_size)
        self.free_block_queue.append_n([self.null_block])  # BUG


@REGISTRY.mutant(
    "universal",
    # its free queue holds block 0: a malformed answer (P1) as soon as it is read
    ["answers", "pool_accounting", "window_liveness", "reset_prefix_cache"],
    "the null block sits in the free queue and can be allocated",
)
def make_null_block_handed_out(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("null_block_handed_out", layout, pool_cls=NullBlockInQueuePool)


class ResetWhileHeldPool(BlockPool):
    """``reset_prefix_cache`` forgets every key even while requests hold blocks."""

    def reset_prefix_cache(self) -> bool:
        for block in self.blocks:  # BUG: no check that every block is free
            self._evict(block)
        return True


@REGISTRY.mutant(
    "universal",
    ["reset_prefix_cache"],
    "reset_prefix_cache succeeds (and forgets keys) while blocks are held",
)
def make_reset_while_held(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("reset_while_held", layout, pool_cls=ResetWhileHeldPool)


class LeakyFreePool(BlockPool):
    """Freeing a request forgets to release its last block."""

    def free_blocks(self, ordered_blocks) -> None:
        blocks = list(ordered_blocks)
        super().free_blocks(blocks[1:])  # BUG: the tail block keeps its reference


class BareEngine(EngineProxy):
    """An engine answering only the calls every engine answers (no ref counts, free
    queue or cached blocks), over another engine."""

    def __init__(self, inner: MutantEngine) -> None:
        super().__init__(inner)
        self.name = inner.name


@REGISTRY.mutant(
    "universal",
    ["idle_pool_free", "allocation_fits"],
    "no optional capabilities, and free() keeps a reference to each freed "
    "tail block (only the capability-free checks see it)",
)
def make_bare_leaky_free(layout: KVCacheLayout) -> BareEngine:
    return BareEngine(mutant_engine("bare_leaky_free", layout, pool_cls=LeakyFreePool))
